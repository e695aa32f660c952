"""Level-switch evolutionary search over per-layer allocations: the paper's Algorithm 1, resumable.

Pure Python + numpy; it knows nothing of torch. `fitness` maps an allocation (a tuple of per-layer
removal counts, see `evoesap.method.allocation`) to a float, higher is better.

- Feasible set: `sum(r) == budget`, `0 <= r[l] <= n_l - k_l`, every `r[l]` a multiple of `granularity`.
- Generation 0: the seeds `uniform` (allocation.uniform), the caller's `init` allocations (for example
  allocation.frequency_global), then the patterns `early_heavy`, `middle_heavy`, `late_heavy` (see
  `seed_patterns`); repeats are dropped and the first `population` kept. The rest are drawn uniformly
  from all feasible allocations, without replacement and never equal to a seed; only when the feasible
  set is smaller than the population does it repeat allocations (then the search is exhaustive).
- Each generation keeps the `elites` fittest (ties: the earlier population slot; elites come first, in
  rank order) and adds `population - elites` offspring. An offspring applies `tau = min(U{1..max_steps},
  U{1..max_steps})` level-switch steps to an elite drawn uniformly. A step moves `Δ` experts from layer
  `b` to layer `a != b` (`r[a] += Δ`, `r[b] -= Δ`) with `Δ` a multiple of `granularity` up to
  `max_transfer` (just `granularity` when `max_transfer` is smaller; granularity 2 gives the paper's
  even-valued transfers). The paper draws `(a, b, Δ)` uniformly and resamples until the move is
  feasible; we draw uniformly from the feasible moves directly, the same distribution without an
  unbounded loop. From any feasible allocation a move exists whenever the feasible set has two or more
  allocations (some layer can then gain and another lose `granularity` experts), and the search refuses
  a single-allocation problem.
- An offspring equal to a member already in the next population is redrawn (new parent, new tau), up to
  32 times; after that, or when the population already holds every feasible allocation, the repeat is
  kept. Every allocation is evaluated once (memo), and the best ever seen is returned (ties: the first).
- All randomness comes from one `numpy.random.Generator(PCG64(seed))`.
- With `checkpoint`, the state after every generation (parameters, population, memo, history, best, RNG
  state) is written as JSON to that fsspec URI (a temporary file moved into place for local paths, a
  single put for object stores). `resume=True` continues from it, and the result and history equal
  those of an uninterrupted run. Parameters must match, except `generations`, which may be raised to
  extend a finished search; a missing checkpoint starts afresh.
- Racing (opt-in, `racing=Racing(...)` with `subset_fitness`): each generation's candidates that have
  no full-set fitness yet are raced over growing sample subsets (`evoesap.method.racing` documents the
  schedule and the minimum each level scores) and only the survivors get `fitness`, the full-set score. Elites and the best allocation
  are ranked on full-set scores only. `subset_fitness(allocation, level, generation)` scores on level
  `level`'s subset of that generation; it holds no state the search must save, so a resumed racing
  search equals an uninterrupted one. History records of candidates stopped early carry the level
  they reached and their score there (`level`); the search draws no extra random numbers, so racing
  off leaves Algorithm 1 and its results unchanged.
- Statistical racing (`racing=Sequential(...)` with `sample_fitness`, or `sample_batch`): each generation's
  new candidates are scored on growing prefixes of one sample order fixed for the search and stop as soon as
  their paired per-sample differences against the elite boundary member say at error rate `delta` that they
  cannot enter the elite (`evoesap.method.racing.Sequential`). The boundary member is the `elites`-th fittest
  distinct member of the population scored exactly on the full set (in generation 0 the first `elites`
  distinct members are scored on the full set first); a candidate below it has `elites` members above it, so
  it could never have become an elite or the best. The candidates race in `waves`, those a per-sample
  additive model of the members scored before (`evoesap.method.surrogate`, fitted on the latest
  SURROGATE_WINDOW full-set per-sample vectors, which the checkpoint keeps) predicts fittest first, so that
  each wave's survivors may raise the boundary for the next; the model's predicted differences are
  subtracted from the paired differences and their full-set mean added back, which narrows the bound where
  the model is good and never makes it wrong. With a `tolerance`, a candidate stops once it cannot beat the boundary
  by that much (the racing module). `sample_fitness(allocation, count)` gives the per-sample
  fitness (higher is better) on the order's first `count` samples (None: all).
- Scoring goes through one seam, a batch per generation and racing level: `score_batch(allocations,
  level, generation)` (level None: the full set), so that a caller can score a generation's candidates on
  several workers (`evoesap.method.distributed`). The search asks for the same allocations in the same order
  whether it is given `fitness` / `subset_fitness` (scored one by one) or `score_batch`.
- Elite floor (opt-in, `elite_floor=True`): from generation 1 on, full-set scoring gets the fitness of the
  weakest parent as `floor` (`fitness(allocation, floor)`, `score_batch(..., floor=floor)`); a scorer may stop
  a candidate as soon as its fitness provably lies below it and return an upper bound below `floor`
  (`CandidateEvaluator.score(..., floor=)`). The parents hold `elites` slots of the population at or above the
  floor, and floors never fall, so such a candidate could never become an elite or the best, now or when
  drawn again: the search takes the same course and returns the same best allocation and fitness. Only the
  history's fitness of those candidates (and the generation means) show the bound instead of the value.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import posixpath
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from evoesap.errors import ArtifactError, ConfigError, DataError
from evoesap.method import allocation
from evoesap.method.allocation import Allocation
from evoesap.method.racing import SCREENED, Racing, Sequential
from evoesap.method.surrogate import Additive
from evoesap.store import artifacts

log = logging.getLogger(__name__)

Fitness = Callable[[Allocation], float]
# with elite_floor: fitness(allocation, floor or None), at or above floor exact, below it possibly an upper bound
FlooredFitness = Callable[[Allocation, "float | None"], float]
# subset_fitness(allocation, racing level, generation): fitness on that level's sample subset
SubsetFitness = Callable[[Allocation, int, int], float]
# score_batch(allocations, racing level or None for the full set, generation): their fitnesses, in order
ScoreBatch = Callable[[Sequence[Allocation], "int | None", int], Sequence[float]]
# sample_fitness(allocation, count): per-sample fitness on the race order's first `count` samples (None: all)
SampleFitness = Callable[[Allocation, "int | None"], Sequence[float]]
# sample_batch(allocations, count): sample_fitness of each, in order
SampleBatch = Callable[[Sequence[Allocation], "int | None"], Sequence[Sequence[float]]]
# on_generation(generation, best, best_fitness, mean_fitness_of_population, evaluations_so_far)
OnGeneration = Callable[[int, Allocation, float, float, int], None]

_FORMAT = "evoesap.search/1"  # a format name, not a module path: checkpoints written before stay readable
_HEAD = json.dumps({"format": _FORMAT})[:-1].encode("utf-8")  # how every checkpoint file starts
_REDRAWS = 32
SURROGATE_WINDOW = 128  # the most recent full-set per-sample fitness vectors that statistical racing's model fits


@dataclasses.dataclass(frozen=True)
class HistoryRecord:
    """One population slot of one generation; `elite` marks the slots kept for the next generation.

    `level` is None when `fitness` is on the full search set, else the racing level the candidate
    stopped at, with `fitness` its score on that level's subset (`racing.SCREENED`: stopped by statistical
    racing's screen before any forward, with `fitness` the model's prediction).
    """

    generation: int
    candidate: int
    allocation: Allocation
    fitness: float
    elite: bool
    level: int | None = None


@dataclasses.dataclass(frozen=True)
class SearchResult:
    best: Allocation
    best_fitness: float
    history: tuple[HistoryRecord, ...]  # (generations + 1) * population records, generation 0 first
    evaluations: int  # distinct allocations evaluated = fitness calls of an uninterrupted run
    subset_evaluations: int = 0  # subset_fitness calls of an uninterrupted run (racing)


@dataclasses.dataclass(frozen=True)
class _Params:
    num_experts: tuple[int, ...]
    top_k: tuple[int, ...]
    budget: int
    population: int
    elites: int
    generations: int
    max_transfer: int
    max_steps: int
    granularity: int
    seed: int
    init: tuple[Allocation, ...]
    racing: Racing | Sequential | None = None


def seed_patterns(num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> dict[str, Allocation]:
    """The structured seeds of generation 0.

    `uniform` is allocation.uniform. The others are allocation.proportional to linear layer weights
    over the `L` MoE layers (`l = 0..L-1`): `early_heavy` `L - l`, `late_heavy` `l + 1`, `middle_heavy`
    `min(l + 1, L - l)` (a tent peaking mid-depth), i.e. removals in those ratios, capped at each bound.
    """
    n_layers = len(num_experts)

    def weighted(weights: list[int]) -> Allocation:
        return allocation.proportional(weights, num_experts, top_k, budget, granularity)

    return {
        "uniform": allocation.uniform(num_experts, top_k, budget, granularity),
        "early_heavy": weighted([n_layers - layer for layer in range(n_layers)]),
        "middle_heavy": weighted([min(layer + 1, n_layers - layer) for layer in range(n_layers)]),
        "late_heavy": weighted([layer + 1 for layer in range(n_layers)]),
    }


def level_switch_search(
    fitness: Fitness | FlooredFitness | None,
    num_experts: Sequence[int],
    top_k: Sequence[int],
    budget: int,
    *,
    population: int = 32,
    elites: int = 4,
    generations: int = 50,
    max_transfer: int = 4,
    max_steps: int = 3,
    granularity: int = 1,
    seed: int = 42,
    init: Sequence[Sequence[int]] | None = None,
    checkpoint: str | None = None,
    resume: bool = False,
    on_generation: OnGeneration | None = None,
    racing: Racing | Sequential | None = None,
    subset_fitness: SubsetFitness | None = None,
    score_batch: ScoreBatch | None = None,
    elite_floor: bool = False,
    sample_fitness: SampleFitness | None = None,
    sample_batch: SampleBatch | None = None,
) -> SearchResult:
    """Search the allocation that maximises `fitness` under the budget (see the module docstring).

    init: extra seeds for generation 0, placed right after the uniform seed.
    racing, subset_fitness: successive halving over sample subsets (both or neither); with a `Sequential` racing,
    `sample_fitness` instead (statistical racing).
    score_batch: scores a batch at once, in place of `fitness` and `subset_fitness` (give one or the other);
    `sample_batch` in place of `sample_fitness`.
    on_generation: called after each generation (0 is the initial population, so `generations + 1`
    calls in all); on resume, once for the restored generation and then for each new one.
    elite_floor: pass the weakest parent's fitness to full-set scoring, which may stop candidates that cannot
    reach it (the module docstring; `fitness` and `score_batch` then take the floor).
    """
    params = _validate(
        num_experts, top_k, budget, population, elites, generations, max_transfer, max_steps, granularity, seed, init
    )
    if (fitness is None) == (score_batch is None):
        raise ConfigError("give the search either fitness (and subset_fitness for racing) or score_batch, not both")
    statistical = isinstance(racing, Sequential)
    if score_batch is None:
        if statistical and sample_fitness is None:
            raise ConfigError("statistical racing needs sample_fitness (per-sample fitness on the race order)")
        if not statistical and (racing is None) != (subset_fitness is None):
            raise ConfigError("racing needs both a Racing schedule and subset_fitness (or neither)")
        if sample_batch is not None:
            raise ConfigError("sample_batch goes with score_batch: give sample_fitness with fitness")
        score_batch = _one_by_one(fitness, subset_fitness, elite_floor)
        if sample_fitness is not None:
            sample_batch = _samples_one_by_one(sample_fitness)
    elif subset_fitness is not None or sample_fitness is not None:
        raise ConfigError("score_batch scores the racing levels too: drop subset_fitness and sample_fitness")
    if statistical and sample_batch is None:
        raise ConfigError("statistical racing with score_batch needs sample_batch (per-sample fitness on the race order)")
    params = dataclasses.replace(params, racing=racing)
    space = searchable(params.num_experts, params.top_k, params.budget, params.granularity)
    if resume and checkpoint is None:
        raise ConfigError("resume=True needs a checkpoint URI to resume from")
    saved = _read_checkpoint(checkpoint, params) if resume and artifacts.exists(checkpoint) else None
    if resume and saved is None:
        log.info("no checkpoint at %s yet: starting the search afresh", artifacts.redact(str(checkpoint)))

    run = _Run(params, space, score_batch, checkpoint, on_generation, elite_floor, sample_batch)
    if saved is None:
        start, pop = 0, _initial_population(_seeds(params), space, params.population, run.rng)
        run.finish(0, pop)
    else:
        start, pop = run.restore(saved)
    for gen in range(start + 1, params.generations + 1):
        pop = _next_population(run.parents(pop), params, space, run.caps, run.sizes, run.rng)
        run.finish(gen, pop)
    return run.result()


class _Run:
    """The state of one search as it goes: memoised fitness, history, the best so far, the RNG; the
    scoring of a generation (racing levels, then the full set), its record and its checkpoint."""

    def __init__(
        self,
        params: _Params,
        space: Any,
        score_batch: ScoreBatch,
        checkpoint: str | None,
        on_generation: OnGeneration | None,
        elite_floor: bool = False,
        sample_batch: SampleBatch | None = None,
    ) -> None:
        self.params, self.score_batch, self.checkpoint, self.on_generation = params, score_batch, checkpoint, on_generation
        self.sample_batch = sample_batch
        self.elite_floor = elite_floor
        self.floor: float | None = None  # the weakest parent's fitness in this generation (elite_floor)
        self.caps = np.asarray(space.caps)  # [L] int, bounds in units of granularity
        self.sizes = np.arange(1, max(1, params.max_transfer // params.granularity) + 1)  # [D] transfer sizes in units
        self.rng = np.random.default_rng(params.seed)
        self.memo: dict[Allocation, float] = {}
        self.history: list[HistoryRecord] = []
        self.best: Allocation | None = None
        self.best_fitness = -math.inf
        self.subset_calls = 0
        # statistical racing: full-set per-sample fitness (race order) of the latest members scored exactly
        self.vectors: dict[Allocation, np.ndarray] = {}

    def scored(self, rs: list[Allocation], level: int | None, gen: int) -> list[float]:
        floored = self.elite_floor and level is None
        values = [
            float(v)
            for v in (self.score_batch(rs, level, gen, floor=self.floor) if floored else self.score_batch(rs, level, gen))
        ]
        if len(values) != len(rs):
            raise DataError(f"score_batch returned {len(values)} values for {len(rs)} allocations: fix the scorer")
        for r, v in zip(rs, values):
            if math.isnan(v):
                where = "fitness" if level is None else f"subset_fitness at racing level {level}"
                raise DataError(f"{where} returned NaN for allocation {r}: the search cannot rank it; fix the fitness")
        return values

    def score_full_set(self, rs: list[Allocation], gen: int) -> None:
        """Full-set fitness of those of `rs` not scored yet, one batch in first-seen order (memo)."""
        new = [r for r in dict.fromkeys(rs) if r not in self.memo]
        if new:
            self.memo.update(zip(new, self.scored(new, None, gen)))

    def samples(self, rs: list[Allocation], count: int | None) -> list[np.ndarray]:
        """Per-sample fitness of `rs` on the race order's first `count` samples (None: all) -> [count] float64 each."""
        assert self.sample_batch is not None
        values = [np.asarray(v, dtype=np.float64) for v in self.sample_batch(rs, count)]
        if len(values) != len(rs) or any(count is not None and len(v) != count for v in values):
            raise DataError(
                f"sample_batch returned {[len(v) for v in values]} values for {len(rs)} allocations on {count} samples: "
                "fix the scorer"
            )
        return values

    def race_sequential(self, gen: int, pop: list[Allocation]) -> dict[Allocation, tuple[int, float]]:
        """Statistical racing of the new members against the elite boundary member (the module docstring), in waves
        of those predicted fittest first, so that survivors scored on the full set raise the boundary for the next;
        survivors get full-set fitness (memo). Returns the checkpoint and the score there of those stopped."""
        race = self.params.racing
        assert isinstance(race, Sequential)
        entrants = [r for r in dict.fromkeys(pop) if r not in self.memo]
        if gen == 0:  # a provisional elite first: the seeds lead the population
            first = entrants[: self.params.elites]
            self.score_full_set(first, gen)
            self.keep_vectors(first)
            entrants = entrants[len(first) :]
        stopped: dict[Allocation, tuple[int, float]] = {}
        if not entrants:
            return stopped
        model, boundary = self.surrogate(), self.boundary(pop)
        if model is not None:  # predicted fittest first (stable: population order on ties)
            entrants.sort(key=lambda r: -float(model.difference(r, boundary).mean()))
        size = math.ceil(len(entrants) / race.waves)
        for start in range(0, len(entrants), size):
            if start:  # the last wave's survivors are data and may have raised the boundary
                model, boundary = self.surrogate(), self.boundary(pop)
            stopped.update(self.race_wave(entrants[start : start + size], boundary, model, gen))
        return stopped

    def boundary(self, pop: list[Allocation]) -> Allocation:
        """The elite boundary member: the `elites`-th fittest distinct member of `pop` scored exactly on the full set
        (the weakest of them when fewer). Every member below it has `elites` members above it: never an elite."""
        exact = [r for r in dict.fromkeys(pop) if r in self.memo and (self.floor is None or self.memo[r] >= self.floor)]
        ranked = sorted(exact, key=lambda r: -self.memo[r])
        return ranked[min(self.params.elites, len(ranked)) - 1]

    def race_wave(
        self, entrants: list[Allocation], boundary: Allocation, model: Additive | None, gen: int
    ) -> dict[Allocation, tuple[int, float]]:
        """Race `entrants` over the checkpoints against `boundary`, the `model`'s predicted differences subtracted."""
        race = self.params.racing
        assert isinstance(race, Sequential)
        full = self.samples([boundary], None)[0]
        stopped = self.screen(entrants, full, model)
        entrants = [r for r in entrants if r not in stopped]
        # predicted per-sample difference to the boundary, fixed before any of the candidate's values are seen
        shift = {r: model.difference(r, boundary) if model is not None else np.zeros(len(full)) for r in entrants}
        for level, count in enumerate(race.checkpoints(len(full))):
            if not entrants:
                break
            values = self.samples(entrants, count)
            self.subset_calls += len(entrants)
            going = []
            for r, v in zip(entrants, values):
                s = shift[r]
                if race.upper(v - full[:count] - s[:count], len(full)) + float(s.mean()) < race.tolerance:
                    stopped[r] = (level, float(np.nanmean(v)))
                else:
                    going.append(r)
            entrants = going
        self.score_full_set(entrants, gen)
        self.keep_vectors(entrants)
        return stopped

    def screen(self, entrants: list[Allocation], full: np.ndarray, model: Additive | None) -> dict[Allocation, tuple[int, float]]:
        """Those of `entrants` the model alone says, at their share of delta, cannot reach the boundary (whose full-set
        per-sample fitness is `full`): stopped at SCREENED with the model's predicted fitness, before any forward."""
        race = self.params.racing
        assert isinstance(race, Sequential)
        if model is None:
            return {}
        predicted = {r: model.mean(r) for r in entrants if model.covers(r)}
        return {
            r: (SCREENED, f)
            for r, f in predicted.items()
            if race.screen_upper(f - float(full.mean()), model.spread, model.members, len(full)) < race.tolerance
        }

    def keep_vectors(self, rs: list[Allocation]) -> None:
        """Remember the full-set per-sample fitness of those of `rs` scored exactly on the full set (with the elite
        floor, those at or above it; the evaluator has them all, so nothing runs), the surrogate's data."""
        race = self.params.racing
        if not isinstance(race, Sequential) or not race.surrogate:
            return
        exact = [r for r in dict.fromkeys(rs) if r not in self.vectors and (self.floor is None or self.memo[r] >= self.floor)]
        if exact:
            self.vectors.update(zip(exact, self.samples(exact, None)))
            for r in list(self.vectors)[: max(0, len(self.vectors) - SURROGATE_WINDOW)]:
                del self.vectors[r]

    def surrogate(self) -> Additive | None:
        """The per-sample additive model of the members kept (`evoesap.method.surrogate`), None before any or off."""
        race = self.params.racing
        if not self.vectors or not isinstance(race, Sequential) or not race.surrogate:
            return None
        caps = [n - k for n, k in zip(self.params.num_experts, self.params.top_k)]
        return Additive.fit(caps, list(self.vectors), np.stack(list(self.vectors.values())))

    def race(self, gen: int, pop: list[Allocation]) -> dict[Allocation, tuple[int, float]]:
        """Score the new members over the racing levels; survivors get full-set fitness (memo).
        Returns the level reached and the score there of those stopped early."""
        racing = self.params.racing
        assert racing is not None
        if isinstance(racing, Sequential):
            return self.race_sequential(gen, pop)
        entrants = [r for r in dict.fromkeys(pop) if r not in self.memo]
        stopped: dict[Allocation, tuple[int, float]] = {}
        for level in range(len(racing.fractions)):
            if not entrants:
                break
            scores = self.scored(entrants, level, gen)
            self.subset_calls += len(entrants)
            stopped.update((r, (level, v)) for r, v in zip(entrants, scores))
            keep = racing.survivors(len(entrants), self.params.elites if gen == 0 else 1)
            entrants = [entrants[i] for i in _top(scores, keep)]
        self.score_full_set(entrants, gen)
        for r in entrants:
            stopped.pop(r, None)
        return stopped

    def finish(self, gen: int, pop: list[Allocation]) -> None:
        """Score generation `gen`, record it, keep the best, checkpoint it and report it."""
        if self.elite_floor and gen > 0:  # the population starts with the parents (`_next_population`)
            self.floor = min(self.memo[r] for r in pop[: self.params.elites])
        stopped = self.race(gen, pop) if self.params.racing is not None else {}
        self.score_full_set([r for r in pop if r not in stopped], gen)
        fits = [-math.inf if r in stopped else self.memo[r] for r in pop]  # stopped early: never elite
        top = set(_top(fits, self.params.elites))
        self.history.extend(
            HistoryRecord(gen, i, r, f, i in top)
            if r not in stopped
            else HistoryRecord(gen, i, r, stopped[r][1], False, stopped[r][0])
            for i, (r, f) in enumerate(zip(pop, fits))
        )
        for r, f in zip(pop, fits):
            if r not in stopped and (self.best is None or f > self.best_fitness):
                self.best, self.best_fitness = r, f
        if self.checkpoint is not None:
            _write_checkpoint(
                self.checkpoint,
                self.params,
                gen,
                pop,
                self.memo,
                self.history,
                self.best,
                self.best_fitness,
                self.rng,
                self.subset_calls,
                self.vectors,
            )
        self.report(gen, pop)

    def restore(self, saved: dict[str, Any]) -> tuple[int, list[Allocation]]:
        """Continue from a checkpoint: its generation and population."""
        self.memo.update(saved["memo"])
        self.history.extend(saved["history"])
        self.best, self.best_fitness = saved["best"], saved["best_fitness"]
        self.subset_calls = saved["subset_calls"]
        self.vectors.update(saved["vectors"])
        self.rng.bit_generator.state = saved["rng"]
        self.report(saved["generation"], saved["population"])
        return saved["generation"], saved["population"]

    def parents(self, pop: list[Allocation]) -> list[Allocation]:
        return [pop[i] for i in _top([self.memo.get(r, -math.inf) for r in pop], self.params.elites)]

    def report(self, gen: int, pop: list[Allocation]) -> None:
        mean = float(np.mean([self.memo[r] for r in pop if r in self.memo]))
        log.info("generation %d: best %.6g, mean %.6g, %d evaluations", gen, self.best_fitness, mean, len(self.memo))
        if self.on_generation is not None:
            self.on_generation(gen, self.best, self.best_fitness, mean, len(self.memo))

    def result(self) -> SearchResult:
        assert self.best is not None
        return SearchResult(self.best, self.best_fitness, tuple(self.history), len(self.memo), self.subset_calls)


