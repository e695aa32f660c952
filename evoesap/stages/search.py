"""Stage `search`: the level-switch evolutionary search over per-layer allocations, ESAP as fitness.

The best allocation and uniform are scored afterwards on samples the search never saw, because a
small search set saturates and a search can overfit it: a separate held-out teacher cache when one is
given (`heldout_cache`; the search then uses every sample of `cache`), else a share of the cached
samples (`heldout_fraction`) kept out of the search. When the searched allocation does not beat
uniform there beyond noise (two standard errors of the paired per-sample difference) the stage says
so loudly and, with `fallback_to_uniform`, returns uniform instead.

Cost: prefix reuse (on by default, exact) starts each candidate's forward at the MoE block of its
first MoE layer that differs from a cached allocation's; racing (opt-in) scores new candidates on
growing sample subsets first (`evoesap.method.racing`). The manifest (`run.cost`) records the search's cost in
full-forward equivalents: the work of the search (active multiply-accumulates, `evoesap.scoring.forward`)
divided by that of one plain forward over the search samples, in all and per candidate (distinct
allocations scored on any subset), with the prefix cache's budget and peak.

Group-limited routing (DeepSeek-V3 with n_group > 1) constrains removal per group: the search runs in
the model's `moe.pruning_space` (granularity raised to a multiple of n_group, per-layer floors) over
group-balanced orders (`importance.model_orders`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.machine import bounds, runtime
from evoesap.method import allocation as alloc
from evoesap.method.racing import SCREENED, Racing, Sequential
from evoesap.params import PlacementParams, check_declared, keyed, param
from evoesap.progress import progress
from evoesap.scoring.criteria import Criterion
from evoesap.store import artifacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SearchParams(PlacementParams):
    """Search settings; defaults are the paper's (seed 42, P 32, m 4, Delta_max 4, tau_max 3)."""

    criterion: Criterion = param("reap", "Importance criterion whose within-layer pruning order the allocation applies.")
    sparsity: float = param(0.25, "Global share of routed experts removed.", gt=0, lt=1)
    population: int = param(32, "Candidate allocations per generation (P).", ge=2)
    elites: int = param(4, "Fittest allocations kept each generation (m), fewer than population.", ge=1)
    generations: int = param(50, "Generations of the evolutionary search.", ge=0)
    max_transfer: int = param(4, "Largest level-switch transfer, in multiples of granularity (Delta_max).", ge=1)
    max_steps: int = param(3, "tau_max: composed level-switch steps per offspring.", ge=1)
    granularity: int = param(1, "Per-layer counts and transfers in multiples of this (2: the paper's even transfers).", ge=1)
    seed: int = param(42, "Seed of the search.")
    metric: Literal["esap", "sap", "kl", "nll"] = param("esap", "Fitness (scoring.metrics.METRICS).")
    heldout_fraction: float = param(
        0.25,
        "Share of the cached samples kept out of the search for the held-out check (when there is no heldout_cache).",
        ge=0,
        lt=1,
    )
    fallback_to_uniform: bool = param(False, "Return uniform when the searched allocation does not generalise.")
    warm_start: str | None = param(
        None,
        "Removal counts per MoE layer (comma-separated) seeding generation 0 right after uniform, e.g. a neighbouring "
        "sparsity's allocation rescaled to this budget (evoesap.planning.target does so).",
    )
    resume: bool = param(False, "Continue an interrupted search from its checkpoint beside the output.")
    batch_size: int = param(8, "Sequences per forward.")
    racing: bool = param(
        False, "Race new candidates over growing sample subsets first (successive halving); elites are ranked on the full set."
    )
    racing_mode: Literal["schedule", "statistical"] = param(
        "statistical",
        "How racing stops candidates: statistical (a candidate stops once its paired per-sample differences against the "
        "elite boundary member say, at error rate racing_delta, that it cannot enter the elite; "
        "evoesap.method.racing.Sequential) or schedule (successive halving by racing_schedule).",
    )
    racing_delta: float = param(
        0.05, "Statistical racing: the declared chance of wrongly stopping a candidate that could enter the elite.", gt=0, lt=1
    )
    racing_tolerance: float = param(
        0.0,
        "Statistical racing: stop a candidate that cannot beat the elite boundary member by this much fitness or more "
        "(an indifference zone, in the metric's units; 0: only those below it). A candidate better by more is wrongly "
        "stopped at most at racing_delta; one within the tolerance may be stopped, so the search may end below exact "
        "search (at 1e-4 on the OLMoE-1B-7B shape, 4-6e-5 below; docs/results/speed.md, #racing-tolerance).",
        ge=0,
    )
    racing_screen: bool = param(
        False,
        "Statistical racing: stop a candidate before any forward when the additive model predicts it, with room for its "
        "leave-one-out error, below the elite (opt-in: evoesap.method.racing.Sequential says when that bound fails).",
    )
    racing_schedule: str = param("0.0625,0.25:0.25", "Subset shares of the racing levels, then the share that advances.")
    racing_min_samples: int = param(
        4, "Least samples any racing level scores (statistical racing: its first checkpoint, at least 2).", ge=1
    )
    racing_min_positions: int = param(
        256, "Least scored positions any racing level scores (evoesap.method.racing says why).", ge=1
    )
    prefix_reuse: bool = param(True, "Start candidates from cached hidden states of the fittest allocations (exact).")
    prefix_cache_bytes: int | None = param(
        None,
        "Budget of the prefix cache on the model's device; unset: states of 32 x (elites + 1) allocations, at "
        "most half of the free memory.",
        ge=0,
    )
    workers: int = param(
        1,
        "Processes scoring each generation's candidates (torchrun underneath), each with a model replica (evoesap.method.distributed).",
        keyed=False,
        ge=1,
    )  # the same artifact on any number
    gpus_per_worker: int = param(
        1,
        "GPUs each worker spreads its model replica over (with device_map: auto); workers x this many in all.",
        keyed=False,
        ge=1,
    )

    def __post_init__(self) -> None:
        check_declared(self)  # choices and ranges first: the rules below compare fields that are in range
        if self.elites >= self.population:
            raise ConfigError(f"elites ({self.elites}) must be fewer than population ({self.population})")
        if self.gpus_per_worker > 1 and self.device_map is None:
            raise ConfigError(
                f"gpus_per_worker={self.gpus_per_worker} spreads each worker's replica over its GPUs: set device_map: auto"
            )
        if self.workers > 1 and self.device_map is not None and self.gpus_per_worker == 1:
            raise ConfigError(
                f"workers={self.workers} gives each worker its own GPU: drop device_map {self.device_map!r}, or set "
                f"gpus_per_worker to spread each worker's replica over several GPUs"
            )
        if self.workers > 1 and ":" in self.device:
            raise ConfigError(
                f"workers={self.workers} puts each worker on the GPU of its local rank: use device "
                f"'auto' or 'cuda', not {self.device!r}"
            )
        if self.racing:
            self.schedule()
        if self.warm_start is not None:
            self.warm_start_counts()
        super().__post_init__()

    @property
    def placement(self) -> dict[str, Any]:
        """A worker's replica spreads over its own group of GPUs (`evoesap.method.distributed.worker_gpus`)."""
        from evoesap.method import distributed

        gpus = distributed.worker_gpus(self.gpus_per_worker) if self.gpus_per_worker > 1 else None
        return {**super().placement, "gpus": gpus}

    def warm_start_counts(self) -> tuple[int, ...]:
        """`warm_start` as integers (its feasibility for the budget is the search's to check)."""
        try:
            return tuple(int(v) for v in str(self.warm_start).split(","))
        except ValueError:
            raise ConfigError(
                f"warm_start must be comma-separated integers, one per MoE layer, got {self.warm_start!r}"
            ) from None

    def schedule(self) -> Racing | Sequential | None:
        """The racing schedule (statistical racing: its test), or None without racing."""
        if not self.racing:
            return None
        if self.racing_mode == "statistical":
            return Sequential(
                self.racing_delta, self.racing_min_samples, screen=self.racing_screen, tolerance=self.racing_tolerance
            )
        return Racing.parse(self.racing_schedule, self.racing_min_samples, self.racing_min_positions)


