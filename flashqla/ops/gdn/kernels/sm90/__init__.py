"""TileLang kernels for Hopper (sm_90a), one module per fused kernel.

Forward (two launches):
    prepare.py    `chunk_prepare_fwd`:   chunk-local cumsum of g, K K^T, the gated WY inverse A (x beta)
    recurrent.py  `chunk_recurrent_fwd`: the state recurrence and the output, state on chip

Context parallelism (`flashqla.cp`):
    cp_scan.py    `cp_scan`:             the combine scan of segment states (forward) and of state
                                         gradients (backward), one launch
    cp_correct.py `cp_correct`, `cp_state_grads`: the output correction o += S_in^T U and the
                                         gradient E = sum U do^T of every segment, one launch each
    cp_limits.py  `cp_transition_limits`: the chunks each (segment, value head) transition walks
                                         (the gate-driven cut), one launch
    cp_relayout.py `relayout_slots`:     A and g_cum_log2 between the caller's and the segments' chunk
                                         slots, one launch
    recurrent.py  `chunk_recurrent_dual`: the run and the transitions of the segments in one launch

Backward (three passes, four launches; `flashqla.ops.gdn.bwd`; NOTES-bwd.md):
    states_bwd.py `chunk_states_bwd`:    the chunk-start states h, recomputed and stored
    chunk_bwd.py  `chunk_fused_bwd`:     every per-chunk gradient, chunks in reverse, dS on chip
    finish_bwd.py `chunk_finish_bwd`:    reverse chunk-local cumsum of dG, GVA sum of dq and dk
    launch_order.py `longest_first_order`: the sequences longest first (the chain kernels' launch
                                         order, `_common.launch_order`), one launch

`build_kernels` compiles the kernels of one configuration concurrently; `precompile` fills TileLang's
disk cache for many configurations in worker processes (a warm start for test suites and servers).
Nothing here imports TileLang until a kernel is built.
"""

from __future__ import annotations

__all__ = ["build_kernels", "op_kernel_specs", "precompile"]


def _build(kind: str, args: tuple):
    if kind == "prepare":
        from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

        return build_prepare_kernel(*args)
    if kind == "recurrent":
        from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

        return build_recurrent_kernel(*args)
    if kind == "states_bwd":
        from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel

        return build_states_kernel(*args)
    if kind == "chunk_bwd":
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

        return build_chunk_bwd_kernel(*args)
    if kind == "dg_cumsum":
        from flashqla.ops.gdn.kernels.sm90.finish_bwd import build_dg_cumsum_kernel

        return build_dg_cumsum_kernel(*args)
    if kind == "gva_reduce":
        from flashqla.ops.gdn.kernels.sm90.finish_bwd import build_gva_reduce_kernel

        return build_gva_reduce_kernel(*args)
    if kind == "cp_scan":
        from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel

        return build_cp_scan_kernel(*args)
    if kind == "cp_limits":
        from flashqla.ops.gdn.kernels.sm90.cp_limits import build_cp_limits_kernel

        return build_cp_limits_kernel(*args)
    if kind == "cp_correct":
        from flashqla.ops.gdn.kernels.sm90.cp_correct import build_cp_correct_kernel

        return build_cp_correct_kernel(*args)
    if kind == "cp_state_grads":
        from flashqla.ops.gdn.kernels.sm90.cp_correct import build_cp_state_grads_kernel

        return build_cp_state_grads_kernel(*args)
    if kind == "cp_relayout":
        from flashqla.ops.gdn.kernels.sm90.cp_relayout import build_relayout_kernel

        return build_relayout_kernel(*args)
    if kind == "cp_slot_h0":
        from flashqla.ops.gdn.kernels.sm90.cp_relayout import build_slot_h0_kernel

        return build_slot_h0_kernel(*args)
    if kind == "cp_tables":
        from flashqla.cp.tables_kernel import build_segment_tables_kernel

        return build_segment_tables_kernel(*args)
    if kind == "launch_order":
        from flashqla.ops.gdn.kernels.sm90.launch_order import build_launch_order_kernel

        return build_launch_order_kernel(*args)
    raise ValueError(f"unknown kernel kind {kind!r}")


def _build_in_worker(spec) -> str:
    _build(*spec)
    return spec[0]


def build_kernels(specs) -> list:
    """Builds (or fetches from cache) the kernels [(kind, args), ...] concurrently in threads.

    kind is "prepare" (args of `build_prepare_kernel`), "recurrent" (`build_recurrent_kernel`),
    "states_bwd", "chunk_bwd", "dg_cumsum" or "gva_reduce" (the backward's builders), "cp_scan"
    (`build_cp_scan_kernel`), "cp_correct", "cp_state_grads" (`cp_correct.py`), "cp_limits" (`cp_limits.py`), "cp_relayout"
    (`cp_relayout.py`), "cp_slot_h0" (`cp_relayout.build_slot_h0_kernel`), "cp_tables" (`flashqla.cp.tables_kernel.build_segment_tables_kernel`),
    "launch_order" (`launch_order.build_launch_order_kernel`, args (offsets' dtype,)).
    Threads overlap the external compiler runs; the first call of the op uses this for its two
    kernels.
    """
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    if len(specs) <= 1:
        return [_build(*s) for s in specs]
    with ThreadPoolExecutor(len(specs)) as ex:
        return list(ex.map(lambda s: _build(*s), specs))


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
        _build(*s)