def _one_by_one(fitness: Any, subset_fitness: SubsetFitness | None, floored: bool = False) -> ScoreBatch:
    """A batch scorer that calls `fitness` / `subset_fitness` for each allocation in turn (`floored`: with the floor)."""

    def score_batch(rs: Sequence[Allocation], level: int | None, gen: int, floor: float | None = None) -> list[float]:
        if level is None:
            return [float(fitness(r, floor) if floored else fitness(r)) for r in rs]
        assert subset_fitness is not None
        return [float(subset_fitness(r, level, gen)) for r in rs]

    return score_batch


def _samples_one_by_one(sample_fitness: SampleFitness) -> SampleBatch:
    """A per-sample batch scorer that calls `sample_fitness` for each allocation in turn."""

    def sample_batch(rs: Sequence[Allocation], count: int | None) -> list[np.ndarray]:
        return [np.asarray(sample_fitness(r, count), dtype=np.float64) for r in rs]

    return sample_batch


def _validate(
    num_experts: Sequence[int],
    top_k: Sequence[int],
    budget: int,
    population: int,
    elites: int,
    generations: int,
    max_transfer: int,
    max_steps: int,
    granularity: int,
    seed: int,
    init: Sequence[Sequence[int]] | None,
) -> _Params:
    """Every parameter checked before the first fitness call, so a bad run fails in seconds, not hours."""
    allocation.unit_caps(num_experts, top_k, granularity)
    n = tuple(allocation.as_int("num_experts", v) for v in num_experts)
    k = tuple(allocation.as_int("top_k", v) for v in top_k)
    g = allocation.as_int("granularity", granularity)
    b = allocation.check_budget(n, k, budget, g)
    minimum = {"population": 2, "elites": 1, "generations": 0, "max_transfer": 1, "max_steps": 1, "seed": 0}
    given = {
        "population": population,
        "elites": elites,
        "generations": generations,
        "max_transfer": max_transfer,
        "max_steps": max_steps,
        "seed": seed,
    }
    ints = {name: allocation.as_int(name, value) for name, value in given.items()}
    for name, value in ints.items():
        if value < minimum[name]:
            raise ConfigError(f"{name} must be >= {minimum[name]}, got {value}")
    if ints["elites"] >= ints["population"]:
        raise ConfigError(
            f"elites {ints['elites']} must be smaller than population {ints['population']}, or no offspring are ever made"
        )
    seeds = []
    for i, r in enumerate(init or ()):
        try:
            seeds.append(allocation.check(r, n, k, b, g))
        except ConfigError as exc:
            raise ConfigError(f"init[{i}]: {exc}") from None
    return _Params(n, k, b, granularity=g, init=tuple(seeds), **ints)


