"""The stage components, typed with KFP artifacts. Each body calls `run_step` and describes its result.

A stage runs into its content-addressed URI under `storage_root` (or finds it finished there, after
checking the manifest and the payload), then fills its KFP output artifacts from it
(`evoesap.components.kfp_artifacts`): the pipeline's lineage in ML Metadata is the lineage the manifests
record. With an s3:// or gs:// root the stage reads and writes object storage itself, so the same
components run under `kfp.local` and on a cluster. Every input is documented here; `params` is
documented key by key from the stage's parameters (`evoesap.components.interface`).
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
import dataclasses
import inspect
import os
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from evoesap import __version__
from evoesap.registry import STAGES

# Where the stage images are published: images/Dockerfile as `<registry>/stage:<version>`, images/Dockerfile.cuda
# as `<registry>/stage-cuda:<version>`. Fully qualified (a registry host first), so no runtime resolves a bare
# name against a default registry where anyone could have pushed it; a configuration's `registry` replaces it.
DEFAULT_REGISTRY = "ghcr.io/evoesap"


def stage_image(registry: str = DEFAULT_REGISTRY, name: str = "stage") -> str:
    """The stage image of this version in `registry`."""
    return f"{registry.rstrip('/')}/{name}:{__version__}"


def qualified(image: str) -> bool:
    """Whether `image` names its registry host (a dot or port in the first part, or localhost) and a tag or digest."""
    host, _, rest = image.partition("/")
    return bool(rest) and ("." in host or ":" in host or host == "localhost") and (":" in rest or "@" in rest)


DEFAULT_IMAGE = stage_image()

_STORAGE = (
    "storage_root: Where EvoESAP keeps its content-addressed artifacts (a path, s3://, gs://); a stage whose "
    "inputs and parameters are unchanged is found finished there and reused."
)
_FULL_MODEL = (
    "model: The full MoE model: a checkpoint directory (a team's Output[Model]), the output of "
    "evoesap.components.reference.model_reference naming a path, URI or hub name (`org/name@REV` at a branch, tag "
    "or commit; a cluster's importer takes object-store URIs only), or dsl.importer of an object-store URI; a hub "
    "name is identified by the commit its revision resolves to."
)


def calibrate(model: Input[Model], data: str, storage_root: str, scores: Output[Dataset], params: dict = {}):
    """Score every expert of the model (frequency, SEER, EAN, REAP) in one pass over calibration samples.

    Args:
        model: (full model)
        data: Calibration data: a JSONL/JSON/Parquet/CSV path or URI, or a hub dataset name.
        storage_root: (see module)

    Returns:
        scores: Per-expert importance scores of every criterion (scores.parquet).
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    publish(scores, run_step("calibrate", storage_root, {"model": source(model), "data": data}, params))


def cache_logits(model: Input[Model], data: str, storage_root: str, cache: Output[Dataset], params: dict = {}):
    """Cache the full model's next-token log-probabilities on samples: the teacher the ESAP fitness compares to.

    Args:
        model: (full model)
        data: Search (or held-out) data: a JSONL/JSON/Parquet/CSV path or URI, or a hub dataset name.
        storage_root: (see module)

    Returns:
        cache: The teacher cache (token ids, answer masks and log-probabilities).
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    publish(cache, run_step("cache-logits", storage_root, {"model": source(model), "data": data}, params))


def search(
    model: Input[Model],
    scores: Input[Dataset],
    cache: Input[Dataset],
    criterion: str,
    sparsity: float,
    storage_root: str,
    allocation: Output[Artifact],
    heldout_cache: Optional[Input[Dataset]] = None,
    params: dict = {},
):
    """Search the per-layer expert allocation that maximises ESAP against the teacher cache.

    Args:
        model: (full model)
        scores: The calibrate stage's scores: the within-layer pruning order of `criterion`.
        cache: The teacher cache of the search samples.
        criterion: Importance criterion whose order the allocation applies: frequency, seer, ean or reap.
        sparsity: Global share of routed experts removed, in (0, 1).
        storage_root: (see module)
        heldout_cache: Teacher cache of other samples for the held-out check; without it a share of `cache` is held out.

    Returns:
        allocation: The chosen allocation (allocation.json, search history); metadata: fitness, held-out check, cost.
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    inputs = {"model": source(model), "scores": source(scores), "cache": source(cache), "heldout_cache": source(heldout_cache)}
    publish(allocation, run_step("search", storage_root, inputs, {**params, "criterion": criterion, "sparsity": sparsity}))


