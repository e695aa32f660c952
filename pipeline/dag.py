"""The EvoESAP DAG as a KFP pipeline, built from one validated configuration.

calibrate and cache-logits run once; for each criterion x sparsity a search, a searched and a uniform
prune, and their evaluations fan out (ParallelFor); when the `quantize` section names a recipe, the searched
checkpoint's quantize step and its evaluation; with `publish_models` the publish (model card, push) of the searched
model, or of its quantized checkpoint when quantize is on; when the `gate` section sets a threshold, the gate's verdict
on that model decides whether publish runs, heads the report and is an output (`verdicts`), and a failing one ends the
run after the report. The full model is evaluated once; the report collects
everything; each searched prune output is handed on (`pruned_models`). `build_subpipeline` is that DAG for a
full model given as an artifact (a step of another pipeline), with pod settings the outer pipeline overrides or
binds; `build_pipeline` names the model (a path, URI or hub name) by a reference step and runs it.
"""

# No `from __future__ import annotations`: kfp reads the pipeline function's real annotations.
import contextlib
import functools
import inspect
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, List, Mapping, NamedTuple

from kfp import compiler, dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Model

from evoesap.components import StageComponents, make_components
from evoesap.components.reference import make_reference
from evoesap.components.verdict import make_verdict_check
from evoesap.components.trainjob import make_search_trainjob
from evoesap.pipeline.feasibility import check_grid
from evoesap.errors import ConfigError
from evoesap.stages import MODEL_STAGES, NAMES, STAGES
from evoesap.stages import get as get_stage
from evoesap.pipeline import cluster, trainjob
from evoesap.pipeline.config import PipelineConfig, with_resources
from evoesap.pipeline.files import SPEC_MARKER, claim_output_file


def _configure(
    task: Any, stage: str, config: PipelineConfig, label: str | None = None, inputs: dict[str, Any] | None = None
) -> Any:
    """Display name, caching and Kubernetes settings (`pipeline.cluster`) of one task; `inputs`: the settings
    that the sub-pipeline's parameters give (`settings_parameters`)."""
    task.set_display_name(label or stage)
    # Never KFP's cache: it would return an output whose payload was deleted or changed in storage. Each
    # stage checks its own finished output instead (manifest, inputs' identity, payload sha256).
    task.set_caching_options(enable_caching=False)
    return cluster.apply(task, config.settings(stage), config.retries, inputs)


def _gpu_params(stage: str, config: PipelineConfig, gpus_at_run_time: bool = False) -> dict[str, Any]:
    """Stage parameters, with the model spread over the task's GPUs when it has several, or may have (its GPU count
    a sub-pipeline input); a multi-worker search puts one worker on each GPU, or on each group of gpus_per_worker,
    instead."""
    params = config.stage_params(stage)
    several = gpus_at_run_time or config.settings(stage).accelerator_count > 1
    if several and not (stage == "search" and config.search_workers > 1):
        params.setdefault("device_map", "auto")
    return params


