"""Symbolic building blocks shared by the records: one chunk of Gated DeltaNet at tiny sizes.

Notation (DESIGN.md section 1, research/flashqla-design.md section 1.2), for one value head and one
chunk of C tokens, state S in R^{K x V} at the chunk start:

    Q, Kc: C x K     Vc: C x V     B = diag(beta)
    gates, multiplicative: a_t = exp(g_t) > 0 (positive symbols)
    gamma_i = a_0 ... a_i = exp(g_cum_i)            D = diag(gamma)      gamma_C = gamma_{C-1}
    Gamma_ij = gamma_i / gamma_j (i >= j, else 0)   = a_{j+1} ... a_i   (a product, no division)
    r_i = gamma_C / gamma_i                          = a_{i+1} ... a_{C-1}

With ``gates="cumulative"`` the chunk instead holds the cumulative gates c_i = gamma_i as independent
positive symbols (Gamma_ij = c_i / c_j, a_t = c_t / c_{t-1}): the parametrisation in which the
gradient with respect to g_cum is ``c_i * d/dc_i``.
"""

from __future__ import annotations

from functools import reduce

import sympy as sp

__all__ = ["mat", "Chunk", "tril", "hadamard", "prod", "rows_sum", "cols_sum", "chunk_form", "transition"]


def mat(name: str, r: int, c: int, **assumptions) -> sp.Matrix:
    """An r x c matrix of real symbols ``name_i_j``."""
    assumptions.setdefault("real", True)
    return sp.Matrix(r, c, lambda i, j: sp.Symbol(f"{name}_{i}_{j}", **assumptions))


def prod(xs) -> sp.Expr:
    return reduce(lambda x, y: x * y, xs, sp.Integer(1))


def tril(X: sp.Matrix, diagonal: int = 0) -> sp.Matrix:
    """Lower part of X: entries (i, j) with j - i <= diagonal (diagonal=-1: strictly lower)."""
    return sp.Matrix(X.rows, X.cols, lambda i, j: X[i, j] if j - i <= diagonal else 0)


def hadamard(X: sp.Matrix, Y: sp.Matrix) -> sp.Matrix:
    return X.multiply_elementwise(Y)


def rows_sum(X: sp.Matrix) -> sp.Matrix:
    """Column vector of row sums."""
    return sp.Matrix([sum(X[i, :]) for i in range(X.rows)])


def cols_sum(X: sp.Matrix) -> sp.Matrix:
    """Column vector of column sums."""
    return sp.Matrix([sum(X[:, j]) for j in range(X.cols)])


def chunk_form(ch, S, scale=1, A_g=None, out_diagonal: int = 0) -> dict:
    """FLA's chunk form (research/fla-gdn.md section 2.2) of a chunk ``ch``: a concrete `Chunk`, or a
    symbolic one of `derivations._symbolic` (the same formulas prove the general records).

    ``ch`` provides q, k, v, B = diag(beta), D = diag(gamma), Dr = diag(r), gamma_C, ``gate(X, d)`` (the
    decay mask Gamma_d * X) and ``A_gated()``. ``out_diagonal``: the output mask's diagonal (0: token t
    sees itself; the tests shift it to check that a broken rewrite fails). Returns dict with A (gated),
    w, u, v_new, o, S_end."""
    A = ch.A_gated() if A_g is None else A_g
    w = A * ch.B * ch.D * ch.k
    u = A * ch.B * ch.v
    v_new = u - w * S
    o = scale * (ch.D * ch.q * S + ch.gate(ch.q * ch.k.T, out_diagonal) * v_new)
    S_end = ch.gamma_C * S + ch.k.T * ch.Dr * v_new
    return dict(A=A, w=w, u=u, v_new=v_new, o=o, S_end=S_end)


def transition(ch, A=None):
    """Transition form of the state update: S' = (gamma_C I - T_c) S + B_c with
    T_c = gamma_C K^T A B K and B_c = K^T A B diag(r) V (A gate-free). Returns (T_c, B_c)."""
    A = ch.A_free() if A is None else A
    T_c = ch.gamma_C * ch.k.T * A * ch.B * ch.k
    B_c = ch.k.T * A * ch.B * ch.Dr * ch.v
    return T_c, B_c


