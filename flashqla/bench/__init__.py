"""Benchmark harness: `python -m flashqla.bench` (GDN forward, ours vs FLA vs FlashQLA) and
`python -m flashqla.bench --bwd` (backward and training step).

Forward modules: `grid` (FlashQLA's published H200 grid, FLOP and byte counts, CP rows), `timing`
(the one CUDA-graph timer), `trusted` (fp64 chunked result of the correctness gate, and its
gradients by autograd for the backward gate), `peers` (the implementations and the environment
key), `runner` (one row: inputs, gate, timing), `store` (resumable CSVs, the peers' cache),
`breakdown` (FLA's forward kernel by kernel), `report` (markdown, geometric means, plot).
Backward modules: `bwd_grid` (FlashQLA's backward grid with its seeded random lengths, backward and
training-step FLOP), `bwd_impls` (each implementation as a forward and a backward call),
`bwd_runner` (inputs with do/dht, fp64 gradients, gate, timing), `bwd_report`, `bwd_main` (the
loop). Importing this package needs no GPU and imports no peer.
"""
