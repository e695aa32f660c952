"""Racing: successive halving of each generation's new candidates over growing sample subsets.

EvoPress's multi-step selection, applied to the level-switch search (`evoesap.search`). In every
generation the candidates not yet scored on the full search set run a race: all of them are scored on
the first subset (default 1/8 of the search samples), the best `advance` share (default a quarter, at
least one) on the next (1/2), and the best `advance` share of those on the full set. Only full-set
scores rank elites and the best allocation, so elites are always ranked on the full set; a candidate
stopped early never becomes an elite. In generation 0 at least `elites` candidates reach the full set.

With the defaults and 28 offspring: 28 on 1/8, 7 on 1/2, 2 on all, which is 3.5 + 7 x 3/8 + 2 x 1/2
= 7.1 sample-set passes instead of 28 (the evaluator memoises per sample, so a promoted candidate runs
only the samples it lacks).

The subsets are nested within a generation and drawn afresh for each: level `i` of generation `g`
takes the first `ceil(fraction_i * n)` samples of a permutation seeded by `(seed, g)`, so a resumed
search sees exactly the subsets of an uninterrupted one and no single small subset is overfitted.
Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from evoesap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Racing:
    """A racing schedule: the sample shares of the preliminary levels and the share that advances."""

    fractions: tuple[float, ...] = (0.125, 0.5)  # increasing shares of the search samples; the full set follows
    advance: float = 0.25  # share of a level's entrants scored at the next level (at least one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fractions", tuple(float(f) for f in self.fractions))
        f = self.fractions
        if not f or any(not 0 < x < 1 for x in f) or any(a >= b for a, b in zip(f, f[1:])):
            raise ConfigError(f"racing fractions must increase strictly within (0, 1), got {list(f)}")
        if not 0 < self.advance <= 1:
            raise ConfigError(f"racing advance must lie in (0, 1], got {self.advance}")

    def survivors(self, entrants: int, minimum: int = 1) -> int:
        """How many of `entrants` go on to the next level."""
        return min(entrants, max(minimum, math.ceil(self.advance * entrants)))

    @classmethod
    def parse(cls, text: str) -> "Racing":
        """From "0.125,0.5:0.25" (fractions, then the advance share after a colon)."""
        shares, _, advance = text.partition(":")
        try:
            return cls(tuple(float(x) for x in shares.split(",") if x.strip()), float(advance or cls.advance))
        except ValueError:
            raise ConfigError(f"racing schedule {text!r} is not like '0.125,0.5:0.25' (fractions:advance)") from None


def subset(samples: Sequence[int], fraction: float, seed: int, generation: int) -> list[int]:
    """The `fraction` share of `samples` used by a racing level in `generation` (sorted, at least one)."""
    order = np.random.default_rng([seed, generation]).permutation(len(samples))
    take = max(1, math.ceil(fraction * len(samples)))
    return sorted(int(samples[i]) for i in order[:take])
