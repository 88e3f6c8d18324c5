"""How long does a first call take when nothing is compiled yet: a forward, a split forward and a
training step, each in a new process with an empty TileLang cache (every kernel it needs built, then
run once)?

Run on the GPU machine (`source .device/on-device.sh` first):

    python benchmarks/experiments/cold_compile.py [--cases fwd fwd_split train train_split] [--out DIR]

Cases (bf16, K = V = 128, valid-domain inputs from `flashqla.testing.make_gdn_inputs`):
- fwd:         16/64 heads, 4 packed sequences of 1024 (unsplit: prepare + recurrent kernel);
- fwd_split:   2/8 heads, one sequence of 32768 (the planner splits it: the split path's launches too);
- train:       4/8 heads, 4 sequences of 2048, forward then backward through autograd (every backward
               kernel of the unsplit path);
- train_split: 2/8 heads, one sequence of 32768, forward then backward (the split backward).

Prints one line per case, `COLD <case> <seconds> ...`, and writes cold_compile.json (per case: the
first call's seconds, the kernels built, the seconds with the process start) to --out (default $OUT,
else the working directory).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "fwd": (16, 64, [1024] * 4, False),
    "fwd_split": (2, 8, [32768], False),
    "train": (4, 8, [2048] * 4, True),
    "train_split": (2, 8, [32768], True),
}

CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r})
from flashqla import chunk_gated_delta_rule
from flashqla.ops.gdn.kernels.sm90._common import compile_count
from flashqla.testing import make_gdn_inputs
x = make_gdn_inputs(1, {T}, {H}, {HV}, 128, 128, seqlens={lengths}, dtype=torch.bfloat16, device="cuda",
                    gate="qwen3next", special_heads=True, initial_state=True, seed=0)
if {train}:
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        x[name].requires_grad_(True)
torch.cuda.synchronize()
t = time.time()
o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, cu_seqlens=x["cu_seqlens"])
if {train}:
    (o.float().square().sum() + ht.square().sum()).backward()
torch.cuda.synchronize()
print("COLD", time.time() - t, compile_count())
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    res = {}
    for case in a.cases:
        H, HV, lengths, train = CASES[case]
        code = CHILD.format(root=ROOT, T=sum(lengths), H=H, HV=HV, lengths=lengths, train=train)
        with tempfile.TemporaryDirectory(prefix="tl-cold-") as cache:
            env = dict(os.environ, TILELANG_CACHE_DIR=cache)
            t0 = time.time()
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                               timeout=600)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("COLD")]
        if not line:
            print(f"COLD {case} failed (rc {r.returncode}):\n{r.stderr[-3000:]}", flush=True)
            res[case] = None
            continue
        _, seconds, built = line[0].split()
        res[case] = dict(first_call_s=float(seconds), kernels_built=int(built), process_s=time.time() - t0)
        print(f"COLD {case} {float(seconds):.1f} s first call, {built} kernels built "
              f"({time.time() - t0:.1f} s with the process start)", flush=True)
    with open(os.path.join(a.out, "cold_compile.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if all(res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
