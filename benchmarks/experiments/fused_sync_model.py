"""Abstract model of the fused forward's synchronisation protocol: build "2" (`flashqla/ops/gdn/kernels/sm90/
fused_fwd.py` on branch `fused-forward`, the experiment's `_fused2_prim_func` on main), transcribed by hand
from its generated CUDA for 16/32 heads, bf16, packed (`build_fused_fwd_kernel(16, 32, 128, 128, "bfloat16",
"float32", "int32", True).get_kernel_source()`; the line numbers below are that source's at f86ad28).
A change to the kernel's barriers must be carried into this model by hand. Journal: forward.md, entry
"The fused forward's training build".

    python benchmarks/experiments/fused_sync_model.py coarse-exh "" 0,1,2,3,4,5   # every interleaving, a process a role
    python benchmarks/experiments/fused_sync_model.py exh "" 0,1,2                  # a process per warp group
    RUNS=2000 python benchmarks/experiments/fused_sync_model.py rand "" 0,1,2,3,4,5,6,7   # random timings
    python benchmarks/experiments/fused_sync_model.py coarse-exh no_fix 4,5        # self-test: f86ad28's wait removed

Mutations (second argument, comma-separated): no_fix (the aux roles' qk_empty wait of f86ad28),
no_xempty (the aux roles' x_empty wait), chain_early_xempty (the chain's x_empty arrive before it
reads a_s), no_chain_qk_empty (the chain's qk_empty wait before a refill).

Thread groups (each a process; named barriers rendezvous between the groups of one role):
  cw0  chain warp 0 (32 threads: TMA issue, qk_full / v_full arrives)     lines 120-395
  cr   chain warps 1-7 (224)
  a0w  aux 0 warp 0 (32: gates into gc_s/bq_s)                           lines 397-788
  a0r  aux 0 warps 1-3 (96)
  a1w  aux 1 warp 0 (32)                                                 lines 789-1180
  a1r  aux 1 warps 1-3 (96)
  TMA  the copy engine: any issued copy may land at any step.
mbarrier semantics: n = completed phases; wait(P) passes iff n % 2 != P; a phase completes when its
pending arrival count reaches 0 and its tx count is 0 (expect_tx adds, complete_tx subtracts).
Parity formulas are the generated code's, verbatim (as Python expressions on the loop counters).
Checks: hang (no process can step, not all done), outstanding TMA at exit, every wait passing on
its intended phase (n == intended count: flags phase aliasing), data races on the shared buffers
(a write while a reader of another role / chunk holds the buffer, a read of the wrong chunk or of
a not-yet-landed TMA tile), arrive-count / named-barrier thread-count consistency.
"""
import sys
import random
import os
RUNS = int(os.environ.get("RUNS", "2000"))

THREADS = {"cw0": 32, "cr": 224, "a0w": 32, "a0r": 96, "a1w": 32, "a1r": 96}
ROLE = {"cw0": "chain", "cr": "chain", "a0w": "aux0", "a0r": "aux0", "a1w": "aux1", "a1r": "aux1"}
# mbarrier inits (lines 99-111)
INIT = {("qk_full", 0): 32, ("qk_full", 1): 32, ("qk_full", 2): 32,
        ("qk_empty", 0): 128, ("qk_empty", 1): 128, ("qk_empty", 2): 128,
        ("v_full", 0): 32, ("v_full", 1): 32, ("x_full", 0): 128, ("x_full", 1): 128,
        ("x_empty", 0): 256, ("x_empty", 1): 256}
# named barriers: id -> thread count in the generated code (bar.sync id, count)
NB_COUNT = {3: 256, 8: 256, 4: 128, 5: 128}
TILE = 16384  # expect_transaction per tensor (2 boxes of 64x64 bf16)


