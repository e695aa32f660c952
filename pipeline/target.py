"""A configuration's `target:` run here: calibrate and the teacher caches once, then per criterion the bracketing of
`evoesap.planning.target`, each probe a search artifact under `storage_root` (by default the cold search at that
sparsity: the artifact a sweep or a `sparsities: [s]` run with the same settings makes, reused both ways), the decision
published as a `target` artifact (target.json) whose manifest lists every probe among its inputs, so the lineage
reaches each one."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.planning import target
from evoesap.steps import run_step
from evoesap.store import artifacts

# `config` below is a `pipeline.config.PipelineConfig` (which reads `memory_sparsity` from here: not imported back)
log = logging.getLogger(__name__)


def target_grid(config: Any, model: str | None = None) -> tuple[Any, list[float]]:
    """(the model's pruning space at the search's granularity, the searchable sparsities), from config.json alone;
    `model`: a folder with the config.json to read instead of the configuration's model."""
    return searchable(model or config.pinned_model, config.parsed_params("search").granularity)


def searchable(model: str, granularity: int) -> tuple[Any, list[float]]:
    """(the pruning space of `model` at `granularity`, its searchable sparsities), from its config.json alone;
    refused in one line when there is none."""
    from evoesap import moe
    from evoesap.machine import runtime

    space = moe.pruning_space(runtime.inspect_checkpoint(model), granularity)
    points = target.grid(space.num_experts, space.min_kept, space.granularity)
    if not points:
        raise ConfigError(f"{artifacts.redact(model)} has no searchable sparsity at granularity {space.granularity}")
    return space, points


def _quality_target(config: Any) -> Any:
    """The configuration's `target:` section, refused in one line unless it is a quality target."""
    if config.target is None or not config.target.quality:
        raise ConfigError(
            "the configuration has no quality target: add target: {heldout_esap: 0.97} or target: {gate: true} (a bytes "
            "target's sparsity is computed when the configuration loads: run the pipeline)"
        )
    return config.target


def gate_words(section: Mapping[str, Any]) -> str:
    """The gate section's thresholds in words, as a gate target states its goal: `max_task_drop 0.05`."""
    from evoesap.steps import make_params

    return ", ".join(f"{name} {value:g}" for name, value in make_params("gate", section).thresholds.items())


def cost_line(config: Any, model: str | None = None) -> str:
    """What a `target:` run will cost, said before it starts: the grid and the most probes per criterion (the
    bracketing's worst case, re-checks included)."""
    goal = _quality_target(config)
    _, points = target_grid(config, model)
    most = target.max_probes(len(points), goal.rechecks)
    probes = "warm-started" if goal.warm_start else "cold (a sweep's)"
    aim = f"the gate ({gate_words(config.stage_params('gate'))})" if goal.gate else f"held-out ESAP >= {goal.heldout_esap}"
    each = "search, prune, evaluation and gate" if goal.gate else "search"
    line = (
        f"target {aim}: bisection over {len(points)} grid sparsities ({points[0]:.4f}..{points[-1]:.4f}) looking past "
        f"{goal.rechecks} one-point dip(s), {probes} searches, each probe a {each}, at most {most} per criterion, "
        f"{most * len(config.criteria)} in all (a sweep: {len(points) * len(config.criteria)})"
    )
    if goal.choose_criterion and len(config.criteria) > 1:
        line += (
            f"; choosing among {len(config.criteria)} criteria: each after the first probed first at the best sparsity "
            "so far, one probe when it cannot win"
        )
    return line


@dataclasses.dataclass(frozen=True)
class Gating:
    """What a gate target's probes need beyond the search: the full model's evaluation the gate compares with, the
    previous release's metrics, and the prune, evaluate and gate sections (as the DAG's tasks take them, so the run
    that follows reuses every probe's artifacts)."""

    full_evaluation: str
    previous: str | None
    sections: Mapping[str, Mapping[str, Any]]  # prune, evaluate, gate

    def judge(self, storage_root: str, inputs: Mapping[str, str | None], criterion: str) -> target.Judge:
        """`find`'s judge for `criterion`: prune by the probe's search, evaluate, gate against the full evaluation."""
        from evoesap.components.kfp_artifacts import LABELS

        from evoesap.records import facts

        def judge(sparsity: float, search: str) -> tuple[str, Any]:
            point = {"criterion": criterion, "sparsity": sparsity}
            pruned = run_step(
                "prune", storage_root, {"model": inputs["model"], "scores": inputs["scores"], "allocation": search},
                {**self.sections["prune"], **point},
            )  # fmt: skip
            labels = {k: v for k, v in facts.prune_facts(pruned).items() if k in LABELS}  # as the DAG's evaluate labels it
            evaluated = {"model": pruned, **_teacher(inputs)}
            evaluation = run_step("evaluate", storage_root, evaluated, {**self.sections["evaluate"], **labels})
            gated = {"evaluation": evaluation, "full_evaluation": self.full_evaluation, "previous": self.previous}
            verdict = run_step("gate", storage_root, gated, self.sections["gate"])
            return verdict, records.read(verdict, records.GateRecord)

        return judge