def searchable(num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> allocation.FeasibleSet:
    """The feasible allocations of a budget, refused when there is nothing to search (one allocation or none)."""
    space = allocation.FeasibleSet(num_experts, top_k, budget, granularity)
    if space.size < 2:
        raise ConfigError(
            f"budget {budget} admits a single allocation {space.unrank(0)}: there is nothing to search; use it directly"
        )
    return space


def _seeds(params: _Params) -> list[Allocation]:
    patterns = seed_patterns(params.num_experts, params.top_k, params.budget, params.granularity)
    first = list(dict.fromkeys([patterns.pop("uniform"), *params.init]))
    if len(first) > params.population:
        raise ConfigError(
            f"population {params.population} cannot hold the uniform seed and {len(params.init)} init seeds: "
            "raise the population or pass fewer seeds"
        )
    return list(dict.fromkeys([*first, *patterns.values()]))[: params.population]


def _initial_population(
    seeds: list[Allocation], space: allocation.FeasibleSet, size: int, rng: np.random.Generator
) -> list[Allocation]:
    """Seeds, then allocations drawn uniformly from the feasible set without replacement (by rank)."""
    pop = list(seeds)
    taken = sorted(space.rank(r) for r in pop)
    if space.size < size:
        log.warning(
            "population %d exceeds the %d feasible allocations: the search is exhaustive and the population repeats allocations",
            size,
            space.size,
        )
    while len(pop) < size:
        if len(taken) == space.size:
            pop.append(space.unrank(_randbelow(rng, space.size)))
            continue
        index = _randbelow(rng, space.size - len(taken))
        for t in taken:  # the index-th rank not yet taken
            if t > index:
                break
            index += 1
        bisect.insort(taken, index)
        pop.append(space.unrank(index))
    return pop


def _randbelow(rng: np.random.Generator, n: int) -> int:
    """Uniform in [0, n) for any Python int n, since feasible-set sizes overflow int64."""
    if n <= 2**62:
        return int(rng.integers(n))
    bits = n.bit_length()
    words = (bits + 31) // 32
    while True:
        value = 0
        for word in rng.integers(0, 2**32, size=words, dtype=np.uint64):
            value = (value << 32) | int(word)
        value >>= 32 * words - bits
        if value < n:
            return value


def _top(fits: list[float], m: int) -> list[int]:
    """Slots of the m fittest, best first; ties go to the earlier slot."""
    return sorted(range(len(fits)), key=lambda i: (-fits[i], i))[:m]


def _next_population(
    parents: list[Allocation],
    params: _Params,
    space: allocation.FeasibleSet,
    caps: np.ndarray,
    sizes: np.ndarray,
    rng: np.random.Generator,
) -> list[Allocation]:
    pop = list(parents)
    members = set(pop)
    for _ in range(params.population - len(parents)):
        for _ in range(_REDRAWS):
            child = _mutate(parents[int(rng.integers(len(parents)))], params, caps, sizes, rng)
            if child not in members or len(members) >= space.size:
                break
        pop.append(child)
        members.add(child)
    return pop


def _mutate(parent: Allocation, params: _Params, caps: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> Allocation:
    g = params.granularity
    tau = min(int(rng.integers(1, params.max_steps + 1)), int(rng.integers(1, params.max_steps + 1)))
    x = np.asarray(parent) // g  # [L] int, in units of granularity
    n_layers = len(x)
    for _ in range(tau):
        gains = x[:, None] + sizes[None, :] <= caps[:, None]  # [L, D] layer a can remove d more units
        losses = x[:, None] >= sizes[None, :]  # [L, D] layer b can give d units back
        feasible = gains[:, None, :] & losses[None, :, :]  # [a, b, D]
        feasible[np.arange(n_layers), np.arange(n_layers), :] = False
        moves = np.flatnonzero(feasible)
        a, b, d = np.unravel_index(moves[rng.integers(len(moves))], feasible.shape)
        x = x.copy()
        x[a] += sizes[d]
        x[b] -= sizes[d]
    return tuple(int(v) * g for v in x)


def _jsonable(params: _Params) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(params)))


