"""Benchmarks through lm-eval's Python API over a loaded model, plus memory footprint and expert counts.

Task names are resolved and validated against lm-eval's task index before any model is loaded, so a
typo fails in seconds, not after loading a 30B checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from evoesap import records as rec
from evoesap.errors import ConfigError, DataError
from evoesap.evaluation import vllm_eval
from evoesap.store.identity import locate

log = logging.getLogger(__name__)

# MATH-500 in lm-eval 0.4.13: `hendrycks_math500` (HuggingFaceH4/MATH-500, boxed-answer equivalence).
# `minerva_math500` exists too but needs `math_verify` and antlr4 4.11; list it by name to use it.
MATH500_TASK = "hendrycks_math500"


@dataclasses.dataclass(frozen=True)
class Suite:
    """A named group of lm-eval tasks with the protocol the paper evaluates them under."""

    tasks: tuple[str, ...]
    chat_template: bool  # generation through the tokenizer's chat template (greedy, as the tasks say)
    unsafe_code: bool = False  # executes model-written code: needs allow_code_execution


SUITES: dict[str, Suite] = {
    "mc": Suite(
        ("arc_challenge", "arc_easy", "boolq", "hellaswag", "mmlu", "openbookqa", "rte", "winogrande"),
        chat_template=False,
    ),
    "math": Suite(("gsm8k", MATH500_TASK), chat_template=True),
    # Completion-style prompts as lm-eval defines them; humaneval_instruct / mbpp_instruct by name for chat.
    "code": Suite(("humaneval", "mbpp"), chat_template=False, unsafe_code=True),
}

# Which of a task's metrics stands for it in tables, first match wins (metric, filter or None for any).
PRIMARY_METRICS: tuple[tuple[str, str | None], ...] = (
    ("acc_norm", "none"),
    ("acc", "none"),
    ("exact_match", "flexible-extract"),
    ("exact_match", "strict-match"),
    ("exact_match", None),
    ("pass@1", None),
)


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """One lm-eval task (or group) to run, with the protocol it runs under."""

    name: str
    domain: str  # suite name, the task's first tag, or its directory name; the report averages per domain
    chat_template: bool
    zero_shot: bool  # named suites are zero-shot as in the paper; local tasks keep their own num_fewshot
    unsafe_code: bool
    include_path: str | None = None


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """Resolved requests plus the lm-eval TaskManager whose index resolved them."""

    requests: tuple[TaskRequest, ...]
    task_manager: Any  # lm_eval.tasks.TaskManager
    include_paths: tuple[str, ...] = ()  # how to build the same TaskManager elsewhere (the vllm backend)
    include_defaults: bool = True


def _is_path(spec: str) -> bool:
    return "/" in spec or spec.startswith(".") or Path(spec).is_dir()


def resolve_tasks(specs: Sequence[str], *, allow_code_execution: bool = False) -> TaskPlan:
    """Suites, lm-eval task names and local task directories to task requests; errors suggest names."""
    from lm_eval.tasks import TaskManager

    specs = [s.strip() for s in specs if s.strip()]
    if not specs:
        raise ConfigError("no tasks given: name a suite (mc, math, code), an lm-eval task or a task directory")
    for spec in specs:
        if spec in SUITES and SUITES[spec].unsafe_code and not allow_code_execution:
            raise ConfigError(
                f"suite {spec!r} executes model-written code on this machine; pass allow_code_execution "
                "(--allow-code-execution) in a sandbox to run it"
            )
        if spec not in SUITES and _is_path(spec) and not Path(spec).is_dir():
            raise ConfigError(f"task directory {spec!r} does not exist: give a directory of lm-eval YAML tasks")
    dirs = [str(Path(s).resolve()) for s in specs if s not in SUITES and _is_path(s)]
    manager = TaskManager(include_path=dirs or None, include_defaults=len(dirs) < len(specs))
    requests: list[TaskRequest] = []
    for spec in specs:
        if spec in SUITES:
            suite = SUITES[spec]
            requests += [TaskRequest(name, spec, suite.chat_template, True, suite.unsafe_code) for name in suite.tasks]
        elif _is_path(spec):
            requests += _directory_requests(manager, Path(spec).resolve(), allow_code_execution)
        else:
            requests.append(_named_request(manager, spec, allow_code_execution))
    _check_known(manager, requests)
    names = [r.name for r in requests]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"tasks requested twice: {', '.join(duplicates)}; list each suite or task once")
    return TaskPlan(tuple(requests), manager, tuple(dirs), len(dirs) < len(specs))


def _check_known(manager: Any, requests: Sequence[TaskRequest]) -> None:
    for request in requests:
        if request.name not in manager.task_index:
            raise ConfigError(f"lm-eval has no task {request.name!r} in this installation{_suggest(manager, request.name)}")


def _suggest(manager: Any, name: str) -> str:
    close = difflib.get_close_matches(name, [*SUITES, *manager.all_tasks], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "; see `lm-eval ls tasks`"


def _named_request(manager: Any, name: str, allow_code_execution: bool) -> TaskRequest:
    entry = manager.task_index.get(name)
    if entry is None:
        raise ConfigError(f"unknown task or suite {name!r}{_suggest(manager, name)}")
    cfg = entry.cfg or {}
    unsafe = bool(cfg.get("unsafe_code"))
    if unsafe and not allow_code_execution:
        raise ConfigError(
            f"task {name!r} executes model-written code; pass allow_code_execution (--allow-code-execution) to run it"
        )
    return TaskRequest(name, name, cfg.get("output_type") == "generate_until", False, unsafe)


def _directory_requests(manager: Any, directory: Path, allow_code_execution: bool) -> list[TaskRequest]:
    from lm_eval.tasks._index import Kind

    requests = []
    for name, entry in sorted(manager.task_index.items()):
        if entry.kind not in (Kind.TASK, Kind.PY_TASK) or entry.yaml_path is None:
            continue
        if directory not in Path(entry.yaml_path).resolve().parents:
            continue
        domain = sorted(entry.tags)[0] if entry.tags else directory.name
        request = _named_request(manager, name, allow_code_execution)
        # A local task writes its own prompt (doc_to_text); templating it again would wrap it twice.
        requests.append(dataclasses.replace(request, domain=domain, include_path=str(directory), chat_template=False))
    if not requests:
        raise ConfigError(f"task directory {directory} holds no lm-eval task YAML (a file with a `task:` key)")
    return requests


@contextlib.contextmanager
def _code_execution_allowed() -> Iterator[None]:
    """HF_ALLOW_CODE_EVAL=1 for the `code_eval` metric, only while the user-approved run lasts."""
    previous = os.environ.get("HF_ALLOW_CODE_EVAL")
    os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_ALLOW_CODE_EVAL", None)
        else:
            os.environ["HF_ALLOW_CODE_EVAL"] = previous


BACKENDS = ("hf", "vllm")  # lm-eval's model type: transformers in this process, or vLLM in its own environment


def run_lm_eval(
    model: torch.nn.Module | str,
    tokenizer: Any,
    plan: TaskPlan,
    *,
    backend: str = "hf",
    batch_size: int | str = 1,
    limit: int | float | None = None,
    enable_thinking: bool = False,
    think_end_token: str = "</think>",
    max_length: int | None = None,
    model_dtype: str = "auto",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> tuple[list[rec.TaskMetric], dict[str, Any]]:
    """Run every request through lm-eval; return metric records and lm-eval's raw results per call.

    `model` is the loaded model for the `hf` backend, a checkpoint directory or hub name for `vllm`
    (run by `evoesap.evaluation.vllm_eval`; `model_dtype`, `tensor_parallel` and `pipeline_parallel` apply there).
    Requests are batched by protocol (chat template or not, zero-shot or not, code execution) so that one
    call's settings never leak into another's tasks.
    """
    from lm_eval import simple_evaluate

    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    python = vllm_eval.vllm_python() if backend == "vllm" else None
    has_template = bool(getattr(tokenizer, "chat_template", None))
    groups: dict[tuple[bool, bool, bool], list[TaskRequest]] = {}
    for request in plan.requests:
        chat = request.chat_template and has_template
        if request.chat_template and not has_template:
            log.warning("tokenizer has no chat template: %s runs on raw prompts", request.name)
        groups.setdefault((chat, request.zero_shot, request.unsafe_code), []).append(request)

    records: list[rec.TaskMetric] = []
    raw: dict[str, Any] = {}
    for (chat, zero_shot, unsafe), requests in groups.items():
        thinking = {"enable_thinking": enable_thinking, "think_end_token": think_end_token if enable_thinking else None}
        lm_args = {"batch_size": batch_size, "max_length": max_length, **(thinking if chat else {})}
        names = [r.name for r in requests]
        settings = dict(
            tasks=names,
            num_fewshot=0 if zero_shot else None,
            limit=limit,
            apply_chat_template=chat,
            confirm_run_unsafe_code=unsafe,
            log_samples=False,
        )
        log.info("lm-eval (%s): %s (chat template %s, zero-shot %s)", backend, ", ".join(names), chat, zero_shot)
        if python is not None:
            results = vllm_eval.simple_evaluate(
                python,
                {
                    **_vllm_source(str(model)),
                    "dtype": model_dtype,
                    **_vllm_engine_args(),
                    **lm_args,
                    **_vllm_parallel(tensor_parallel, pipeline_parallel),
                },
                settings,
                list(plan.include_paths),
                plan.include_defaults,
                env={"HF_ALLOW_CODE_EVAL": "1"} if unsafe else None,
            )
        else:
            from lm_eval.models.huggingface import HFLM

            lm = HFLM(pretrained=model, tokenizer=tokenizer, **lm_args)
            with _code_execution_allowed() if unsafe else contextlib.nullcontext(), _quiet_git_hash():
                results = simple_evaluate(model=lm, task_manager=plan.task_manager, **settings)
        if results is None:  # non-zero rank under a distributed launcher
            continue
        for request in requests:
            records += _records(request, results)
        for key in ("results", "groups", "n-shot", "n-samples", "versions", "configs"):
            raw.setdefault(key, {}).update(results.get(key, {}))
    return records, raw


def _vllm_source(model: str) -> dict[str, str]:
    """lm-eval's vLLM arguments naming the model: a hub model with its weights and tokenizer at the commit
    its identity recorded (`identity.locate`), a local directory as given."""
    pretrained, pinned = locate(model)
    revision = pinned.get("revision")
    return {"pretrained": pretrained, **({"revision": revision, "tokenizer_revision": revision} if revision else {})}


@contextlib.contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """lm-eval asks git for the working directory's commit and lets git print `fatal: not a git repository`
    outside a checkout; ask the same question with git's stderr discarded."""
    import subprocess
    from unittest import mock

    def describe() -> str | None:
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=5, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() or None

    with mock.patch("lm_eval.evaluator.get_git_commit_hash", describe):
        yield


