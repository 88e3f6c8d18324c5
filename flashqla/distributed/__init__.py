"""Context parallelism across GPUs (or CPU processes) with torch.distributed.

Each rank of a process group holds a contiguous token shard of one packed batch (B = 1, global
`cu_seqlens`; sequences may cross rank boundaries, shards may be uneven or empty). The op
`chunk_gated_delta_rule_cp` equals `flashqla.chunk_gated_delta_rule` on the whole batch, forward and
backward:

    forward   each rank reduces its shard to the summary of the CP records, per value head the map
              S_out = P S_in + Q of its boundary-crossing piece (P [K, K] from a run with v = 0 from
              the identity, Q [K, V] from a zero-start run: CP-1); one all-gather; a prefix combine
              of the gathered maps gives the state entering the rank's first piece (CP-2); that
              piece's outputs are corrected, o += S_in^T o_{v=0}(I) (CP-3). With a backend that splits
              (`KernelBackend(cp="auto")`, `SegmentedBackend`) the rank's pieces are one intra-device
              CP pass and the first piece's map comes out of it (no extra launch)
    backward  the same reversed: each rank forms the gradient D reaching its first piece's entering
              state from forward quantities (BWD-dSin); one all-gather; a reverse combine
              X <- D + P^T X gives the gradient of the state leaving its last piece; then one local
              backward with the true entering states and terminal gradients

Exchanged per call and rank: HV * K * (K + V) state-dtype elements forward and HV * K * V backward
(each rank receives W times that), independent of the token count. Details:
`flashqla.distributed.op`; the plan (who holds what): `flashqla.distributed.context`; per-rank
compute (sm_90 kernels on GPU, any op with FLA's signature, e.g. the fp64 reference, on CPU):
`flashqla.distributed.backends`.

    import torch.distributed as dist
    from flashqla.distributed import build_cp_context, chunk_gated_delta_rule_cp

    ctx = build_cp_context(cu_seqlens_global, group=dist.group.WORLD)      # even split by default
    o_local, _ = chunk_gated_delta_rule_cp(q_local, k_local, v_local, g_local, beta_local, cp_context=ctx)

Importing this package does not import TileLang (the kernel backend imports it at its first call).
"""

from flashqla.distributed.backends import CPComputeBackend, FunctionBackend, KernelBackend, SegmentedBackend, resolve_backend
from flashqla.distributed.context import CPContext, build_cp_context, even_shard_lens
from flashqla.distributed.op import chunk_gated_delta_rule_cp, exchange_bytes

__all__ = [
    "chunk_gated_delta_rule_cp",
    "build_cp_context",
    "CPContext",
    "even_shard_lens",
    "exchange_bytes",
    "CPComputeBackend",
    "KernelBackend",
    "SegmentedBackend",
    "FunctionBackend",
    "resolve_backend",
]
