"""Context parallelism on one device: long sequences with few value heads cut into segments that run
side by side, stitched exactly (derivations CP-1..CP-6).

    plan        whether and where to split (`plan_call`, `plan_cp`; cached on static facts)
    segments    the segment tables (`build_segment_tables`, `segment_tables_device`) and the moves of
                A and g_cum_log2 between the caller's and the segments' chunk slots
    forward     the split forward over a plan's tables (`cp_forward`; `cp_forward_open` for a sequence
                entered from elsewhere, `flashqla.distributed`)
    backward    the split backward (`cp_backward`, `cp_backward_open`)
    saved       what a training forward keeps for its backward (`CPSaved`)
    merge       the combine scans (`scan_segment_states`, `scan_segment_grads`, `scan_open_states`)

The op (`flashqla.chunk_gated_delta_rule_fwd` / `_bwd`, whose `cp=`, `segment_len=`, `truncate=` and
`backend=` options reach these) plans once per call and passes the plan down. The passes here run the
launches of a backend (`flashqla.ops.gdn.backend`: the sm_90 kernels, or
`reference.gdn.cp.ReferenceCPBackend`, their fp64 stand-in on any device).
"""

from flashqla.cp.backward import cp_backward, cp_backward_open
from flashqla.cp.forward import CPInfo, OpenForward, cp_forward, cp_forward_open, transition_limits
from flashqla.cp.merge import scan_open_states, scan_segment_grads, scan_segment_states
from flashqla.cp.plan import CallPlan, CPPlan, clear_plan_cache, cp_splits, plan_call, plan_cp, plan_for, sm_count
from flashqla.cp.saved import CPSaved
from flashqla.cp.segments import SegmentTables, build_segment_tables, segment_tables_device

__all__ = [
    "CPInfo",
    "CPPlan",
    "CPSaved",
    "CallPlan",
    "OpenForward",
    "SegmentTables",
    "build_segment_tables",
    "clear_plan_cache",
    "cp_backward",
    "cp_backward_open",
    "cp_forward",
    "cp_forward_open",
    "cp_splits",
    "plan_call",
    "plan_cp",
    "plan_for",
    "scan_open_states",
    "scan_segment_grads",
    "scan_segment_states",
    "segment_tables_device",
    "sm_count",
    "transition_limits",
]