# vLLM's CPU backend otherwise books 92% of the machine's memory (`gpu_memory_utilization`) and refuses to
# start when less is free, as on any shared machine. A fixed KV cache does not; 4 GiB holds many full-length
# sequences of the models a CPU can evaluate.
# VLLM_CPU_KVCACHE_SPACE (GiB), which vLLM reads itself, overrides it.
CPU_KV_CACHE_BYTES = 4 * 2**30


def _vllm_parallel(tensor: int, pipeline: int) -> dict[str, int]:
    """vLLM's engine arguments for a model split over tensor x pipeline GPUs (none when it is on one)."""
    return {} if tensor * pipeline == 1 else {"tensor_parallel_size": tensor, "pipeline_parallel_size": pipeline}


def _vllm_engine_args() -> dict[str, Any]:
    """Without a GPU, vLLM runs eager (compiling costs minutes on a CPU and gains little) with a 4 GiB KV cache."""
    return {} if torch.cuda.is_available() else {"enforce_eager": True, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}


def _records(request: TaskRequest, results: Mapping[str, Any]) -> list[rec.TaskMetric]:
    """lm-eval's `metric,filter` keys for one task as flat records, its primary metric flagged."""
    entry = results.get("groups", {}).get(request.name) or results["results"].get(request.name)
    if entry is None:
        raise DataError(f"lm-eval returned no results for {request.name!r}; its dataset may be empty")
    samples = results.get("n-samples", {}).get(request.name, {}).get("effective")
    rows = []
    for key, value in entry.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        stderr = entry.get(f"{metric}_stderr,{filt}")
        rows.append(
            rec.TaskMetric(
                task=request.name,
                domain=request.domain,
                metric=metric,
                filter=filt,
                value=float(value),
                stderr=float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None,
                samples=samples,
            )
        )
    primary = _primary(rows)
    if primary is not None:
        rows[primary] = dataclasses.replace(rows[primary], primary=True)
    return rows


