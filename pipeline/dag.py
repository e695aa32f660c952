"""The EvoESAP DAG as a KFP pipeline, built from one validated configuration.

calibrate and cache-logits run once; for each criterion x sparsity a search, a searched and a uniform
prune, and their evaluations fan out (ParallelFor); the full model is evaluated once; the report
collects everything.
"""

# No `from __future__ import annotations`: kfp reads the pipeline function's real annotations.
from pathlib import Path
from typing import Any, Callable

from kfp import compiler, dsl

from evoesap.components import DEFAULT_IMAGE, make_components
from evoesap.pipeline.config import GPU_STAGES, PipelineConfig


def _configure(task: Any, stage: str, config: PipelineConfig) -> Any:
    """Resources, retries and caching of one task, from the configuration."""
    task.set_display_name(stage)
    task.set_caching_options(enable_caching=True)  # every stage is deterministic for its inputs
    if config.retries:
        task.set_retry(num_retries=config.retries, backoff_duration="30s", backoff_factor=2.0)
    res = config.resources.get(stage)
    if res is None:
        return task
    if res.cpu:
        task.set_cpu_limit(res.cpu)
    if res.memory:
        task.set_memory_limit(res.memory)
    if res.accelerator_count and stage in GPU_STAGES:
        task.set_accelerator_type(res.accelerator_type)
        task.set_accelerator_limit(res.accelerator_count)
    return task


def _gpu_params(stage: str, config: PipelineConfig) -> dict[str, Any]:
    """Stage parameters, with the model spread over the task's GPUs when it has several."""
    params = config.stage_params(stage)
    res = config.resources.get(stage)
    if res is not None and res.accelerator_count > 1:
        params.setdefault("device_map", "auto")
    return params


def build_pipeline(config: PipelineConfig) -> Callable:
    """A KFP pipeline function whose parameters default to the configuration's values."""
    comps = make_components(config.image or DEFAULT_IMAGE)

    @dsl.pipeline(name=config.name, description="EvoESAP: ESAP-guided non-uniform expert pruning")
    def evoesap_pipeline(
        model: str = config.model,
        calibration_data: str = config.calibration_data,
        search_data: str = config.search_data,
        heldout_data: str = config.heldout_data or "",
        storage_root: str = config.storage_root,
        grid: list = config.grid(),
        calibrate_params: dict = _gpu_params("calibrate", config),
        cache_logits_params: dict = _gpu_params("cache-logits", config),
        search_params: dict = _gpu_params("search", config),
        prune_params: dict = config.stage_params("prune"),
        evaluate_params: dict = _gpu_params("evaluate", config),
        report_params: dict = config.stage_params("report"),
    ) -> str:
        scores = _configure(
            comps.calibrate(model=model, data=calibration_data, storage_root=storage_root, params=calibrate_params),
            "calibrate",
            config,
        )
        cache = _configure(
            comps.cache_logits(model=model, data=search_data, storage_root=storage_root, params=cache_logits_params),
            "cache-logits",
            config,
        )
        heldout_cache = ""
        if config.heldout_data:
            heldout_cache = _configure(
                comps.cache_logits(
                    model=model, data=heldout_data, storage_root=storage_root, params=cache_logits_params
                ),
                "cache-logits",
                config,
            ).output
        full_eval = _configure(
            comps.evaluate(
                model=model,
                cache=heldout_cache,
                storage_root=storage_root,
                params=evaluate_params,
                method="full",
                point={},
            ),
            "evaluate",
            config,
        )
        plan = _configure(
            comps.fan_out(grid=grid, scores=scores.output, cache=cache.output, heldout_cache=heldout_cache),
            "fan-out",
            config,
        )
        with dsl.ParallelFor(plan.output, name="criterion-x-sparsity") as point:
            searched = _configure(
                comps.search(model=model, storage_root=storage_root, params=search_params, point=point),
                "search",
                config,
            )
            pruned = {}
            for method, allocation in (("searched", searched.output), ("uniform", "")):
                pruned[method] = _configure(
                    comps.prune(
                        model=model, allocation=allocation, storage_root=storage_root, params=prune_params, point=point
                    ),
                    "prune",
                    config,
                )
            evals = {}
            for method, task in pruned.items():
                evals[method] = _configure(
                    comps.evaluate(
                        model=task.output,
                        cache=point.heldout_cache,
                        storage_root=storage_root,
                        params=evaluate_params,
                        method=method,
                        point=point,
                    ),
                    "evaluate",
                    config,
                )
        report = _configure(
            comps.report(
                full=full_eval.output,
                searched=dsl.Collected(evals["searched"].output),
                uniform=dsl.Collected(evals["uniform"].output),
                searches=dsl.Collected(searched.output),
                storage_root=storage_root,
                params=report_params,
            ),
            "report",
            config,
        )
        return report.output

    return evoesap_pipeline


def compile_pipeline(config: PipelineConfig, out: str | Path) -> Path:
    """Write the pipeline spec YAML that a Kubeflow Pipelines cluster runs unchanged."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(config), str(out))
    return out