def _teacher(inputs: Mapping[str, str | None]) -> dict[str, str]:
    """An evaluation's held-out teacher cache input, as the DAG's evaluate tasks take it (none without held-out data)."""
    return {"teacher_cache": str(inputs["heldout_cache"])} if inputs.get("heldout_cache") else {}


def probe_inputs(config: Any) -> dict[str, str | None]:
    """What every probe reads, made (or reused) under the storage root: the model, calibrate's scores and the teacher
    caches of the search and held-out samples (None without heldout_data)."""
    root, model = config.storage_root, config.pinned_model
    scores = run_step("calibrate", root, {"model": model, "data": config.calibration_data}, config.stage_params("calibrate"))
    cache_params = config.stage_params("cache-logits")
    cache = run_step("cache-logits", root, {"model": model, "data": config.search_data}, cache_params)
    heldout = (
        run_step("cache-logits", root, {"model": model, "data": config.heldout_data}, cache_params)
        if config.heldout_data
        else None
    )
    return {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout}


def gating_for(config: Any, inputs: Mapping[str, str | None]) -> Gating:
    """A gate target's judge settings: the full model's evaluation as the DAG's `evaluate full` task makes it (made or
    reused), the previous release's metrics and the prune, evaluate and gate sections."""
    evaluate = {"method": "full", **config.stage_params("evaluate")}
    full = run_step("evaluate", config.storage_root, {"model": inputs["model"], **_teacher(inputs)}, evaluate)
    sections = {stage: config.stage_params(stage) for stage in ("prune", "evaluate", "gate")}
    return Gating(full, config.previous_metrics, sections)


def run_target(config: Any) -> list[tuple[str, records.Record]]:
    """Find each criterion's sparsity for the configuration's target; return (target artifact URI, TargetRecord)."""
    goal = _quality_target(config)
    target_grid(config)  # before any work: a model with nothing to search is refused here
    inputs = probe_inputs(config)
    judged = gating_for(config, inputs) if goal.gate else None
    return decide(inputs, config.storage_root, config.criteria, goal, config.stage_params("search"), judged)


def decide(
    inputs: Mapping[str, str | None],
    storage_root: str,
    criteria: Sequence[str],
    goal: Any,
    section: Mapping[str, Any],
    gating: Gating | None = None,
) -> list[tuple[str, records.Record]]:
    """Per criterion, the bracketing for the quality target `goal` (a configuration's `Target`) over searches of
    `inputs` (model, scores, cache, heldout_cache) with the search `section`, each probe a search artifact under
    `storage_root` (and with `gating`, a gate target's, its prune, evaluate and gate artifacts); the decision
    published as a target artifact. With `goal.choose_criterion`, each criterion after the first starts at the best
    sparsity so far (`target.bracket`'s `start`). Returns (its URI, its TargetRecord) per criterion."""
    from evoesap.steps import make_params

    if goal.gate and gating is None:
        raise ConfigError(
            "target.gate judges each probe against the full model's evaluation, and none was given: compile the "
            "pipeline with target: {gate: true} in the configuration"
        )
    # the granularity as the search stage reads its section (the sparsity is a placeholder: it sets no granularity)
    granularity = make_params("search", {**section, "criterion": criteria[0], "sparsity": 0.5}).granularity
    space, points = searchable(str(inputs["model"]), granularity)
    words = gate_words(gating.sections["gate"]) if goal.gate else None  # gating is given: refused above otherwise
    found: list[tuple[str, records.Record]] = []
    for criterion in criteria:
        search, made = _search_step(storage_root, inputs, section, criterion), []

        def step(sparsity: float, seed: tuple[int, ...] | None, search=search, made=made) -> tuple[str, Any]:
            made.append(search(sparsity, seed))
            return made[-1]

        best = target.best([record for _, record in found]) if goal.choose_criterion else None
        judge = gating.judge(storage_root, inputs, criterion) if goal.gate else None
        record = target.find(
            goal.heldout_esap, points, step, space.num_experts, space.min_kept, space.granularity, criterion,
            warm=goal.warm_start, rechecks=goal.rechecks, judge=judge, gate=words,
            start=None if best is None else points.index(best.chosen),
        )  # fmt: skip
        params = {
            "criterion": criterion, "threshold": record.threshold, "warm_start": goal.warm_start, "rechecks": goal.rechecks,
            "search": dict(section), "start": record.start,
            **({"gate": {k: dict(v) for k, v in gating.sections.items()}} if judge is not None and gating else {}),
        }  # fmt: skip
        given = (
            dict(inputs) if gating is None else {**inputs, "full_evaluation": gating.full_evaluation, "previous": gating.previous}
        )
        key = artifacts.cache_key("target", params, artifacts.describe_inputs(given))
        out = artifacts.join(storage_root, "target", key[:24])
        probes = {f"probes.{i}": uri for i, (uri, _) in enumerate(made)}
        with artifacts.stage_output(out, "target", params, {**given, **probes}) as staging:
            records.write(staging, record)
        log.info("%s: %s", criterion, record.line())
        found.append((out, record))
    return found


