"""The EvoESAP DAG as a KFP pipeline, built from one validated configuration.

calibrate and cache-logits run once; for each criterion x sparsity a search, a searched and a uniform
prune, and their evaluations fan out (ParallelFor); when the `quantize` section names a recipe, the searched
checkpoint's quantize step and its evaluation; with `publish_models` the publish (model card, push) of the searched
model, or of its quantized checkpoint when quantize is on; when the `gate` section sets a threshold, the gate's verdict
on that model decides what publish does (it releases on a passing one and hands on a withheld entry on a failing one),
heads the report and is an output (`verdicts`, and `verdict`: "pass" or "fail"), and with `stop_on_fail` (a run-time value of `gate_params`) a failing one ends the run after the report. The
full model is evaluated once; the report collects everything; each searched prune output is handed on (`pruned_models`). `build_subpipeline` is that DAG for a
full model given as an artifact (a step of another pipeline), with pod settings the outer pipeline overrides or
binds; `build_pipeline` names the model (a path, URI or hub name) by a reference step and runs it.
"""

# No `from __future__ import annotations`: kfp reads the pipeline function's real annotations.
import functools
import inspect
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, List, Mapping, NamedTuple

from evoesap.components import StageComponents, make_components
from evoesap.components.reference import make_reference
from evoesap.components.target import make_target_check, make_target_finder
from evoesap.components.trainjob import make_search_trainjob
from evoesap.components.verdict import make_verdict_check
from evoesap.components.workspace import make_model_to_workspace
from evoesap.pipeline import cluster, trainjob
from evoesap.pipeline.config import ModelWorkspace, PipelineConfig, with_resources
from evoesap.pipeline.feasibility import check_grid
from evoesap.pipeline.files import SPEC_MARKER, claim_output_file
from kfp import compiler, dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Model

from evoesap.errors import ConfigError
from evoesap.network import refuse_credentials
from evoesap.params import PlacementParams
from evoesap.registry import MODEL_STAGES, NAMES, STAGES
from evoesap.registry import get as get_stage


def _configure(
    task: Any,
    stage: str,
    config: PipelineConfig,
    label: str | None = None,
    inputs: dict[str, Any] | None = None,
    retries: int | None = None,
) -> Any:
    """Display name, caching and Kubernetes settings (`pipeline.cluster`) of one task; `inputs`: the settings
    that the sub-pipeline's parameters give (`settings_parameters`); `retries`: in place of the configured ones."""
    task.set_display_name(label or stage)
    # Never KFP's cache: it would return an output whose payload was deleted or changed in storage. Each
    # stage checks its own finished output instead (manifest, inputs' identity, payload sha256).
    task.set_caching_options(enable_caching=False)
    settings = config.settings(stage)
    if retries is not None:
        settings = settings.model_copy(update={"retries": retries})
    return cluster.apply(task, settings, config.retries, inputs)


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
    default the configured value, for each `<stage>.<setting>` of `names` (`cluster.RUNTIME_SETTINGS`). A multi-worker
    search takes them as inputs of its launcher (`_search_trainjob`), where an empty value keeps the compiled one."""
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
        }.get(stage)
        if absent:
            raise ConfigError(f"{where}: the DAG has no {stage} task to set, since {absent}")
        # a multi-worker search's launcher takes them as inputs, not as its pod's settings; a quality target's finder
        # runs the search in a pod of its own, which takes them as any stage's pod does
        launched = stage == "search" and config.search_workers > 1 and not quality_target(config)
        if setting == "queue_name" and not launched:
            raise ConfigError(
                f"{where}: KFP takes a pod label from no pipeline input, so only a multi-worker search (workers > 1, "
                f"no quality target) takes its queue at run time, on its TrainJob; set resources.{stage}.queue_name "
                "when building (`overrides`)"
            )
        if setting.startswith("accelerator") and stage not in MODEL_STAGES:
            raise ConfigError(f"{where}: {stage} loads no model; stages that can use an accelerator: {', '.join(MODEL_STAGES)}")
        settings = config.settings(stage)
        default = config.stage_image(stage) if setting == "image" else cluster.runtime_default(settings, setting)
        if default is None and launched:
            default = ""  # the launcher keeps the compiled (unset) value
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
    `extra` keyword parameters it takes through `**`, those without a default first (as Python orders them)."""
    signature = inspect.signature(func)
    kept = [p for p in signature.parameters.values() if p.name not in drop and p.kind is not p.VAR_KEYWORD]
    parameters = kept + [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in extra]
    parameters.sort(key=lambda p: p.default is not p.empty)  # stable: the order stays within each kind
    names = [p.name for p in parameters]

    @functools.wraps(func)
    def pipeline(*args: Any) -> Any:
        return func(**dict(zip(names, args)))

    pipeline.__signature__ = signature.replace(parameters=parameters)
    return pipeline


