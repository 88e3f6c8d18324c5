"""Smoke run of the v3 backward kernels, one launch at a time with a synchronisation and a line
after each (a hang shows which launch; faulthandler dumps the Python stack after $HANG_S seconds).

    python tests/gpu/v3_smoke.py            small fixed-length and packed cases (passed on the H200)
    python tests/gpu/v3_smoke.py --big      the packed rows pass 2b hung on (16/32 and 4/8 heads, 8
                                            sequences, 8192 tokens), each launch repeated --reps times
    compute-sanitizer --tool synccheck python tests/gpu/v3_smoke.py --big --reps 1
                                            (the barrier checks; racecheck likewise) for the hang's cause
"""

import faulthandler
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.bwd_v2_check import SCALE, _case  # noqa: E402


def step(name, fn):
    t = time.time()
    out = fn()
    torch.cuda.synchronize()
    print(f"{name}: ok {time.time() - t:.2f} s", flush=True)
    return out


def big(reps):
    from flashqla.bench.bwd_grid import bwd_mix
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v3 import chunk_grads_v3
    from flashqla.ops.gdn.kernels.sm90.dh_bwd import chunk_dh_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd
    from tests.gpu.device_check import gen_inputs

    for H, HV in ((4, 8), (16, 32)):
        lengths = list(bwd_mix(8192, 8).lengths)
        x = gen_inputs(H, HV, lengths, True)
        cu = x["cu_seqlens"]
        do = torch.randn(x["v"].shape, device="cuda").to(x["v"].dtype)
        f = step(f"{H}/{HV} fwd", lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True))
        h = step(f"{H}/{HV} states", lambda: chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], cu,
                                                              torch.bfloat16))
        dh, _ = step(f"{H}/{HV} dh (2a)", lambda: chunk_dh_bwd(f.q, f.k, do, f.A, f.g_cum_log2, None, SCALE, cu))
        for cpc in (1, 4):
            for i in range(reps):
                step(f"{H}/{HV} grads (2b) cpc {cpc} #{i}", lambda: chunk_grads_v3(
                    f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, dh, do, SCALE, cu, cpc))


def main():
    faulthandler.dump_traceback_later(float(os.environ.get("HANG_S", "45")), repeat=True)
    if "--big" in sys.argv:
        reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 5
        big(reps)
        print("smoke done", flush=True)
        return
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v3 import chunk_grads_v3
    from flashqla.ops.gdn.kernels.sm90.dh_bwd import chunk_dh_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    for name, kw in [("T=1", dict(B=1, T=1, H=2, HV=4)), ("T=130", dict(B=1, T=130, H=2, HV=4)),
                     ("varlen", dict(lengths=[5, 0, 63, 1, 64, 130], H=2, HV=4))]:
        xd, h_dtype, _ = _case(3, **kw)
        cu = xd["cu_seqlens"]
        f = step(f"{name} fwd", lambda: chunk_gated_delta_rule_fwd(xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"], SCALE,
                                                                    xd["initial_state"], True, cu))
        h = step(f"{name} states", lambda: chunk_states_bwd(f.k, xd["v"], f.A, f.g_cum_log2, xd["initial_state"], cu, h_dtype))
        step(f"{name} v2", lambda: chunk_fused_bwd(f.q, f.k, xd["v"], xd["beta"], f.A, f.g_cum_log2, h, xd["do"], xd["dht"],
                                                   SCALE, cu, variant="v2"))
        dh, dh0 = step(f"{name} dh (2a)", lambda: chunk_dh_bwd(f.q, f.k, xd["do"], f.A, f.g_cum_log2, xd["dht"], SCALE, cu))
        for cpc in (1, 4):
            step(f"{name} grads (2b) cpc {cpc}", lambda: chunk_grads_v3(f.q, f.k, xd["v"], xd["beta"], f.A, f.g_cum_log2, h, dh,
                                                                        xd["do"], SCALE, cu, cpc))
    print("smoke done", flush=True)


if __name__ == "__main__":
    main()