def _primary(rows: list[rec.TaskMetric]) -> int | None:
    """Index of the task's primary metric: the first of PRIMARY_METRICS it has, else its first."""
    for metric, filt in PRIMARY_METRICS:
        for i, row in enumerate(rows):
            if row.metric == metric and (filt is None or row.filter == filt):
                return i
    return 0 if rows else None


def memory_footprint(model: torch.nn.Module) -> rec.Memory:
    """Parameter count, bytes as loaded, and the bf16 load size (floating tensors at 2 bytes)."""
    from evoesap import moe

    saved = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()  # what a checkpoint stores
    bf16 = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in saved)
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied weights once
    return rec.Memory(parameters=count, parameter_bytes=int(moe.parameter_bytes(model)), bf16_bytes=bf16)


def expert_counts(model: torch.nn.Module) -> rec.Experts:
    """Experts and top-k per MoE layer, in model order."""
    from evoesap import moe

    spec = moe.inspect(model)
    return rec.Experts(
        family=spec.family,
        num_experts=tuple(int(n) for n in spec.num_experts),
        top_k=tuple(int(k) for k in spec.top_k),
        decoder_index=tuple(int(layer.decoder_index) for layer in spec.layers),
    )


def heldout_esap(model: torch.nn.Module, tokenizer: Any, cache_uri: str, batch_size: int = 8) -> rec.HeldoutEsap:
    """ESAP of this (physically pruned) model against its full model's teacher cache.

    The weights differ from the teacher's by design, so the evaluator checks only the vocabulary.
    """
    from evoesap.scoring.evaluator import CandidateEvaluator

    scorer = CandidateEvaluator(model, cache_uri, metric="esap", batch_size=batch_size, tokenizer=tokenizer, verify=False)
    lower, upper = scorer.bounds({})
    return rec.HeldoutEsap(esap=lower, esap_upper=upper, samples=scorer.num_samples)
