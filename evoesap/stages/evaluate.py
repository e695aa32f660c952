"""The evaluate stage: one model through lm-eval suites, its memory footprint and expert counts -> metrics.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from typing import Any, Literal

from evoesap import records
from evoesap.errors import ConfigError, DataError
from evoesap.evaluation import lmeval, vllm_eval
from evoesap.machine import bounds, runtime
from evoesap.params import PlacementParams, check_declared, keyed, param
from evoesap.store import artifacts
from evoesap.store.identity import identify, is_hub_name, is_uri, same

log = logging.getLogger(__name__)

LM_EVAL_FILE = "lm_eval_results.json"
SCHEMA_VERSION = 1
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


@dataclasses.dataclass(frozen=True)
class EvaluateParams(PlacementParams):
    """What to run and how; the labels (criterion, sparsity, method) only name the run in the report."""

    tasks: tuple[str, ...] = param(
        ("mc", "math"), "Comma-separated: suites mc, math, code; lm-eval task names; task directories."
    )
    limit: float | None = param(None, "At most N examples per task, for smoke runs (below 1: a fraction).")
    batch_size: int | str = param(8, "An integer or 'auto'.")
    allow_code_execution: bool = param(False, "Run model-written code (the code suite); use a sandbox.")
    enable_thinking: bool = param(
        False, "Chat template switch of reasoning models for generation tasks (the paper turns it off)."
    )
    think_end_token: str = param("</think>", "The answer follows this, when thinking is on.")
    max_length: int | None = param(None, "Context length for lm-eval; unset: the model config's.")
    backend: Literal[lmeval.BACKENDS] = param(
        "hf", "lm-eval model: hf (transformers) or vllm (EVOESAP_VLLM_PYTHON's environment)."
    )
    tensor_parallel: int = param(1, "vllm backend: GPUs each layer is split across (vLLM's tensor_parallel_size).")
    pipeline_parallel: int = param(
        1,
        "vllm backend: GPUs the layers are split across in sequence "
        "(pipeline_parallel_size); the engine uses tensor_parallel x pipeline_parallel GPUs.",
    )
    esap_batch_size: int = param(8, "Batch size of held-out ESAP, when a teacher cache is given.")
    criterion: str | None = param(None, "Label for the report: the criterion the model was pruned with.")
    sparsity: float | None = param(None, "Label for the report: the sparsity the model was pruned at.")
    method: str | None = param(None, "Label for the report: full, uniform, searched, frequency, ...")

    def __post_init__(self) -> None:
        for name in ("criterion", "method"):
            value = getattr(self, name)
            if value is not None and not _LABEL.fullmatch(value):
                raise ConfigError(
                    f"{name} label {value!r} may hold letters, digits and . _ + - only (at most 64, the first a "
                    "letter or digit): it names the run's rows and files in the report"
                )
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"limit must be positive, got {self.limit}")
        if isinstance(self.batch_size, str) and not self.batch_size.startswith("auto"):
            raise ConfigError(f"batch_size must be a positive integer or 'auto', got {self.batch_size!r}")
        check_declared(self)  # backend's choices before the rules that read it
        if isinstance(self.batch_size, (int, float)) and self.batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer or 'auto', got {self.batch_size!r}")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.gpus() > 1 and self.backend != "vllm":
            raise ConfigError(
                f"tensor_parallel/pipeline_parallel split the vllm backend's engine, not {self.backend!r}: "
                "pass backend vllm (the hf backend spreads a model with device_map instead)"
            )
        super().__post_init__()

    def gpus(self) -> int:
        """GPUs one vLLM engine spans; 1 for the hf backend (its device_map decides)."""
        return self.tensor_parallel * self.pipeline_parallel

    def labels(self) -> records.Labels:
        return records.Labels(self.criterion, self.sparsity, self.method)


def _limit(limit: float | None) -> int | float | None:
    """Whole numbers as int (lm-eval reads a float < 1 as a fraction); configs may turn ints into floats."""
    return int(limit) if limit is not None and limit >= 1 and float(limit).is_integer() else limit


def run_evaluate(
    model: str,
    params: EvaluateParams,
    out_uri: str,
    *,
    teacher_cache: str | None = None,
    allocation: str | None = None,
) -> artifacts.Manifest:
    """Evaluate `model` (a checkpoint URI or hub name) and publish metrics.json at `out_uri`.

    `allocation` is recorded for lineage only; the expert counts are read from the model itself.
    """
    from evoesap import moe

    plan = lmeval.resolve_tasks(params.tasks, allow_code_execution=params.allow_code_execution)
    python = vllm_eval.vllm_python() if params.backend == "vllm" else None  # fails before anything loads
    inputs = {"model": model, "teacher_cache": teacher_cache, "allocation": allocation}
    seen = artifacts.preflight(out_uri, "evaluate", inputs)
    bounds.check_stage(params, model)
    if python is not None:
        _check_vllm_quantized(model, params.device)
    if teacher_cache:
        _check_heldout(teacher_cache, model, allocation)
    tokenizer = moe.load_tokenizer(model)
    if tokenizer is None:
        raise DataError(f"{artifacts.redact(model)} has no tokenizer files: save the tokenizer with the model")
    try:
        _evaluate(model, params, out_uri, inputs, seen, plan, python, tokenizer, teacher_cache)
    finally:  # loading leaves objects in reference cycles that map the weights: free them before the stage returns
        runtime.release_memory()
    return artifacts.read_manifest(out_uri)


def _evaluate(
    model: str,
    params: EvaluateParams,
    out_uri: str,
    inputs: dict[str, str | None],
    seen: str,
    plan: Any,
    python: str | None,
    tokenizer: Any,
    teacher_cache: str | None,
) -> None:
    """Load the model, run lm-eval (in a vLLM process when `python` is given) and publish metrics.json."""
    with artifacts.stage_output(out_uri, "evaluate", keyed(params), inputs, seen) as staging:
        log.info("loading %s", artifacts.redact(model))
        loaded = runtime.load_model(model, params.model_dtype, **params.placement)
        memory = dataclasses.replace(lmeval.memory_footprint(loaded), checkpoint_bytes=runtime.stored_bytes(model))
        quantized = quantization(model, loaded.config)
        experts = lmeval.expert_counts(loaded)
        esap = lmeval.heldout_esap(loaded, tokenizer, teacher_cache, params.esap_batch_size) if teacher_cache else None
        lm_eval_options = dict(
            batch_size=params.batch_size,
            limit=_limit(params.limit),
            enable_thinking=params.enable_thinking,
            think_end_token=params.think_end_token,
            max_length=params.max_length,
            tensor_parallel=params.tensor_parallel,
            pipeline_parallel=params.pipeline_parallel,
        )
        if python is None:
            task_records, raw = lmeval.run_lm_eval(loaded, tokenizer, plan, **lm_eval_options)
        else:
            dtype = str(next(loaded.parameters()).dtype).removeprefix("torch.")  # "auto" = as loaded here
            del loaded  # vLLM loads its own copy, in its own process
            runtime.release_memory()
            with _served_copy(model) as served:
                task_records, raw = lmeval.run_lm_eval(
                    served, tokenizer, plan, backend="vllm", model_dtype=dtype, **lm_eval_options
                )
        metrics = records.MetricsRecord(
            schema=SCHEMA_VERSION,
            model=artifacts.redact(model),
            labels=params.labels(),
            records=tuple(task_records),
            memory=memory,
            experts=experts,
            heldout_esap=esap,
            limit=params.limit,
            quantization=quantized,
        )
        records.write(staging, metrics)
        (staging / LM_EVAL_FILE).write_text(json.dumps(raw, indent=2, sort_keys=True, default=str))


def quantization(model: str, config: Any) -> records.Quantized | None:
    """How the evaluated weights are quantized: a quantize artifact's recipe and scheme (quantization.json), else the
    method a quantized checkpoint's config names (`quantization_config`); None for unquantized weights."""
    if _stage(model) == "quantize":
        doc = records.read(model, records.QuantizationRecord)
        return records.Quantized(recipe=doc.recipe, scheme=doc.scheme)
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    found = found if isinstance(found, dict) else found.to_dict()
    return records.Quantized(recipe=None, scheme=str(found.get("quant_method") or "unknown"))