def settings_parameters(config: PipelineConfig, names: Iterable[str]) -> dict[str, dict[str, inspect.Parameter]]:
    """stage -> setting -> the sub-pipeline parameter `<section>_<setting>` that carries it at run time, its
    default the configured value, for each `<stage>.<setting>` of `names` (`cluster.RUNTIME_SETTINGS`)."""
    if isinstance(names, str):
        raise ConfigError(f"settings_inputs {names!r}: give a list of <stage>.<setting> names, e.g. ['search.accelerator_count']")
    out: dict[str, dict[str, inspect.Parameter]] = {}
    for name in names:
        stage, _, setting = str(name).partition(".")
        where = f"settings input {name!r}"
        if stage not in NAMES:
            raise ConfigError(f"{where}: unknown stage {stage!r}; write <stage>.<setting> with a stage of {', '.join(NAMES)}")
        if setting not in cluster.RUNTIME_SETTINGS:
            raise ConfigError(
                f"{where}: {setting!r} is not a setting KFP takes at run time; valid: {', '.join(cluster.RUNTIME_SETTINGS)} "
                "(the others are fixed when the pipeline is built: pass them in `overrides`)"
            )
        absent = {
            "quantize": not config.stage_params("quantize").get("recipe") and "the quantize section names no recipe",
            "publish": not config.publish_models and "publish_models is off",
            "search": config.search_workers > 1 and "the search runs as a TrainJob (workers > 1), whose pods are fixed",
        }.get(stage)
        if absent:
            raise ConfigError(f"{where}: the DAG has no {stage} task to set, since {absent}")
        if setting.startswith("accelerator") and stage not in MODEL_STAGES:
            raise ConfigError(f"{where}: {stage} loads no model; stages that can use an accelerator: {', '.join(MODEL_STAGES)}")
        settings = config.settings(stage)
        default = config.stage_image(stage) if setting == "image" else cluster.runtime_default(settings, setting)
        if default is None:
            raise ConfigError(
                f"{where} needs a configured value to start from: set resources.{stage}.{setting}"
                + (" and accelerator_type" if setting == "accelerator_count" else "")
                + " in the configuration or the overrides"
            )
        section = get_stage(stage).section
        kind = cluster.RUNTIME_SETTINGS[setting]
        parameter = inspect.Parameter(f"{section}_{setting}", inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
        out.setdefault(stage, {})[setting] = parameter
    return out


def _signed(func: Callable, drop: tuple[str, ...] = (), extra: Iterable[inspect.Parameter] = ()) -> Callable:
    """`func` as KFP reads it (`dsl.pipeline` reads the signature, then calls it with one argument per parameter, in
    order): without the parameters `drop` (their defaults stay: no pipeline input that no task uses), with the
    `extra` keyword parameters it takes through `**`."""
    signature = inspect.signature(func)
    kept = [p for p in signature.parameters.values() if p.name not in drop and p.kind is not p.VAR_KEYWORD]
    parameters = kept + [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in extra]
    names = [p.name for p in parameters]

    @functools.wraps(func)
    def pipeline(*args: Any) -> Any:
        return func(**dict(zip(names, args)))

    pipeline.__signature__ = signature.replace(parameters=parameters)
    return pipeline


def _search_trainjob(config: PipelineConfig, args: dict[str, Any]) -> Any:
    """The search task of a `workers > 1` configuration: the launcher (`pipeline.trainjob`), whose own pod asks for
    no compute; the job's nodes get the search's image, resources and environment."""
    settings, image = config.settings("search"), config.stage_image("search")
    job = trainjob.job_template(settings, image, config.parsed_params("search").gpus_per_worker)
    task = make_search_trainjob(image)(job=job, **args)
    task.set_display_name(f"search on {config.search_workers} workers (TrainJob)")
    task.set_caching_options(enable_caching=False)
    return cluster.apply(task, trainjob.launcher_settings(settings), config.retries)


Outputs = NamedTuple("Outputs", report=Markdown, report_html=HTML, pruned_models=List[Model])
# With a gate: also each point's verdict (gate.json; metadata `passed` and `verdict`, its one line) for the caller.
GatedOutputs = NamedTuple("GatedOutputs", report=Markdown, report_html=HTML, pruned_models=List[Model], verdicts=List[Artifact])


def gated(config: PipelineConfig) -> bool:
    """Whether the configuration's `gate` section sets a threshold (then the DAG gates publish and reports verdicts)."""
    return config.parsed_params("gate").active


def _gate(stage: Callable, comps: Any, config: PipelineConfig, candidate: Any, full: Any, storage_root: Any) -> Any:
    """The gate task judging `candidate` (the evaluate task of the model publish would release) against the full
    model's evaluation and the previous release's metrics; None when the configuration sets no threshold. Its
    thresholds are compiled in, as quantize's recipe is: they decide the DAG's shape (publish under a condition)."""
    if not gated(config):
        return None
    task = comps.gate(
        evaluation=candidate.outputs["evaluation"],
        full_evaluation=full.outputs["evaluation"],
        storage_root=storage_root,
        previous=config.previous_metrics or "",
        params=config.stage_params("gate"),
    )
    return stage("gate", task, "gate")


def _when_passed(verdict: Any) -> Any:
    """The condition publish runs under: the verdict passed (`dsl.If` on the gate's output, which kfp.local and a
    cluster both evaluate); no condition without a gate."""
    return contextlib.nullcontext() if verdict is None else dsl.If(verdict.outputs["Output"] == "pass", name="gate-passed")


def _verdict_input(verdict: Any) -> dict[str, Any]:
    """publish's `gate` input: the verdict again, so the published artifact's lineage names the gate it passed and
    publish run by hand (or by an orchestrator without conditions) refuses a failing one itself."""
    return {} if verdict is None else {"gate": verdict.outputs["verdict"]}


def _end_on_failed_gate(config: PipelineConfig, verdict: Any, report: Any) -> None:
    """With `stop_on_fail`, a last task after the report that fails the run with the failing verdicts' one line."""
    if not config.parsed_params("gate").stop_on_fail:
        return
    task = make_verdict_check(config.stage_image("gate"))(verdicts=dsl.Collected(verdict.outputs["verdict"]))
    task.after(report)
    _configure(task, "gate", config, "release gate")


def _refuse_quality_target(config: PipelineConfig) -> None:
    """A held-out ESAP target chooses its sparsity by searching (`evoesap pipeline target`); the DAG's fan-out is fixed
    when it compiles, so it takes that choice as `sparsities` (a `bytes` target is computed at compile: see `grid`)."""
    if config.target is not None and config.target.heldout_esap is not None:
        raise ConfigError(
            "target.heldout_esap is found by `evoesap pipeline target CONFIG` (bisection over searches); run it, then "
            "run the pipeline with sparsities: [<the sparsity it chose>] in place of target"
        )


def _gated(func: Callable, config: PipelineConfig) -> Callable:
    """`func` announcing the verdicts output (`GatedOutputs`) when the configuration gates publish."""
    if gated(config):
        func.__signature__ = inspect.signature(func).replace(return_annotation=GatedOutputs)
    return func


def _defaults(config: PipelineConfig, gpus_at_run_time: Iterable[str] = ()) -> dict[str, Any]:
    """The pipeline parameters' defaults: the configuration's values. `gpus_at_run_time`: the stages whose GPU count
    is a sub-pipeline input."""

    def gpu_params(stage: str) -> dict[str, Any]:
        return _gpu_params(stage, config, stage in gpus_at_run_time)

    return {
        "calibration_data": config.calibration_data,
        "search_data": config.search_data,
        "heldout_data": config.heldout_data or "",
        "storage_root": config.storage_root,
        "grid": config.grid(),
        "calibrate_params": gpu_params("calibrate"),
        "cache_logits_params": gpu_params("cache-logits"),
        "search_params": gpu_params("search"),
        "prune_params": config.stage_params("prune"),
        "evaluate_params": gpu_params("evaluate"),
        "report_params": config.stage_params("report"),
        "publish_params": config.stage_params("publish"),
    }


def build_subpipeline(
    config: PipelineConfig, overrides: Mapping[str, Any] | None = None, settings_inputs: Iterable[str] = ()
) -> Callable:
    """The whole EvoESAP DAG as a pipeline that takes the full model as an artifact (`Input[Model]`).

    Use it as a step of another pipeline: `evoesap = build_subpipeline(config)`, then
    `evoesap(model=train_task.outputs["model"])`; its outputs are the report (Markdown, HTML) and the
    searched pruned model of every criterion x sparsity point (`pruned_models`, a list of `dsl.Model`).
    `overrides`: pod settings in the schema of the configuration's `resources` section, merged over it.
    `settings_inputs`: `<stage>.<setting>` names (`cluster.RUNTIME_SETTINGS`) that become inputs
    `<section>_<setting>` the outer pipeline binds at run time, e.g. `search.accelerator_count` ->
    `search_accelerator_count: str`, its default the configured value.
    """
    if overrides:
        config = with_resources(config, overrides)
    _refuse_quality_target(config)
    runtime = settings_parameters(config, settings_inputs)
    check_grid(config.pinned_model, config.grid(), config.stage_params("search"), config.stage_params("prune"))
    bound = {image: make_components(image) for image in {config.stage_image(stage.name) for stage in STAGES}}
    comps = StageComponents(**{stage.section: getattr(bound[config.stage_image(stage.name)], stage.section) for stage in STAGES})
    d = _defaults(config, [stage for stage, names in runtime.items() if "accelerator_count" in names])

    def evoesap_stages(
        model: Input[Model],
        calibration_data: str = d["calibration_data"],
        search_data: str = d["search_data"],
        storage_root: str = d["storage_root"],
        grid: list = d["grid"],
        calibrate_params: dict = d["calibrate_params"],
        cache_logits_params: dict = d["cache_logits_params"],
        search_params: dict = d["search_params"],
        prune_params: dict = d["prune_params"],
        evaluate_params: dict = d["evaluate_params"],
        report_params: dict = d["report_params"],
        publish_params: dict = d["publish_params"],
        heldout_data: str = d["heldout_data"],  # hidden (`_signed`) when the configuration has none
        **settings: Any,  # the settings inputs (`runtime`), by parameter name
    ) -> Outputs:
        def stage(name: str, task: Any, label: str | None = None) -> Any:
            inputs = {setting: settings[parameter.name] for setting, parameter in runtime.get(name, {}).items()}
            return _configure(task, name, config, label, inputs)

        # With quantize on, publish releases the quantized checkpoint, not the pruned one: it is the model the quantize
        # step exists to ship, one `to`/`repo` holds one checkpoint, and its card still shows the pruned model's
        # accuracy beside it (the pruned checkpoint stays in the storage root and in `pruned_models`).
        quantize_on = bool(config.stage_params("quantize").get("recipe"))

        scores = stage(
            "calibrate", comps.calibrate(model=model, data=calibration_data, storage_root=storage_root, params=calibrate_params)
        )
        cache = stage(
            "cache-logits",
            comps.cache_logits(model=model, data=search_data, storage_root=storage_root, params=cache_logits_params),
            "cache-logits search set",
        )
        heldout = {}
        if config.heldout_data:
            heldout["heldout_cache"] = stage(
                "cache-logits",
                comps.cache_logits(model=model, data=heldout_data, storage_root=storage_root, params=cache_logits_params),
                "cache-logits held-out set",
            ).outputs["cache"]
        teacher = {"teacher_cache": heldout["heldout_cache"]} if heldout else {}
        full = stage(
            "evaluate", comps.evaluate(model=model, storage_root=storage_root, params=evaluate_params, **teacher), "evaluate full"
        )
        with dsl.ParallelFor(grid, name="criterion-x-sparsity", parallelism=config.parallelism) as point:
            point_args = dict(criterion=point.criterion, sparsity=point.sparsity, storage_root=storage_root)
            search_args = dict(
                model=model,
                scores=scores.outputs["scores"],
                cache=cache.outputs["cache"],
                params=search_params,
                **heldout,
                **point_args,
            )
            if config.search_workers > 1:  # a Kubeflow Trainer job that this task launches and follows
                searched = _search_trainjob(config, search_args)
            else:
                searched = stage("search", comps.search(**search_args))
            allocations = {"searched": {"allocation": searched.outputs["allocation"]}, "uniform": {}}  # uniform: none
            pruned = {
                method: stage("prune", comps.prune(model=model, scores=scores.outputs["scores"], params=prune_params,
                                                   **allocation, **point_args), f"prune {method}")
                for method, allocation in allocations.items()
            }  # fmt: skip
            evals = {
                method: stage("evaluate", comps.evaluate(model=task.outputs["pruned"], storage_root=storage_root,
                                                         params=evaluate_params, **teacher), f"evaluate {method}")
                for method, task in pruned.items()
            }  # fmt: skip
            release = {}  # what publish releases: the searched checkpoint, or its quantized one when quantize is on
            if quantize_on:  # opt-in: the searched checkpoint quantized, and evaluated for the report and the card
                quantized = stage("quantize", comps.quantize(model=pruned["searched"].outputs["pruned"],
                                                             data=calibration_data, storage_root=storage_root,
                                                             params=config.stage_params("quantize")),
                                  "quantize searched")  # fmt: skip
                evals["quantized"] = stage("evaluate", comps.evaluate(model=quantized.outputs["quantized"],
                                                                      storage_root=storage_root,
                                                                      params=evaluate_params, **teacher),
                                           "evaluate quantized")  # fmt: skip
                release = {"quantized": quantized.outputs["quantized"],
                           "quantized_evaluation": evals["quantized"].outputs["evaluation"]}  # fmt: skip
            verdict = _gate(stage, comps, config, evals["quantized" if quantize_on else "searched"], full, storage_root)
            if config.publish_models:
                with _when_passed(verdict):
                    stage("publish", comps.publish(pruned=pruned["searched"].outputs["pruned"], storage_root=storage_root,
                                                   evaluation=evals["searched"].outputs["evaluation"],
                                                   full_evaluation=full.outputs["evaluation"],
                                                   search=searched.outputs["allocation"], params=publish_params,
                                                   **release, **_verdict_input(verdict)),
                          "publish quantized" if quantize_on else "publish searched")  # fmt: skip
        report = stage(
            "report",
            comps.report(
                full=full.outputs["evaluation"],
                searched=dsl.Collected(evals["searched"].outputs["evaluation"]),
                uniform=dsl.Collected(evals["uniform"].outputs["evaluation"]),
                searches=dsl.Collected(searched.outputs["allocation"]),
                storage_root=storage_root,
                params=report_params,
                **({"quantized": dsl.Collected(evals["quantized"].outputs["evaluation"])} if quantize_on else {}),
                **({"gates": dsl.Collected(verdict.outputs["verdict"])} if verdict is not None else {}),
            ),
        )
        outputs = dict(
            report=report.outputs["markdown"],
            report_html=report.outputs["page"],
            # the prune outputs themselves: no importer in the loop (a cluster's importer takes object-store URIs
            # only, and kubeflow/pipelines#10860: importers inside a ParallelFor); the checkpoint is at metadata["uri"]
            pruned_models=dsl.Collected(pruned["searched"].outputs["pruned"]),
        )
        if verdict is None:
            return Outputs(**outputs)
        _end_on_failed_gate(config, verdict, report)
        return GatedOutputs(**outputs, verdicts=dsl.Collected(verdict.outputs["verdict"]))

    extra = [parameter for by_setting in runtime.values() for parameter in by_setting.values()]
    func = _gated(_signed(evoesap_stages, () if config.heldout_data else ("heldout_data",), extra), config)
    description = "EvoESAP stages: calibrate ... report, for a given full model"
    return dsl.pipeline(name=f"{config.name}-stages", description=description)(func)


def build_pipeline(config: PipelineConfig) -> Callable:
    """The standalone pipeline: the full model given by path, URI or hub name, then the DAG.

    The model reaches the stages as a reference (`components.reference`): a cluster's importer takes object-store
    URIs only, so a hub name or a path cannot be imported there. A hub model's revision rides in the `model`
    parameter itself (`org/name@REV`, the configuration's `pinned_model`), never in metadata compiled with a
    run-time placeholder, which a cluster would store unresolved."""
    stages = build_subpipeline(config)
    d = _defaults(config)
    reference = make_reference(config.default_image)

    def evoesap_pipeline(
        model: str = config.pinned_model,
        calibration_data: str = d["calibration_data"],
        search_data: str = d["search_data"],
        storage_root: str = d["storage_root"],
        grid: list = d["grid"],
        calibrate_params: dict = d["calibrate_params"],
        cache_logits_params: dict = d["cache_logits_params"],
        search_params: dict = d["search_params"],
        prune_params: dict = d["prune_params"],
        evaluate_params: dict = d["evaluate_params"],
        report_params: dict = d["report_params"],
        publish_params: dict = d["publish_params"],
        heldout_data: str = d["heldout_data"],  # hidden (`_signed`) when the configuration has none
    ) -> Outputs:
        named = cluster.apply(reference(model=model), config.resources.get("all") or cluster.StageSettings(), config.retries)
        named.set_display_name("model").set_caching_options(enable_caching=False)
        run = stages(
            model=named.outputs["reference"],
            calibration_data=calibration_data,
            search_data=search_data,
            **({"heldout_data": heldout_data} if config.heldout_data else {}),
            storage_root=storage_root,
            grid=grid,
            calibrate_params=calibrate_params,
            cache_logits_params=cache_logits_params,
            search_params=search_params,
            prune_params=prune_params,
            evaluate_params=evaluate_params,
            report_params=report_params,
            publish_params=publish_params,
        ).set_caching_options(enable_caching=False)
        outputs = dict(
            report=run.outputs["report"], report_html=run.outputs["report_html"], pruned_models=run.outputs["pruned_models"]
        )
        return GatedOutputs(**outputs, verdicts=run.outputs["verdicts"]) if gated(config) else Outputs(**outputs)

    func = _gated(evoesap_pipeline if config.heldout_data else _signed(evoesap_pipeline, ("heldout_data",)), config)
    return dsl.pipeline(name=config.name, description="EvoESAP: ESAP-guided non-uniform expert pruning")(func)


def compile_pipeline(config: PipelineConfig, out: str | Path) -> Path:
    """Write the pipeline spec YAML that a Kubeflow Pipelines cluster runs unchanged."""
    out = claim_output_file(Path(out), "--output", SPEC_MARKER)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.partial-") as tmp:
        staged = Path(tmp) / out.name
        compiler.Compiler().compile(build_pipeline(config), str(staged))
        os.replace(staged, out)  # a reader never sees half a spec
    return out