def unmet(found: Sequence[tuple[str, records.Record]], choose: bool = False) -> ConfigError | None:
    """The error a target that some criterion cannot meet ends with (`decide`'s results: the decision is recorded
    first), one line per such criterion's reason; None when every criterion has a sparsity, or when choosing the
    criterion (`choose`) and one has."""
    if choose and target.best([record for _, record in found]) is not None:
        return None
    missed = [f"{record.criterion}: {record.line()}" for _, record in found if record.chosen is None]
    return ConfigError("; ".join(missed)) if missed else None


def fan_out(found: Sequence[tuple[str, records.Record]], choose: bool = False) -> list[dict[str, Any]]:
    """The points the run goes on with: each criterion at its chosen sparsity, or only the best one (`choose`)."""
    chosen = [record for _, record in found if record.chosen is not None]
    if choose:
        chosen = [target.best(chosen)] if chosen else []
    return [{"criterion": record.criterion, "sparsity": record.chosen} for record in chosen]


def memory_sparsity(config: Any) -> float:
    """The least grid sparsity whose checkpoint fits the configuration's `target.bytes` (`fitting_sparsity`): the
    search's grid, the checkpoint as the prune section writes it (its `model_dtype`), quantized by the quantize
    section's recipe when it sets one."""
    point = {"criterion": config.criteria[0], "sparsity": 0.5}  # placeholders: neither sets the grid or the dtype
    search, prune = config.parsed_params("search", point), config.parsed_params("prune", point)
    recipe = config.stage_params("quantize").get("recipe")
    return fitting_sparsity(config.pinned_model, config.target.bytes, search.granularity, prune.model_dtype, recipe)


@functools.cache
def fitting_sparsity(model: str, size: str | int, granularity: int, model_dtype: str, recipe: str | None = None) -> float:
    """The least grid sparsity at which every allocation's checkpoint fits in `size` bytes on disk, as prune writes it
    (`moe.checkpoint_bytes`: shards with their headers, index, config.json, a non-uniform result's modeling file,
    tokenizer and the other copied files), predicted from the headers without writing a weight. At one budget the
    allocations differ in data bytes only where layers' experts differ in size, in whether the modeling file is
    written, and by a few header bytes with where the removal lies: a point's size is the largest of its uniform
    allocation's and its heaviest ones' (removal packed into the lightest layers, equal ones taken from either end). Refused in one line when nothing needs pruning or `size` is below the smallest
    checkpoint prune can write (every layer at its fewest experts), naming that floor. With `recipe`, every size is
    the checkpoint the quantize stage writes from the pruned one by that recipe (`planning.quantized`), predicted as
    exactly."""
    from evoesap.machine import runtime
    from evoesap.machine.sizes import parse_bytes
    from evoesap.planning import quantized

    wanted = parse_bytes(size)
    refused = quantized.refusal(recipe)
    if refused:
        raise ConfigError(refused)
    dtype = runtime.MODEL_DTYPES[model_dtype]
    sizer = _Sizer(model, None if dtype == "auto" else dtype, granularity, recipe)
    what = f"checkpoint quantized by {recipe}" if recipe else "checkpoint"
    smaller = "raise it" if recipe else "raise it, or quantize the pruned checkpoint"
    full = sizer.full()
    if full <= wanted:
        raise ConfigError(
            f"target.bytes {size} ({wanted:,} bytes) is at least the full {what}'s {full:,} bytes on disk: nothing needs pruning"
        )
    floor = sizer.floor()
    if wanted < floor:
        raise ConfigError(
            f"target.bytes {size} ({wanted:,} bytes) is below the model's floor, its smallest {what}: {floor:,} bytes "
            f"on disk, every layer at its fewest experts: {smaller}"
        )
    points = sizer.points
    lo, hi = -1, len(points)  # size(lo) > wanted (the full model), size(hi) <= wanted (the floor)
    while hi - lo > 1:  # checkpoint bytes fall as sparsity rises: the modeling file is in every point's largest
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sizer.at(mid) <= wanted else (mid, hi)
    if hi == len(points):
        last = sizer.at(len(points) - 1)
        raise ConfigError(
            f"target.bytes {size} ({wanted:,} bytes) is below the smallest searchable {what}, {last:,} bytes at "
            f"sparsity {points[-1]:.4f}: only the model's floor ({floor:,} bytes, every layer at its fewest experts, a "
            f"single allocation with nothing to search) fits; raise it{'' if recipe else ', or quantize'} or lower the "
            "search's granularity"
        )
    return points[hi]