def _search_trainjob(config: PipelineConfig, args: dict[str, Any], inputs: Mapping[str, Any]) -> Any:
    """The search task of a `workers > 1` configuration: the launcher (`pipeline.trainjob`), whose own pod asks for
    no compute; the job's nodes get the search's image, resources and environment. `inputs`: the search's settings
    that sub-pipeline parameters give (`settings_parameters`), bound to the launcher's inputs of the same names, which
    it lays over the compiled template; its own pod takes only the image from them."""
    settings, image = config.settings("search"), config.stage_image("search")
    job = trainjob.job_template(settings, image, config.parsed_params("search").gpus_per_worker)
    task = make_search_trainjob(image)(job=job, **args, **inputs)
    task.set_display_name(f"search on {config.search_workers} workers (TrainJob)")
    task.set_caching_options(enable_caching=False)
    own = {name: value for name, value in inputs.items() if name == "image"}  # the same code as its workers
    return cluster.apply(task, trainjob.launcher_settings(settings), config.retries, own)


class Outputs(NamedTuple):
    report: Markdown
    report_html: HTML
    pruned_models: List[Model]


def gated(config: PipelineConfig) -> bool:
    """Whether the configuration's `gate` section sets a threshold (then the DAG gates publish and reports verdicts)."""
    return config.parsed_params("gate").active


def _gate(stage: Callable, comps: Any, config: PipelineConfig, candidate: Any, full: Any, storage_root: Any, params: Any) -> Any:
    """The gate task judging `candidate` (the evaluate task of the model publish would release) against the full
    model's evaluation and the previous release's metrics; None when the configuration sets no threshold (whether
    it does decides the DAG's shape: publish takes the verdict). `params`: its `gate_params` input."""
    if not gated(config):
        return None
    task = comps.gate(
        evaluation=candidate.outputs["evaluation"],
        full_evaluation=full.outputs["evaluation"],
        storage_root=storage_root,
        previous=config.previous_metrics or "",
        params=params,
    )
    return stage("gate", task, "gate")


def _verdict_input(verdict: Any) -> dict[str, Any]:
    """publish's `gate` input: the verdict, which publish decides on itself. Publish runs after every gate, under no
    condition (KFP cannot collect, out of a ParallelFor, an output of a task that may be skipped), so `released_models`
    is an output of every run: on a passing verdict the release, whose lineage names the gate it passed; on a failing
    one nothing is published and its component hands on a withheld entry (`kfp_artifacts.withhold`), as publish run by
    hand refuses a failing verdict."""
    return {} if verdict is None else {"gate": verdict.outputs["verdict"]}


def _gathered_verdict(config: PipelineConfig, verdict: Any, report: Any, params: Any) -> Any:
    """The last task, after the report: "pass" when every point's verdict passed, else "fail" (the `verdict` output a
    caller branches on); with `stop_on_fail` in `params` (the `gate_params` input, read at run time) a failing verdict
    instead fails the run with the failing verdicts' one line."""
    task = make_verdict_check(config.stage_image("gate"))(verdicts=dsl.Collected(verdict.outputs["verdict"]), params=params)
    task.after(report)
    return _configure(task, "gate", config, "release gate", retries=0)  # a refusal is deterministic: a retry only repeats it