def _check_vllm_quantized(model: str, device: str) -> None:
    """Refuse, before any work, a quantized checkpoint for vLLM on the CPU: its CPU build has no quantized MoE kernel."""
    if runtime.resolve_device(device) != "cpu" or is_hub_name(model):
        return
    config = artifacts.read_json(artifacts.join(model, "config.json"))
    if config.get("quantization_config"):
        raise ConfigError(
            f"{artifacts.redact(model)} is quantized ({config['quantization_config'].get('quant_method')}) and vLLM's CPU "
            "build has no quantized MoE kernel: evaluate it with backend hf, or with vllm on a GPU"
        )


def _stage(model: str) -> str | None:
    """The stage that made `model` when it is one of our artifacts, else None."""
    if is_hub_name(model) or not artifacts.exists(artifacts.join(model, artifacts.MANIFEST)):
        return None
    return artifacts.read_manifest(model).stage


def _check_heldout(teacher_cache: str, model: str, allocation: str | None) -> None:
    """Refuse, by lineage, a teacher cache that the search behind `model` optimised on: its ESAP is not held out."""
    artifacts.read_manifest(teacher_cache, "cache-logits")  # a finished cache, before the model loads
    cache = identify(teacher_cache)[0]
    search_uri = allocation
    if search_uri is None and _stage(model) == "quantize":  # the search behind the checkpoint that was quantized
        model = artifacts.read_manifest(model).inputs.get("model", {}).get("uri", "")
    if search_uri is None and model and _stage(model) is not None:
        search_uri = artifacts.read_manifest(model).inputs.get("allocation", {}).get("uri")
    if not search_uri or not artifacts.exists(artifacts.join(search_uri, artifacts.MANIFEST)):
        return
    search_inputs = artifacts.read_manifest(search_uri).inputs
    if same(search_inputs.get("cache", {}), cache):  # by content: the same cache made again elsewhere is not held out
        raise ConfigError(
            f"--teacher-cache {artifacts.redact(teacher_cache)} is the cache the search {artifacts.redact(search_uri)} "
            "optimised on, so its ESAP is not held out: give a cache of other samples (cache-logits on held-out data)"
        )


@contextlib.contextmanager
def _served_copy(model: str) -> Iterator[str]:
    """What vLLM can open: a local directory or hub name (pinned or not) as given, an object-store URI downloaded."""
    if not is_uri(model):
        yield model
        return
    with artifacts.local_copy(model) as local:
        yield str(local)
