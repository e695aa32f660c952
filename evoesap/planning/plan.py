"""`evoesap plan` and the check before a stage runs: the memory model (`evoesap.planning.footprint`) applied to a
pipeline configuration, or to one stage's inputs and parameters on this machine."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from evoesap.planning import footprint
from evoesap.planning.footprint import (
    Data,
    GiB,
    Machine,
    ModelShape,
    StagePlan,
    cache_bytes,
    default_cache_mode,
    model_shape,
    plan_stages,
)
from evoesap.store.identity import is_uri

log = logging.getLogger(__name__)


def format_table(shape: ModelShape, plans: list[StagePlan], data: Data, params: dict[str, Any]) -> str:
    """The plan as a markdown table, the cache sizes in both modes and every refusal."""

    def gib(n: int) -> str:
        return f"{n / GiB:,.1f}"

    cache_p = params["cache-logits"]
    lines = [
        f"model {shape.model_type}: {gib(shape.bytes)} GiB of weights, vocabulary {shape.vocab:,}; "
        f"teacher cache of {data.cache_rows:,} rows: full {gib(cache_bytes(data.cache_rows, shape.vocab, 'full', cache_p.top_k, cache_p.dtype))} GiB, "
        f"top-{cache_p.top_k} {gib(cache_bytes(data.cache_rows, shape.vocab, 'topk', cache_p.top_k, cache_p.dtype))} GiB "
        f"({cache_p.dtype}; mode {cache_p.mode})",
        "",
        "host: peak resident memory; without a GPU it includes the checkpoint's expert pages left mapped after "
        "loading, which the kernel drops when memory is short (not counted against the machine)",
        "",
        "| stage | host GiB | per-GPU GiB | disk GiB | temp GiB | fits |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for plan in plans:
        lines.append(
            f"| {plan.stage} | {gib(plan.host)} | {gib(plan.device)} | {gib(plan.disk)} | {gib(plan.temp)} | "
            f"{'yes' if plan.refusal is None else 'NO'} |"
        )
    remarks = [p.refusal for p in plans if p.refusal] + [p.note for p in plans if p.note]  # the offloads' costs
    if remarks:
        lines += ["", *(f"- {r}" for r in remarks)]
    return "\n".join(lines)


def pipeline_plan(
    config: Any, machine: Machine, model: str | None = None
) -> tuple[ModelShape, Data, dict[str, Any], list[StagePlan]]:
    """The plan of a pipeline configuration (`pipeline.config.PipelineConfig`) on `machine`; `model`: a
    checkpoint or config folder to read instead of the configuration's model (offline planning)."""
    from evoesap.registry import STAGES

    params = {stage.name: config.parsed_params(stage.name) for stage in STAGES}
    shape = model_shape(model or config.pinned_model, params["search"].model_dtype)
    cache_p = params["cache-logits"]
    rows = cache_p.sample_count * cache_p.max_length
    data = Data(params["calibrate"].sample_count * params["calibrate"].max_length, rows, rows if config.heldout_data else 0)
    if cache_p.mode is None:  # unset: full unless the full cache would crowd or not fit the search
        mode, _ = default_cache_mode(shape, machine, data, cache_p, params["search"])
        params["cache-logits"] = dataclasses.replace(cache_p, mode=mode)
    remote = is_uri(config.storage_root) and not config.storage_root.startswith("file://")
    return shape, data, params, plan_stages(shape, machine, data, params, remote_out=remote)


def check_stage(stage: str, inputs: dict[str, Any], params: Any) -> StagePlan | None:
    """Refuse (ResourceError) a stage that would not fit this machine, before it loads anything; its plan.
    A stage without a peak formula, or whose inputs cannot be read yet, gets no plan (the stage itself
    says what is wrong with an input)."""
    from evoesap import registry as stages
    from evoesap.errors import EvoESAPError, ResourceError
    from evoesap.machine import bounds
    from evoesap.store import artifacts

    if stages.get(stage).peak is None:
        return None
    bounds.check_stage(params, inputs["model"])  # the device and the checkpoint, before either is measured
    cache_class = stages.get("cache-logits").params_class()
    cache_p, rows, heldout = cache_class(), 0, 0
    try:
        shape = model_shape(inputs["model"], getattr(params, "model_dtype", "auto"))
        if stage == "search":
            meta = artifacts.read_json(artifacts.join(inputs["cache"], "cache.json"))
            cache_p = cache_class(mode=meta["mode"], top_k=meta["top_k"] or 1, dtype=meta["dtype"])
            rows = int(meta["num_positions"])
            if inputs.get("heldout_cache"):
                heldout = int(artifacts.read_json(artifacts.join(inputs["heldout_cache"], "cache.json"))["num_positions"])
    except (EvoESAPError, OSError, ValueError, KeyError, TypeError) as exc:
        log.info("%s: no memory plan (%s)", stage, exc)
        return None
    machine = footprint.local_machine(getattr(params, "device", "cpu"))
    search_p = params if stage == "search" else stages.get("search").params_class()()
    if stage == "cache-logits":
        rows = params.sample_count * params.max_length
        mode = params.mode or default_cache_mode(shape, machine, Data(0, rows), params, search_p)[0]
        cache_p = dataclasses.replace(params, mode=mode)
    calibrate_tokens = params.sample_count * params.max_length if stage == "calibrate" else 0
    # an evaluated model is already pruned: no prune entry, nothing more comes off its bytes
    by_stage = {stage: params, "cache-logits": cache_p, "search": search_p}
    data = Data(calibrate_tokens, rows, heldout)
    plan = plan_stages(shape, machine, data, by_stage, only=stage)[0]
    if plan.refusal:
        raise ResourceError(plan.refusal)
    if stage == "cache-logits" and params.mode == "full":  # asked for: a full cache the search could not hold is refused now
        search = plan_stages(shape, machine, data, by_stage, only="search")[0].refusal
        if search:
            raise ResourceError(f"cache_logits.mode is full, but {search}")
    return plan