def quality_target(config: PipelineConfig) -> bool:
    """Whether the sparsities are found at run time (`target: {heldout_esap: X}` or `{gate: true}`): a task before the fan-out bisects
    the grid and hands on its points (a `bytes` target is computed at compile: see `PipelineConfig.grid`)."""
    return config.target is not None and config.target.quality


def _hidden(config: PipelineConfig) -> tuple[str, ...]:
    """The pipeline inputs no task of this configuration reads: the compiled grid or the target's threshold (whichever
    the fan-out does not take), and the held-out data when there is none."""
    hidden = ("grid",) if quality_target(config) else ("target_params",)
    return hidden + (() if config.heldout_data else ("heldout_data",))


def _found_grid(dag: "_Dag", target_params: Any) -> Any:
    """The fan-out of a quality target: the task that finds each criterion's sparsity (`components.target`), its
    probes under the storage root; it runs the searches, so it takes the search stage's pod settings. Its decisions
    go to the report (`dag.target`)."""
    finder = make_target_finder(dag.config.stage_image("search"))
    task = finder(
        model=dag.model,
        scores=dag.scores.outputs["scores"],
        cache=dag.cache.outputs["cache"],
        heldout_cache=dag.heldout["heldout_cache"],
        storage_root=dag.root,
        criteria=list(dag.config.criteria),
        target=target_params,
        params=dag.params["search"],
        **_gate_target_inputs(dag),
        **dag.ws,
    )
    dag.target = dag.stage("search", task, "target: find the sparsities")
    return dag.target.outputs["Output"]


def _target_check(config: PipelineConfig, finder: Any, report: Any) -> Any:
    """The task after the report that ends the run when a criterion missed the quality target (`check_targets`): the
    finder hands on only the criteria that met it, so the report shows every decision first."""
    task = make_target_check(config.stage_image("report"))(decisions=finder.outputs["decisions"])
    task.after(report)
    return _configure(task, "report", config, "target: every criterion met", retries=0)  # a miss is deterministic


def _gate_target_inputs(dag: "_Dag") -> dict[str, Any]:
    """What the finder of a gate target (`target: {gate: true}`) judges each probe with: the full model's evaluation,
    the previous release's metrics and the prune, evaluate and gate parameters the point's own tasks take."""
    if not dag.config.target.gate:
        return {}
    sections = {f"{stage}_params": dag.params[stage] for stage in ("prune", "evaluate", "gate")}
    return dict(full_evaluation=dag.full.outputs["evaluation"], previous=dag.config.previous_metrics or "", **sections)


def outputs_type(config: PipelineConfig) -> type:
    """What the (sub-)pipeline hands on, typed for KFP: the report, the searched pruned models and their metrics (one
    per criterion x sparsity), the full model's metrics; the quantized models and their metrics when the quantize
    section names a recipe; the published checkpoints (`released_models`, a withheld entry for a release the gate refused)
    with publish_models; each point's verdict
    (`verdicts`: gate.json, metadata `passed` and `verdict`, its one line) and their sum (`verdict`: "pass" when
    every point passed, else "fail"; with `stop_on_fail` a failing one ends the run instead) with a gate. A pipeline
    output must come from a task, so the optional ones exist only when their step does."""
    fields = [*Outputs.__annotations__.items(), ("pruned_metrics", List[Metrics]), ("full_metrics", Metrics)]
    if config.stage_params("quantize").get("recipe"):
        fields += [("quantized_models", List[Model]), ("quantized_metrics", List[Metrics])]
    if config.publish_models:
        fields.append(("released_models", List[Model]))
    if gated(config):
        fields += [("verdicts", List[Artifact]), ("verdict", str)]
    return NamedTuple("Outputs", fields)


