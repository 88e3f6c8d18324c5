"""Every shipped sm_90 kernel by kind: build one, build many concurrently, precompile into TileLang's
disk cache, and list what a head configuration can launch (`op_kernel_specs`, what
`flashqla.warmup` builds).

A kernel spec is (kind, args): `build(kind, args)` calls the kind's builder with args (its static
key). Kinds and builders:
    "prepare"          prepare.build_prepare_kernel
    "recurrent"        recurrent.build_recurrent_kernel
    "recurrent_serving" recurrent.build_recurrent_serving_kernel (the serving build: pools by index,
                       state layout and dtype, checkpoints; `serving_kernel_specs`, not in warmup's list)
    "states_bwd"       states_bwd.build_states_kernel
    "chunk_bwd"        chunk_bwd.build_chunk_bwd_kernel
    "dg_cumsum"        finish_bwd.build_dg_cumsum_kernel
    "gva_reduce"       finish_bwd.build_gva_reduce_kernel
    "cp_scan"          cp_scan.build_cp_scan_kernel
    "cp_limits"        cp_limits.build_cp_limits_kernel
    "cp_correct"       cp_correct.build_cp_correct_kernel
    "cp_state_grads"   cp_correct.build_cp_state_grads_kernel
    "cp_relayout"      cp_relayout.build_relayout_kernel
    "cp_slot_h0"       cp_relayout.build_slot_h0_kernel
    "cp_tables"        cp_tables.build_segment_tables_kernel
    "launch_order"     launch_order.build_launch_order_kernel
    "pool_gather"      pool_states.build_pool_gather_kernel (the serving torch path's state moves,
    "pool_store"       pool_states.build_pool_store_kernel   in `serving_kernel_specs`)
    "checkpoint_combine" pool_states.build_checkpoint_combine_kernel
    "zero_tail"        packed_tail.build_zero_tail_kernel (packed o's rows past device offsets that end
                       before T, when the host has no hint that they end at T)
Nothing here imports TileLang until a kernel is built.
"""

from __future__ import annotations

import importlib

from flashqla.ops.gdn.kernels.sm90.cp_scan import scan_choice
from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

__all__ = ["BUILDERS", "build", "build_kernels", "build_once", "op_kernel_specs", "precompile",
           "serving_kernel_specs"]

_PKG = "flashqla.ops.gdn.kernels.sm90"

#: kind -> (module in this package, builder function)
BUILDERS = {
    "prepare": ("prepare", "build_prepare_kernel"),
    "recurrent": ("recurrent", "build_recurrent_kernel"),
    "recurrent_serving": ("recurrent", "build_recurrent_serving_kernel"),
    "states_bwd": ("states_bwd", "build_states_kernel"),
    "chunk_bwd": ("chunk_bwd", "build_chunk_bwd_kernel"),
    "dg_cumsum": ("finish_bwd", "build_dg_cumsum_kernel"),
    "gva_reduce": ("finish_bwd", "build_gva_reduce_kernel"),
    "cp_scan": ("cp_scan", "build_cp_scan_kernel"),
    "cp_limits": ("cp_limits", "build_cp_limits_kernel"),
    "cp_correct": ("cp_correct", "build_cp_correct_kernel"),
    "cp_state_grads": ("cp_correct", "build_cp_state_grads_kernel"),
    "cp_relayout": ("cp_relayout", "build_relayout_kernel"),
    "cp_slot_h0": ("cp_relayout", "build_slot_h0_kernel"),
    "cp_tables": ("cp_tables", "build_segment_tables_kernel"),
    "launch_order": ("launch_order", "build_launch_order_kernel"),
    "pool_gather": ("pool_states", "build_pool_gather_kernel"),
    "pool_store": ("pool_states", "build_pool_store_kernel"),
    "checkpoint_combine": ("pool_states", "build_checkpoint_combine_kernel"),
    "zero_tail": ("packed_tail", "build_zero_tail_kernel"),
}


def build(kind: str, args: tuple):
    """The compiled kernel of spec (kind, args) (cached by its builder). ValueError for an unknown kind."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown kernel kind {kind!r} (one of {sorted(BUILDERS)})")
    module, name = BUILDERS[kind]
    return getattr(importlib.import_module(f"{_PKG}.{module}"), name)(*args)


def _build_in_worker(spec) -> str:
    build(*spec)
    return spec[0]


def build_kernels(specs) -> list:
    """Builds (or fetches from cache) the kernels [(kind, args), ...] concurrently in threads (the
    threads overlap the external compiler runs) and returns them in order."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    if len(specs) <= 1:
        return [build(*s) for s in specs]
    with ThreadPoolExecutor(len(specs)) as ex:
        return list(ex.map(lambda s: build(*s), specs))