def _write_checkpoint(
    uri: str,
    params: _Params,
    generation: int,
    pop: list[Allocation],
    memo: dict[Allocation, float],
    history: list[HistoryRecord],
    best: Allocation | None,
    best_fitness: float,
    rng: np.random.Generator,
    subset_calls: int,
    vectors: dict[Allocation, np.ndarray] | None = None,
) -> None:
    payload = {
        "format": _FORMAT,
        "params": _jsonable(params),
        "generation": generation,
        "population": [list(r) for r in pop],
        "memo": [[list(r), f] for r, f in memo.items()],
        "history": [
            [h.generation, h.candidate, list(h.allocation), h.fitness, h.elite] + ([] if h.level is None else [h.level])
            for h in history
        ],
        "best": list(best) if best is not None else None,
        "best_fitness": best_fitness,
        "rng": rng.bit_generator.state,
        "subset_calls": subset_calls,
        "vectors": [[list(r), v.tolist()] for r, v in (vectors or {}).items()],
    }
    data = json.dumps(payload).encode("utf-8")
    fs, path = artifacts.split(uri)
    if not is_checkpoint_place(uri):  # appeared since the search started: not ours to replace
        raise ArtifactError(
            f"{artifacts.redact(uri)} is a file that is not a search checkpoint: it was left as it is; move it away "
            "and re-run the search"
        )
    if artifacts.is_local(uri):
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        partial = f"{path}.partial-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(partial, data)
        fs.mv(partial, path)  # a rename: readers see the old checkpoint or the new one, never half
    else:
        fs.pipe_file(path, data)  # one object-store put is atomic by itself


