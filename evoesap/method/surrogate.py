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

The same model predicts a candidate's full-set mean fitness before any forward (`mean`), and says how far to
trust that: `spread` is the root mean square of its leave-one-out errors on the members' full-set means (each
member predicted by the model fitted on the others, in closed form through the ridge's hat matrix), the error
of predicting an allocation the model has not seen. The race's zero-forward screen bounds a candidate with it,
only where the candidate's removal count in every layer is one some member has (`covers`): the model
interpolates there, and its smoothing would otherwise flatten an unseen count's effect unchecked.
Pure numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

SMOOTH = 0.1  # ridge weight on the change between neighbouring removal counts of a layer
SHRINK = 0.01  # ridge weight on every value: counts never seen stay near their neighbours, near 0 without any


@dataclasses.dataclass(frozen=True)
class Additive:
    """Fitted per-layer, per-sample values: `values[offsets[l] + r_l]` is layer l's share at r_l removals."""

    offsets: tuple[int, ...]  # [L + 1] start of each layer's block of removal counts
    values: np.ndarray  # [sum(caps + 1), N] float64
    intercept: float = 0.0  # full-set mean fitness of an allocation with no layer's share: `mean`'s constant
    spread: float = math.inf  # RMS leave-one-out error of the members' full-set means (inf below two members)
    members: int = 0  # allocations fitted
    seen: tuple[bool, ...] = ()  # [sum(caps + 1)] some member has this removal count in this layer

    @classmethod
    def fit(cls, caps: Sequence[int], allocations: Sequence[Sequence[int]], vectors: np.ndarray) -> Additive:
        """From the full-set per-sample fitness `vectors` ([m, N]) of `allocations` (m of them; `caps`: most
        removals per layer)."""
        offsets = tuple(int(v) for v in np.cumsum([0, *(int(c) + 1 for c in caps)]))
        p, n = offsets[-1], vectors.shape[1]
        if not len(allocations):
            return cls(offsets, np.zeros((p, n)), seen=(False,) * p)
        design = _design(offsets, allocations)  # [m, p]
        x = design - design.mean(axis=0)
        y = vectors - vectors.mean(axis=0)  # [m, N]
        steps = np.zeros((p - len(caps), p))  # [p - L, p] neighbouring counts of one layer
        row = 0
        for begin, end in zip(offsets, offsets[1:]):
            for v in range(begin, end - 1):
                steps[row, v], steps[row, v + 1] = -1.0, 1.0
                row += 1
        gram = x.T @ x + SMOOTH * steps.T @ steps + SHRINK * np.eye(p)
        values = np.linalg.solve(gram, x.T @ y)  # [p, N]
        means = vectors.mean(axis=1)  # [m] full-set mean fitness of each member
        slope = values.mean(axis=1)  # [p] the model of the full-set mean (it is linear in y)
        intercept = float(means.mean() - design.mean(axis=0) @ slope)
        m = len(allocations)
        spread = math.inf
        if m > 1:  # leave-one-out errors of the means: residual / (1 - leverage), the intercept (centring) counted in
            leverage = 1.0 / m + np.einsum("ij,ji->i", x, np.linalg.solve(gram, x.T))  # [m]
            loo = (means - intercept - design @ slope) / (1.0 - leverage)
            spread = float(np.sqrt(np.mean(loo**2)))
        return cls(offsets, values, intercept, spread, m, tuple(bool(v) for v in design.any(axis=0)))

    def difference(self, a: Sequence[int], b: Sequence[int]) -> np.ndarray:
        """Predicted per-sample fitness of `a` minus that of `b` -> [N] float64."""
        x = _design(self.offsets, [a, b])  # [2, p]
        return (x[0] - x[1]) @ self.values

    def mean(self, a: Sequence[int]) -> float:
        """Predicted full-set mean fitness of `a` (its error is about `spread` where `covers(a)`)."""
        return self.intercept + float(_design(self.offsets, [a])[0] @ self.values.mean(axis=1))

    def covers(self, a: Sequence[int]) -> bool:
        """Whether every layer's removal count of `a` is one some member has: the model interpolates."""
        return bool(self.seen) and all(self.seen[self.offsets[layer] + int(v)] for layer, v in enumerate(a))


def _design(offsets: tuple[int, ...], allocations: Sequence[Sequence[int]]) -> np.ndarray:
    """One-hot removal counts per layer -> [m, p] float64."""
    x = np.zeros((len(allocations), offsets[-1]))
    for i, r in enumerate(allocations):
        x[i, [offsets[layer] + int(v) for layer, v in enumerate(r)]] = 1.0
    return x