def programs(n, mut=frozenset()):
    """op lists per group for a sequence of n chunks (mut: mutations for the model's self-test)"""
    P = _programs(n, mut)
    if COARSE:
        # one process per role: cr / a0r / a1r merged into warp 0's group (their arrivals added to it,
        # their ops other than arrivals being the same bookkeeping); named barriers then always pass
        Q = {}
        for w, r in (("cw0", "cr"), ("a0w", "a0r"), ("a1w", "a1r")):
            ops = []
            for op in P[w]:
                if op[0] == "nb":
                    continue
                if op[0] == "arrive" and op[1][0] in ("x_empty", "qk_empty", "x_full"):
                    op = ("arrive", op[1], THREADS[w] + THREADS[r])
                ops.append(op)
            Q[w] = ops
        for r in ("cr", "a0r", "a1r"):
            Q[r] = [("done",)]
        return Q
    return P


COARSE = False


def _programs(n, mut=frozenset()):
    P = {g: [] for g in THREADS}
    # ---------------- chain
    for g in ("cw0", "cr"):
        o = P[g]
        if g == "cw0":
            for c in range(min(n, 3)):                      # lines 123-137
                o += [("expect", ("qk_full", c), TILE), ("tma", ("qk", c), c, ("qk_full", c), TILE),
                      ("expect", ("qk_full", c), TILE), ("tma", ("qk", c), c, ("qk_full", c), TILE, "k"),
                      ("arrive", ("qk_full", c))]
            for c in range(min(n, 2)):                      # lines 138-147
                o += [("expect", ("v_full", c), TILE), ("tma", ("v", c), c, ("v_full", c), TILE),
                      ("arrive", ("v_full", c))]
        for c in range(n):
            s, sv = c % 3, c & 1
            o += [("nb", 3, c, 0)]                           # 169
            o += [("wait", ("qk_full", s), (c % 6) // 3, c // 3 + 1)]  # 180
            o += [("check", ("qk", s), c), ("hold", ("qk", s), c)]
            o += [("nb", 3, c, 1)]                           # 184 (wgmma on st_s, k_s, q_s)
            o += [("wait", ("x_full", sv), (c & 3) >> 1, c // 2 + 1)]  # 212
            o += [("check", ("gc", s), c), ("hold", ("gc", s), c),
                  ("checkab", sv, c), ("hold", ("a", sv), c)]
            o += [("wait", ("v_full", sv), (c & 3) >> 1, c // 2 + 1)]  # 236
            o += [("check", ("v", sv), c), ("hold", ("v", sv), c)]
            if "chain_early_xempty" not in mut:
                o += [("release", ("a", sv)), ("arrive", ("x_empty", sv))]  # 332-335 after wait_wgmma
            else:
                o += [("arrive", ("x_empty", sv)), ("release", ("a", sv))]
            o += [("nb", 3, c, 2), ("write", ("v", sv), c), ("nb", 3, c, 3)]  # 337-342 o staged in v_s
            o += [("release", ("qk", s)), ("release", ("gc", s)), ("release", ("v", sv))]
            o += [("nb", 8, c, 0)]                           # 358
            if g == "cw0":
                if c + 3 < n:                                # 360-375
                    if "no_chain_qk_empty" not in mut:
                        o += [("wait", ("qk_empty", s), (c % 6) // 3, c // 3 + 1)]
                    o += [("expect", ("qk_full", s), TILE), ("tma", ("qk", s), c + 3, ("qk_full", s), TILE),
                          ("expect", ("qk_full", s), TILE), ("tma", ("qk", s), c + 3, ("qk_full", s), TILE, "k"),
                          ("arrive", ("qk_full", s))]
                if c + 2 < n:                                # 376-385
                    o += [("expect", ("v_full", sv), TILE), ("tma", ("v", sv), c + 2, ("v_full", sv), TILE),
                          ("arrive", ("v_full", sv))]
        o += [("done",)]
    # ---------------- aux
    for j, (gw, gr) in enumerate((("a0w", "a0r"), ("a1w", "a1r"))):
        nb = 4 + j
        iters = ((n + 1) >> 1) if j == 0 else (n >> 1)     # 461 / 853
        for g in (gw, gr):
            o = P[g]
            for i in range(iters):
                c = 2 * i + j
                s = c % 3
                if j == 0:
                    pre = (2 <= i)                            # 507
                    pe = 1 - (((i % 3) * 2) // 3)             # 508
                    pf = ((i % 3) * 2) // 3                   # 510
                else:
                    pre = (1 <= i)                            # 899
                    pe = 1 - ((((i % 3) * 2) + 1) // 3)       # 900
                    pf = (((i % 3) * 2) + 1) // 3             # 902
                if "no_fix" in mut:
                    pre = False
                if pre:
                    o += [("wait", ("qk_empty", s), pe, c // 3)]
                o += [("wait", ("qk_full", s), pf, c // 3 + 1)]
                o += [("check", ("qk", s), c), ("hold", ("qk", s), c)]
                if g == gw:
                    o += [("write", ("gc", s), c), ("hold", ("gc", s), c)]  # 511-517
                o += [("nb", nb, i, 0)]                           # 521
                if g == gr:
                    o += [("check", ("gc", s), c), ("hold", ("gc", s), c)]
                o += [("nb", nb, i, 1)]                           # 536 ... (589-681: more role barriers)
                o += [("nb", nb, i, 2)]
                if "no_xempty" not in mut:
                    o += [("wait", ("x_empty", j), 1 - (i & 1), i)]  # 707
                o += [("nb", nb, i, 3), ("write", ("a", j), c), ("nb", nb, i, 4)]  # 708-741
                o += [("nb", nb, i, 5), ("nb", nb, i, 6), ("write", ("a", j), c)]  # 747-783 (pg_s)
                o += [("release", ("qk", s)), ("release", ("gc", s))]
                o += [("arrive", ("qk_empty", s))]                # 786
                o += [("arrive", ("x_full", j))]                  # 787
            o += [("done",)]
    return P


class Hazard(Exception):
    pass


def initial(n, mut):
    st = {
        "pc": {g: 0 for g in THREADS},
        "bar": {b: [0, INIT[b], 0] for b in INIT},  # n completed, pending arrivals, tx
        "nb": {},        # (id, gen) -> set of groups arrived
        "content": {},   # ("qk"/"v"/"gc", s) -> (chunk, landed);  ("a", j) -> {group: chunk}
        "holders": {},   # res -> set of (group, chunk)
        "tma": [],       # pending (res, chunk, bar, bytes)
    }
    return st


def key(st):
    return (tuple(sorted(st["pc"].items())), tuple(sorted((b, tuple(v)) for b, v in st["bar"].items())),
            tuple(sorted((k, frozenset(v)) for k, v in st["nb"].items())),
            tuple(sorted((k, v if not isinstance(v, dict) else tuple(sorted(v.items())))
                         for k, v in st["content"].items())),
            tuple(sorted((k, frozenset(v)) for k, v in st["holders"].items() if v)),
            tuple(sorted(st["tma"])))


def clone(st):
    return {"pc": dict(st["pc"]), "bar": {b: list(v) for b, v in st["bar"].items()},
            "nb": {k: set(v) for k, v in st["nb"].items()},
            "content": {k: (dict(v) if isinstance(v, dict) else v) for k, v in st["content"].items()},
            "holders": {k: set(v) for k, v in st["holders"].items()}, "tma": list(st["tma"])}


def maybe_complete(st, b):
    v = st["bar"][b]
    if v[1] == 0 and v[2] == 0:
        v[0] += 1
        v[1] = INIT[b]
    if v[1] < 0 or v[2] < 0 and v[1] == 0:
        raise Hazard(f"barrier {b}: arrival/tx underflow {v}")


def role_groups(role):
    return [g for g in THREADS if ROLE[g] == role]


def step(st, g, P, n):
    """try to execute group g's next op; returns new state or None if blocked"""
    ops = P[g]
    pc = st["pc"][g]
    op = ops[pc]
    kind = op[0]
    if kind == "done":
        return None
    if kind == "wait":
        _, b, par, want = op
        nb_ = st["bar"][b][0]
        if nb_ % 2 == par:
            return None  # blocked
        if nb_ != want:
            raise Hazard(f"{g}: wait {b} parity {par} passed at completed-phase count {nb_}, intended {want} (op {pc})")
        st = clone(st)
    else:
        st = clone(st)
        if kind == "arrive":
            b = op[1]
            st["bar"][b][1] -= op[2] if len(op) > 2 else THREADS[g]
            if st["bar"][b][1] < 0:
                raise Hazard(f"{g}: too many arrivals on {b}")
            maybe_complete(st, b)
        elif kind == "expect":
            st["bar"][op[1]][2] += op[2]
        elif kind == "tma":
            res, c, b, by = op[1], op[2], op[3], op[4]
            hs = st["holders"].get(res, set())
            if hs:
                raise Hazard(f"{g}: TMA of chunk {c} into {res} while held by {sorted(hs)}")
            st["content"][res] = (c, False)
            st["tma"].append((res, c, b, by, len(op) > 5))
        elif kind == "check":
            res, c = op[1], op[2]
            cont = st["content"].get(res)
            if res[0] in ("qk", "v"):
                pend = [t for t in st["tma"] if t[0] == res]
                if cont is None or cont[0] != c or pend:
                    raise Hazard(f"{g}: reads {res} for chunk {c}, holds {cont}, pending {pend}")
            else:
                if cont != c:
                    raise Hazard(f"{g}: reads {res} for chunk {c}, holds {cont}")
        elif kind == "checkab":
            j, c = op[1], op[2]
            cont = st["content"].get(("a", j), {})
            grp = role_groups(f"aux{j}")[:1] if COARSE else role_groups(f"aux{j}")
            if any(cont.get(x) != c for x in grp):
                raise Hazard(f"{g}: reads a_s/pg_s[{j}] for chunk {c}, holds {cont}")
        elif kind == "hold":
            st["holders"].setdefault(op[1], set()).add((g, op[2]))
        elif kind == "release":
            st["holders"][op[1]] = {h for h in st["holders"].get(op[1], set()) if h[0] != g}
        elif kind == "write":
            res, c = op[1], op[2]
            hs = st["holders"].get(res, set())
            bad = {h for h in hs if not (ROLE[h[0]] == ROLE[g] and h[1] == c)}
            if bad:
                raise Hazard(f"{g}: writes {res} for chunk {c} while held by {sorted(bad)}")
            if res[0] == "a":
                st["content"].setdefault(res, {})[g] = c
            elif res[0] == "v":
                cont = st["content"].get(res)
                if cont != (c, True) or [t for t in st["tma"] if t[0] == res]:
                    raise Hazard(f"{g}: writes o into {res} for chunk {c} but it holds {cont}")
            else:
                st["content"][res] = c
        else:
            raise RuntimeError(op)
    st["pc"][g] = pc + 1
    return st


def _first(st, key_, g):
    return True


LOCAL_AFTER = ("check", "checkab", "hold", "expect")


def run_group(st, g, P, n):
    """one atomic step of group g: leading releases, its op, trailing local bookkeeping
    (partial-order reduction: these are invisible to the other groups). None if blocked."""
    ops = P[g]
    st2 = st
    pc = st["pc"][g]
    # leading releases
    if ops[pc][0] == "release":
        st2 = clone(st2)
        while ops[st2["pc"][g]][0] == "release":
            st2 = step(st2, g, P, n)
    op = ops[st2["pc"][g]]
    if op[0] == "done":
        return st2 if st2 is not st else None
    if op[0] == "nb":
        _, bid, it, k = op
        key_ = (bid, it, k)
        grp = role_groups(ROLE[g])
        if sum(THREADS[x] for x in grp) != NB_COUNT[bid]:
            raise Hazard(f"named barrier {bid}: count {NB_COUNT[bid]} != threads reaching it")
        arrived = st2["nb"].get(key_, set())
        if g in arrived:
            return None  # waiting for the rest of the role
        st2 = clone(st2) if st2 is st else st2
        arrived = st2["nb"].setdefault(key_, set())
        arrived.add(g)
        if all(x in arrived for x in grp):
            for x in grp:
                st2["pc"][x] += 1
            del st2["nb"][key_]
    else:
        ns = step(st2, g, P, n)
        if ns is None:
            return None
        st2 = ns
    while ops[st2["pc"][g]][0] in LOCAL_AFTER:
        st2 = step(st2, g, P, n)
    return st2


def successors(st, P, n):
    out = []
    for g in THREADS:
        ns = run_group(st, g, P, n)
        if ns is not None:
            out.append((g, ns))
    for idx, (res, c, b, by, _) in enumerate(st["tma"]):
        ns = clone(st)
        del ns["tma"][idx]
        if not [t for t in ns["tma"] if t[0] == res]:
            ns["content"][res] = (c, True)
        ns["bar"][b][2] -= by
        if ns["bar"][b][2] < 0:
            raise Hazard(f"tx underflow on {b}")
        maybe_complete(ns, b)
        out.append(("TMA", ns))
    return out


def done(st, P):
    return all(P[g][st["pc"][g]][0] == "done" for g in THREADS)


def explore(n, mut=frozenset(), limit=int(os.environ.get("LIMIT", "3000000"))):
    P = programs(n, mut)
    st0 = initial(n, mut)
    seen = {key(st0)}
    stack = [st0]
    finals = 0
    while stack:
        st = stack.pop()
        try:
            succ = successors(st, P, n)
        except Hazard as h:
            return f"HAZARD: {h}", len(seen)
        if not succ:
            if done(st, P):
                if st["tma"]:
                    return f"HAZARD: exit with TMA outstanding {st['tma']}", len(seen)
                finals += 1
                continue
            blocked = {g: P[g][st["pc"][g]] for g in THREADS if P[g][st["pc"][g]][0] != "done"}
            bars = {b: v for b, v in st["bar"].items()}
            return f"HANG: blocked {blocked} barriers {bars}", len(seen)
        for _, ns in succ:
            k = key(ns)
            if k not in seen:
                seen.add(k)
                stack.append(ns)
                if len(seen) > limit:
                    return f"state limit reached (no hazard among {len(seen)} states)", len(seen)
    return f"ok ({finals} final states)", len(seen)


def random_runs(n, runs, mut=frozenset(), seed=0):
    rng = random.Random(seed)
    P = programs(n, mut)
    for r in range(runs):
        st = initial(n, mut)
        bias = {g: rng.random() for g in list(THREADS) + ["TMA"]}  # per-run speed skew
        while True:
            try:
                succ = successors(st, P, n)
            except Hazard as h:
                return f"HAZARD (run {r}): {h}"
            if not succ:
                if done(st, P):
                    if st["tma"]:
                        return f"HAZARD: exit with TMA outstanding"
                    break
                blocked = {g: P[g][st["pc"][g]] for g in THREADS if P[g][st["pc"][g]][0] != "done"}
                return f"HANG (run {r}): {blocked}"
            w = [bias[g] + 1e-3 for g, _ in succ]
            st = rng.choices(succ, weights=w)[0][1]
    return f"ok ({runs} random runs)"


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "exh"
    if mode.startswith("coarse-"):
        globals()["COARSE"] = True
        mode = mode[len("coarse-"):]
    muts = frozenset(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else frozenset()
    ns = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else list(range(8))
    for n in ns:
        if mode == "exh":
            res, cnt = explore(n, muts)
            print(f"n={n} mut={sorted(muts)}: {res} [{cnt} states]", flush=True)
        else:
            print(f"n={n} mut={sorted(muts)}: {random_runs(n, RUNS, muts, seed=n)}", flush=True)