def is_checkpoint_place(uri: str) -> bool:
    """Whether `uri` is free or holds a search checkpoint: a file of that name that is not one (a user's own) is
    never overwritten or removed. Read from its first bytes, which `_write_checkpoint` always starts with."""
    fs, path = artifacts.split(uri)
    try:
        if fs.info(path)["type"] != "file":
            return False
        with fs.open(path, "rb") as f:
            head = f.read(len(_HEAD))
    except FileNotFoundError:
        return True
    return head == _HEAD


def remove_checkpoint(uri: str) -> None:
    """Remove a finished search's checkpoint, only if it is one."""
    if artifacts.exists(uri) and is_checkpoint_place(uri):
        fs, path = artifacts.split(uri)
        fs.rm(path)


def _read_checkpoint(uri: str, params: _Params) -> dict[str, Any]:
    try:
        payload = json.loads(artifacts.read_bytes(uri).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ArtifactError(f"{artifacts.redact(uri)} is not a search checkpoint ({exc}); delete it to start afresh") from None
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ArtifactError(f"{artifacts.redact(uri)} is not a {_FORMAT} checkpoint; delete it to start afresh")
    now, then = _jsonable(params), payload["params"]
    differ = [
        f"{key}: checkpoint {then.get(key)!r}, now {now[key]!r}"
        for key in now
        if key != "generations" and then.get(key) != now[key]
    ]
    if differ:
        raise ConfigError(
            f"cannot resume from {artifacts.redact(uri)}: parameters differ ({'; '.join(differ)}); "
            "resume with the same parameters or start afresh without resume"
        )
    if payload["generation"] > params.generations:
        raise ConfigError(
            f"checkpoint {artifacts.redact(uri)} already has {payload['generation']} generations, more than "
            f"generations={params.generations}: resume with at least that many"
        )
    return {
        "generation": payload["generation"],
        "population": [tuple(r) for r in payload["population"]],
        "memo": {tuple(r): float(f) for r, f in payload["memo"]},
        "history": [HistoryRecord(g, c, tuple(a), float(f), bool(e), *level) for g, c, a, f, e, *level in payload["history"]],
        "best": tuple(payload["best"]),
        "best_fitness": float(payload["best_fitness"]),
        "rng": payload["rng"],
        "subset_calls": int(payload.get("subset_calls", 0)),
        "vectors": {tuple(r): np.asarray(v, dtype=np.float64) for r, v in payload.get("vectors", [])},
    }