def prune(
    model: Input[Model],
    scores: Input[Dataset],
    criterion: str,
    sparsity: float,
    storage_root: str,
    pruned: Output[Model],
    allocation: Optional[Input[Artifact]] = None,
    params: dict = {},
):
    """Physically remove experts and save a standard checkpoint: the searched allocation, or uniform without one.

    Args:
        model: (full model)
        scores: The calibrate stage's scores: which experts of a layer go first under `criterion`.
        criterion: Importance criterion: frequency, seer, ean or reap (must match the allocation's).
        sparsity: Global share of routed experts removed, in (0, 1) (must match the allocation's).
        storage_root: (see module)
        allocation: The search stage's allocation; omitted: the same budget spread uniformly over layers.

    Returns:
        pruned: The pruned checkpoint; metadata: method, criterion, sparsity, expert_counts, parameter_bytes.
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    inputs = {"model": source(model), "scores": source(scores), "allocation": source(allocation)}
    publish(pruned, run_step("prune", storage_root, inputs, {**params, "criterion": criterion, "sparsity": sparsity}))


def quantize(
    model: Input[Model],
    storage_root: str,
    quantized: Output[Model],
    data: str = "",
    params: dict = {},
):
    """Quantize a (pruned) checkpoint with llm-compressor's oneshot by a named recipe; a compressed-tensors checkpoint.

    Args:
        model: The checkpoint to quantize: the prune stage's pruned model (uniform or non-uniform) or the full model.
        storage_root: (see module)
        data: Calibration data (the run's calibration set) for the recipes that calibrate; empty for fp8-dynamic.

    Returns:
        quantized: The compressed-tensors checkpoint (same architecture name and expert counts); metadata: recipe, bytes.
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    publish(quantized, run_step("quantize", storage_root, {"model": source(model), "data": data or None}, params))


def evaluate(
    model: Input[Model],
    storage_root: str,
    metrics: Output[Metrics],
    evaluation: Output[Dataset],
    teacher_cache: Optional[Input[Dataset]] = None,
    params: dict = {},
):
    """Evaluate a model on lm-eval tasks (and held-out ESAP against a teacher cache).

    Args:
        model: The model to evaluate: a pruned model from the prune stage (its method, criterion and sparsity label the run) or the full model (a hub name at its metadata `revision`).
        storage_root: (see module)
        teacher_cache: A teacher cache of held-out samples: adds held-out ESAP to the metrics.

    Returns:
        metrics: One scalar per task (its primary metric), for KFP's run comparison.
        evaluation: The full metrics.json (every metric, stderr, memory, expert counts, held-out ESAP).
    """
    from evoesap.components.kfp_artifacts import publish, publish_metrics, source

    from evoesap.steps import run_step

    labels = {k: model.metadata[k] for k in ("method", "criterion", "sparsity") if k in model.metadata}
    labels = {"method": "full", **params, **labels}
    uri = run_step("evaluate", storage_root, {"model": source(model), "teacher_cache": source(teacher_cache)}, labels)
    publish(evaluation, uri)
    publish_metrics(metrics, uri)


def gate(
    evaluation: Input[Dataset],
    full_evaluation: Input[Dataset],
    storage_root: str,
    verdict: Output[Artifact],
    previous: str = "",
    params: dict = {},
) -> str:
    """Decide whether the release candidate may be published: its held-out ESAP and task drops against thresholds.

    Args:
        evaluation: The evaluate stage's evaluation of the release candidate (the model publish would release).
        full_evaluation: The evaluate stage's evaluation of the full model it was pruned from.
        storage_root: (see module)
        previous: The previous release's metrics (an evaluate artifact or a metrics.json URI); empty: none.

    Returns:
        verdict: gate.json, every check with its numbers; metadata: passed, verdict (one line), checks.
        Output: "pass" or "fail", for the pipeline's condition on publish.
    """
    from evoesap.components.kfp_artifacts import publish, source

    from evoesap.steps import run_step

    inputs = {"evaluation": source(evaluation), "full_evaluation": source(full_evaluation), "previous": previous or None}
    publish(verdict, run_step("gate", storage_root, inputs, params))
    return "pass" if verdict.metadata["passed"] else "fail"


def report(
    full: Input[Dataset],
    searched: Input[List[Dataset]],
    uniform: Input[List[Dataset]],
    searches: Input[List[Artifact]],
    storage_root: str,
    markdown: Output[Markdown],
    page: Output[HTML],
    quantized: Optional[Input[List[Dataset]]] = None,
    gates: Optional[Input[List[Artifact]]] = None,
    params: dict = {},
):
    """The benchmark table, memory figures and plots of a set of evaluations and searches.

    Args:
        full: The evaluate stage's evaluation of the full model.
        searched: Evaluations of the searched pruned models.
        uniform: Evaluations of the uniformly pruned models.
        searches: The search stage's allocations (search curves and densities).
        storage_root: (see module)
        quantized: Evaluations of the quantized searched models: a row each beside the models they were quantized from.
        gates: The gate stage's verdicts: they head the report.

    Returns:
        markdown: The report in Markdown (rendered in the KFP UI).
        page: The report as one HTML page with its plots inlined (rendered in the KFP UI).
    """
    from evoesap.components.kfp_artifacts import publish_report, source

    from evoesap.steps import run_step

    runs = [full, *uniform, *searched, *(quantized or [])]
    inputs = {
        "runs": [source(a) for a in runs],
        "searches": [source(a) for a in searches],
        "gates": [source(a) for a in gates or []],
    }
    publish_report(markdown, page, run_step("report", storage_root, inputs, params))


def publish(
    pruned: Input[Model],
    evaluation: Input[Dataset],
    storage_root: str,
    published: Output[Model],
    full_evaluation: Optional[Input[Dataset]] = None,
    search: Optional[Input[Artifact]] = None,
    report: Optional[Input[Markdown]] = None,
    quantized: Optional[Input[Model]] = None,
    quantized_evaluation: Optional[Input[Dataset]] = None,
    gate: Optional[Input[Artifact]] = None,
    params: dict = {},
):
    """Write the model card beside a pruned (or its quantized) checkpoint and push both to params `to` (a URI) and `repo` (the Hub).

    Args:
        pruned: The prune stage's pruned checkpoint.
        evaluation: The evaluate stage's evaluation of that pruned checkpoint.
        storage_root: (see module)
        full_evaluation: The evaluation of the full model it was pruned from: the card's comparison.
        search: The search stage's allocation the checkpoint was pruned by: the card's search section.
        report: The report covering the published model's evaluation: copied beside the checkpoint.
        quantized: The quantize stage's checkpoint of `pruned`: published instead of it (the card states its recipe and bytes).
        quantized_evaluation: The evaluation of `quantized` (required with it).
        gate: The gate stage's verdict on the published model's evaluation: publish refuses unless it passed.

    Returns:
        published: The checkpoint with its model card (README.md) and density plot; metadata: its storage URI.
    """
    from evoesap.components.kfp_artifacts import publish as describe
    from evoesap.components.kfp_artifacts import source

    from evoesap.steps import run_step

    evaluations = [source(e) for e in (quantized_evaluation, evaluation, full_evaluation) if e is not None]
    inputs = {
        "pruned": source(pruned),
        "evaluations": evaluations,
        "search": source(search),
        "report": source(report),
        "quantized": source(quantized),
        "gate": source(gate),
    }
    describe(published, run_step("publish", storage_root, inputs, params))


STAGE_FUNCTIONS: dict[str, Callable] = {stage.name: globals()[stage.section] for stage in STAGES}


_SOURCE_DOCS = {name: fn.__doc__ for name, fn in STAGE_FUNCTIONS.items()}


def _documented(stage: str, function: Callable) -> Callable:
    """`function` with the shared storage_root and full-model texts and its `params` keys written into the docstring
    (kfp reads input descriptions from the docstring's Args)."""
    from evoesap.components.interface import params_description

    doc = _SOURCE_DOCS[stage].replace("storage_root: (see module)", _STORAGE).replace("model: (full model)", _FULL_MODEL)
    own_inputs = tuple(inspect.signature(function).parameters)
    params = f"        params: {params_description(stage, exclude=own_inputs)}\n"
    function.__doc__ = doc.replace("\n    Returns:\n", f"{params}\n    Returns:\n")
    return function


# The components bound to one image, as attributes named like the YAML sections (`components.cache_logits`).
StageComponents = dataclasses.make_dataclass("StageComponents", [stage.section for stage in STAGES], frozen=True)


def make_components(image: str = DEFAULT_IMAGE) -> StageComponents:
    """The components bound to a stage image; no packages are installed at run time."""
    wrap = dsl.component(base_image=image, install_kfp_package=False)
    return StageComponents(**{stage.section: wrap(_documented(stage.name, STAGE_FUNCTIONS[stage.name])) for stage in STAGES})


def write_component_yamls(directory: str | Path, image: str = DEFAULT_IMAGE) -> list[Path]:
    """Compile each stage component to `<directory>/<stage>.yaml`, a step any KFP pipeline can load
    (`kfp.components.load_component_from_file`)."""
    from kfp import compiler

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    comps = make_components(image)
    written = []
    for stage in STAGES:
        path = directory / f"{stage.section}.yaml"
        with tempfile.TemporaryDirectory(dir=directory, prefix=f".{path.name}.partial-") as tmp:
            staged = Path(tmp) / path.name
            compiler.Compiler().compile(getattr(comps, stage.section), str(staged))
            os.replace(staged, path)  # a reader never sees half a component
        written.append(path)
    return written
