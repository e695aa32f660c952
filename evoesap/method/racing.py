"""Racing: successive halving of each generation's new candidates over growing sample subsets.

EvoPress's multi-step selection, applied to the level-switch search (`evoesap.method.search`). In every
generation the candidates not yet scored on the full search set run a race: all of them are scored on
the first subset (default 1/16 of the search samples), the best `advance` share (default a quarter, at
least one) on the next (1/4), and the best `advance` share of those on the full set. Only full-set
scores rank elites and the best allocation, so elites are always ranked on the full set; a candidate
stopped early never becomes an elite. In generation 0 at least `elites` candidates reach the full set.

With the defaults and 28 offspring: 28 on 1/16, 7 on 1/4, 2 on all, which is 1.75 + 7 x 3/16 + 2 x 3/4
= 4.6 sample-set passes instead of 28 (the evaluator memoises per sample, so a promoted candidate runs
only the samples it lacks). On the demo world this default cost 3.7-4.4x less per generation than
exact search and lost at most 0.14% full-set ESAP over 12 searches; EvoPress's 1/8, 1/2 schedule
("0.125,0.5:0.25") cost 2.6-3.0x less (docs/results/search-quality.md).

A level never starves: it scores at least `min_samples` samples (default 4) and `min_positions` scored
positions (default 256), however small its share. Fitness is a mean over samples, and samples differ
far more than positions within one, so one sample ranks candidates by that sample's quirks (a 16-sample
search set's 1/16 level is one sample: it ended at a clearly worse allocation); four halve the standard
error of one, and 256 positions keep a level of short answers from resting on a few dozen tokens while
costing under a tenth of a typical search set (a few thousand positions). `check` refuses, before the
search starts, a schedule whose levels would not grow strictly up to the full set with these minimums.

The subsets are nested within a generation and drawn afresh for each: level `i` of generation `g`
takes the shortest prefix of a permutation seeded by `(seed, g)` that holds `ceil(fraction_i * n)`
samples and both minimums, so a resumed search sees exactly the subsets of an uninterrupted one and no
single small subset is overfitted. Pure Python + numpy.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from evoesap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Racing:
    """A racing schedule: the sample shares of the preliminary levels, the share that advances, and the
    least that any level scores."""

    fractions: tuple[float, ...] = (0.0625, 0.25)  # increasing shares of the search samples; the full set follows
    advance: float = 0.25  # share of a level's entrants scored at the next level (at least one)
    min_samples: int = 4  # every level scores at least this many samples...
    min_positions: int = 256  # ...and at least this many scored positions

    def __post_init__(self) -> None:
        object.__setattr__(self, "fractions", tuple(float(f) for f in self.fractions))
        f = self.fractions
        if not f or any(not 0 < x < 1 for x in f) or any(a >= b for a, b in zip(f, f[1:])):
            raise ConfigError(f"racing fractions must increase strictly within (0, 1), got {list(f)}")
        if not 0 < self.advance <= 1:
            raise ConfigError(f"racing advance must lie in (0, 1], got {self.advance}")
        if self.min_samples < 1 or self.min_positions < 0:
            raise ConfigError(
                f"racing_min_samples must be >= 1 and racing_min_positions >= 0, got {self.min_samples} and {self.min_positions}"
            )

    def survivors(self, entrants: int, minimum: int = 1) -> int:
        """How many of `entrants` go on to the next level."""
        return min(entrants, max(minimum, math.ceil(self.advance * entrants)))

    def check(self, positions: Sequence[int]) -> None:
        """Refuse, before any search, a schedule whose levels would not grow strictly up to the full set.

        `positions`: scored positions of each search sample. A level's size is bounded by its share, the
        minimum sample count and, at worst (the fewest positions first), the samples that reach the
        minimum of positions; every level must stay below the next level's share and count (the full
        set after the last), or it would score what the next one scores and cut on no new information.
        """
        n = len(positions)
        counts = [self._count(f, n) for f in self.fractions] + [n]
        worst = self._reach(sorted(positions))
        for level, fraction in enumerate(self.fractions):
            size = max(counts[level], worst)
            if size >= counts[level + 1]:
                following = (
                    "the whole search set" if level + 1 == len(self.fractions) else f"level {level + 1}'s {counts[level + 1]}"
                )
                raise ConfigError(
                    f"racing level {level} (share {fraction:g}) may score {size} of the {n} search samples (at least "
                    f"{self.min_samples} samples and {self.min_positions} scored positions), not fewer than {following}: "
                    f"it cannot save work; use more search samples, fewer or larger racing shares "
                    f"(racing_schedule {self.text!r}), lower racing_min_samples/racing_min_positions, or no racing"
                )

    def subset(self, samples: Sequence[int], positions: Sequence[int], level: int, seed: int, generation: int) -> list[int]:
        """Level `level`'s samples in `generation` (sorted): the shortest prefix of the generation's
        permutation that holds the level's share, `min_samples` and `min_positions` (all, if none does)."""
        if len(positions) != len(samples):
            raise ConfigError(f"racing needs the scored positions of each of the {len(samples)} samples, got {len(positions)}")
        order = _permutation(len(samples), seed, generation)
        take = max(self._count(self.fractions[level], len(samples)), self._reach([positions[i] for i in order]))
        return sorted(int(samples[i]) for i in order[:take])

    @property
    def text(self) -> str:
        """The schedule as `parse` reads it."""
        return f"{','.join(f'{f:g}' for f in self.fractions)}:{self.advance:g}"

    def _count(self, fraction: float, n: int) -> int:
        return min(n, max(self.min_samples, math.ceil(fraction * n)))

    def _reach(self, positions: Sequence[int]) -> int:
        """How many of `positions`, taken in order, reach `min_positions` (all of them if they never do)."""
        return min(len(positions), bisect.bisect_left(list(itertools.accumulate(positions)), self.min_positions) + 1)

    @classmethod
    def parse(cls, text: str, min_samples: int = 4, min_positions: int = 256) -> Racing:
        """From "0.0625,0.25:0.25" (fractions, then the advance share after a colon) and the minimums."""
        shares, _, advance = text.partition(":")
        try:
            values = tuple(float(x) for x in shares.split(",") if x.strip()), float(advance or cls.advance)
        except ValueError:
            raise ConfigError(f"racing schedule {text!r} is not like '0.0625,0.25:0.25' (fractions:advance)") from None
        return cls(*values, min_samples=min_samples, min_positions=min_positions)


@functools.lru_cache(maxsize=64)
def _permutation(n: int, seed: int, generation: int) -> tuple[int, ...]:
    """One generation's sample order, drawn once although every candidate of every level asks for it."""
    return tuple(np.random.default_rng([seed, generation]).permutation(n).tolist())