def split_samples(num_samples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(search, held-out) sample indices: a seeded share held out, at least one sample left for the search."""
    held = int(round(num_samples * fraction)) if num_samples > 1 else 0
    held = min(held, num_samples - 1)
    order = np.random.default_rng(seed).permutation(num_samples)
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def generalisation(searched: np.ndarray, uniform: np.ndarray) -> records.HeldoutCheck:
    """Paired comparison on held-out samples (values oriented so that higher is better)."""
    diff = searched - uniform
    n = len(diff)
    stderr = float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    mean = float(diff.mean()) if n else float("nan")
    beats = n > 1 and mean > 2 * stderr
    return records.HeldoutCheck(
        samples=n,
        searched=float(searched.mean()) if n else None,
        uniform=float(uniform.mean()) if n else None,
        difference=mean if n else None,
        stderr=stderr if n > 1 else None,
        beats_uniform=bool(beats),
        searched_stderr=float(searched.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
    )


def _checkpoint_uri(out_uri: str) -> str:
    return f"{out_uri.rstrip('/')}.checkpoint.json"


def _history_frame(history: Any) -> pd.DataFrame:
    """One row per population slot; `fitness` is on the full search set. With racing, a candidate stopped
    early has NaN there and its subset score in `race_fitness` at `race_level` (columns only then); one that
    statistical racing's screen stopped has race_level -1 and the model's predicted fitness there."""
    frame = pd.DataFrame(
        {
            "generation": [h.generation for h in history],
            "candidate": [h.candidate for h in history],
            "allocation": [list(h.allocation) for h in history],
            "fitness": [h.fitness if h.level is None else float("nan") for h in history],
            "elite": [h.elite for h in history],
        }
    )
    if any(h.level is not None for h in history):
        frame["race_level"] = pd.array([h.level for h in history], dtype="Int64")
        frame["race_fitness"] = [h.fitness if h.level is not None else float("nan") for h in history]
    return frame


def search_work(
    totals: dict[str, int], unit: int, result: Any, scoring: Scoring, params: SearchParams, resumed: bool = False
) -> records.SearchWork:
    """The search's work in full-forward equivalents (hardware-independent), before any held-out scoring: the one
    definition of FFE, for allocation.json and the manifest's `run.cost` alike.

    A resumed search counts only the work of this run; candidates are distinct allocations scored on
    the full set or on a racing subset, or stopped by statistical racing's screen before any forward. `totals` sums the workers' `Scoring.totals`; `unit` is one plain
    forward over the search samples (`CandidateEvaluator.full_forward_work`).
    """
    raced_only = len(
        {h.allocation for h in result.history if h.level is not None} - {h.allocation for h in result.history if h.level is None}
    )
    candidates = result.evaluations + raced_only
    total = totals["work"] / unit
    stops = {(h.generation, h.allocation, h.level) for h in result.history if h.level is not None}
    screened = {stop for stop in stops if stop[2] == SCREENED}
    stopped_at: dict[int, int] = {}
    for generation, _, level in stops - screened:
        count = scoring.samples_at(level, generation)
        stopped_at[count] = stopped_at.get(count, 0) + 1
    statistical = params.racing and params.racing_mode == "statistical"
    return records.SearchWork(
        full_forward_equivalents=total,
        full_forward_equivalents_per_candidate=total / max(1, candidates),
        candidates=candidates,
        full_set_evaluations=result.evaluations,
        stopped_early=len(stops - screened),
        stopped_at=dict(sorted(stopped_at.items())),
        racing=params.racing_mode if params.racing else "off",
        racing_delta=params.racing_delta if statistical else None,
        racing_tolerance=params.racing_tolerance if statistical else None,
        resumed=resumed,
        screened=len(screened),
    )


def _cost(totals: dict[str, int], work: records.SearchWork, result: Any) -> dict[str, Any]:
    """The manifest's `run.cost`: `work` (`search_work`) and how it ran (the prefix cache's budget and peak are the
    largest worker's)."""
    return {
        **work.to_json(),
        "subset_evaluations": result.subset_evaluations,
        "samples_run": totals["forwards"],
        "prefix_cache_budget_bytes": totals["prefix_budget"],
        "prefix_cache_peak_bytes": totals["prefix_peak"],
        "workers": totals["workers"],
    }


def _plots(
    staging: Path, params: SearchParams, history: pd.DataFrame, allocations: dict[str, list[int]], n: tuple[int, ...]
) -> None:
    import matplotlib.pyplot as plt

    from evoesap.reporting import report

    label = f"{params.criterion} {params.sparsity:.0%}"
    fig = report.search_curve_figure({label: history})
    fig.savefig(staging / "search_curve.png", dpi=120)
    plt.close(fig)
    fig = report.density_figure({name: (r, n) for name, r in allocations.items()}, title=label)
    fig.savefig(staging / "density.png", dpi=120)
    plt.close(fig)


@dataclasses.dataclass
class Scoring:
    """What every scorer of one search holds (the one process, or the coordinator and each worker): the
    model's evaluator, the pruning orders and the split of the cached samples."""

    orders: Any
    top_k: tuple[int, ...]  # the model's routing top-k per MoE layer
    num_experts: tuple[int, ...]
    min_kept: tuple[int, ...]
    granularity: int
    budget: int
    uniform: list[int]
    search_ids: list[int]
    heldout_ids: list[int]
    search_positions: list[int]
    schedule: Racing | Sequential | None
    seed: int
    evaluator: Any  # CandidateEvaluator over the search cache
    judge: Any  # CandidateEvaluator for the held-out check (the evaluator itself without a held-out cache)

    def __post_init__(self) -> None:
        # statistical racing's sample order, once per search: cache indices of the search samples
        self.race_order: list[int] = []
        if isinstance(self.schedule, Sequential):
            self.race_order = [self.search_ids[i] for i in self.schedule.order(self.search_positions, self.seed)]

    def score(self, r: tuple[int, ...], level: int | None, generation: int) -> float:
        """Fitness of `r` on the full search set (level None) or on that racing level's subset."""
        samples = self.search_ids
        if level is not None:
            assert isinstance(self.schedule, Racing)
            samples = self.schedule.subset(self.search_ids, self.search_positions, level, self.seed, generation)
        return self.evaluator.score(alloc.pruned_sets(r, self.orders), samples=samples)

    def score_batch(self, rs: Any, level: int | None, generation: int) -> list[float]:
        return [self.score(tuple(r), level, generation) for r in rs]

    def samples(self, r: tuple[int, ...], count: int | None) -> np.ndarray:
        """Per-sample fitness of `r` (higher is better) on the race order's first `count` samples (None: all)."""
        samples = self.race_order[:count] if count is not None else self.race_order
        values = self.evaluator.sample_values(alloc.pruned_sets(r, self.orders), samples=samples)
        return self.evaluator.metric.sign * values.double().numpy()

    def sample_batch(self, rs: Any, count: int | None) -> list[np.ndarray]:
        return [self.samples(tuple(r), count) for r in rs]

    def samples_at(self, level: int, generation: int) -> int:
        """Samples a candidate stopped at racing level `level` of `generation` was scored on."""
        if isinstance(self.schedule, Sequential):
            return self.schedule.samples_at(level, len(self.search_ids))
        assert self.schedule is not None
        return len(self.schedule.subset(self.search_ids, self.search_positions, level, self.seed, generation))

    def totals(self) -> dict[str, int]:
        """This process's share of the search's cost (`_cost`)."""
        prefix = self.evaluator.prefix
        return {
            "work": self.evaluator.work,
            "forwards": self.evaluator.forwards,
            "workers": 1,
            "prefix_budget": prefix.budget if prefix is not None else 0,
            "prefix_peak": prefix.peak_bytes if prefix is not None else 0,
        }


def prepare_scoring(
    model: str, scores: str, cache: str, params: SearchParams, heldout_cache: str | None = None, judge: bool = True
) -> Scoring:
    """Load the model and the teacher cache(s) and build the search's evaluator; `judge=False` (a worker)
    skips the held-out evaluator."""
    from evoesap import moe
    from evoesap.scoring.evaluator import CandidateEvaluator
    from evoesap.scoring.importance import model_orders, read_scores
    from evoesap.scoring.teacher import load_cache

    spec = runtime.inspect_checkpoint(model)
    orders = model_orders(read_scores(scores), params.criterion, spec)
    space = moe.pruning_space(spec, params.granularity)
    n, kept, granularity = space.num_experts, space.min_kept, space.granularity
    budget = alloc.budget(params.sparsity, n, kept, granularity)
    uniform = list(alloc.uniform(n, kept, budget, granularity))
    bounds.check_search(params, n, alloc.FeasibleSet(n, kept, budget, granularity).size)

    teacher = load_cache(cache)
    heldout_teacher = load_cache(heldout_cache) if heldout_cache and judge else None
    if not heldout_cache:
        search_ids, heldout_ids = split_samples(teacher.num_samples, params.heldout_fraction, params.seed)
    else:
        search_ids = list(range(teacher.num_samples))
        heldout_ids = list(range(heldout_teacher.num_samples)) if heldout_teacher is not None else []
    schedule = params.schedule()
    scored = (teacher.offsets[1:] - teacher.offsets[:-1]).tolist()  # [S] scored positions per sample
    search_positions = [scored[i] for i in search_ids]
    if schedule is not None:
        schedule.check(search_positions)  # before the model loads
    loaded = runtime.load_model(model, params.model_dtype, **params.placement)
    evaluator = CandidateEvaluator(
        loaded,
        teacher,
        metric=params.metric,
        batch_size=params.batch_size,
        prefix_cache_bytes=params.prefix_cache_bytes if params.prefix_reuse else 0,
        keep=params.elites,
    )
    held = (
        evaluator
        if heldout_teacher is None
        else CandidateEvaluator(  # refuses another model's cache now
            loaded,
            heldout_teacher,
            metric=params.metric,
            batch_size=params.batch_size,
            weights_hash=teacher.meta.model_hash,
            cache_device_bytes=0,  # the held-out cache stays on the host: it must not take the search's device memory
        )
    )
    del teacher, heldout_teacher  # on a GPU the evaluator holds the device copy; the host copy goes now
    return Scoring(
        orders,
        tuple(spec.top_k),
        n,
        kept,
        granularity,
        budget,
        uniform,
        search_ids,
        heldout_ids,
        search_positions,
        schedule,
        params.seed,
        evaluator,
        held,
    )


def _allocation_record(
    params: SearchParams, scoring: Scoring, result: Any, best: list[int], finals: dict[tuple[int, ...], float]
) -> records.AllocationRecord:
    """allocation.json: the chosen allocation (the searched one, or uniform when it does not generalise and
    `fallback_to_uniform` is set), both fitnesses, the held-out check and its warning."""
    orders, n, uniform = scoring.orders, scoring.num_experts, scoring.uniform
    sign = scoring.evaluator.metric.sign
    check = None
    warnings: list[str] = []  # also in allocation.json, so the report shows what the log said
    if scoring.heldout_ids:
        judge = scoring.judge
        check = generalisation(
            sign * judge.sample_values(alloc.pruned_sets(best, orders), samples=scoring.heldout_ids).numpy(),
            sign * judge.sample_values(alloc.pruned_sets(uniform, orders), samples=scoring.heldout_ids).numpy(),
        )
        if not check.beats_uniform:
            warnings.append(check.warning(params.metric, params.fallback_to_uniform))
            headline, detail = warnings[-1].split(": ", 1)
            log.warning("%s: %s", headline.upper(), detail)
    chosen = uniform if (check and not check.beats_uniform and params.fallback_to_uniform) else best
    return records.AllocationRecord(
        criterion=params.criterion,
        sparsity=params.sparsity,
        metric=params.metric,
        budget=scoring.budget,
        granularity=scoring.granularity,
        num_experts=tuple(n),
        top_k=scoring.top_k,
        min_kept=tuple(scoring.min_kept),
        removal_counts=tuple(chosen),
        pruned={layer: tuple(ids) for layer, ids in alloc.pruned_sets(chosen, orders).items()},
        fitness=finals[tuple(chosen)],
        searched=records.Candidate(tuple(best), result.best_fitness),
        uniform=records.Candidate(tuple(uniform), finals[tuple(uniform)]),
        fallback_applied=chosen is uniform and best != uniform,
        heldout=check,
        warnings=tuple(warnings),
        evaluations=result.evaluations,
        search_samples=len(scoring.search_ids),
        heldout_samples=len(scoring.heldout_ids),
    )


def _check_processes(params: SearchParams) -> None:
    """Refuse more workers, or GPUs, than this machine has, before anything is sized or started."""
    if runtime.resolve_device(params.device).startswith("cuda"):  # the groups side by side
        runtime.check_gpu_count(params.workers * params.gpus_per_worker, "workers x gpus_per_worker")
        return
    runtime.check_cpu_count(params.workers, "workers")
    if params.gpus_per_worker > 1:
        raise ConfigError(
            f"gpus_per_worker={params.gpus_per_worker} spreads each worker's replica over GPUs, but the search runs on "
            f"the CPU (device {params.device!r}): leave it at 1"
        )


def run_search(
    model: str, scores: str, cache: str, params: SearchParams, out_uri: str, heldout_cache: str | None = None
) -> artifacts.Manifest:
    """Search the allocation for one criterion and sparsity; publish allocation.json, history and plots.

    `heldout_cache`: a teacher cache of other samples for the generalisation check (see the module docstring).
    With `workers > 1` it launches that many processes (`evoesap.method.distributed`); the coordinator among them
    runs the search and publishes the same artifact.
    """
    from evoesap.method import distributed, search

    inputs = {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout_cache}
    seen = artifacts.preflight(out_uri, "search", inputs)
    if not search.is_checkpoint_place(_checkpoint_uri(out_uri)):
        raise ConfigError(
            f"{artifacts.redact(_checkpoint_uri(out_uri))} is a file that is not a search checkpoint: the search keeps "
            "its checkpoint under that name beside --out; move the file or choose another --out (nothing was changed)"
        )
    if not distributed.joined():
        _check_processes(params)
    bounds.check_stage(params, model)
    for uri in (cache, heldout_cache):  # inputs must be finished artifacts before anything loads
        if uri:
            artifacts.read_manifest(uri, "cache-logits")
    if params.workers > 1 and not distributed.joined():
        return distributed.launch("evoesap.stages.search_workers", inputs, params, out_uri, _checkpoint_uri(out_uri))
    scoring = prepare_scoring(model, scores, cache, params, heldout_cache)
    n, uniform = scoring.num_experts, scoring.uniform

    bar = progress(total=params.generations + 1, desc=f"search {params.criterion} {params.sparsity:.0%}", unit="gen")

    resumed = params.resume and artifacts.exists(_checkpoint_uri(out_uri))

    def on_generation(gen: int, best: Any, best_fitness: float, mean_fitness: float, evaluations: int) -> None:
        bar.n = gen + 1
        bar.set_postfix(best=f"{best_fitness:.5f}", mean=f"{mean_fitness:.5f}", evals=evaluations)  # method.search logs it

    with distributed.scorer(scoring) as pool:
        try:
            result = search.level_switch_search(
                None,
                n,
                scoring.min_kept,
                scoring.budget,
                population=params.population,
                elites=params.elites,
                generations=params.generations,
                max_transfer=params.max_transfer,
                max_steps=params.max_steps,
                granularity=scoring.granularity,
                seed=params.seed,
                init=[params.warm_start_counts()] if params.warm_start else None,
                checkpoint=_checkpoint_uri(out_uri),
                resume=params.resume,
                on_generation=on_generation,
                racing=scoring.schedule,
                score_batch=pool.score_batch,
                sample_batch=pool.sample_batch if isinstance(scoring.schedule, Sequential) else None,
            )
        finally:
            bar.close()
        best = [int(x) for x in result.best]
        # full-set fitness of the searched allocation and uniform, scored where their samples are memoised
        wanted = list(dict.fromkeys([tuple(best), tuple(uniform)]))
        finals = dict(zip(wanted, pool.score_batch(wanted, None, params.generations)))
        totals = pool.totals()
        work = search_work(totals, scoring.evaluator.full_forward_work(scoring.search_ids), result, scoring, params, resumed)
        cost = _cost(totals, work, result)

    record = _allocation_record(params, scoring, result, best, finals)
    history = _history_frame(result.history)
    with artifacts.stage_output(out_uri, "search", keyed(params), inputs, seen, run={"cost": cost}) as staging:
        records.write(staging, record)
        history.to_parquet(staging / records.HISTORY_FILE, index=False)
        _plots(staging, params, history, {"uniform": uniform, "searched": best}, n)
    search.remove_checkpoint(_checkpoint_uri(out_uri))
    return artifacts.read_manifest(out_uri)
