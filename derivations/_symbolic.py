"""One chunk at symbolic sizes, for the general (all-sizes) proofs: the twin of `derivations._chunk`.

`GChunk` holds a chunk of C tokens with C, K, V symbols: generators (`derivations._nc`) for Q, K (C x K),
V (C x V), the diagonal B = diag(beta), D = diag(gamma) and D^-1, the scalar gamma_C (= gamma_{C-1}, the
chunk's last cumulative gate), and the two inverses as generators defined by their relations:

    A  = (I + L_free)^-1,   L_free  = tril_-1(B K K^T)                         (gate-free)
    Ag = (I + L_gated)^-1,  L_gated = tril_-1(B (Gamma * K K^T)) = B D tril_-1(K K^T) D^-1   [L-gate]

with diag(r) = gamma_C D^-1 [L-gamma] and Gamma_d * X = D tril_d(X) D^-1 [L-gate]. It offers the
attributes `derivations._chunk.chunk_form` and `transition` read, so the records' formulas are one code
for the concrete and the general proofs.

`Ext` is the chunk of C + 1 tokens made of a `GChunk` and one more token (q, k, v as K x 1 / V x 1
columns, beta, a), as block matrices split C + 1: q' = [Q; q^T], B' = diag(B, beta),
D' = diag(D, a gamma_C), gamma_C' = a gamma_C [L-gamma], masks by blocks [L-mask-blocks], and
Ag' = [[Ag, 0], [-l Ag, 1]] with l the new row of L_gated' (the block inverse [L-blockinv], checked as a
step of every proof that uses it). `One` is the chunk of one token (C = 1): 1 x 1 blocks, A = Ag = 1.
"""

from __future__ import annotations

import sympy as sp

from ._nc import Block, M, dg, diag, diag_pair, diagpart, eye, rules_from, sym, tr, tril, zeros
from ._proof import Eq

__all__ = ["Csym", "Ksym", "Vsym", "GChunk", "Ext", "One", "token"]

Csym = sp.Symbol("C", integer=True, positive=True)
Ksym = sp.Symbol("K", integer=True, positive=True)
Vsym = sp.Symbol("V", integer=True, positive=True)


class GChunk:
    """A chunk of C tokens at symbolic sizes (module docstring). prefix: names the chunks of a segment."""

    def __init__(self, C=Csym, K=Ksym, V=Vsym, prefix: str = ""):
        p = prefix
        self.prefix = p
        self.C, self.K, self.V = C, K, V
        self.q = sym(f"Q{p}", C, K)
        self.k = sym(f"K{p}", C, K)
        self.v = sym(f"V{p}", C, V)
        self.B = diag(f"B{p}", C)
        self.D, self.Dinv = diag_pair(f"D{p}", f"Dinv{p}", C)
        self.gamma_C = sp.Symbol(f"gamma{p}", positive=True)
        self.A = sym(f"A{p}", C, C)
        self.Ag = sym(f"Ag{p}", C, C)

    # the attributes the shared formulas read
    @property
    def Dr(self) -> M:
        """diag(r) = gamma_C D^-1 [L-gamma]."""
        return self.gamma_C * self.Dinv

    def gate(self, X: M, diagonal: int = 0) -> M:
        """Gamma_diagonal * X = D tril_diagonal(X) D^-1 [L-gate]."""
        return self.D * tril(X, diagonal) * self.Dinv

    def gate_T(self, X: M, diagonal: int = 0) -> M:
        """Gamma_diagonal^T * X = (Gamma_diagonal * X^T)^T."""
        return self.gate(X.T, diagonal).T

    @staticmethod
    def tril(X: M, diagonal: int = 0) -> M:
        return tril(X, diagonal)

    def eye(self, n) -> M:
        return eye(n)

    # reductions of elementwise products [L-adjoint]
    @staticmethod
    def rowsum_had(X: M, Y: M) -> M:
        """rowsum(X * Y) = dg(X Y^T)."""
        return dg(X * Y.T)

    @staticmethod
    def colsum_had(X: M, Y: M) -> M:
        """colsum(X * Y) = dg(X^T Y)."""
        return dg(X.T * Y)

    @staticmethod
    def sum_had(X: M, Y: M):
        """sum(X * Y) = tr(X^T Y), a scalar."""
        return tr(X.T * Y)

    @property
    def e_last(self) -> M:
        """The last unit vector (C x 1)."""
        return sym(f"e_last{self.prefix}", self.C, 1)

    def add_last(self, x: M, s) -> M:
        return x + self.e_last * s

    @property
    def L_free(self) -> M:
        return tril(self.B * self.k * self.k.T, -1)

    @property
    def L_gated(self) -> M:
        return tril(self.B * self.gate(self.k * self.k.T), -1)

    def A_free(self) -> M:
        return self.A

    def A_gated(self) -> M:
        return self.Ag

    # the rules
    def rules(self, which: str = "both") -> list:
        """The defining relations of the inverses, (I + L) A = A (I + L) = I ("def"), and their unit lower
        triangular shape diag(dg(A)) = I, tril_-1(A) = A - I (so tril_0(A) = A) [L-ut]; with every
        transpose."""
        out = []
        I = eye(self.C)
        pairs = []
        if which in ("both", "free"):
            pairs.append((self.L_free, self.A))
        if which in ("both", "gated"):
            pairs.append((self.L_gated, self.Ag))
        for L, A in pairs:
            out += rules_from(L * A, I - A, "def") + rules_from(A * L, I - A, "def")
            out += rules_from(diagpart(A), I, "L-ut") + rules_from(tril(A, -1), A - I, "L-ut")
        return out

    def regate_rule(self) -> list:
        """Ag -> D A D^-1 (record RW-1)."""
        return rules_from(self.Ag, self.D * self.A * self.Dinv, "RW-1")


