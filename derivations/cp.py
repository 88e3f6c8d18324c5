"""CP: the algebra of context parallelism (a long sequence split into segments).

A segment of chunks maps the state that enters it affinely:

    S_end = P S_start + Q,   P = M_{n-1} ... M_0,  M_c = gamma_C I - T_c (RW-3),  Q = S_end from S_start = 0

(CP-1). Maps compose, (P2, Q2) o (P1, Q1) = (P2 P1, P2 Q1 + Q2), and the composition is associative,
so the entering states of all segments follow from a scan of per-segment maps computed in parallel
(CP-2). A segment's outputs are affine in its entering state too,
O_c(S) = O_c(0) + scale D_c R_c P_{<c} S with R_c = Q_c - tril_0(Q_c K_c^T) A_c B_c K_c, so segments
run from zero and are corrected afterwards (CP-3).

The same affine form makes the backward of a piece entered with an unknown state cheap (BWD-dSin, the
record in this module that belongs to the backward family): with segment j entered with
A_j S_in + B_j (A_0 = I, A_{j+1} = P_j A_j), o_t = o0_t + (A_j S_in + B_j)^T U_t (U_t the output of
the run from I with v = 0) and S_end = A_m S_in + B_m, the gradient reaching S_in is
sum_j A_j^T E_j + A_m^T G with E_j = sum_{t in j} U_t do_t^T and G the gradient at S_end: forward
quantities and GEMMs, no backward pass. The checker differentiates the recurrence's loss with
`sympy.diff` and compares.

The gate-driven shortcut drops the state S_w that enters a warm-up window of chunks whose summed
log-decay is G (= sum of g over the window) and restarts from zero there. By CP-1 the error it makes
at any later point is P S_w, P the product of every gated factor a_t (I - beta_t k_t k_t^T) from the
window start on. With ||k_t|| = 1 and beta_t in [0, 1] each factor I - beta k k^T is symmetric with
eigenvalues 1 and 1 - beta in [0, 1], so its spectral norm is <= 1 and ||P||_2 <= exp(G):

    CP-4  ||S_true - S_trunc||_F <= exp(G) ||S_w||_F                  (every later state)
    CP-5  ||o_t,true - o_t,trunc||_2 <= scale ||q_t||_2 exp(G) ||S_w||_F  (every later output)
    CP-6  ||P^T Y||_F <= exp(G) ||Y||_F                                 (the backward: the state
                                                                         gradient a cut drops)

(G over the window; tokens further on decay more, which only tightens both.) The checker proves each
inequality for one value column (columns are independent; the Frobenius norm sums them) from a
sum-of-squares certificate: per token a^2 ||x||^2 - ||a (I - beta k k^T) x||^2 = a^2 beta (2 - beta) (k^T x)^2,
telescoped over the window, plus Lagrange's identity ||q||^2 ||x||^2 - (q^T x)^2 = sum_{i<j} (q_i x_j - q_j x_i)^2
for the outputs. The unit-key condition enters as the multiple beta^2 (k^T x)^2 (1 - k^T k) of its
defining polynomial (zero when ||k|| = 1); the coefficients' signs are decided with beta = 1 / (1 + p),
p >= 0 (beta in (0, 1]; beta = 0 makes the factor the identity).

General proofs (every chunk length, K, V, number of chunks or segments, window length):
- CP-1: induction on the number of chunks, the next chunk's chunk form (CF-2) as M S + B_c (RW-1);
- CP-2: each segment affine (CP-1), both groupings expanded;
- CP-3: chunk c entered with P S + Q (CP-1), its outputs by its chunk form (CF-1), reduced with RW-1;
- BWD-dSin: induction on the number of segments: the last one is affine in its entering state (CP-1,
  CP-3), so its terms are <E_m + P_m^T G, S_m> + const and the hypothesis applies with G' = E_m + P_m^T G;
- CP-4, CP-6: induction on the window (any order of the factors, each symmetric) with the certificate of
  the whole state matrix, (aG)^2 ||S||^2 - ||a (I - beta k k^T) Y||^2 = a^2 (G^2 ||S||^2 - ||Y||^2)
  + a^2 beta (2 - beta) ||k^T Y||^2 + a^2 beta^2 ||k^T Y||^2 (1 - k^T k) (`derivations._proof.Cert`);
- CP-5: Cauchy-Schwarz as the identity q^T q (q^T q ||Y||^2 - ||q^T Y||^2) = ||q^T q Y - q q^T Y||^2,
  then CP-4.
"""