def precompile(specs, max_workers: int | None = None) -> None:
    """Compiles [(kind, args), ...] in worker processes into TileLang's disk cache, then loads them
    into this process (each load is a cache hit). Needs no GPU."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    specs = list(dict.fromkeys(specs))
    workers = max_workers or min(len(specs), os.cpu_count() or 1)
    if workers > 1 and len(specs) > 1:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_build_in_worker, specs))
    for s in specs:
        build(*s)


_BUILT: set = set()


def build_once(key, specs) -> None:
    """Builds `specs` concurrently the first time `key` is seen in this process (a call's first use of
    a configuration; every later launch finds its kernel in the builders' caches)."""
    if key in _BUILT:
        return
    build_kernels(list(dict.fromkeys(specs)))
    _BUILT.add(key)


def _few_sequence_scan(HV: int, K: int, V: int, reverse: bool) -> tuple:
    """The `build_cp_scan_kernel` arguments of the scan a cut call over few sequences launches
    (`cp_scan.scan_choice`)."""
    variant, width = scan_choice(HV, 1, True, V)
    return (HV, K, V, reverse, variant, width)


def bwd_specs(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
              dh0: bool | None = None) -> list:
    """Passes 1 and 2 and the dG cumsum of the backward on offsets (seq_dtype, varlen), bf16 and fp16
    inputs alike (h stored in q's dtype, `states_bwd`); pass 2 for a call returning dh0 (True), not
    (False), or both (None)."""
    specs = [("states_bwd", (H, HV, K, V, dtype, seq_dtype, varlen))]
    specs += [("chunk_bwd", (H, HV, K, V, dtype, beta_dtype, seq_dtype, varlen, d))
              for d in ((True, False) if dh0 is None else (bool(dh0),))]
    return specs + [("dg_cumsum", (HV, seq_dtype, varlen))]


def op_kernel_specs(H: int, HV: int, *, N: int = 1, varlen: bool = False, dtype: str = "bfloat16",
                    beta_dtype: str = "float32", seq_dtype: str = "int32", backward: bool = True,
                    block_v: int | None = None, K: int = 128, V: int = 128, segments_first_use: bool = True,
                    one_head_prepare: bool = True, dh0: bool | None = None, fp16_products: bool = False) -> list:
    """The kernels (`[(kind, args), ...]`, for `build_kernels` / `precompile`) that one call of
    `flashqla.chunk_gated_delta_rule` uses for H q/k heads, HV value heads, N sequences (the
    recurrent kernel's value slice width depends on N * HV: `recurrent.pick_block_v`; `block_v`
    forces it), packed or not, q/k/v in `dtype`, beta in `beta_dtype`, cu_seqlens in `seq_dtype`;
    with the backward's when `backward`.

    The context-parallel kernels (scans, output correction, state gradients, the dual run +
    transition launch at both value slice widths, the transition limits and, for packed input, the
    segment tables) are included since `cp="auto"` may split; for packed input, the launch that zeroes
    o's rows past device offsets ending before T (`packed_tail`). The split path runs on the segments'
    packed offsets, int32 for a fixed-length batch too; with `segments_first_use` (the default) such a
    batch's list also holds what that path builds on them and the rest does not name: the prepare
    kernel on packed offsets and, with `backward`, the segment tables and packed relayouts that the
    backward's first use on the segments builds. With `one_head_prepare` (the default) and
    G = HV / H > 1 the list ends with the prepare kernel that takes one value head a CTA
    (`prepare.pick_heads_per_cta` picks it for few chunk slots), on the call's offsets and on the
    segments' packed ones. `dh0`: pass 2's build for a call that returns dh0 (True), that does not
    (False), or both (None, the default: what a precompile needs). With `fp16_products` and bf16 input
    the list ends with the builds of the opt-in fp16 A_beta product (`flashqla.ops.gdn.fwd.product_dtype`:
    A diag(beta) stored in fp16 and read by fp16 products): prepare (both heads-per-CTA builds where
    `one_head_prepare`), the recurrent kernel and the split path's run + transition launch, on the
    offsets the forward's launches above use. Pure Python: needs neither a GPU nor TileLang."""
    BV = block_v or pick_block_v(N, HV, V)
    specs = [
        ("prepare", (H, HV, K, dtype, beta_dtype, seq_dtype, varlen)),
        ("recurrent", (H, HV, K, V, BV, dtype, seq_dtype, varlen)),
        ("cp_scan", (HV, K, V, False)),
        ("cp_scan", _few_sequence_scan(HV, K, V, False)),
        ("cp_correct", (HV, K, V, dtype, seq_dtype if varlen else "int32")),
    ]
    if varlen:
        specs.append(("cp_tables", (seq_dtype,)))
        specs.append(("zero_tail", (V, dtype, seq_dtype)))  # o's rows past device offsets ending before T
    if K == V:  # the split path's run + transition launch, on the segments' packed offsets, either slice width
        cp_seq = seq_dtype if varlen else "int32"
        if not varlen and segments_first_use:  # a fixed-length batch's segments are packed: prepare on them
            specs.append(("prepare", (H, HV, K, dtype, beta_dtype, cp_seq, True)))
        specs += [("recurrent", (H, HV, K, V, bv, dtype, cp_seq, True, True)) for bv in (64, 128)]
        specs.append(("cp_limits", (HV, cp_seq)))
        specs.append(("cp_slot_h0", (HV, K, V)))  # the runs' initial states (when h0 is given)
        # A and g_cum_log2 between the caller's slots and the segments' (training forward: back to the
        # caller's; backward: to the segments')
        specs += [("cp_relayout", (HV, dtype, seq_dtype if varlen else "int32", cp_seq, to_seg, varlen))
                  for to_seg in ((False, True) if backward else (False,))]
        if backward and not varlen and segments_first_use:
            # the backward's first use on a fixed-length batch's segments builds the list of a packed int32
            # call: its segment tables and relayouts too (the caller's side packed, never launched here)
            specs.append(("cp_tables", (cp_seq,)))
            specs += [("cp_relayout", (HV, dtype, cp_seq, cp_seq, to_seg, True)) for to_seg in (False, True)]
    if backward:
        # passes 1-3 on the input's offsets, then (split path) on the segments' packed offsets
        keys = [(seq_dtype, varlen)] + ([(seq_dtype if varlen else "int32", True)] if K == V else [])
        for sd, vl in dict.fromkeys(keys):
            specs += bwd_specs(H, HV, K, V, dtype, beta_dtype, sd, vl, dh0)
        # pass 2's per-value-head dq / dk are fp32: pass 3 sums them over a GVA group and rounds
        specs.append(("gva_reduce", (H, HV, K, dtype)))
        specs += [
            ("cp_scan", (HV, K, V, True)),
            ("cp_scan", _few_sequence_scan(HV, K, V, True)),
            ("cp_state_grads", (HV, K, V, dtype, seq_dtype if varlen else "int32")),
        ]
        # the longest-first launch order (`launch_order.launch_order`) of the split path's segments
        specs += [("launch_order", (sd,)) for sd, vl in dict.fromkeys(keys) if vl]
    if one_head_prepare and HV // H > 1:
        offsets = [(seq_dtype, varlen)] + ([(seq_dtype if varlen else "int32", True)] if K == V else [])
        specs += [("prepare", (H, HV, K, dtype, beta_dtype, sd, vl, 1)) for sd, vl in dict.fromkeys(offsets)]
    if fp16_products and dtype == "bfloat16":
        f16 = "float16"
        cp_seq = seq_dtype if varlen else "int32"
        offsets = [(seq_dtype, varlen)] + ([(cp_seq, True)] if K == V else [])
        heads = (None, 1) if one_head_prepare and HV // H > 1 else (None,)
        specs += [("prepare", (H, HV, K, dtype, beta_dtype, sd, vl, h, f16))
                  for sd, vl in dict.fromkeys(offsets) for h in heads]
        specs.append(("recurrent", (H, HV, K, V, BV, dtype, seq_dtype, varlen, False, f16)))
        if K == V:
            specs += [("recurrent", (H, HV, K, V, bv, dtype, cp_seq, True, True, f16)) for bv in (64, 128)]
    return specs


def serving_kernel_specs(H: int, HV: int, *, N: int = 1, varlen: bool = False, dtype: str = "bfloat16",
                         seq_dtype: str = "int32", block_v: int | None = None, K: int = 128, V: int = 128,
                         state_dtypes=("float32", "bfloat16"), state_layouts=("kv", "vk"),
                         checkpoints=(False, True), split: bool = False, fp16_products: bool = False) -> list:
    """The serving builds of the recurrent kernel (kind "recurrent_serving",
    `recurrent.build_recurrent_serving_kernel`) a serving call of these heads may launch, for every
    combination of the given state dtypes, layouts and checkpoint switches (the prepare kernel is
    `op_kernel_specs`'). With `split` (K == V), also the split path's dual launch with checkpoints
    (`recurrent.chunk_recurrent_dual_checkpoints`, fp32 "kv", on the segments' packed offsets) at
    both value slice widths and the checkpoint combine (`pool_states`, int32 and int64 positions); and
    always the torch path's pool gather and store (`pool_states`, int32 and int64 indices), in each
    state dtype and layout. Kept out of `op_kernel_specs` (warmup's list and the recorded sources)
    so that a plain call builds nothing more. `fp16_products`: the builds of the opt-in fp16 A_beta
    product (bf16 input; `flashqla.ops.gdn.fwd.product_dtype`) instead. Pure Python."""
    BV = block_v or pick_block_v(N, HV, V)
    seq = seq_dtype if varlen else "int32"
    op = (False, "float16") if fp16_products and dtype == "bfloat16" else ()  # the opt-in fp16 A_beta product
    specs = [("recurrent_serving", (H, HV, K, V, BV, dtype, seq, varlen, sd, lay, ck) + op)
             for sd in state_dtypes for lay in state_layouts for ck in checkpoints]
    if split and K == V:
        specs += [("recurrent_serving", (H, HV, K, V, bv, dtype, seq, True, "float32", "kv", True, True)
                   + (("float16",) if op else ()))
                  for bv in (64, 128)]
    for sd in state_dtypes:  # the torch path's state moves (any plan), the checkpoint combine (split plans)
        for lay in state_layouts:
            for it in ("int32", "int64"):
                specs += [("pool_gather", (K, V, sd, lay, it)), ("pool_store", (K, V, sd, lay, it))]
                if split and K == V:
                    specs.append(("checkpoint_combine", (K, V, sd, lay, it)))
    return specs
