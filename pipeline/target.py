"""A configuration's `target:` run here: calibrate and the teacher caches once, then per criterion the bracketing of
`evoesap.target`, each probe a search artifact under `storage_root`, the decision published as a `target` artifact
(target.json) whose manifest lists every probe among its inputs, so the lineage reaches each one."""

from __future__ import annotations

import logging
from typing import Any

from evoesap import artifacts, records, target
from evoesap.errors import ConfigError
from evoesap.pipeline.config import PipelineConfig
from evoesap.steps import run_step

log = logging.getLogger(__name__)


def target_grid(config: PipelineConfig, model: str | None = None) -> tuple[Any, list[float]]:
    """(the model's pruning space at the search's granularity, the searchable sparsities), from config.json alone;
    `model`: a folder with the config.json to read instead of the configuration's model."""
    from evoesap import moe, runtime

    spec = runtime.inspect_checkpoint(model or config.pinned_model)
    space = moe.pruning_space(spec, config.parsed_params("search").granularity)
    points = target.grid(space.num_experts, space.min_kept, space.granularity)
    if not points:
        raise ConfigError(f"{artifacts.redact(config.model)} has no searchable sparsity at granularity {space.granularity}")
    return space, points


def cost_line(config: PipelineConfig, model: str | None = None) -> str:
    """What a `target:` run will cost, said before it starts: the grid and the most searches per criterion."""
    _, points = target_grid(config, model)
    most = target.max_probes(len(points))
    return (
        f"target held-out ESAP >= {config.target.heldout_esap}: bisection over {len(points)} grid sparsities "
        f"({points[0]:.4f}..{points[-1]:.4f}), at most {most} searches per criterion, {most * len(config.criteria)} "
        f"in all (a sweep: {len(points) * len(config.criteria)})"
    )


def run_target(config: PipelineConfig) -> list[tuple[str, records.Record]]:
    """Find each criterion's sparsity for the configuration's target; return (target artifact URI, TargetRecord)."""
    if config.target is None:
        raise ConfigError("the configuration has no target: add target: {heldout_esap: 0.97}")
    space, points = target_grid(config)  # before any work: a model with nothing to search is refused here
    root, model = config.storage_root, config.pinned_model
    scores = run_step("calibrate", root, {"model": model, "data": config.calibration_data}, config.stage_params("calibrate"))
    cache_params = config.stage_params("cache-logits")
    cache = run_step("cache-logits", root, {"model": model, "data": config.search_data}, cache_params)
    heldout = run_step("cache-logits", root, {"model": model, "data": config.heldout_data}, cache_params)
    inputs = {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout}
    section = config.stage_params("search")
    found = []
    for criterion in config.criteria:
        search, made = target.search_step(root, inputs, section, criterion), []

        def step(sparsity: float, seed: tuple[int, ...] | None) -> tuple[str, Any]:
            made.append(search(sparsity, seed))
            return made[-1]

        record = target.find(
            config.target.heldout_esap, points, step, space.num_experts, space.min_kept, space.granularity, criterion
        )
        params = {"criterion": criterion, "threshold": record.threshold, "search": section}
        key = artifacts.cache_key("target", params, artifacts.describe_inputs(inputs))
        out = artifacts.join(root, "target", key[:24])
        probes = {f"probes.{i}": uri for i, (uri, _) in enumerate(made)}
        with artifacts.stage_output(out, "target", params, {**inputs, **probes}) as staging:
            records.write(staging, record)
        log.info("%s: %s", criterion, record.line())
        found.append((out, record))
    return found