from __future__ import annotations

import sympy as sp

from ._chunk import Chunk, chunk_form, hadamard, mat, prod, transition
from ._core import Bound, Identity, register


def chunk_map(ch):
    """(M_c, B_c) of one chunk from the transition form (RW-3): S' = M_c S + B_c, M_c = gamma_C I - T_c;
    a concrete or a symbolic chunk."""
    T_c, B_c = transition(ch)
    return ch.gamma_C * ch.eye(ch.K) - T_c, B_c


def _maps(chunks):
    """Per-chunk maps (M_c, B_c) from the transition form."""
    return [chunk_map(ch) for ch in chunks]


def output_correction(ch, P, S, scale, diagonal: int = 0):
    """scale D R P S, R = Q - tril_diagonal(Q K^T) A_free diag(beta) K: how the outputs of a chunk entered
    with P S + Q move with S (CP-3); a concrete or a symbolic chunk."""
    R = ch.q - ch.tril(ch.q * ch.k.T, diagonal) * ch.A_free() * ch.B * ch.k
    return scale * ch.D * R * P * S


def combine(first, second):
    """(P2, Q2) o (P1, Q1): first the `first` segment, then the `second`."""
    (P1, Q1), (P2, Q2) = first, second
    return P2 * P1, P2 * Q1 + Q2


def _run(chunks, S, scale=1):
    """Recurrence through consecutive chunks. Returns (per-chunk outputs, end state)."""
    outs = []
    for ch in chunks:
        O, S, _ = ch.recurrence(S, scale)
        outs.append(O)
    return outs, S


def _segment(C, K, V, n):
    chunks = [Chunk(C, K, V, prefix=f"c{i}") for i in range(n)]
    S = mat("s", K, V)
    _, lhs = _run(chunks, S)
    _, Q = _run(chunks, sp.zeros(K, V))
    P = prod(M for M, _ in reversed(_maps(chunks)))
    return lhs, P * S + Q


def _compose(C, K, V):
    chunks = [Chunk(C, K, V, prefix=f"c{i}") for i in range(3)]
    # the map of the concatenation, read off runs of the recurrence: P from the homogeneous run of I
    # (values zeroed), Q from the zero-start run
    homog = [Chunk(C, K, K, prefix=f"c{i}") for i in range(3)]
    for h, ch in zip(homog, chunks):
        h.v = sp.zeros(C, K)
    _, P_cat = _run(homog, sp.eye(K))
    _, Q_cat = _run(chunks, sp.zeros(K, V))
    m1, m2, m3 = _maps(chunks)
    left = combine(combine(m1, m2), m3)
    right = combine(m1, combine(m2, m3))
    return (P_cat, Q_cat, P_cat, Q_cat), (*left, *right)


def _outputs(C, K, V, n, diagonal=0):
    chunks = [Chunk(C, K, V, prefix=f"c{i}") for i in range(n)]
    S = mat("s", K, V)
    scale = sp.Symbol("scale", positive=True)
    lhs, _ = _run(chunks, S, scale)
    zero, _ = _run(chunks, sp.zeros(K, V), scale)
    rhs, P = [], sp.eye(K)
    for ch, O0, (M, _) in zip(chunks, zero, _maps(chunks)):
        rhs.append(O0 + output_correction(ch, P, S, scale, diagonal))
        P = M * P
    return tuple(lhs), tuple(rhs)


