"""Benchmark harness: `python -m flashqla.bench` (GDN forward, ours vs FLA vs FlashQLA) and
`python -m flashqla.bench --bwd` (backward and training step), one harness for both.

Modules, one per concern; what differs between the forward and the backward is data (`store.SCHEMAS`,
`gate.GATE_TOL`, the grids) or one small function each (`runner`'s per-row measurement, `report`'s
page body):

- `grid`: the forward, context-parallel and backward grids (FlashQLA's published tables), FLOP counts;
- `impls`: the implementation table (ours and the peers: how each is loaded and called), the
  environment key;
- `inputs`: the seeded inputs of a row;
- `gate`: the fp64 result (from `reference/`), the error metric and the gate's decision;
- `timing`: the one CUDA-graph timer;
- `runner`: the measuring loop;
- `store`: the CSVs (results, the peers' cache), their schemas and file names;
- `report`: the markdown pages; `plots`: every figure (pages and `notebooks/70_benchmarks.py`);
- `breakdown`: FLA's forward kernel by kernel;
- `config`: the options; `__main__`: the command line.

Importing this package needs no GPU and imports no peer.
"""
