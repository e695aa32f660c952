"""A per-sample additive model of fitness over layers, fitted on allocations scored on the full search set.

Statistical racing (`evoesap.method.racing.Sequential`) bounds a candidate's full-set mean difference to the
elite boundary member from the paired differences on the first samples of its order. Much of their spread
comes from which layers the two allocations prune differently, and how much each sample suffers from that
is seen in the members scored before: sample i's fitness is close to `a_i + sum_l g_li(r_l)`, a value per
layer and removal count. `Additive` fits the g by ridge regression (small values, neighbouring counts alike)
and predicts the difference between two allocations on every sample (`difference`); the race subtracts it
from the paired differences and adds back its full-set mean, which it knows exactly. The model is fixed
before a candidate's values are seen and only changes what the bound estimates, so a poor model widens the
bound and never makes it wrong; an untrained model predicts no difference (the plain paired test).
Pure numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

SMOOTH = 0.1  # ridge weight on the change between neighbouring removal counts of a layer
SHRINK = 0.01  # ridge weight on every value: counts never seen stay near their neighbours, near 0 without any


@dataclasses.dataclass(frozen=True)
class Additive:
    """Fitted per-layer, per-sample values: `values[offsets[l] + r_l]` is layer l's share at r_l removals."""

    offsets: tuple[int, ...]  # [L + 1] start of each layer's block of removal counts
    values: np.ndarray  # [sum(caps + 1), N] float64

    @classmethod
    def fit(cls, caps: Sequence[int], allocations: Sequence[Sequence[int]], vectors: np.ndarray) -> Additive:
        """From the full-set per-sample fitness `vectors` ([m, N]) of `allocations` (m of them; `caps`: most
        removals per layer)."""
        offsets = tuple(int(v) for v in np.cumsum([0, *(int(c) + 1 for c in caps)]))
        p, n = offsets[-1], vectors.shape[1]
        if not len(allocations):
            return cls(offsets, np.zeros((p, n)))
        x = _design(offsets, allocations)  # [m, p]
        x = x - x.mean(axis=0)
        y = vectors - vectors.mean(axis=0)  # [m, N]
        steps = np.zeros((p - len(caps), p))  # [p - L, p] neighbouring counts of one layer
        row = 0
        for begin, end in zip(offsets, offsets[1:]):
            for v in range(begin, end - 1):
                steps[row, v], steps[row, v + 1] = -1.0, 1.0
                row += 1
        gram = x.T @ x + SMOOTH * steps.T @ steps + SHRINK * np.eye(p)
        return cls(offsets, np.linalg.solve(gram, x.T @ y))

    def difference(self, a: Sequence[int], b: Sequence[int]) -> np.ndarray:
        """Predicted per-sample fitness of `a` minus that of `b` -> [N] float64."""
        x = _design(self.offsets, [a, b])  # [2, p]
        return (x[0] - x[1]) @ self.values


def _design(offsets: tuple[int, ...], allocations: Sequence[Sequence[int]]) -> np.ndarray:
    """One-hot removal counts per layer -> [m, p] float64."""
    x = np.zeros((len(allocations), offsets[-1]))
    for i, r in enumerate(allocations):
        x[i, [offsets[layer] + int(v) for layer, v in enumerate(r)]] = 1.0
    return x
