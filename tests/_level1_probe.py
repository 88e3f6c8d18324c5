"""A probe kernel for `tests/test_kernels_compile.py`: the inverse's first level by products
(`prepare.diagonal_blocks_8x8_mma`) alone, one CTA of one warpgroup on a 64 x 64 fp16 tile. Kept in a
module of its own: TileLang reads a prim_func's annotations, which `from __future__ import annotations`
would turn into strings."""


def level1_mma_probe():
    """The probe's PrimFunc: y = x with its eight 8 x 8 diagonal blocks replaced by (I + L_b)^-1."""
    import tilelang.language as T
    from tilelang.layout import make_linear_layout

    from flashqla.ops.gdn.kernels.sm90 import prepare as P

    C = 64

    @T.prim_func
    def level1_mma_probe(x: T.Tensor((C, C), "float16"), y: T.Tensor((C, C), "float16")):
        with T.Kernel(1, threads=128, prelude=P.MOVMATRIX_PRELUDE) as (bx,):
            m_s = T.alloc_shared((C, P.M_ROW), "float16")
            T.annotate_layout({m_s: make_linear_layout(m_s)})
            inv = P.alloc_inverse_locals(T)
            l1 = P.alloc_level1_locals(T)
            tx = T.get_thread_binding()
            for t, s in T.Parallel(C, C):
                m_s[t, s] = x[t, s]
            P.diagonal_blocks_8x8_mma(T, m_s, inv, l1, tx // 32, tx % 32)()
            for t, s in T.Parallel(C, C):
                y[t, s] = m_s[t, s]

    return level1_mma_probe
