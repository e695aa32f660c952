"""The stage registry: the one list of pipeline stages, from which everything that names a stage is derived.

Each stage is `run_<stage>(inputs..., params, out_uri) -> Manifest` in its own module of `evoesap.stages`, with a
frozen parameter dataclass whose fields carry their help (`evoesap.params`). The CLI verbs
(`evoesap.cli.stages`), the pipeline YAML's sections and their schema (`evoesap.pipeline.config`), the KFP
components (their typed signature, documentation and generic body: `evoesap.components`), the cluster settings and
the planner all read `STAGES`; adding a stage is its module plus one entry below. Entries name their code as strings, so reading the registry
imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from typing import Any

from evoesap.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KfpArgument:
    """An argument of a stage's KFP component that carries (part of) an input. KFP types a list of artifacts by what
    they are, so one input may arrive as several arguments (report's runs as full, uniform, searched, quantized),
    gathered back into the one input in their declared order."""

    name: str
    help: str  # its description in the component
    kind: str = "Dataset"  # an artifact (Model, Dataset, Artifact, Markdown), or str: a path, URI or hub name as text
    many: bool = False  # a list of artifacts
    required: bool = True
    # "module:function"(artifact) -> the URIs the stage reads for one artifact of this argument; None: the one URI
    # `kfp_artifacts.source` names (an artifact that stands for several, like the target finder's decisions, says which)
    read: str | None = None


@dataclasses.dataclass(frozen=True)
class StageInput:
    """An input of a stage: an artifact, a model or a data file, given by path, URI or hub name. One declaration
    for the CLI's option and the KFP component's argument(s)."""

    name: str
    help: str
    required: bool = True
    many: bool = False  # a list (the CLI option repeats)
    model: bool = False  # a model that a hub `revision` can pin
    kind: str = "Dataset"  # its KFP type (`KfpArgument.kind`)
    # the KFP component's arguments that carry it: None, one of its own name, kind and help; (): none (the CLI's
    # lineage only)
    kfp: tuple[KfpArgument, ...] | None = None

    @property
    def kfp_arguments(self) -> tuple[KfpArgument, ...]:
        if self.kfp is not None:
            return self.kfp
        return (KfpArgument(self.name, self.help, self.kind, self.many, self.required),)


@dataclasses.dataclass(frozen=True)
class StageOutput:
    """An output of a stage's KFP component: its name, its KFP artifact type (`kfp.dsl.<kind>`), what it holds, and
    the "module:function"(artifact, uri) that fills it from the stage's finished artifact at `uri`."""

    name: str
    kind: str  # Dataset, Artifact, Model, Metrics, Markdown or HTML
    help: str
    fill: str = "evoesap.components.kfp_artifacts:publish"


@dataclasses.dataclass(frozen=True)
class StageReturn:
    """A string a stage's KFP component returns besides its artifacts (the gate's "pass"/"fail" for the pipeline's
    condition): its meaning and the "module:function"(uri) that reads it off the stage's finished artifact."""

    help: str
    value: str


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str  # the CLI verb, the artifact's stage, the key of the cluster settings
    run: str  # "module:function" of run_<stage>
    params: str  # "module:class" of its parameter dataclass
    inputs: tuple[StageInput, ...]
    output: str  # what --out receives
    outputs: tuple[StageOutput, ...]  # what its KFP component writes (the CLI writes the one artifact at --out)
    summary: str  # one line: what the stage does
    example: str  # a command line that runs it
    loads_model: bool  # whether it runs the model (and may use an accelerator)
    grid: tuple[str, ...] = ()  # parameters set per point of the criterion x sparsity fan-out, not in its section
    peak: str | None = None  # "module:function" predicting its peak memory, disk and temp (evoesap.planning.footprint)
    fits_with: str = ""  # the settings that make it fit when its plan is refused
    facts: str | None = None  # "module:function": its artifact's headline numbers for KFP metadata (records.facts)
    # "module:function"(uri) -> str: one line on what its finished artifact found, which the CLI prints after it
    headline: str | None = None
    # "module:function"(arguments, params) -> params: what its KFP component adds to its params from its arguments
    # (evaluate's report labels from its model's metadata)
    kfp_params: str | None = None
    returns: StageReturn | None = None  # what its KFP component returns besides its artifacts
    # "module:function"(artifact, line): what its KFP component fills each output with when the release gate refused
    # the candidate (`GateFailed`, its verdict's one line), so the task succeeds and hands on typed outputs; None: the
    # refusal fails the task
    withheld: str | None = None

    @property
    def section(self) -> str:
        """Its key in the pipeline YAML and its attribute name in Python (`cache-logits` -> `cache_logits`)."""
        return self.name.replace("-", "_")

    def function(self) -> Callable[..., Any]:
        return load(self.run)

    def params_class(self) -> type:
        return load(self.params)

    def facts_function(self) -> Callable[[str], dict[str, Any]]:
        if self.facts is None:
            raise ConfigError(f"stage {self.name!r} has no facts")
        return load(self.facts)

    def peak_function(self) -> Callable[..., Any]:
        if self.peak is None:
            raise ConfigError(f"stage {self.name!r} has no memory formula")
        return load(self.peak)


def load(target: str) -> Any:
    """The object a "module:function" string names (imported on first use)."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


_MODEL = StageInput("model", "Full model: path, URI or hub name.", model=True, kind="Model")
_SCORES = StageInput("scores", "Calibration artifact (scores.parquet).")

STAGES: tuple[Stage, ...] = (
    Stage(
        "calibrate",
        "evoesap.stages.calibrate:run_calibrate",
        "evoesap.stages.calibrate:CalibrateParams",
        (_MODEL, StageInput("data", "Calibration data: JSONL/JSON/Parquet/CSV path or URI, or a hub dataset.", kind="str")),
        "the scores artifact",
        (StageOutput("scores", "Dataset", "Per-expert importance scores of every criterion (scores.parquet)."),),
        "Score every expert (frequency, SEER, EAN, REAP) in one observer pass over calibration samples.",
        "evoesap calibrate --model runs/demo/model --data runs/demo/data/calibration.jsonl --samples 64 --out runs/cal",
        loads_model=True,
        peak="evoesap.planning.footprint:calibrate_peak",
        fits_with="calibrate.batch_size or calibrate.max_length, or device_map: auto over more GPUs",
    ),
    Stage(
        "cache-logits",
        "evoesap.stages.cache_logits:run_cache_logits",
        "evoesap.stages.cache_logits:CacheLogitsParams",
        (
            _MODEL,
            StageInput("data", "Search (or held-out) samples: JSONL/JSON/Parquet/CSV path or URI, or a hub dataset.", kind="str"),
        ),
        "the teacher cache artifact",
        (StageOutput("cache", "Dataset", "The teacher cache (token ids, answer masks and log-probabilities)."),),
        "Run the full model once over the search samples and cache its next-token distributions.",
        "evoesap cache-logits --model runs/demo/model --data runs/demo/search.jsonl --out runs/cache --mode topk --top-k 32",
        loads_model=True,
        peak="evoesap.planning.footprint:cache_logits_peak",
        fits_with="cache_logits.batch_size, or device_map: auto over more GPUs",
    ),
    Stage(
        "search",
        "evoesap.stages.search:run_search",
        "evoesap.stages.search:SearchParams",
        (
            _MODEL,
            _SCORES,
            StageInput("cache", "Teacher cache artifact from cache-logits."),
            StageInput(
                "heldout_cache",
                "Teacher cache of other samples for the held-out check (then the cache is all search); without it a "
                "share of the cache is held out.",
                required=False,
            ),
        ),
        "the search artifact",
        (
            StageOutput(
                "allocation",
                "Artifact",
                "The chosen allocation (allocation.json, search history); metadata: fitness, held-out check, cost.",
            ),
        ),
        "Search the per-layer allocation with ESAP as fitness.",
        "evoesap search --model runs/demo/model --scores runs/cal --cache runs/cache --criterion reap --sparsity 0.25 "
        "--out runs/search --racing",
        loads_model=True,
        grid=("criterion", "sparsity"),
        peak="evoesap.planning.footprint:search_peak",
        facts="evoesap.records.facts:search_facts",
        headline="evoesap.records.facts:search_headline",
        fits_with="cache_logits.mode: topk (top_k 64), fewer cache_logits.samples or max_length, search.batch_size, "
        "or search.device_map: auto over more GPUs",
    ),
    Stage(
        "prune",
        "evoesap.stages.prune:run_prune",
        "evoesap.stages.prune:PruneParams",
        (
            _MODEL,
            _SCORES,
            StageInput("allocation", "Search artifact; omit for the uniform allocation.", required=False, kind="Artifact"),
        ),
        "the pruned checkpoint artifact",
        (
            StageOutput(
                "pruned", "Model", "The pruned checkpoint; metadata: method, criterion, sparsity, expert_counts, parameter_bytes."
            ),
        ),
        "Cut experts out of a checkpoint.",
        "evoesap prune --model runs/demo/model --scores runs/cal --allocation runs/search --criterion reap --sparsity 0.5 "
        "--out runs/pruned",
        loads_model=False,
        grid=("criterion", "sparsity"),
        peak="evoesap.planning.footprint:prune_peak",
        facts="evoesap.records.facts:prune_facts",
        fits_with="a larger volume for the pruned checkpoint",
    ),
    Stage(
        "quantize",
        "evoesap.stages.quantize:run_quantize",
        "evoesap.stages.quantize:QuantizeParams",
        (
            StageInput(
                "model", "Checkpoint to quantize: a prune artifact (uniform or non-uniform) or a path or URI.", kind="Model"
            ),
            StageInput(
                "data",
                "Calibration data (the run's calibration set): JSONL/JSON/Parquet/CSV path or URI, or a hub "
                "dataset; recipes without calibration (fp8-dynamic) ignore it.",
                required=False,
                kind="str",
            ),
        ),
        "the quantized checkpoint artifact (compressed-tensors)",
        (
            StageOutput(
                "quantized",
                "Model",
                "The compressed-tensors checkpoint (same architecture name and expert counts); metadata: recipe, bytes.",
            ),
        ),
        "Quantize a checkpoint with llm-compressor's oneshot by a named recipe, in llm-compressor's own environment.",
        "evoesap quantize --model runs/pruned --data runs/demo/data/calibration.jsonl --recipe w4a16-gptq --samples 64 "
        "--out runs/quantized",
        loads_model=True,
        facts="evoesap.records.facts:quantize_facts",
    ),
    Stage(
        "evaluate",
        "evoesap.stages.evaluate:run_evaluate",
        "evoesap.stages.evaluate:EvaluateParams",
        (
            StageInput("model", "Checkpoint (path or URI) or hub name; pruned checkpoints load too.", model=True, kind="Model"),
            StageInput("teacher_cache", "Full model's cache on held-out samples: adds held-out ESAP.", required=False),
            StageInput("allocation", "Allocation artifact the model was pruned with (lineage).", required=False, kfp=()),
        ),
        "the metrics artifact",
        (
            StageOutput(
                "metrics",
                "Metrics",
                "One scalar per task (its primary metric), for KFP's run comparison.",
                fill="evoesap.components.kfp_artifacts:publish_metrics",
            ),
            StageOutput(
                "evaluation", "Dataset", "The full metrics.json (every metric, stderr, memory, expert counts, held-out ESAP)."
            ),
        ),
        "Evaluate a model with lm-eval, its memory footprint and expert counts; write metrics.json.",
        "evoesap evaluate --model runs/pruned --tasks mc,math,./my_tasks --out runs/eval --limit 20 --method searched",
        loads_model=True,
        peak="evoesap.planning.footprint:evaluate_peak",
        facts="evoesap.records.facts:evaluate_facts",
        kfp_params="evoesap.components.kfp_artifacts:run_labels",
        fits_with="evaluate.batch_size or evaluate.max_length, or device_map: auto over more GPUs",
    ),
    Stage(
        "gate",
        "evoesap.stages.gate:run_gate",
        "evoesap.stages.gate:GateParams",
        (
            StageInput(
                "evaluation", "Evaluate artifact of the release candidate (a prune or quantize artifact publish would release)."
            ),
            StageInput(
                "full_evaluation",
                "Evaluate artifact of the full model it was pruned from (checked by content, with the same scoring settings).",
            ),
            StageInput(
                "previous",
                "The previous release's metrics: an evaluate artifact or a metrics.json path or URI.",
                required=False,
                kind="str",
            ),
        ),
        "the verdict artifact (gate.json)",
        (
            StageOutput(
                "verdict", "Artifact", "gate.json, every check with its numbers; metadata: passed, verdict (one line), checks."
            ),
        ),
        "Decide whether a candidate may be published: held-out ESAP and task drops against thresholds.",
        "evoesap gate --evaluation runs/eval --full-evaluation runs/eval-full --min-heldout-esap 0.9 "
        "--max-task-drop 0.02 --out runs/gate",
        loads_model=False,
        facts="evoesap.records.facts:gate_facts",
        returns=StageReturn('"pass" or "fail": the verdict, for a condition on it.', "evoesap.components.verdict:outcome"),
    ),
    Stage(
        "report",
        "evoesap.stages.report:run_report",
        "evoesap.stages.report:ReportParams",
        (
            StageInput(
                "runs",
                "Evaluate artifacts (repeat the option): full, uniform, searched runs.",
                many=True,
                kfp=(
                    KfpArgument("full", "The evaluate stage's evaluation of the full model."),
                    KfpArgument("uniform", "Evaluations of the uniformly pruned models.", many=True),
                    KfpArgument("searched", "Evaluations of the searched pruned models.", many=True),
                    KfpArgument(
                        "quantized",
                        "Evaluations of the quantized searched models: a row each beside the models they were quantized from.",
                        many=True,
                        required=False,
                    ),
                ),
            ),
            StageInput(
                "searches",
                "Search artifacts whose history.parquet gives the search curves.",
                required=False,
                many=True,
                kind="Artifact",
            ),
            StageInput("gates", "Gate artifacts whose verdicts head the report.", required=False, many=True, kind="Artifact"),
            StageInput(
                "targets",
                "Target artifacts (evoesap pipeline target): each decision heads the report, marked on the frontier plot.",
                required=False,
                many=True,
                kfp=(
                    KfpArgument(
                        "decisions",
                        "The quality target's decisions (the target finder's `decisions` output): the target artifact of "
                        "every criterion, named by its metadata `targets`.",
                        kind="Artifact",
                        required=False,
                        read="evoesap.components.kfp_artifacts:target_uris",
                    ),
                ),
            ),
        ),
        "the report artifact",
        (
            StageOutput(
                "markdown",
                "Markdown",
                "The report in Markdown (rendered in the KFP UI).",
                fill="evoesap.components.kfp_artifacts:publish_markdown",
            ),
            StageOutput(
                "page",
                "HTML",
                "The report as one HTML page with its plots inlined (rendered in the KFP UI).",
                fill="evoesap.components.kfp_artifacts:publish_page",
            ),
        ),
        "Tables like the paper's Table 2, memory savings, per-layer density plots and search curves.",
        "evoesap report --runs runs/eval-full --runs runs/eval-uniform --runs runs/eval-searched --searches runs/search "
        "--out runs/report",
        loads_model=False,
    ),
    Stage(
        "publish",
        "evoesap.stages.publish:run_publish",
        "evoesap.stages.publish:PublishParams",
        (
            StageInput("pruned", "Prune artifact: the checkpoint to publish.", kind="Model"),
            StageInput(
                "evaluations",
                "Evaluate artifacts (repeat the option): the published model's, and the full (and pruned) model's for "
                "the comparison.",
                many=True,
                kfp=(
                    KfpArgument("quantized_evaluation", "The evaluation of `quantized` (required with it).", required=False),
                    KfpArgument("evaluation", "The evaluate stage's evaluation of the pruned checkpoint."),
                    KfpArgument(
                        "full_evaluation",
                        "The evaluation of the full model it was pruned from: the card's comparison.",
                        required=False,
                    ),
                ),
            ),
            StageInput(
                "search",
                "Search artifact the model was pruned by: the card's search section.",
                required=False,
                kind="Artifact",
            ),
            StageInput(
                "report",
                "Report artifact covering the published model's evaluation: copied under report/.",
                required=False,
                kind="Markdown",
            ),
            StageInput(
                "quantized",
                "Quantize artifact of the pruned checkpoint: published instead of it, the card stating its recipe and "
                "bytes (its evaluation is then the one required).",
                required=False,
                kind="Model",
            ),
            StageInput(
                "gate",
                "Gate artifact (verdict) of the published model's evaluation: publish refuses unless it passed.",
                required=False,
                kind="Artifact",
            ),
        ),
        "the publish artifact (checkpoint and model card)",
        (
            StageOutput(
                "published",
                "Model",
                "The checkpoint with its model card (README.md) and density plot; metadata: its storage URI, criterion, "
                "sparsity, where it was pushed. A release the gate refused: no files, metadata withheld (true) and "
                "reason (the verdict's line).",
            ),
        ),
        "Write the model card beside a pruned (or pruned and quantized) checkpoint; push both to a URI or a Hub repository.",
        "evoesap publish --pruned runs/pruned --evaluations runs/eval --evaluations runs/eval-full --search runs/search "
        "--repo my-org/olmoe-pruned --out runs/publish",
        loads_model=False,
        facts="evoesap.records.facts:publish_facts",
        withheld="evoesap.components.kfp_artifacts:withhold",
    ),
)

NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)
MODEL_STAGES: tuple[str, ...] = tuple(stage.name for stage in STAGES if stage.loads_model)


def get(name: str) -> Stage:
    """The stage called `name`; an unknown name is refused with the nearest valid one."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    near = difflib.get_close_matches(name, NAMES, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"unknown stage {name!r}{hint}; stages are {', '.join(NAMES)}")
