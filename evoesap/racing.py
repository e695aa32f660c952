"""Racing: successive halving of each generation's new candidates over growing sample subsets.

EvoPress's multi-step selection, applied to the level-switch search (`evoesap.search`). In every
generation the candidates not yet scored on the full search set run a race: all of them are scored on
the first subset (default 1/16 of the search samples), the best `advance` share (default a quarter, at
least one) on the next (1/4), and the best `advance` share of those on the full set. Only full-set
scores rank elites and the best allocation, so elites are always ranked on the full set; a candidate
stopped early never becomes an elite. In generation 0 at least `elites` candidates reach the full set.

With the defaults and 28 offspring: 28 on 1/16, 7 on 1/4, 2 on all, which is 1.75 + 7 x 3/16 + 2 x 3/4
= 4.6 sample-set passes instead of 28 (the evaluator memoises per sample, so a promoted candidate runs
only the samples it lacks). On the demo world this default cost 3.7-4.4x less per generation than
exact search and lost at most 0.14% full-set ESAP over 12 searches; EvoPress's 1/8, 1/2 schedule
("0.125,0.5:0.25") cost 2.6-3.0x less (benchmarks/RESULTS.md). The first level should still hold a few
thousand tokens: with very small search sets, pass a larger first share.

The subsets are nested within a generation and drawn afresh for each: level `i` of generation `g`
takes the first `ceil(fraction_i * n)` samples of a permutation seeded by `(seed, g)`, so a resumed
search sees exactly the subsets of an uninterrupted one and no single small subset is overfitted.
Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from evoesap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Racing:
    """A racing schedule: the sample shares of the preliminary levels and the share that advances."""

    fractions: tuple[float, ...] = (0.0625, 0.25)  # increasing shares of the search samples; the full set follows
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
        """From "0.0625,0.25:0.25" (fractions, then the advance share after a colon)."""
        shares, _, advance = text.partition(":")
        try:
            return cls(tuple(float(x) for x in shares.split(",") if x.strip()), float(advance or cls.advance))
        except ValueError:
            raise ConfigError(f"racing schedule {text!r} is not like '0.0625,0.25:0.25' (fractions:advance)") from None


def subset(samples: Sequence[int], fraction: float, seed: int, generation: int) -> list[int]:
    """The `fraction` share of `samples` used by a racing level in `generation` (sorted, at least one)."""
    order = _permutation(len(samples), seed, generation)
    take = max(1, math.ceil(fraction * len(samples)))
    return sorted(int(samples[i]) for i in order[:take])


@functools.lru_cache(maxsize=64)
def _permutation(n: int, seed: int, generation: int) -> tuple[int, ...]:
    """One generation's sample order, drawn once although every candidate of every level asks for it."""
    return tuple(np.random.default_rng([seed, generation]).permutation(n).tolist())
