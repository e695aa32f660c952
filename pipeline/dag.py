"""The EvoESAP DAG as a KFP pipeline, built from one validated configuration.

calibrate and cache-logits run once; for each criterion x sparsity a search, a searched and a uniform
prune, and their evaluations fan out (ParallelFor); the full model is evaluated once; the report
collects everything. `build_subpipeline` is that DAG for a full model given as an artifact (a step of
another pipeline); `build_pipeline` imports the model from a path, URI or hub name and runs it.
"""

# No `from __future__ import annotations`: kfp reads the pipeline function's real annotations.
from pathlib import Path
from typing import Any, Callable, List, NamedTuple

from kfp import compiler, dsl
from kfp.dsl import HTML, Input, Markdown, Model

from evoesap.components import DEFAULT_IMAGE, make_components
from evoesap.pipeline.config import GPU_STAGES, PipelineConfig


def _configure(task: Any, stage: str, config: PipelineConfig) -> Any:
    """Resources, retries and caching of one task, from the configuration."""
    task.set_display_name(stage)
    # Never KFP's cache: it would return an output whose payload was deleted or changed in storage. Each
    # stage checks its own finished output instead (manifest, inputs' identity, payload sha256).
    task.set_caching_options(enable_caching=False)
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


Outputs = NamedTuple("Outputs", report=Markdown, report_html=HTML, pruned_models=List[Model])


def _defaults(config: PipelineConfig) -> dict[str, Any]:
    """The pipeline parameters' defaults: the configuration's values."""
    return {
        "calibration_data": config.calibration_data,
        "search_data": config.search_data,
        "heldout_data": config.heldout_data or "",
        "storage_root": config.storage_root,
        "grid": config.grid(),
        "calibrate_params": _gpu_params("calibrate", config),
        "cache_logits_params": _gpu_params("cache-logits", config),
        "search_params": _gpu_params("search", config),
        "prune_params": config.stage_params("prune"),
        "evaluate_params": _gpu_params("evaluate", config),
        "report_params": config.stage_params("report"),
    }


def build_subpipeline(config: PipelineConfig) -> Callable:
    """The whole EvoESAP DAG as a pipeline that takes the full model as an artifact (`Input[Model]`).

    Use it as a step of another pipeline: `evoesap = build_subpipeline(config)`, then
    `evoesap(model=train_task.outputs["model"])`; its outputs are the report (Markdown, HTML) and the
    searched pruned model of every criterion x sparsity point (`pruned_models`, a list of `dsl.Model`).
    """
    comps = make_components(config.image or DEFAULT_IMAGE)
    d = _defaults(config)

    @dsl.pipeline(name=f"{config.name}-stages", description="EvoESAP stages: calibrate ... report, for a given full model")
    def evoesap_stages(
        model: Input[Model],
        calibration_data: str = d["calibration_data"],
        search_data: str = d["search_data"],
        heldout_data: str = d["heldout_data"],
        storage_root: str = d["storage_root"],
        grid: list = d["grid"],
        calibrate_params: dict = d["calibrate_params"],
        cache_logits_params: dict = d["cache_logits_params"],
        search_params: dict = d["search_params"],
        prune_params: dict = d["prune_params"],
        evaluate_params: dict = d["evaluate_params"],
        report_params: dict = d["report_params"],
    ) -> Outputs:
        def stage(name: str, task: Any) -> Any:
            return _configure(task, name, config)

        scores = stage("calibrate", comps.calibrate(model=model, data=calibration_data, storage_root=storage_root, params=calibrate_params))
        cache = stage("cache-logits", comps.cache_logits(model=model, data=search_data, storage_root=storage_root, params=cache_logits_params))
        heldout = {}
        if config.heldout_data:
            heldout["heldout_cache"] = stage(
                "cache-logits",
                comps.cache_logits(model=model, data=heldout_data, storage_root=storage_root, params=cache_logits_params),
            ).outputs["cache"]
        teacher = {"teacher_cache": heldout["heldout_cache"]} if heldout else {}
        full = stage("evaluate", comps.evaluate(model=model, storage_root=storage_root, params=evaluate_params, **teacher))
        with dsl.ParallelFor(grid, name="criterion-x-sparsity") as point:
            point_args = dict(criterion=point.criterion, sparsity=point.sparsity, storage_root=storage_root)
            searched = stage(
                "search",
                comps.search(model=model, scores=scores.outputs["scores"], cache=cache.outputs["cache"], params=search_params,
                             **heldout, **point_args),
            )  # fmt: skip
            allocations = {"searched": {"allocation": searched.outputs["allocation"]}, "uniform": {}}  # uniform: none
            pruned = {
                method: stage("prune", comps.prune(model=model, scores=scores.outputs["scores"], params=prune_params,
                                                   **allocation, **point_args))
                for method, allocation in allocations.items()
            }  # fmt: skip
            evals = {
                method: stage("evaluate", comps.evaluate(model=task.outputs["pruned"], storage_root=storage_root,
                                                         params=evaluate_params, **teacher))
                for method, task in pruned.items()
            }  # fmt: skip
        report = stage(
            "report",
            comps.report(
                full=full.outputs["evaluation"],
                searched=dsl.Collected(evals["searched"].outputs["evaluation"]),
                uniform=dsl.Collected(evals["uniform"].outputs["evaluation"]),
                searches=dsl.Collected(searched.outputs["allocation"]),
                storage_root=storage_root,
                params=report_params,
            ),
        )
        return Outputs(
            report=report.outputs["markdown"],
            report_html=report.outputs["page"],
            pruned_models=dsl.Collected(pruned["searched"].outputs["pruned"]),
        )

    return evoesap_stages


def build_pipeline(config: PipelineConfig) -> Callable:
    """The standalone pipeline: the full model given by path, URI or hub name (`dsl.importer`), then the DAG."""
    stages = build_subpipeline(config)
    d = _defaults(config)

    @dsl.pipeline(name=config.name, description="EvoESAP: ESAP-guided non-uniform expert pruning")
    def evoesap_pipeline(
        model: str = config.model,
        calibration_data: str = d["calibration_data"],
        search_data: str = d["search_data"],
        heldout_data: str = d["heldout_data"],
        storage_root: str = d["storage_root"],
        grid: list = d["grid"],
        calibrate_params: dict = d["calibrate_params"],
        cache_logits_params: dict = d["cache_logits_params"],
        search_params: dict = d["search_params"],
        prune_params: dict = d["prune_params"],
        evaluate_params: dict = d["evaluate_params"],
        report_params: dict = d["report_params"],
    ) -> Outputs:
        imported = dsl.importer(artifact_uri=model, artifact_class=Model, reimport=False)
        imported.set_display_name("model").set_caching_options(enable_caching=False)
        run = stages(
            model=imported.output,
            calibration_data=calibration_data,
            search_data=search_data,
            heldout_data=heldout_data,
            storage_root=storage_root,
            grid=grid,
            calibrate_params=calibrate_params,
            cache_logits_params=cache_logits_params,
            search_params=search_params,
            prune_params=prune_params,
            evaluate_params=evaluate_params,
            report_params=report_params,
        ).set_caching_options(enable_caching=False)
        return Outputs(
            report=run.outputs["report"], report_html=run.outputs["report_html"], pruned_models=run.outputs["pruned_models"]
        )

    return evoesap_pipeline


def compile_pipeline(config: PipelineConfig, out: str | Path) -> Path:
    """Write the pipeline spec YAML that a Kubeflow Pipelines cluster runs unchanged."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(config), str(out))
    return out