def _returning(func: Callable, returns: type) -> Callable:
    """`func` as KFP reads it, its return annotation `returns` (`outputs_type`)."""
    func.__signature__ = inspect.signature(func).replace(return_annotation=returns)
    return func


def _defaults(config: PipelineConfig, gpus_at_run_time: Iterable[str] = ()) -> dict[str, Any]:
    """The pipeline parameters' defaults: the configuration's values. `gpus_at_run_time`: the stages whose GPU count
    is a sub-pipeline input."""

    def params(stage: Any) -> dict[str, Any]:  # a stage that places its model itself may spread it over the GPUs
        if issubclass(stage.params_class(), PlacementParams):
            return _gpu_params(stage.name, config, stage.name in gpus_at_run_time)
        return config.stage_params(stage.name)

    return {
        "calibration_data": config.calibration_data,
        "search_data": config.search_data,
        "heldout_data": config.heldout_data or "",
        "storage_root": config.storage_root,
        "grid": [] if quality_target(config) else config.grid(),
        "target_params": config.target.model_dump(exclude_none=True) if quality_target(config) else {},
        **{params_input(stage.name): params(stage) for stage in STAGES},
    }


def params_input(stage: str) -> str:
    """The pipeline input that carries a stage's parameters (`<section>_params`, a dict)."""
    return f"{get_stage(stage).section}_params"


def _params_parameters(config: PipelineConfig, defaults: Mapping[str, Any]) -> list[inspect.Parameter]:
    """One `<section>_params: dict` pipeline input per stage of the registry, its default the configured section;
    quantize's and the gate's only when the DAG has that task (a recipe, a threshold), since an input no task reads
    would take a `--set` silently."""
    absent = {"quantize": not config.stage_params("quantize").get("recipe"), "gate": not gated(config)}
    return [
        inspect.Parameter(
            params_input(s.name), inspect.Parameter.KEYWORD_ONLY, default=defaults[params_input(s.name)], annotation=dict
        )
        for s in STAGES
        if not absent.get(s.name, False)
    ]


def workspace_config(config: PipelineConfig, model_workspace: ModelWorkspace | Mapping[str, Any] | None = None) -> Any:
    """The `pipeline_config` of the pipeline that embeds the DAG: the run's workspace (`model_workspace`, else the
    configuration's), or None without one. KFP creates a run's workspace from its root pipeline's config only, so the
    embedding pipeline passes it: `@dsl.pipeline(pipeline_config=workspace_config(config))`."""
    chosen = _model_workspace(config, model_workspace)
    if chosen is None:
        return None
    kubernetes = dsl.KubernetesWorkspaceConfig(pvcSpecPatch=chosen.pvc_spec_patch) if chosen.pvc_spec_patch else None
    return dsl.PipelineConfig(workspace=dsl.WorkspaceConfig(size=chosen.size, kubernetes=kubernetes))


def _model_workspace(config: PipelineConfig, given: ModelWorkspace | Mapping[str, Any] | None) -> ModelWorkspace | None:
    """The workspace the model is downloaded into: `given` (validated as the configuration's), else the configuration's."""
    if given is None:
        return config.model_workspace
    if isinstance(given, ModelWorkspace):
        return given
    try:
        return ModelWorkspace.model_validate(dict(given))
    except (TypeError, ValueError) as exc:
        problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in getattr(exc, "errors", lambda: [])())
        raise ConfigError(f"model_workspace {given!r}: {problems or exc}; e.g. {{'size': '200Gi'}}") from None


def _in_workspace(config: PipelineConfig, model: Any, workspace: Any) -> Any:
    """The model artifact copied once into the run's workspace (`components.workspace`): a reference naming the copy,
    which is all each stage pod then downloads."""
    task = make_model_to_workspace(config.default_image)(model=model, workspace=workspace)
    cluster.apply(task, config.resources.get("all") or cluster.StageSettings(), config.retries)
    task.set_display_name("model into the workspace").set_caching_options(enable_caching=False)
    return task.outputs["reference"]