def _few_sequence_scan(HV: int, K: int, V: int, reverse: bool) -> tuple:
    """The `build_cp_scan_kernel` arguments of the scan a cut call over few sequences launches
    (`cp_scan.scan_choice`)."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import scan_choice

    variant, width = scan_choice(HV, 1, True, V)
    return (HV, K, V, reverse, variant, width)


def op_kernel_specs(H: int, HV: int, *, N: int = 1, varlen: bool = False, dtype: str = "bfloat16",
                    beta_dtype: str = "float32", seq_dtype: str = "int32", backward: bool = True,
                    h_dtype: str = "bfloat16", block_v: int | None = None, K: int = 128, V: int = 128,
                    segments_first_use: bool = True, one_head_prepare: bool = True, dh0: bool | None = None) -> list:
    """The kernels (`[(kind, args), ...]`, for `build_kernels` / `precompile`) that one call of
    `flashqla.chunk_gated_delta_rule` uses for H q/k heads, HV value heads, N sequences (the
    recurrent kernel's value slice width depends on N * HV: `recurrent.pick_block_v`), packed or not,
    q/k/v in `dtype`, beta in `beta_dtype`, cu_seqlens in `seq_dtype`; with the backward's four when
    `backward`; the context-parallel kernels (scans, output correction, state gradients, the dual
run + transition launch at both value slice widths, the transition limits and, for packed input,
the segment tables) are
included since `cp="auto"` may split. The split path runs on the segments' packed offsets, int32
for a fixed-length batch too; with `segments_first_use` (the default) such a batch's list also holds
what that path builds on them and the rest does not name: the prepare kernel on packed offsets and,
with `backward`, the segment tables and packed relayouts that the backward's first use on the
segments builds (`bwd._build_once`, which passes False: a call's own first use leaves them to the
split path's). With `one_head_prepare` (the default) and G = HV / H > 1 the list ends with the
prepare kernel that takes one value head a CTA (`prepare.pick_heads_per_cta` picks it for few chunk
slots), on the call's offsets and on the segments' packed ones. `dh0`: pass 2's build for a call that
returns dh0 (True), that does not (False), or both (None, the default: what a precompile needs;
`chunk_bwd.pass2_variant`). Pure Python: needs neither a GPU nor TileLang."""
    from flashqla.ops.gdn.kernels.sm90.prepare import DEFAULT_VARIANT
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v, resolve_schedule

    BV = block_v or pick_block_v(N, HV, V)
    specs = [
        ("prepare", (H, HV, K, dtype, beta_dtype, seq_dtype, varlen, DEFAULT_VARIANT)),
        ("recurrent", (H, HV, K, V, BV, dtype, seq_dtype, varlen, resolve_schedule(None, BV))),
        ("cp_scan", (HV, K, V, False)),
        ("cp_scan", _few_sequence_scan(HV, K, V, False)),
        ("cp_correct", (HV, K, V, dtype, seq_dtype if varlen else "int32")),
    ]
    if varlen:
        specs.append(("cp_tables", (seq_dtype,)))
    if K == V:  # the split path's run + transition launch, on the segments' packed offsets, either slice width
        cp_seq = seq_dtype if varlen else "int32"
        if not varlen and segments_first_use:  # a fixed-length batch's segments are packed: prepare on them
            specs.append(("prepare", (H, HV, K, dtype, beta_dtype, cp_seq, True, DEFAULT_VARIANT)))
        specs += [("recurrent", (H, HV, K, V, bv, dtype, cp_seq, True, resolve_schedule(None, bv, dual=True), True))
                  for bv in (64, 128)]
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
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_VARIANT as BWD_VARIANT
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd import pass2_variant

        # passes 1-3 on the input's offsets, then (split path) on the segments' packed offsets; pass 2
        # with the variant the op runs (`build_chunk_bwd_kernel` alone defaults to "v1"), for a call
        # returning dh0 or not
        keys = [(seq_dtype, varlen)] + ([(seq_dtype if varlen else "int32", True)] if K == V else [])
        for sd, vl in dict.fromkeys(keys):
            specs.append(("states_bwd", (H, HV, K, V, dtype, h_dtype, sd, vl)))
            specs += [("chunk_bwd", (H, HV, K, V, dtype, h_dtype, beta_dtype, sd, vl, variant))
                      for variant in dict.fromkeys(pass2_variant(vl, d) for d in ((True, False) if dh0 is None else (dh0,)))]
            specs.append(("dg_cumsum", (HV, sd, vl)))
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import qk_store_dtype, v5_applies

        # pass 2's per-value-head dq / dk: fp32, or q's dtype from v5 under $FLASHQLA_BWD_QK_DTYPE=input
        # (then with HV == H they are dq / dk and nothing is reduced)
        qk_in = qk_store_dtype(dtype) if BWD_VARIANT.startswith("v5") and v5_applies(K, V, dtype, h_dtype) else "float32"
        if HV != H or qk_in != dtype:
            specs.append(("gva_reduce", (H, HV, K, dtype) + (() if qk_in == "float32" else (qk_in,))))
        specs += [
            ("cp_scan", (HV, K, V, True)),
            ("cp_scan", _few_sequence_scan(HV, K, V, True)),
            ("cp_state_grads", (HV, K, V, dtype, seq_dtype if varlen else "int32")),
        ]
        # the longest-first launch order (`_common.launch_order`): of a packed batch's sequences
        # (FLASHQLA_BWD_ORDER=longest), and of the split path's segments (their packed offsets)
        specs += [("launch_order", (sd,)) for sd, vl in dict.fromkeys(keys) if vl]
    if one_head_prepare and HV // H > 1 and DEFAULT_VARIANT == "v3":
        offsets = [(seq_dtype, varlen)] + ([(seq_dtype if varlen else "int32", True)] if K == V else [])
        specs += [("prepare", (H, HV, K, dtype, beta_dtype, sd, vl, DEFAULT_VARIANT, 1)) for sd, vl in dict.fromkeys(offsets)]
    return specs