def _window(C, K, reverse=False):
    """One value column x through C gated factors a_t (I - beta_t k_t k_t^T), beta_t in (0, 1], in
    token order (the window map P), or in reverse order (P^T: each factor is symmetric).

    Returns (x0, x_C, gate product, sum-of-squares terms, condition multipliers, domain) certifying
    (prod a)^2 ||x0||^2 - ||x_C||^2 = sum_t (prod_{s applied at or after t} a_s)^2 [beta_t (2 - beta_t)
    (k_t^T x_{t-1})^2 + beta_t^2 (k_t^T x_{t-1})^2 (1 - k_t^T k_t)] (telescoped per-token steps)."""
    a = [sp.Symbol(f"a_{t}", positive=True) for t in range(C)]
    b = [sp.Symbol(f"beta_{t}", positive=True) for t in range(C)]
    domain = {b[t]: 1 / (1 + sp.Symbol(f"p_{t}", nonnegative=True)) for t in range(C)}
    x0 = sp.Matrix([sp.Symbol(f"x_{i}", real=True) for i in range(K)])
    x, terms, conditions = x0, [], []
    order = list(reversed(range(C))) if reverse else list(range(C))
    for pos, t in enumerate(order):
        k = mat(f"k{t}", K, 1)
        beta = b[t]
        kx = (k.T * x)[0]
        carry = prod(a[s] for s in order[pos:]) ** 2
        terms.append((carry * beta * (2 - beta), kx))
        conditions.append((carry * beta**2 * kx**2, 1 - (k.T * k)[0]))
        x = a[t] * (x - beta * k * kx)
    return x0, x, prod(a), terms, conditions, domain


def _state_bound(C, K):
    x0, x, G, terms, conditions, domain = _window(C, K)
    return Bound(small=(x.T * x)[0], large=G**2 * (x0.T * x0)[0], terms=terms, conditions=conditions, domain=domain)


def _adjoint_bound(C, K):
    x0, x, G, terms, conditions, domain = _window(C, K, reverse=True)
    return Bound(small=(x.T * x)[0], large=G**2 * (x0.T * x0)[0], terms=terms, conditions=conditions, domain=domain)


def _output_bound(C, K):
    x0, x, G, terms, conditions, domain = _window(C, K)
    q = sp.Matrix([sp.Symbol(f"q_{i}", real=True) for i in range(K)])
    scale = sp.Symbol("scale", positive=True)
    qq = (q.T * q)[0]
    sos = [(scale**2 * qq * c, b) for c, b in terms]
    sos += [(scale**2, q[i] * x[j] - q[j] * x[i]) for i in range(K) for j in range(i + 1, K)]
    conditions = [(scale**2 * qq * m, h) for m, h in conditions]
    return Bound(small=(scale * (q.T * x)[0]) ** 2, large=scale**2 * qq * G**2 * (x0.T * x0)[0], terms=sos, conditions=conditions, domain=domain)


CP_1 = register(Identity(
    id="CP-1",
    statement="a segment maps its entering state affinely: S_end = P S_start + Q, Q from a zero-start run",
    latex=r"S_{end} = P S_{start} + Q,\quad P = \prod_{c} (\gamma_{C,c} I - T_c),\quad Q = S_{end}|_{S_{start}=0}",
    build=_segment,
    sizes=((2, 2, 2, 2), (3, 2, 1, 2)),
    size_names=("C", "K", "V", "chunks"),
    twins=("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.cp.segment_maps"),
    source="FLA cp pre_process_fwd (S_ext, M); FlashQLA cp_fwd; research/flashqla-design.md 4.3",
    general=lambda: _general_segment(),
))

CP_2 = register(Identity(
    id="CP-2",
    statement="segment maps compose, (P2,Q2)o(P1,Q1) = (P2 P1, P2 Q1 + Q2), into the concatenation's map, associatively",
    latex=r"(P_3,Q_3)\circ((P_2,Q_2)\circ(P_1,Q_1)) = ((P_3,Q_3)\circ(P_2,Q_2))\circ(P_1,Q_1) = (P_{1:3}, Q_{1:3})",
    build=_compose,
    sizes=((2, 2, 1),),
    twins=("reference.gdn.cp.segment_maps", "reference.gdn.cp.combine"),
    source="FLA merge_fwd_bwd_kernel; FlashQLA correct_initial_states; research/flashqla-design.md 4.3",
    general=lambda: _general_compose(),
))

CP_3 = register(Identity(
    id="CP-3",
    statement="segment outputs are affine in S_start: O_c(S) = O_c(0) + scale D_c R_c P_<c S",
    latex=r"O_c(S) = O_c(0) + \mathrm{scale}\, D_c R_c P_{<c} S,\quad R_c = Q_c - \operatorname{tril}_0(Q_c K_c^\top) A_c B_c K_c",
    build=_outputs,
    sizes=((2, 2, 2, 2), (3, 2, 1, 1)),
    size_names=("C", "K", "V", "chunks"),
    twins=("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.cp.output_correction"),
    source="FlashQLA intra-card CP (segments from zero, corrected); research/flashqla-design.md 4.3",
    general=lambda: _general_outputs(),
))