def token(prefix: str = "", K=Ksym, V=Vsym):
    """One token's symbols: q, k (K x 1), v (V x 1), beta, a."""
    p = prefix
    return dict(
        q=sym(f"q{p}", K, 1), k=sym(f"k{p}", K, 1), v=sym(f"v{p}", V, 1),
        beta=sp.Symbol(f"beta{p}", positive=True), a=sp.Symbol(f"a{p}", positive=True),
    )


class One:
    """The chunk of one token (C = 1), for base cases: every C x C quantity is a 1 x 1 block."""

    def __init__(self, K=Ksym, V=Vsym, prefix: str = "1"):
        t = token(prefix, K, V)
        self.tok = t
        self.C, self.K, self.V = sp.Integer(1), K, V
        self.q, self.k, self.v = t["q"].T, t["k"].T, t["v"].T
        a, beta = t["a"], t["beta"]
        self.B = eye(1) * beta
        self.D = eye(1) * a
        self.Dinv = eye(1) * (1 / a)
        self.gamma_C = a

    Dr = GChunk.Dr
    gate = GChunk.gate
    gate_T = GChunk.gate_T
    tril = staticmethod(tril)
    eye = GChunk.eye
    L_free = GChunk.L_free
    L_gated = GChunk.L_gated

    def A_free(self) -> M:
        return eye(1)  # (I + 0)^-1: a 1 x 1 strictly lower part is zero [L-mask-blocks]

    def A_gated(self) -> M:
        return eye(1)

    def recurrence(self, S: M):
        """One token of the recurrence from S: (S_1, o_1^T / scale, write beta (v^T - a k^T S))."""
        t = self.tok
        k, v, q, a, beta = t["k"], t["v"], t["q"], t["a"], t["beta"]
        S1 = a * (S - beta * k * (k.T * S)) + beta * k * v.T
        return S1, q.T * S1, beta * (v.T - a * k.T * S)


class Ext:
    """The chunk of C + 1 tokens: a `GChunk` ``ch`` and one more token, as 2 x 2 block matrices."""

    def __init__(self, ch: GChunk, prefix: str = "n"):
        self.ch = ch
        t = token(prefix, ch.K, ch.V)
        self.tok = t
        a, beta = t["a"], t["beta"]
        self.C, self.K, self.V = ch.C + 1, ch.K, ch.V
        self.q = Block([[ch.q], [t["q"].T]])
        self.k = Block([[ch.k], [t["k"].T]])
        self.v = Block([[ch.v], [t["v"].T]])
        self.B = Block.diag(ch.B, eye(1) * beta)
        self.gamma_C = a * ch.gamma_C  # gamma_C = a_C gamma_{C-1} [L-gamma]
        self.D = Block.diag(ch.D, eye(1) * self.gamma_C)
        self.Dinv = Block.diag(ch.Dinv, eye(1) * (1 / self.gamma_C))
        Lg = self.L_gated
        self.ell = Lg.grid[1][0]  # the new row of L_gated
        self.Ag = Block([[ch.Ag, zeros(ch.C, 1)], [-(self.ell * ch.Ag), eye(1)]])
        Lf = self.L_free
        self.ell_free = Lf.grid[1][0]
        self.A = Block([[ch.A, zeros(ch.C, 1)], [-(self.ell_free * ch.A), eye(1)]])

    @property
    def Dr(self):
        return self.gamma_C * self.Dinv

    def gate(self, X: Block, diagonal: int = 0) -> Block:
        """Gamma'_d * X = D' tril_d(X) D'^-1 [L-gate] with the mask taken blockwise [L-mask-blocks]."""
        return self.D * X.tril(diagonal) * self.Dinv

    def gate_T(self, X: Block, diagonal: int = 0) -> Block:
        return self.gate(X.T, diagonal).T

    @staticmethod
    def tril(X: Block, diagonal: int = 0) -> Block:
        return X.tril(diagonal)

    def eye(self, n=None) -> Block:
        return Block.eye(self.ch.C, 1)

    @property
    def L_free(self) -> Block:
        return (self.B * self.k * self.k.T).tril(-1)

    @property
    def L_gated(self) -> Block:
        return (self.B * self.gate(self.k * self.k.T)).tril(-1)

    def A_free(self) -> Block:
        return self.A

    def A_gated(self) -> Block:
        return self.Ag

    def inverse_steps(self, which: str = "gated") -> list:
        """Steps proving the block forms of the inverses: (I + L') A' = I [L-blockinv, under the C-token
        relations]."""
        I = self.eye()
        out = []
        if which in ("both", "gated"):
            out.append(Eq("step: (I + L_gated') Ag' = I", (I + self.L_gated) * self.Ag, I, self.ch.rules("gated")))
        if which in ("both", "free"):
            out.append(Eq("step: (I + L_free') A' = I", (I + self.L_free) * self.A, I, self.ch.rules("free")))
        return out

    def recurrence(self, S_C: M):
        """The new token applied to the state S_C after C tokens: (S_{C+1}, o^T / scale, write)."""
        t = self.tok
        k, v, q, a, beta = t["k"], t["v"], t["q"], t["a"], t["beta"]
        S1 = a * (S_C - beta * k * (k.T * S_C)) + beta * k * v.T
        return S1, q.T * S1, beta * (v.T - a * k.T * S_C)