WORKSPACE_INPUT = inspect.Parameter("workspace", inspect.Parameter.KEYWORD_ONLY, annotation=str)
# the sub-pipeline's input that the embedding pipeline binds to dsl.WORKSPACE_PATH_PLACEHOLDER: a task given the
# placeholder gets the workspace mounted, and KFP's SDK refuses a pipeline that gives it without declaring a workspace,
# so a team pipeline that forgets `workspace_config` is refused when defined, not left waiting for a volume on a cluster


def build_subpipeline(
    config: PipelineConfig,
    overrides: Mapping[str, Any] | None = None,
    settings_inputs: Iterable[str] = (),
    model_workspace: ModelWorkspace | Mapping[str, Any] | None = None,
) -> Callable:
    """The whole EvoESAP DAG as a pipeline that takes the full model as an artifact (`Input[Model]`).

    Use it as a step of another pipeline: `evoesap = build_subpipeline(config)`, then
    `evoesap(model=train_task.outputs["model"])`; its outputs are the report (Markdown, HTML) and the
    searched pruned model of every criterion x sparsity point (`pruned_models`, a list of `dsl.Model`).
    `overrides`: pod settings in the schema of the configuration's `resources` section, merged over it.
    `settings_inputs`: `<stage>.<setting>` names (`cluster.RUNTIME_SETTINGS`) that become inputs
    `<section>_<setting>` the outer pipeline binds at run time, e.g. `search.accelerator_count` ->
    `search_accelerator_count: str`, its default the configured value.
    `model_workspace` (else the configuration's): the model is downloaded once into the run's KFP workspace and every
    stage reads it there, where without it each stage pod downloads it; the sub-pipeline then takes a required input
    `workspace`, which the embedding pipeline binds to `dsl.WORKSPACE_PATH_PLACEHOLDER`, and the embedding pipeline
    declares the workspace (`pipeline_config=workspace_config(config)`).
    """
    workspace = _model_workspace(config, model_workspace)
    if workspace is not None and config.search_workers > 1:
        raise ConfigError(
            f"model_workspace: a multi-worker search (search.workers {config.search_workers}) runs in TrainJob pods, which "
            "do not mount the run's workspace: search with one worker, or drop model_workspace"
        )
    if overrides:
        config = with_resources(config, overrides)
    runtime = settings_parameters(config, settings_inputs)
    if not quality_target(config):  # a target's points are grid sparsities by construction
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
        heldout_data: str = d["heldout_data"],  # hidden (`_signed`) when the configuration has none
        target_params: dict = d["target_params"],  # hidden without a quality target, `grid` with one
        **settings: Any,  # each stage's `<section>_params`, then the settings inputs (`runtime`), by parameter name
    ) -> Any:  # outputs_type(config)
        def given(name: str) -> dict[str, Any]:  # a stage's settings that parameters carry, by setting
            return {setting: settings[parameter.name] for setting, parameter in runtime.get(name, {}).items()}

        def stage(name: str, task: Any, label: str | None = None) -> Any:
            return _configure(task, name, config, label, given(name))

        params = {name: settings.get(params_input(name)) for name in NAMES}
        in_workspace = settings.get(WORKSPACE_INPUT.name)  # the run's workspace path, with model_workspace
        if in_workspace is not None:
            model = _in_workspace(config, model, in_workspace)
        dag = _Dag(config, comps, stage, model, storage_root, params, given("search"), in_workspace)
        full = dag.once(calibration_data, search_data, heldout_data)
        points = _found_grid(dag, target_params) if quality_target(config) else grid
        with dsl.ParallelFor(points, name="criterion-x-sparsity", parallelism=config.parallelism) as point:
            searched, pruned, evals = dag.point(point, calibration_data)
        report = dag.report(full, searched, evals)
        if dag.target is not None:
            _target_check(config, dag.target, report)
        handed = dict(
            report=report.outputs["markdown"],
            report_html=report.outputs["page"],
            # the prune outputs themselves: no importer in the loop (a cluster's importer takes object-store URIs
            # only, and kubeflow/pipelines#10860: importers inside a ParallelFor); the checkpoint is at metadata["uri"]
            pruned_models=dsl.Collected(pruned["searched"].outputs["pruned"]),
            pruned_metrics=dsl.Collected(evals["searched"].outputs["metrics"]),
            full_metrics=full.outputs["metrics"],
        )
        if dag.quantize_on:
            handed["quantized_models"] = dsl.Collected(dag.release["quantized"])
            handed["quantized_metrics"] = dsl.Collected(evals["quantized"].outputs["metrics"])
        if config.publish_models:
            handed["released_models"] = dsl.Collected(dag.released.outputs["published"])
        if dag.verdict is not None:
            handed["verdicts"] = dsl.Collected(dag.verdict.outputs["verdict"])
            handed["verdict"] = _gathered_verdict(config, dag.verdict, report, dag.params["gate"]).output
        return outputs(**handed)

    outputs = outputs_type(config)
    extra = [*_params_parameters(config, d), *(parameter for by_setting in runtime.values() for parameter in by_setting.values())]
    extra += [WORKSPACE_INPUT] if workspace is not None else []
    func = _returning(_signed(evoesap_stages, _hidden(config), extra), outputs)
    description = "EvoESAP stages: calibrate ... report, for a given full model"
    return dsl.pipeline(name=f"{config.name}-stages", description=description)(func)


