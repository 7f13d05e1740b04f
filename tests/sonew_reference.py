"""An independent dense float64 NumPy reference of SONew's semantics (issue: optimizer core).

It builds the banded matrix ``H`` explicitly over each tensor's chain (``g.T.reshape(-1)``), applies
Algorithm 3 by removing edges from the graph, solves the LogDet problem with dense submatrix
inverses
(Theorem 2 on the reduced graph) and multiplies dense matrices. Nothing here shares code with
``sonew_pax.optim``.
"""

from __future__ import annotations

import numpy as np


def chain(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).T.reshape(-1)


def unchain(v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return v.reshape(tuple(reversed(shape))).T


def band_edges(n: int, band: int) -> set[tuple[int, int]]:
    return {(i, j) for i in range(n) for j in range(i + 1, min(n, i + band + 1))}


def cut_edges(H: np.ndarray, band: int, gamma: float) -> set[tuple[int, int]]:
    """Algorithm 3 (chain-cut form): edges of the banded graph that survive."""
    n = H.shape[0]
    edges = band_edges(n, band)
    cuts = []
    for j in range(n):
        window = list(range(j + 1, min(n, j + band + 1)))
        if not window:
            continue
        # The window is "undefined" when it is within gamma of singular: a sequential Schur
        # complement (pivot) of its unit-diagonal scaling is <= gamma.
        W = H[np.ix_(window, window)]
        scale = 1 / np.sqrt(np.diag(W))
        pivots = [
            np.linalg.det((W * np.outer(scale, scale))[: i + 1, : i + 1])
            / np.linalg.det((W * np.outer(scale, scale))[:i, :i])
            for i in range(len(window))
        ]
        if min(pivots) <= gamma:
            cuts.append(j)
            continue
        schur = H[j, j] - H[window, j] @ np.linalg.solve(W, H[window, j])
        if not (np.isfinite(schur) and schur > gamma * H[j, j]):
            cuts.append(j)
    return {(p, q) for (p, q) in edges if not any(p <= i < q for i in cuts)}


def logdet_solution(H: np.ndarray, edges: set[tuple[int, int]]) -> np.ndarray:
    """Theorem 2 on the graph ``edges``: ``X = L D L^T`` from dense window solves."""
    n = H.shape[0]
    L = np.eye(n)
    D = np.zeros(n)
    for j in range(n):
        window = sorted(q for (p, q) in edges if p == j)
        if window:
            L[window, j] = -np.linalg.solve(H[np.ix_(window, window)], H[window, j])
            D[j] = 1.0 / (H[j, j] + H[window, j] @ L[window, j])
        else:
            D[j] = 1.0 / H[j, j]
    return L @ np.diag(D) @ L.T


class DenseSONew:
    """Multi-step dense SONew on a dict of NumPy tensors (float64).

    ``damping="absolute"`` adds ``eps`` to ``d_hat``; ``"mean"`` / ``"max"`` add ``eps`` times
    the mean / max of the previous step's ``d_hat`` (the direction is zero while there is none,
    or it is zero)."""

    def __init__(
        self,
        lr,
        b1,
        b2,
        eps,
        band,
        gamma,
        graft,
        graft_eps,
        weight_decay,
        precondition_1d=False,
        damping="absolute",
    ):
        self.__dict__.update(locals())
        self.t = 0
        self.m, self.d, self.E, self.scale = {}, {}, {}, {}

    def _eps(self, name: str) -> float | None:
        """This step's damping of tensor ``name``; ``None`` for an infinite one."""
        if self.damping == "absolute":
            return self.eps
        scale = self.scale.get(name, 0.0)
        return self.eps * scale if scale > 0 else None

    def _preconditioned(self, x):
        return x.ndim >= 2 or self.precondition_1d

    def step(self, grads: dict, params: dict) -> dict:
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        out = {}
        for name, g in grads.items():
            gv = chain(g)
            n = gv.size
            m = self.m.get(name, np.zeros(n))
            d = self.d.get(name, np.zeros(n))
            E = self.E.get(name, np.zeros((n, n)))
            m = b1 * m + (1 - b1) * gv
            d = b2 * d + (1 - b2) * gv**2
            mask = np.zeros((n, n))
            for p, q in band_edges(n, self.band):
                mask[p, q] = mask[q, p] = 1
            E = b2 * E + (1 - b2) * np.outer(gv, gv) * mask
            self.m[name], self.d[name], self.E[name] = m, d, E
            m_hat, d_hat = m / (1 - b1**t), d / (1 - b2**t)
            adam = m_hat / (np.sqrt(d_hat) + self.graft_eps)
            eps = self._eps(name)
            self.scale[name] = d_hat.max() if self.damping == "max" else d_hat.mean()
            if self._preconditioned(g) and eps is None:
                u = np.zeros(n)
            elif self._preconditioned(g):
                H = E / (1 - b2**t) + np.diag(d_hat + eps)
                X = logdet_solution(H, cut_edges(H, self.band, self.gamma))
                u = X @ m_hat
                if self.graft == "adam":
                    nu = np.linalg.norm(u)
                    u = u * (np.linalg.norm(adam) / nu if nu > 0 else 0.0)
            else:
                u = adam
            # A schedule is evaluated on an int32 count, as optax does (its value may be float32).
            lr = float(self.lr(np.int32(t - 1))) if callable(self.lr) else self.lr
            upd = -lr * (u + self.weight_decay * chain(params[name]))
            out[name] = unchain(upd, g.shape)
        return out
