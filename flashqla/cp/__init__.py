"""Context parallelism on one device: the planner (when and where to split, segment tables without
host sync, a plan cache keyed on static facts) and the state merge (combine scan)."""

from flashqla.cp.merge import scan_segment_states
from flashqla.cp.planner import (
    BV_CHOICES,
    CHUNK_COST,
    DEFAULT_SM_COUNT,
    GATE_THRESHOLD,
    MIN_GAIN,
    PASSES_EXACT,
    PASSES_GATED,
    SEGMENT_QUANTUM,
    CPPlan,
    PlanKey,
    SegmentTables,
    build_segment_tables,
    clear_plan_cache,
    get_cp_plan,
    num_segment_slots,
    plan_cache_info,
    plan_cp,
    plan_key,
    sm_count,
)

__all__ = [
    "BV_CHOICES",
    "CHUNK_COST",
    "DEFAULT_SM_COUNT",
    "GATE_THRESHOLD",
    "MIN_GAIN",
    "PASSES_EXACT",
    "PASSES_GATED",
    "SEGMENT_QUANTUM",
    "CPPlan",
    "PlanKey",
    "SegmentTables",
    "build_segment_tables",
    "clear_plan_cache",
    "get_cp_plan",
    "num_segment_slots",
    "plan_cache_info",
    "plan_cp",
    "plan_key",
    "sm_count",
    "scan_segment_states",
]