def _entering_grad(C, K, V, n):
    """n segments of C tokens entered with S: the gradient of <dO, O(S)> + <G, S_end(S)> with respect
    to S, by differentiating the recurrence, against sum_j A_j^T E_j + A_n^T G from the runs of each
    segment from I with v = 0 (outputs U, rows U_t^T; end state P_j), E_j = U_j^T dO_j and
    A_0 = I, A_{j+1} = P_j A_j."""
    chunks = [Chunk(C, K, V, prefix=f"c{i}") for i in range(n)]
    S = mat("s", K, V)
    scale = sp.Symbol("scale", positive=True)
    dO = [mat(f"do{i}", C, V) for i in range(n)]
    G = mat("G", K, V)
    outs, S_end = _run(chunks, S, scale)
    loss = sum(sum(hadamard(d, O)) for d, O in zip(dO, outs)) + sum(hadamard(G, S_end))
    lhs = sp.Matrix(K, V, lambda i, j: sp.diff(loss, S[i, j]))
    rhs, A = sp.zeros(K, V), sp.eye(K)
    for i, d in enumerate(dO):
        homog = Chunk(C, K, K, prefix=f"c{i}")  # the same symbols, value width K
        homog.v = sp.zeros(C, K)
        U, P, _ = homog.recurrence(sp.eye(K), scale)
        rhs += A.T * (U.T * d)
        A = P * A
    return lhs, rhs + A.T * G


CP_4 = register(Identity(
    id="CP-4",
    statement="dropping the state S_w entering a window of summed log-decay G moves later states by <= exp(G) ||S_w||",
    latex=r"\|S_{true} - S_{trunc}\|_F = \|P S_w\|_F \le e^{G} \|S_w\|_F",
    build=_state_bound,
    sizes=((3, 2), (2, 3)),
    size_names=("C", "K"),
    kind="bounded",
    bound="||dS||_F <= exp(G) ||S_w||_F, G = sum of g over the dropped window",
    condition="||k_t||_2 = 1 and beta_t in [0, 1] (any a_t = exp(g_t) > 0)",
    twins=("reference.gdn.cp.cp_gated_delta_rule_fwd", "reference.gdn.recurrent.recurrent_gated_delta_rule"),
    source="FlashQLA warm-up truncation (threshold sum g < -10); research/flashqla-design.md 4.3",
    general=lambda: _general_window("state"),
))

CP_5 = register(Identity(
    id="CP-5",
    statement="the same dropped state moves each later output o_t by <= scale ||q_t|| exp(G) ||S_w||",
    latex=r"\|o_t^{true} - o_t^{trunc}\|_2 \le \mathrm{scale}\, \|q_t\|_2\, e^{G} \|S_w\|_F",
    build=_output_bound,
    sizes=((3, 2), (2, 3)),
    size_names=("C", "K"),
    kind="bounded",
    bound="||do_t||_2 <= scale ||q_t||_2 exp(G) ||S_w||_F",
    condition="||k_t||_2 = 1 and beta_t in [0, 1] (any a_t = exp(g_t) > 0)",
    twins=("reference.gdn.cp.cp_gated_delta_rule_fwd", "reference.gdn.recurrent.recurrent_gated_delta_rule"),
    source="FlashQLA warm-up truncation; research/flashqla-design.md 4.3, 4.5",
    general=lambda: _general_window("output"),
))

CP_6_ADJ = register(Identity(
    id="CP-6",
    statement="the transposed window map (the state gradient a cut transition drops, P^T G) is bounded the same way: <= exp(G) ||G||",
    latex=r"\|P^\top Y\|_F \le e^{G} \|Y\|_F,\quad P^\top = \prod_{t\ \mathrm{ascending}} a_t (I - \beta_t k_t k_t^\top)",
    build=_adjoint_bound,
    sizes=((3, 2), (2, 3)),
    size_names=("C", "K"),
    kind="bounded",
    bound="||P^T Y||_F <= exp(G) ||Y||_F, G = sum of g over the window",
    condition="||k_t||_2 = 1 and beta_t in [0, 1] (any a_t = exp(g_t) > 0)",
    twins=("reference.gdn.cp.segment_maps", "reference.gdn.cp.entering_state_grad"),
    source="CP-4 transposed (each factor is symmetric); the backward's gate-driven cut of P_j^T G_j "
           "(flashqla.cp.driver.cp_backward, transition_limits)",
    general=lambda: _general_window("adjoint"),
))

