"""Benchmark harness: `python -m flashqla.bench` (GDN forward, ours vs FLA vs FlashQLA).

Modules: `grid` (FlashQLA's published H200 grid, FLOP and byte counts, CP rows), `timing` (the one
CUDA-graph timer), `trusted` (fp64 chunked result of the correctness gate), `peers` (the
implementations and the environment key), `runner` (one row: inputs, gate, timing), `store`
(resumable CSVs, the peers' cache), `breakdown` (FLA's forward kernel by kernel), `report`
(markdown, geometric means, plot). Importing this package needs no GPU and imports no peer.
"""
