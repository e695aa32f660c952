"""A configuration's `target:` run here: calibrate and the teacher caches once, then per criterion the bracketing of
`evoesap.planning.target`, each probe a search artifact under `storage_root` (by default the cold search at that
sparsity: the artifact a sweep or a `sparsities: [s]` run with the same settings makes, reused both ways), the decision
published as a `target` artifact (target.json) whose manifest lists every probe among its inputs, so the lineage
reaches each one."""

from __future__ import annotations

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
    if config.target is None or config.target.heldout_esap is None:
        raise ConfigError(
            "the configuration has no quality target: add target: {heldout_esap: 0.97} (a bytes target's sparsity "
            "is computed when the configuration loads: run the pipeline)"
        )
    return config.target


def cost_line(config: Any, model: str | None = None) -> str:
    """What a `target:` run will cost, said before it starts: the grid and the most searches per criterion (the
    bracketing's worst case, re-checks included)."""
    goal = _quality_target(config)
    _, points = target_grid(config, model)
    most = target.max_probes(len(points), goal.rechecks)
    probes = "warm-started" if goal.warm_start else "cold (a sweep's)"
    return (
        f"target held-out ESAP >= {goal.heldout_esap}: bisection over {len(points)} grid sparsities "
        f"({points[0]:.4f}..{points[-1]:.4f}) looking past {goal.rechecks} one-point dip(s), {probes} searches, at most "
        f"{most} per criterion, {most * len(config.criteria)} in all (a sweep: {len(points) * len(config.criteria)})"
    )


def run_target(config: Any) -> list[tuple[str, records.Record]]:
    """Find each criterion's sparsity for the configuration's target; return (target artifact URI, TargetRecord)."""
    goal = _quality_target(config)
    target_grid(config)  # before any work: a model with nothing to search is refused here
    root, model = config.storage_root, config.pinned_model
    scores = run_step("calibrate", root, {"model": model, "data": config.calibration_data}, config.stage_params("calibrate"))
    cache_params = config.stage_params("cache-logits")
    cache = run_step("cache-logits", root, {"model": model, "data": config.search_data}, cache_params)
    heldout = run_step("cache-logits", root, {"model": model, "data": config.heldout_data}, cache_params)
    inputs = {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout}
    return decide(inputs, root, config.criteria, goal, config.stage_params("search"))


def decide(
    inputs: Mapping[str, str], storage_root: str, criteria: Sequence[str], goal: Any, section: Mapping[str, Any]
) -> list[tuple[str, records.Record]]:
    """Per criterion, the bracketing for the quality target `goal` (a configuration's `Target`) over searches of
    `inputs` (model, scores, cache, heldout_cache) with the search `section`, each probe a search artifact under
    `storage_root`; the decision published as a target artifact. Returns (its URI, its TargetRecord) per criterion."""
    from evoesap.steps import make_params

    # the granularity as the search stage reads its section (the sparsity is a placeholder: it sets no granularity)
    granularity = make_params("search", {**section, "criterion": criteria[0], "sparsity": 0.5}).granularity
    space, points = searchable(inputs["model"], granularity)
    found = []
    for criterion in criteria:
        search, made = _search_step(storage_root, inputs, section, criterion), []

        def step(sparsity: float, seed: tuple[int, ...] | None, search=search, made=made) -> tuple[str, Any]:
            made.append(search(sparsity, seed))
            return made[-1]

        record = target.find(
            goal.heldout_esap, points, step, space.num_experts, space.min_kept, space.granularity, criterion,
            warm=goal.warm_start, rechecks=goal.rechecks,
        )  # fmt: skip
        params = {
            "criterion": criterion, "threshold": record.threshold, "warm_start": goal.warm_start, "rechecks": goal.rechecks,
            "search": dict(section),
        }  # fmt: skip
        key = artifacts.cache_key("target", params, artifacts.describe_inputs(dict(inputs)))
        out = artifacts.join(storage_root, "target", key[:24])
        probes = {f"probes.{i}": uri for i, (uri, _) in enumerate(made)}
        with artifacts.stage_output(out, "target", params, {**inputs, **probes}) as staging:
            records.write(staging, record)
        log.info("%s: %s", criterion, record.line())
        found.append((out, record))
    return found


def unmet(found: Sequence[tuple[str, records.Record]]) -> ConfigError | None:
    """The error a target that some criterion cannot meet ends with (`decide`'s results: the decision is recorded
    first), one line per such criterion's reason; None when every criterion has a sparsity."""
    missed = [f"{record.criterion}: {record.line()}" for _, record in found if record.chosen is None]
    return ConfigError("; ".join(missed)) if missed else None


def memory_sparsity(config: Any) -> float:
    """The least grid sparsity whose checkpoint fits the configuration's `target.bytes` (`fitting_sparsity`)."""
    search = config.parsed_params("search", {"criterion": config.criteria[0], "sparsity": 0.5})
    return fitting_sparsity(config.pinned_model, config.target.bytes, search.granularity, search.model_dtype)


@functools.cache
def fitting_sparsity(model: str, size: str | int, granularity: int, model_dtype: str) -> float:
    """The least grid sparsity whose checkpoint fits in `size`, from config.json and the weights' headers alone
    (`footprint.model_shape`, weights in `model_dtype`): each removed expert frees a mean routed expert's bytes (exact
    where every layer's experts weigh the same, as in the supported families, so the searched allocation fits as
    uniform does). Refused in one line when nothing needs pruning or even the most pruning cannot fit."""
    from evoesap import moe
    from evoesap.machine import runtime
    from evoesap.machine.sizes import parse_bytes
    from evoesap.planning.footprint import model_shape

    wanted = parse_bytes(size)
    shape = model_shape(model, model_dtype)
    space = moe.pruning_space(runtime.inspect_checkpoint(model), granularity)
    points = target.grid(space.num_experts, space.min_kept, space.granularity)
    per_expert = shape.expert_bytes / sum(space.num_experts)
    if shape.bytes <= wanted:
        raise ConfigError(f"target.bytes {size} is at least the full model's {shape.bytes:,} bytes: nothing needs pruning")
    left = [shape.bytes - round(s * sum(space.num_experts)) * per_expert for s in points]
    fits = [s for s, b in zip(points, left) if b <= wanted]
    if not fits:
        raise ConfigError(
            f"target.bytes {size} ({wanted:,} bytes) is below the model's floor of {int(left[-1]):,} bytes (sparsity "
            f"{points[-1]:.4f}, every layer at its fewest experts): raise it, or quantize"
        )
    return fits[0]


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