CP_6 = register(Identity(
    id="BWD-dSin",
    statement="the gradient reaching a piece's entering state needs no backward pass: sum_j A_j^T E_j + A_m^T G, E_j = sum_t U_t do_t^T",
    latex=r"\frac{\partial \mathcal{L}}{\partial S_{in}} = \sum_j A_j^\top E_j + A_m^\top G,\quad "
          r"E_j = \sum_{t \in j} U_t\, do_t^\top,\quad A_0 = I,\ A_{j+1} = P_j A_j",
    build=_entering_grad,
    sizes=((2, 2, 1, 2), (1, 2, 2, 3)),
    size_names=("C", "K", "V", "segments"),
    twins=("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.cp.entering_state_grad"),
    source="CP-1 and CP-3 composed (o_t = o0_t + (A_j S_in + B_j)^T U_t, S_end = A_m S_in + B_m) and "
           "differentiated; the cross-rank backward's D (flashqla.distributed.op) and its segmented form "
           "(flashqla.cp.driver)",
    general=lambda: _general_entering_grad(),
))


# ------------------------------------------------------------------------------------------------
# general proofs
# ------------------------------------------------------------------------------------------------

#: the chunk-level facts the CP general proofs cite: the chunk form is the recurrence (CF-1, CF-2) and
#: its gated inverse is the re-gated gate-free one (RW-1)
CP_USES = ("CF-2", "RW-1", "L-gate", "L-gamma", "L-ut")


def _general_segment():
    from ._nc import eye, rules_from, sym
    from ._proof import Eq, Proof
    from ._symbolic import GChunk, Ksym, Vsym

    ch = GChunk(prefix="c")  # the next chunk, any length
    S, S_n = sym("S", Ksym, Vsym), sym("S_n", Ksym, Vsym)
    P_n, Q_n = sym("P_n", Ksym, Ksym), sym("Q_n", Ksym, Vsym)
    M, B = chunk_map(ch)
    hyp = rules_from(S_n, P_n * S + Q_n, "hyp", transpose=False)
    rules = ch.rules("free") + ch.regate_rule()
    return Proof(
        claim="for every number of chunks n and every C, K, V: the state after the n chunks is P S + Q with "
              "P = M_{n-1} ... M_0 and Q the state after them from S = 0",
        method="induction on n (n = 0: S = I S + 0); step: the next chunk maps its entering state S_n by its "
               "chunk form (CF-2) = M S_n + B_c; non-commutative reduction with the hypothesis S_n = P_n S + Q_n",
        uses=CP_USES,
        steps=[Eq("base: S = I S + 0", S, eye(Ksym) * S),
               Eq("step: S_{n+1} = (M P_n) S + (M Q_n + B)", chunk_form(ch, S_n)["S_end"], (M * P_n) * S + (M * Q_n + B), rules + hyp),
               Eq("step: from S = 0, Q_{n+1} = M Q_n + B", chunk_form(ch, Q_n)["S_end"], M * Q_n + B, rules)],
    )


def _general_compose():
    from ._nc import sym
    from ._proof import Eq, Proof
    from ._symbolic import Ksym, Vsym

    S = sym("S", Ksym, Vsym)
    m = [(sym(f"P{i}", Ksym, Ksym), sym(f"Q{i}", Ksym, Vsym)) for i in (1, 2, 3)]
    left = combine(combine(m[0], m[1]), m[2])
    right = combine(m[0], combine(m[1], m[2]))
    seq = S
    for P, Q in m:  # the concatenation: each segment maps its entering state (CP-1)
        seq = P * seq + Q
    return Proof(
        claim="for segments of any lengths and sizes: both groupings of the composition map S as the "
              "concatenation does (so the composition is associative and a scan may group it freely)",
        method="each segment is affine (CP-1); non-commutative expansion",
        uses=("CP-1",),
        steps=[Eq("((3 o 2) o 1)(S) = concatenation", left[0] * S + left[1], seq),
               Eq("(3 o (2 o 1))(S) = concatenation", right[0] * S + right[1], seq)],
    )


