"""FLA 0.6.0's forward, kernel by kernel, with the HBM bytes each step writes and the next read back.

FLA's `chunk_gated_delta_rule_fwd` (fla/ops/gated_delta_rule/chunk.py) is a serial chain of five
steps, each its own launch, handing its results to the next through HBM:

    1 chunk_local_cumsum              g -> g_cum (fp32, log2 units)    fla.ops.utils
    2 kkt_solve                       k, g_cum, beta -> A (bf16, C wide; zero-filled, then written)
                                      fla.ops.gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel
                                      (in 0.6.0 `chunk_gated_delta_rule_fwd_intra` is this kernel
                                      followed by step 3)
    3 recompute_w_u_fwd               k, v, beta, A, g_cum -> w, u (bf16)      fla.ops.gated_delta_rule.wy_fast
    4 chunk_gated_delta_rule_fwd_h    k, w, u, g_cum, h0 -> h (bf16 per chunk), v_new (bf16), ht (fp32)
                                      fla.ops.common.chunk_delta_h
    5 chunk_fwd_o                     q, k, v_new, h, g_cum -> o (bf16)        fla.ops.common.chunk_o

Each step is timed alone with the harness's CUDA-graph timer on the previous steps' real outputs;
`step_bytes` counts, from shapes and dtypes, the bytes of inputs it reads (each tensor once, a
lower bound), of intermediates it reads back and writes, and of outputs it writes. The sum of the
steps against FLA's whole forward (one graph) shows the launch and serial-chain cost; the
intermediates' round trip at the measured copy rate shows what fusion saves in traffic alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StepBytes", "step_bytes", "COPY_TBPS", "run_fla_breakdown", "STEP_NAMES"]

#: Device copy rate measured on our H200, TB/s (DESIGN.md section 6).
COPY_TBPS = 4.0

STEP_NAMES = ("chunk_local_cumsum", "kkt_solve", "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o")


@dataclass
class StepBytes:
    """HBM bytes of one step: inputs read, intermediates read back, intermediates written,
    final outputs written; `reads_from` / `writes` name the tensors."""

    step: str
    inputs_read: int
    inter_read: int
    inter_written: int
    out_written: int
    reads: str = ""
    writes: str = ""

    @property
    def total(self) -> int:
        return self.inputs_read + self.inter_read + self.inter_written + self.out_written


def step_bytes(T: int, N: int, NT: int, H: int, HV: int, K: int = 128, V: int = 128, C: int = 64,
               elem: int = 2, beta_elem: int = 4) -> list[StepBytes]:
    """Bytes per FLA forward step for T tokens in N sequences and NT chunks in all.

    elem: bytes of q/k/v and of the bf16 intermediates (A, w, u, h, v_new, o); beta_elem: of beta.
    g, g_cum and the states are fp32. A is zero-filled (`torch.zeros`) before the kernel writes it,
    and the final state likewise (`new_zeros`): both fills are counted as writes.
    """
    q = k = elem * T * H * K
    v = elem * T * HV * V
    g = gc = 4 * T * HV
    beta = beta_elem * T * HV
    A = elem * T * HV * C
    w = elem * T * HV * K
    u = v_new = o = elem * T * HV * V
    h = elem * NT * HV * K * V
    state = 4 * N * HV * K * V
    return [
        StepBytes("chunk_local_cumsum", g, 0, gc, 0, "g", "g_cum"),
        StepBytes("kkt_solve", k + beta, gc, 2 * A, 0, "k, beta, g_cum", "A (zero fill + store)"),
        StepBytes("recompute_w_u_fwd", k + v + beta, A + gc, w + u, 0, "k, v, beta, A, g_cum", "w, u"),
        StepBytes("chunk_gated_delta_rule_fwd_h", k + state, w + u + gc, h + v_new, 2 * state,
                  "k, h0, w, u, g_cum", "h, v_new, ht (zero fill + store)"),
        StepBytes("chunk_fwd_o", q + k, v_new + h + gc, 0, o, "q, k, v_new, h, g_cum", "o"),
    ]


def run_fla_breakdown(x, timer: dict | None = None, ref=None) -> dict:
    """Times FLA's five forward steps one by one on the row inputs `x` (an `inputs.RowInputs`).

    Returns {"steps": [(name, ms)], "intra_ms": ms of `chunk_gated_delta_rule_fwd_intra`,
    "kkt_source": "kernel" or "intra - w_u", "err_o": rel. RMS of the chained steps' o against
    `ref["o"]` (`gate.fp64_result`; NaN without `ref`), "NT": total chunks}. Raises ImportError when
    FLA is absent.
    """
    import torch
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    from flashqla.bench.gate import rel_rms
    from flashqla.bench.timing import time_cuda_graph

    timer = timer or {}
    C = 64
    q, k, v, g, beta, h0, cu = x.q, x.k, x.v, x.g, x.beta, x.h0, x.cu_seqlens
    _, T, H, K = k.shape
    HV = v.shape[2]
    ci = prepare_chunk_indices(cu, C)
    NT = int(ci.shape[0])
    scale = K**-0.5

    with torch.no_grad():
        def cumsum():
            return chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)

        gc = cumsum()
        try:
            from fla.ops.gated_delta_rule.chunk_fwd import (
                chunk_gated_delta_rule_fwd_kkt_solve_kernel as kern,
            )

            def kkt_solve():
                A = torch.zeros(1, T, HV, C, device=k.device, dtype=k.dtype)
                kern[(NT, HV)](k=k, g=gc, beta=beta, A=A, cu_seqlens=cu, chunk_indices=ci,
                               T=T, H=H, HV=HV, K=K, BT=C, BC=16)
                return A

            A = kkt_solve()
            kkt_source = "kernel"
        except Exception:
            kkt_solve, kkt_source = None, "intra - w_u"
            _, _, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_size=C, chunk_indices=ci)

        def w_u():
            return recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=cu, chunk_indices=ci)

        w, u = w_u()

        def fwd_h():
            return chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, chunk_indices=ci)

        h, v_new, _ = fwd_h()

        def fwd_o():
            return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu, chunk_indices=ci)

        o = fwd_o()

        def intra():
            return chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_size=C, chunk_indices=ci)

        err_o = rel_rms(o, ref["o"]) if ref is not None else math.nan
        del o
        ms = {}
        for name, fn in (("chunk_local_cumsum", cumsum), ("kkt_solve", kkt_solve), ("recompute_w_u_fwd", w_u),
                         ("chunk_gated_delta_rule_fwd_h", fwd_h), ("chunk_fwd_o", fwd_o), ("intra", intra)):
            ms[name] = time_cuda_graph(fn, **timer).ms if fn is not None else math.nan
        if kkt_solve is None:
            ms["kkt_solve"] = ms["intra"] - ms["recompute_w_u_fwd"]
    return {
        "steps": [(n, ms[n]) for n in STEP_NAMES],
        "intra_ms": ms["intra"],
        "kkt_source": kkt_source,
        "err_o": err_o,
        "NT": NT,
    }
