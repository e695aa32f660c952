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


SCREENED = -1  # the racing level of a candidate statistical racing's screen stopped before any forward
SCREEN_MEMBERS = 8  # members scored in full before the screen judges: a variance estimate worth a t quantile


@dataclasses.dataclass(frozen=True)
class Sequential:
    """Statistical racing: a new candidate stops once the evidence says, at error rate `delta`, that its full-set
    fitness lies below that of the elite boundary member (the `elites`-th fittest member scored on the full set so
    far; in generation 0 the first `elites` members are scored on the full set first).

    Every candidate is scored on growing prefixes of one sample order, fixed once per search (`order`: stratified
    by scored length, seeded), at the checkpoints `min_samples`, x `growth`, ... below the search set's size. At
    each checkpoint the paired differences d_i = candidate_i - boundary_i on the same samples (same teacher, same
    order) give an upper confidence bound on the full-set mean of d (`upper`): a Student-t bound with the
    finite-population correction of sampling without replacement, at level `delta / checkpoints` (a union bound
    over the checkpoints, so the bound holds at all of them at once). A candidate whose bound is below zero cannot
    enter the elite and stops there; the rest go on to the full set, where only exact scores rank. The t bound is
    the normal approximation of the sample mean (a distribution-free empirical Bernstein bound, which needs the
    range of d, would need hundreds of samples to stop anything at the differences between ESAP candidates), so
    `delta` is the declared rate of wrongly stopping a candidate that could have entered the elite, as far as
    that approximation holds; with few samples the t quantile is large and the test cautious.

    With `surrogate`, the search subtracts from d the per-sample difference that an additive model of the members
    scored before predicts (`evoesap.method.surrogate`, fixed before the candidate is scored) and adds back its
    full-set mean, known exactly: the same bound on a quantity that spreads less (on the tiny world, the
    residuals spread a third to a half as much as d). A generation's candidates race in `waves`, predicted
    fittest first, and each wave's survivors may raise the boundary of the next.

    With `tolerance` (an indifference zone, in fitness units) a candidate stops once its bound says it cannot beat the
    boundary by `tolerance` or more: `delta` then bounds the chance of wrongly stopping a candidate better than the
    boundary by more than `tolerance`, and one within it may stop, so each such decision may cost up to `tolerance`.
    It pays where candidates are near-tied (docs/results/speed.md, #racing-tolerance); 0 (the default) stops only
    candidates below the boundary.

    With `screen` (and the model), a candidate is first judged with no forward at all: the model's predicted full-set
    mean difference to the boundary plus a Student-t multiple of the model's leave-one-out error (`screen_upper`,
    at its own share of delta: one more look in the union bound) below zero stops it at `SCREENED`. It needs
    `SCREEN_MEMBERS` members scored in full and a candidate whose removal counts the members cover (the model then
    interpolates, where its leave-one-out errors say how far it may miss). It saves the first checkpoints' samples of
    clearly worse candidates and costs the checkpoints a slightly smaller share of delta (docs/results/speed.md,
    #statistical-screen, has what that nets). It is opt-in: its bound holds only while the model's bias is small
    beside its leave-one-out scatter, true of the tiny world's ESAP (where the model errs towards caution) but not of
    every fitness: on a strongly curved additive one (tests/unit/test_racing_sequential.py) about one random world
    in 300 screened a member of exact search's elite, the ridge's smoothing missing a poorly supported count's
    effect by four of its standard errors.
    """

    delta: float = 0.05  # declared chance of wrongly stopping a candidate that could enter the elite
    min_samples: int = 4  # the first checkpoint's samples (and the strata of the order)
    growth: float = 2.0  # each checkpoint scores this many times the samples of the previous one
    waves: int = 4  # a generation's candidates race in this many waves, predicted fittest first
    surrogate: bool = True  # subtract the differences a per-sample additive model predicts (evoesap.method.surrogate)
    screen: bool = False  # with the model: stop a candidate it predicts, with room for its error, below the boundary
    tolerance: float = 0.0  # stop a candidate that cannot beat the boundary by this much fitness or more

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ConfigError(f"racing_delta must lie in (0, 1), got {self.delta}")
        if self.min_samples < 2:
            raise ConfigError(f"statistical racing needs racing_min_samples >= 2 (a variance), got {self.min_samples}")
        if self.waves < 1:
            raise ConfigError(f"statistical racing's waves must be >= 1, got {self.waves}")
        if not self.growth > 1:
            raise ConfigError(f"statistical racing's growth must exceed 1, got {self.growth}")
        if not 0 <= self.tolerance < math.inf:
            raise ConfigError(f"racing_tolerance must be >= 0 and finite, got {self.tolerance}")

    def checkpoints(self, n: int) -> tuple[int, ...]:
        """Sample counts at which candidates may stop, each below `n` (the full set follows)."""
        out, size = [], self.min_samples
        while size < n:
            out.append(size)
            size = max(size + 1, math.ceil(size * self.growth))
        return tuple(out)

    def order(self, positions: Sequence[int], seed: int) -> tuple[int, ...]:
        """The race's sample order (indices into `positions`, the scored positions of each search sample), once
        per search: samples sorted by length into `min_samples` strata, each shuffled, then dealt in turn, so that
        every prefix spans short and long samples alike."""
        n = len(positions)
        rng = np.random.default_rng([seed, 0x5EC])
        ranked = sorted(range(n), key=lambda i: (positions[i], int(rng.integers(1 << 30))))
        strata = [ranked[i * n // self.min_samples : (i + 1) * n // self.min_samples] for i in range(self.min_samples)]
        for stratum in strata:
            rng.shuffle(stratum)
        return tuple(s[i] for i in range(max(map(len, strata))) for s in strata if i < len(s))

    def upper(self, differences: np.ndarray, population: int) -> float:
        """Upper confidence bound on the mean of d over all `population` samples, from its first values
        (`differences`, NaN ones dropped), at level delta / checkpoints."""
        d = np.asarray(differences, dtype=np.float64)
        d = d[~np.isnan(d)]
        n = len(d)
        if n >= population:
            return float(d.mean())
        if n < 2:
            return math.inf
        spread = float(d.std(ddof=1)) * math.sqrt((1 - n / population) / n)
        return float(d.mean()) + student_t(1 - self.delta / self.looks(population), n - 1) * spread

    def looks(self, population: int) -> int:
        """The tests a candidate may stop at, each at delta / looks (the union bound): the checkpoints, and the screen."""
        return max(1, len(self.checkpoints(population)) + (self.screen and self.surrogate))

    def screen_upper(self, predicted: float, error: float, members: int, population: int) -> float:
        """Upper bound on a candidate's full-set mean difference to the boundary from the model alone: `predicted`
        (the model's mean for it minus the boundary's exact mean) plus the t quantile at delta / looks, with the
        members' degrees of freedom, times `error` (the model's leave-one-out error); inf where it may not judge."""
        if not (self.screen and self.surrogate) or members < SCREEN_MEMBERS or not math.isfinite(error):
            return math.inf
        return predicted + student_t(1 - self.delta / self.looks(population), members - 1) * error

    def check(self, positions: Sequence[int]) -> None:
        """Refuse, before any search, a search set too small for a first checkpoint below it."""
        if not self.checkpoints(len(positions)):
            raise ConfigError(
                f"statistical racing's first checkpoint ({self.min_samples} samples, racing_min_samples) is not below the "
                f"{len(positions)} search samples: it cannot save work; use more search samples, a lower "
                "racing_min_samples, or no racing"
            )

    def samples_at(self, level: int, n: int) -> int:
        """Samples a candidate stopped at `level` was scored on (none when screened)."""
        return 0 if level == SCREENED else self.checkpoints(n)[level]


def student_t(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom: exact for 1 and 2, else the Cornish-Fisher
    expansion of the normal quantile (Abramowitz and Stegun 26.7.5; within 3% below the exact value for df 3 and
    p <= 0.999, within 0.1% from df 7). numpy has no t quantile and scipy is no dependency."""
    from statistics import NormalDist

    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = NormalDist().inv_cdf(p)
    v = float(df)
    terms = (
        z,
        (z**3 + z) / (4 * v),
        (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2),
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3),
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4),
    )
    return float(sum(terms))