class Chunk:
    """Symbols of one chunk and the quantities of its chunk form.

    C, K, V: sizes; prefix: distinguishes the chunks of a multi-chunk segment;
    gates: "token" (a_t symbols) or "cumulative" (c_t symbols, see the module docstring).
    """

    def __init__(self, C: int, K: int, V: int, prefix: str = "", gates: str = "token"):
        self.C, self.K, self.V = C, K, V
        p = prefix
        self.q = mat(f"q{p}", C, K)
        self.k = mat(f"k{p}", C, K)
        self.v = mat(f"v{p}", C, V)
        self.beta = [sp.Symbol(f"beta{p}_{t}", positive=True) for t in range(C)]
        self.gates = gates
        if gates == "token":
            self.a = [sp.Symbol(f"a{p}_{t}", positive=True) for t in range(C)]
            self.gamma = [prod(self.a[: i + 1]) for i in range(C)]
        elif gates == "cumulative":
            self.c = [sp.Symbol(f"c{p}_{t}", positive=True) for t in range(C)]
            self.gamma = list(self.c)
            self.a = [self.c[0]] + [self.c[t] / self.c[t - 1] for t in range(1, C)]
        else:
            raise ValueError(gates)

    # ---- gate quantities
    def Gam(self, i: int, j: int) -> sp.Expr:
        """gamma_i / gamma_j for i >= j (a product of token gates in the token parametrisation)."""
        if self.gates == "token":
            return prod(self.a[j + 1 : i + 1])
        return self.c[i] / self.c[j]

    @property
    def B(self) -> sp.Matrix:
        return sp.diag(*self.beta)

    @property
    def D(self) -> sp.Matrix:
        return sp.diag(*self.gamma)

    @property
    def Dinv(self) -> sp.Matrix:
        return sp.diag(*[1 / g for g in self.gamma])

    @property
    def Dr(self) -> sp.Matrix:
        """diag(r), r_i = gamma_C / gamma_i."""
        return sp.diag(*self.r)

    def gate(self, X: sp.Matrix, diagonal: int = 0) -> sp.Matrix:
        """Gamma_diagonal * X (the causal decay mask, elementwise)."""
        return hadamard(self.Gamma(diagonal), X)

    def gate_T(self, X: sp.Matrix, diagonal: int = 0) -> sp.Matrix:
        """Gamma_diagonal^T * X."""
        return hadamard(self.Gamma(diagonal).T, X)

    @staticmethod
    def tril(X: sp.Matrix, diagonal: int = 0) -> sp.Matrix:
        return tril(X, diagonal)

    # reductions of elementwise products (the backward's rowsum / colsum terms)
    @staticmethod
    def rowsum_had(X: sp.Matrix, Y: sp.Matrix) -> sp.Matrix:
        """rowsum(X * Y) as a column vector."""
        return rows_sum(hadamard(X, Y))

    @staticmethod
    def colsum_had(X: sp.Matrix, Y: sp.Matrix) -> sp.Matrix:
        """colsum(X * Y) as a column vector."""
        return cols_sum(hadamard(X, Y))

    @staticmethod
    def sum_had(X: sp.Matrix, Y: sp.Matrix) -> sp.Expr:
        """sum(X * Y) = <X, Y>."""
        return sum(hadamard(X, Y))

    def add_last(self, x: sp.Matrix, s) -> sp.Matrix:
        """x with s added to its last entry (x + e_last s)."""
        x = sp.Matrix(x)
        x[self.C - 1] += s
        return x

    @staticmethod
    def eye(n) -> sp.Matrix:
        return sp.eye(n)

    @property
    def gamma_C(self) -> sp.Expr:
        return self.gamma[-1]

    @property
    def r(self) -> list:
        return [self.Gam(self.C - 1, i) for i in range(self.C)]

    def Gamma(self, diagonal: int = 0) -> sp.Matrix:
        """Causal decay mask Gamma (diagonal=0: i >= j; diagonal=-1: i > j), zero elsewhere."""
        return sp.Matrix(self.C, self.C, lambda i, j: self.Gam(i, j) if j - i <= diagonal else 0)

    # ---- the two sides of the chunk form
    def recurrence(self, S0: sp.Matrix, scale=1):
        """Token by token: S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale S_t^T q_t.

        Returns (O [C x V], S_end [K x V], states [S_0 .. S_C])."""
        S, rows, states = S0, [], [S0]
        for t in range(self.C):
            kt = self.k[t, :].T
            S = self.a[t] * (S - self.beta[t] * kt * (kt.T * S)) + self.beta[t] * kt * self.v[t, :]
            states.append(S)
            rows.append(scale * self.q[t, :] * S)
        return sp.Matrix.vstack(*rows), S, states

    def inverse(self, L: sp.Matrix) -> sp.Matrix:
        """(I + L)^-1 for strictly lower L, by forward substitution (entries stay polynomial)."""
        return (sp.eye(self.C) + L).lower_triangular_solve(sp.eye(self.C))

    @property
    def L_gated(self) -> sp.Matrix:
        """FLA's L = tril_-1(diag(beta) (K K^T * Gamma)) (chunk_scaled_dot_kkt)."""
        return tril(self.B * hadamard(self.k * self.k.T, self.Gamma()), -1)

    @property
    def L_free(self) -> sp.Matrix:
        """The gate-free L = tril_-1(diag(beta) K K^T) (FlashQLA's kkt_solve input)."""
        return tril(self.B * self.k * self.k.T, -1)

    def A_gated(self) -> sp.Matrix:
        """FLA's A = (I + L_gated)^-1."""
        return self.inverse(self.L_gated)

    def A_free(self) -> sp.Matrix:
        """Gate-free A = (I + L_free)^-1."""
        return self.inverse(self.L_free)

    def chunk_form(self, S0: sp.Matrix, scale=1, A_g: sp.Matrix | None = None, out_diagonal: int = 0):
        """FLA's chunk form (module function `chunk_form`). Returns dict with A (gated), w, u, v_new, o, S_end."""
        return chunk_form(self, S0, scale, A_g, out_diagonal)

    def transition(self, A: sp.Matrix | None = None):
        """(T_c, B_c) of the transition form (module function `transition`)."""
        return transition(self, A)