class _Dag:
    """The tasks of the DAG, step by step: what runs once (`once`), what runs per criterion x sparsity point
    (`point`, inside the ParallelFor), and the report over all of them (`report`)."""

    def __init__(
        self,
        config: PipelineConfig,
        comps: Any,
        stage: Callable,
        model: Any,
        storage_root: Any,
        params: Mapping[str, Any],
        search_settings: Mapping[str, Any],
        workspace: Any = None,
    ) -> None:
        self.config, self.comps, self.stage, self.model, self.root, self.params = (
            config,
            comps,
            stage,
            model,
            storage_root,
            params,
        )
        self.search_settings = search_settings  # the search's settings given at run time, for a multi-worker launcher
        # the tasks that take the full model, when it lies in the run's workspace (`workspace`: its path, the sub-pipeline's
        # input), which KFP mounts into a task given it
        self.ws = {"workspace": workspace} if workspace is not None else {}
        self.scores = self.cache = self.full = self.released = None  # released: the publish task, with publish_models
        self.verdict = None  # the gate task, when the configuration sets a threshold
        self.target = None  # the task finding each criterion's sparsity, with a quality target
        self.release: dict[str, Any] = {}  # what publish releases instead of the pruned checkpoint (quantize on)
        self.heldout: dict[str, Any] = {}  # the held-out teacher cache, as the search's input
        self.teacher: dict[str, Any] = {}  # the same cache, as the evaluations' input
        # With quantize on, publish releases the quantized checkpoint, not the pruned one: it is the model the quantize
        # step exists to ship, one `to`/`repo` holds one checkpoint, and its card still shows the pruned model's
        # accuracy beside it (the pruned checkpoint stays in the storage root and in `pruned_models`).
        self.quantize_on = bool(config.stage_params("quantize").get("recipe"))

    def once(self, calibration_data: Any, search_data: Any, heldout_data: Any) -> Any:
        """calibrate, the teacher caches and the full model's evaluation; returns that evaluation's task."""
        comps, stage, model, root, p = self.comps, self.stage, self.model, self.root, self.params
        self.scores = stage(
            "calibrate", comps.calibrate(model=model, data=calibration_data, storage_root=root, params=p["calibrate"], **self.ws)
        )
        self.cache = stage(
            "cache-logits",
            comps.cache_logits(model=model, data=search_data, storage_root=root, params=p["cache-logits"], **self.ws),
            "cache-logits search set",
        )
        if self.config.heldout_data:
            self.heldout["heldout_cache"] = stage(
                "cache-logits",
                comps.cache_logits(model=model, data=heldout_data, storage_root=root, params=p["cache-logits"], **self.ws),
                "cache-logits held-out set",
            ).outputs["cache"]
        self.teacher = {"teacher_cache": self.heldout["heldout_cache"]} if self.heldout else {}
        self.full = stage(
            "evaluate",
            comps.evaluate(model=model, storage_root=root, params=p["evaluate"], **self.teacher, **self.ws),
            "evaluate full",
        )
        return self.full

    def point(self, point: Any, calibration_data: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """One criterion x sparsity point: the search, the searched and uniform prunes, their evaluations, and the
        quantize and publish steps when configured. Returns (search task, prune tasks, evaluate tasks) by method."""
        comps, stage, model, root, p = self.comps, self.stage, self.model, self.root, self.params
        point_args = dict(criterion=point.criterion, sparsity=point.sparsity, storage_root=root)
        search_args = dict(
            model=model,
            scores=self.scores.outputs["scores"],
            cache=self.cache.outputs["cache"],
            params=p["search"],
            **self.heldout,
            **point_args,
        )
        if self.config.search_workers > 1:  # a Kubeflow Trainer job that this task launches and follows
            searched = _search_trainjob(self.config, search_args, self.search_settings)
        else:
            searched = stage("search", comps.search(**search_args, **self.ws))
        allocations = {"searched": {"allocation": searched.outputs["allocation"]}, "uniform": {}}  # uniform: none
        pruned = {
            method: stage("prune", comps.prune(model=model, scores=self.scores.outputs["scores"], params=p["prune"],
                                               **allocation, **point_args, **self.ws), f"prune {method}")
            for method, allocation in allocations.items()
        }  # fmt: skip
        evals = {
            method: stage("evaluate", comps.evaluate(model=task.outputs["pruned"], storage_root=root,
                                                     params=p["evaluate"], **self.teacher), f"evaluate {method}")
            for method, task in pruned.items()
        }  # fmt: skip
        self.release = self._quantize(pruned["searched"], evals, calibration_data) if self.quantize_on else {}
        candidate = evals["quantized" if self.quantize_on else "searched"]  # the model publish would release
        self.verdict = _gate(stage, comps, self.config, candidate, self.full, root, p["gate"])
        if self.config.publish_models:
            self.released = self._publish(pruned["searched"], evals["searched"], searched, self.release)
        return searched, pruned, evals

    def _quantize(self, pruned: Any, evals: dict[str, Any], calibration_data: Any) -> dict[str, Any]:
        """Opt-in: the searched checkpoint quantized, and evaluated (`evals["quantized"]`) for the report and the
        card; returns what publish releases instead of the pruned checkpoint."""
        comps, stage, root, p = self.comps, self.stage, self.root, self.params
        quantized = stage("quantize", comps.quantize(model=pruned.outputs["pruned"], data=calibration_data,
                                                     storage_root=root, params=p["quantize"]),
                          "quantize searched")  # fmt: skip
        evals["quantized"] = stage("evaluate", comps.evaluate(model=quantized.outputs["quantized"], storage_root=root,
                                                              params=p["evaluate"], **self.teacher),
                                   "evaluate quantized")  # fmt: skip
        return {"quantized": quantized.outputs["quantized"], "quantized_evaluation": evals["quantized"].outputs["evaluation"]}

    def _publish(self, pruned: Any, evaluated: Any, searched: Any, release: dict[str, Any]) -> Any:
        return self.stage("publish", self.comps.publish(pruned=pruned.outputs["pruned"], storage_root=self.root,
                                                 evaluation=evaluated.outputs["evaluation"],
                                                 full_evaluation=self.full.outputs["evaluation"],
                                                 search=searched.outputs["allocation"], params=self.params["publish"],
                                                 **release, **_verdict_input(self.verdict)),
                   "publish quantized" if self.quantize_on else "publish searched")  # fmt: skip

    def report(self, full: Any, searched: Any, evals: dict[str, Any]) -> Any:
        """The report over the full model's evaluation and every point's searched, uniform (and quantized) ones, the
        gate's verdicts and the quality target's decisions."""
        return self.stage(
            "report",
            self.comps.report(
                full=full.outputs["evaluation"],
                searched=dsl.Collected(evals["searched"].outputs["evaluation"]),
                uniform=dsl.Collected(evals["uniform"].outputs["evaluation"]),
                searches=dsl.Collected(searched.outputs["allocation"]),
                storage_root=self.root,
                params=self.params["report"],
                **({"quantized": dsl.Collected(evals["quantized"].outputs["evaluation"])} if self.quantize_on else {}),
                **({"gates": dsl.Collected(self.verdict.outputs["verdict"])} if self.verdict is not None else {}),
                **({"decisions": self.target.outputs["decisions"]} if self.target is not None else {}),
            ),
        )


def build_pipeline(config: PipelineConfig) -> Callable:
    """The standalone pipeline: the full model given by path, URI or hub name, then the DAG.

    The model reaches the stages as a reference (`components.reference`): a cluster's importer takes object-store
    URIs only, so a hub name or a path cannot be imported there. A hub model's revision rides in the `model`
    parameter itself (`org/name@REV`, the configuration's `pinned_model`), never in metadata compiled with a
    run-time placeholder, which a cluster would store unresolved."""
    if config.model_workspace is not None:
        raise ConfigError(
            f"model_workspace (size {config.model_workspace.size}) downloads a model handed in as an artifact once per "
            "run, but the standalone pipeline names its model and every stage reads it from there: drop model_workspace, "
            "or embed the DAG with build_subpipeline"
        )
    stages = build_subpipeline(config)
    d = _defaults(config)
    reference = make_reference(config.default_image)

    def evoesap_pipeline(
        model: str = config.pinned_model,
        calibration_data: str = d["calibration_data"],
        search_data: str = d["search_data"],
        storage_root: str = d["storage_root"],
        grid: list = d["grid"],
        heldout_data: str = d["heldout_data"],  # hidden (`_signed`) when the configuration has none
        target_params: dict = d["target_params"],  # hidden without a quality target, `grid` with one
        **params: dict,  # each stage's `<section>_params`
    ) -> Any:  # outputs_type(config)
        fanned = {"grid": grid, "heldout_data": heldout_data, "target_params": target_params}
        named = cluster.apply(reference(model=model), config.resources.get("all") or cluster.StageSettings(), config.retries)
        named.set_display_name("model").set_caching_options(enable_caching=False)
        run = stages(
            model=named.outputs["reference"],
            calibration_data=calibration_data,
            search_data=search_data,
            storage_root=storage_root,
            **{name: value for name, value in fanned.items() if name not in _hidden(config)},
            **params,
        ).set_caching_options(enable_caching=False)
        return outputs(**{name: run.outputs[name] for name in outputs._fields})

    outputs = outputs_type(config)
    func = _returning(_signed(evoesap_pipeline, _hidden(config), _params_parameters(config, d)), outputs)
    return dsl.pipeline(name=config.name, description="EvoESAP: ESAP-guided non-uniform expert pruning")(func)


def compile_pipeline(config: PipelineConfig, out: str | Path) -> Path:
    """Write the pipeline spec YAML that a Kubeflow Pipelines cluster runs unchanged."""
    out = claim_output_file(Path(out), "--output", SPEC_MARKER)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.partial-") as tmp:
        staged = Path(tmp) / out.name
        compiler.Compiler().compile(build_pipeline(config), str(staged))
        for line in staged.read_text().splitlines():  # a value that did not come through the configuration's check
            refuse_credentials(line.strip(), "the compiled spec's line")
        os.replace(staged, out)  # a reader never sees half a spec
    return out
