"""The streamed forward: the recurrent kernel starts while the prepare kernel still runs.

Why. The prepare kernel is chunk-parallel and the recurrent kernel walks each (sequence, value head)
chunk by chunk. When the walks are few (one sequence of 2048 tokens at 2 or 4 q/k heads: 16 to 32
CTAs on 132 SMs) the recurrent grid leaves most SMs idle, and launched after the prepare grid it
also waits for the prepare's last chunk before it walks its first: on the H200 the 2/8 x 2048 row
spends 20.2 us in prepare and 54.3 us in the recurrence (NOTES.md). The recurrence only needs chunk
c's A diag(beta) and g_cum_log2 when it reaches chunk c.

How (both kernels built with `pdl=True`; `chunk_gated_delta_rule_fwd` with `streamed` on):
- the prepare kernel takes one value head per CTA instead of the G of a q/k head (K K^T formed G
  times instead of once), so each CTA is G times shorter and the recurrence's first chunks are
  ready early (with G heads a CTA, every CTA of a one-wave grid ends near the grid's end);
- the caller zeroes `ready` [S, HV] int32 (S chunk slots), then launches prepare and recurrent in
  one stream;
- every prepare CTA first executes `griddepcontrol.launch_dependents` (TileLang `T.pdl_trigger`):
  the recurrent grid, launched with programmatic stream serialisation, may start once every prepare
  CTA has started. So a recurrent CTA never waits on a prepare CTA that is not resident or done:
  no deadlock, whatever the grid sizes;
- a prepare CTA (slot, hv), after its g_cum_log2 stores, waits in every thread for the completion
  (not only the source reads) of the TMA stores of A diag(beta) it issued, fences the async proxy
  against the generic one and all its writes at GPU scope (`flashqla_writes_done`), synchronises
  the CTA, and thread 0 stores ready[slot, hv] = 1 with release semantics at GPU scope
  (`flashqla_publish`);
- the recurrent kernel's producer warp, before its TMA loads of chunk slot s of value head hv,
  spins with acquire loads on ready[s, hv] (`flashqla_wait_ready`, backing off with nanosleep;
  after 2^26 polls, over 6 s, it traps: an unpublished slot is a bug that must fail, not hang) and
  fences the generic proxy against the async one before the loads;
- the recurrent kernel ends with `griddepcontrol.wait` (`T.pdl_sync`): it completes only after the
  prepare grid did, so the stream order seen by later work is unchanged. (TileLang also launches a
  kernel with programmatic stream serialisation only when it contains that call.)

Without a launch attribute honoured (an older driver) the recurrent grid starts after the prepare grid
as before and finds every slot ready: the same results, no overlap.
"""

__all__ = ["SOURCE"]

#: Device functions the two kernels call (`T.import_source` + `T.call_extern`).
SOURCE = r"""
#ifndef FLASHQLA_STREAMED_FUNCS
#define FLASHQLA_STREAMED_FUNCS
__device__ __forceinline__ void flashqla_writes_done() {
  // the bulk (TMA) stores this thread issued have written global memory (not only read shared
  // memory, as the kernels' own wait_group.read before reusing a staging tile); then order them,
  // and this thread's generic stores, before what follows, for every proxy, at GPU scope
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __threadfence();
}
__device__ __forceinline__ void flashqla_publish(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void flashqla_wait_ready(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  for (unsigned spins = 0; v == 0; ++spins) {
    if (spins == (1u << 26)) __trap();  // > 6 s: a slot never published is a bug; fail, never hang
    __nanosleep(100);
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
#endif
"""