class _Sizer:
    """Checkpoint bytes on disk of a model's grid points, each computed once."""

    def __init__(self, model: str, dtype: Any, granularity: int, recipe: str | None = None) -> None:
        from evoesap import moe
        from evoesap.machine import runtime

        self.model, self.dtype, self.recipe = model, dtype, recipe
        spec = runtime.inspect_checkpoint(model)
        self.space = moe.pruning_space(spec, granularity)
        self.least = moe.pruning_space(spec, 1).min_kept  # prune's own floor: granularity 1
        self.points = target.grid(self.space.num_experts, self.space.min_kept, self.space.granularity)
        self.weights = _expert_weights(model)  # one routed expert's bytes per MoE layer
        self.sizes: dict[int, int] = {}

    def _bytes(self, *counts: Sequence[int]) -> int:
        from evoesap import moe

        allocations = [{layer: list(range(c)) for layer, c in enumerate(r) if c} for r in counts]
        if self.recipe is not None:
            from evoesap.planning import quantized

            return max(quantized.quantized_bytes(self.model, allocations, self.dtype, self.recipe))
        return max(moe.checkpoint_bytes(self.model, allocations, self.dtype))

    def full(self) -> int:
        return self._bytes([0] * len(self.space.num_experts))

    def floor(self) -> int:
        return self._bytes([n - k for n, k in zip(self.space.num_experts, self.least)])

    def at(self, index: int) -> int:
        from evoesap.method import allocation as alloc

        if index not in self.sizes:
            n, k, g = self.space.num_experts, self.space.min_kept, self.space.granularity
            budget = alloc.budget(self.points[index], n, k, g)
            heaviest = [self._packed(budget, tie) for tie in (1, -1)]  # ties among equal experts to the first, the last
            self.sizes[index] = self._bytes(alloc.uniform(n, k, budget, g), *heaviest)
        return self.sizes[index]

    def _packed(self, budget: int, tie: int) -> list[int]:
        """The removal of `budget` experts packed into the layers whose experts weigh least (the most data bytes kept),
        equal layers taken first to last (`tie` 1) or last to first (-1): the headers and the index differ by a few
        bytes with where the removal lies, so both ends are sized."""
        from evoesap.method import allocation as alloc

        n, k, g = self.space.num_experts, self.space.min_kept, self.space.granularity
        caps, left, counts = alloc.unit_caps(n, k, g), budget // g, [0] * len(n)
        for layer in sorted(range(len(n)), key=lambda i: (self.weights[i], tie * i)):
            counts[layer] = min(caps[layer], left) * g
            left -= counts[layer] // g
        return counts


def _expert_weights(model: str) -> tuple[int, ...]:
    """Bytes of one routed expert per MoE layer, from the config's meta model (relative sizes: dtype aside)."""
    from evoesap import moe
    from evoesap.moe import stream_prune

    config = stream_prune.read_config(*stream_prune.checkpoint_files(model, patterns=("config.json",)))
    return moe.expert_bytes(moe.spec.meta_model(config))


def _search_step(
    storage_root: str, inputs: Mapping[str, str | None], section: Mapping[str, Any], criterion: str
) -> Callable[[float, tuple[int, ...] | None], tuple[str, Any]]:
    """`find`'s `search`: the search stage at its content-addressed URI under `storage_root` (`steps.run_step`), the
    seed, if any, passed as its `warm_start` (without one, the parameters a sweep's search at that sparsity has)."""

    def search(sparsity: float, seed: tuple[int, ...] | None) -> tuple[str, Any]:
        warm = {"warm_start": ",".join(str(v) for v in seed)} if seed is not None else {}
        uri = run_step("search", storage_root, inputs, {**section, **warm, "criterion": criterion, "sparsity": sparsity})
        return uri, records.read(uri, records.AllocationRecord)

    return search