def _general_outputs(diagonal: int = 0):
    from ._nc import sym
    from ._proof import Eq, Proof
    from ._symbolic import GChunk, Ksym, Vsym

    ch = GChunk(prefix="c")  # chunk c of the segment, entered with P S + Q (CP-1)
    S, P, Q = sym("S", Ksym, Vsym), sym("P", Ksym, Ksym), sym("Q", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    O_S = chunk_form(ch, P * S + Q, scale)["o"]
    O_0 = chunk_form(ch, Q, scale)["o"]
    return Proof(
        claim="for every chunk c of a segment of any length, every C, K, V: O_c(S) = O_c(0) + scale D_c R_c P_<c S",
        method="chunk c is entered with P_<c S + Q_<c (CP-1) and its outputs are its chunk form (CF-1); "
               "non-commutative reduction with A_gated -> D A_free D^-1 (RW-1)",
        uses=CP_USES + ("CF-1", "CP-1"),
        steps=[Eq("O_c(S) = O_c(0) + scale D R P S", O_S, O_0 + output_correction(ch, P, S, scale, diagonal),
                  ch.rules("free") + ch.regate_rule())],
    )


def _general_entering_grad():
    from . import _nc
    from ._nc import eye, sym, zeros
    from ._proof import Eq, Proof
    from ._symbolic import GChunk, Ksym, Vsym

    Cj = sp.Symbol("C_j", integer=True, positive=True)  # tokens of segment m
    S_m, G = sym("S_m", Ksym, Vsym), sym("G", Ksym, Vsym)
    U, O0, dO = sym("U_m", Cj, Ksym), sym("O0_m", Cj, Vsym), sym("dO_m", Cj, Vsym)
    P, Bm = sym("P_m", Ksym, Ksym), sym("B_m", Ksym, Vsym)
    Sig, A = sym("Sigma_m", Ksym, Vsym), sym("A_m", Ksym, Ksym)  # sum_{j<m} A_j^T E_j, and A_m
    E = U.T * dO
    G1 = U.T * dO + P.T * G
    # U of a chunk: the run from I with v = 0, whose outputs are scale D R S (CP-3 with v = 0)
    ch = GChunk(prefix="c")
    ch.v = zeros(ch.C, Vsym)
    S = sym("S", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    return Proof(
        claim="for every number of segments m and all sizes: the gradient of sum_j <dO_j, O_j> + <G, S_end> "
              "with respect to S_in is sum_j A_j^T E_j + A_m^T G",
        method="induction on m (m = 0: d<G, S_in>/dS_in = G); step: the last segment is affine in its entering "
               "state (CP-1, CP-3: O_m = O0_m + U_m S_m, S_end = P_m S_m + B_m), so the loss is "
               "<U_m^T dO_m + P_m^T G, S_m> + const and the hypothesis applies with G' = E_m + P_m^T G",
        uses=("CP-1", "CP-3", "L-adjoint", "RW-1", "L-gate", "L-gamma", "L-ut"),
        steps=[Eq("base: d<G, S>/dS = G", _nc.grad([(G, S_m)], S_m), G),
               Eq("step: d/dS_m of the last segment's terms = E_m + P_m^T G",
                  _nc.grad([(dO, O0 + U * S_m), (G, P * S_m + Bm)], S_m), G1),
               Eq("step: Sigma_m + A_m^T G' = (Sigma_m + A_m^T E_m) + (P_m A_m)^T G", Sig + A.T * G1, (Sig + A.T * E) + (P * A).T * G),
               Eq("U: the outputs of a chunk run with v = 0 are scale D R S (linear in S)", chunk_form(ch, S, scale)["o"],
                  output_correction(ch, eye(Ksym), S, scale), ch.rules("free") + ch.regate_rule())],
    )


def _general_window(which: str):
    """CP-4 ("state"), CP-5 ("output"), CP-6 ("adjoint") for windows of any length and any K, V: the
    bound for the whole state matrix (Frobenius norm, no per-column argument)."""
    from ._nc import eye, rules_from, sym
    from ._proof import Cert, Eq, Proof

    Kd, Vd = sp.Symbol("K", integer=True, positive=True), sp.Symbol("V", integer=True, positive=True)
    S, Y = sym("S_w", Kd, Vd), sym("Y", Kd, Vd)  # the dropped state; Y = P S_w after the window so far
    k = sym("k", Kd, 1)
    a = sp.Symbol("a", positive=True)
    beta = sp.Symbol("beta", positive=True)
    G = sp.Symbol("G", positive=True)  # the gate product of the window so far (exp of its summed g)
    h = sp.Symbol("h", nonnegative=True)  # the hypothesis' slack: G^2 ||S_w||^2 - ||Y||^2 >= 0
    domain = {beta: 1 / (1 + sp.Symbol("p", nonnegative=True))}
    I = eye(Kd)
    Fk = a * (I - beta * k * k.T)
    Y1 = Fk * Y
    Z = k.T * Y
    from ._nc import tr

    nS, nY, nY1, nZ = tr(S.T * S), tr(Y.T * Y), tr(Y1.T * Y1), tr(Z.T * Z)
    kk = tr(k.T * k)
    hyp_value = G**2 * nS - nY
    step_terms = [(a**2, ("hyp", hyp_value)), (a**2 * beta * (2 - beta), Z)]
    step_cond = [(a**2 * beta**2 * nZ, 1 - kk)]
    steps = [
        Cert("base: an empty window, G = 1 and Y = S_w", small=tr(S.T * S), large=tr(S.T * S)),
        Cert("step: one more factor a (I - beta k k^T)", small=nY1, large=(a * G) ** 2 * nS,
             terms=step_terms, conditions=step_cond, domain=domain),
    ]
    uses = ()
    method = ("induction on the number of factors (any order: the new factor multiplies on the left); step: "
              "(aG)^2 ||S||^2 - ||a (I - beta k k^T) Y||^2 = a^2 (G^2 ||S||^2 - ||Y||^2) + a^2 beta (2 - beta) ||k^T Y||^2 "
              "+ a^2 beta^2 ||k^T Y||^2 (1 - k^T k), every term >= 0 for beta in (0, 1], zero condition term for ||k|| = 1")
    if which == "adjoint":
        steps.insert(0, Eq("each factor is symmetric, so P^T is again a product of such factors", Fk.T, Fk))
        claim = ("for windows of any length and all K, V: ||P^T Y||_F <= exp(G) ||Y||_F (P^T: the same factors in "
                 "ascending order)")
    elif which == "state":
        claim = "for windows of any length and all K, V: ||P S_w||_F <= exp(G) ||S_w||_F"
    else:
        q = sym("q", Kd, 1)
        scale = sp.Symbol("scale", positive=True)
        alpha = tr(q.T * q)
        W = alpha * Y - q * (q.T * Y)
        o = q.T * Y  # the output difference / scale, 1 x V
        # Cauchy-Schwarz: alpha (alpha ||Y||^2 - ||q^T Y||^2) = ||alpha Y - q q^T Y||^2; then CP-4
        steps = [
            Cert("Cauchy-Schwarz (times alpha = q^T q)", small=alpha * tr(o.T * o), large=alpha**2 * nY, terms=[(1, W)]),
            Cert("with CP-4 (G^2 ||S_w||^2 - ||Y||^2 >= 0)", small=scale**2 * alpha * nY,
                 large=scale**2 * alpha * G**2 * nS, terms=[(scale**2 * alpha, ("cited", "CP-4", hyp_value))]),
        ]
        uses = ("CP-4",)
        method = ("Cauchy-Schwarz as an identity, q^T q (q^T q ||Y||^2 - ||q^T Y||^2) = ||q^T q Y - q q^T Y||_F^2 "
                  "(q = 0 is trivial), then CP-4 for ||Y||_F = ||P S_w||_F")
        claim = ("for windows of any length and all K, V: ||o_t,true - o_t,trunc||_2^2 = scale^2 ||q^T P S_w||^2 "
                 "<= scale^2 ||q||^2 exp(2G) ||S_w||_F^2 (for q != 0 divide the first step by q^T q > 0; q = 0 "
                 "makes both sides 0)")
    conclusion = hyp_value if which != "output" else scale**2 * alpha * G**2 * nS - scale**2 * tr(o.T * o)
    return Proof(claim=claim, method=method, uses=uses, steps=steps, conclusion=conclusion)
