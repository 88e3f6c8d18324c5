"""TileLang kernels for Hopper (sm_90a), one module per shipped kernel (factory + launcher); each
imports only `_common`. `registry` builds them by kind and lists what a configuration launches.

Forward (two launches):
    prepare.py          `chunk_prepare_fwd`:   chunk-local cumsum of g, K K^T, the gated WY inverse A (x beta)
    recurrent.py        `chunk_recurrent_fwd`: the state recurrence and the output, state on chip;
                        `chunk_recurrent_dual`: the split path's run and transitions in one launch

Backward (three passes, four launches; `flashqla.ops.gdn.bwd`):
    states_bwd.py       `chunk_states_bwd`:    the chunk-start states h, recomputed and stored (q's dtype)
    chunk_bwd.py        `chunk_fused_bwd`:     every per-chunk gradient, chunks in reverse, dS on chip
    finish_bwd.py       `chunk_finish_bwd`:    reverse chunk-local cumsum of dG, GVA sum of dq and dk
    launch_order.py     `launch_order`:        the sequences longest first, one launch

Context parallelism (`flashqla.cp`):
    cp_tables.py        `segment_tables`:      the segment tables of packed offsets, one launch
    cp_scan.py          `cp_scan`:             the combine scan of segment states (forward) and of state
                                               gradients (backward), one launch
    cp_correct.py       `cp_correct`, `cp_state_grads`: the output correction o += S_in^T U and the
                                               gradient E = sum U do^T of every segment, one launch each
    cp_limits.py        `cp_transition_limits`: the chunks each (segment, value head) transition walks
                                               (the gate-driven cut), one launch
    cp_relayout.py      `relayout_slots`:      A and g_cum_log2 between the caller's and the segments'
                                               chunk slots, one launch; `slot_initial_states`

Nothing here imports TileLang until a kernel is built.
"""
