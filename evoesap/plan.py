"""Each stage's peak memory, disk and temporary space, predicted before any weight is read.

From a checkpoint's config.json (and its safetensors headers when present, else a meta-device model
built from the config), the data sizes and the stage parameters: host memory, memory per accelerator,
disk for the artifact and temporary space, for calibrate, cache-logits, search, prune and evaluate,
and the teacher cache in full and top-K modes. `check` refuses, before any work, a stage whose
prediction exceeds what the machine (or the configured resources) has, naming the setting to change.

The formulas follow what the stages allocate (the model, one decoder layer's activations, the LM-head
row chunks, the cache writer's queue, the weights hash's one-tensor copy); the one measured constant is
the interpreter with torch, transformers and pyarrow imported. A host figure counts the memory-mapped
weights the stage touches as well as what it allocates. benchmarks/bench_memory.py records the planner's
error against measured peaks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
from typing import Any

from evoesap.errors import ConfigError

log = logging.getLogger(__name__)
GiB = 1 << 30
RUNTIME_BYTES = 320 << 20  # anonymous memory of a stage process before its model or cache (bench_memory: 315 MiB)
# [tokens, hidden] tensors alive in one decoder layer's forward: the residual, its norm, q, k, v, the
# attention output, its projection and the MoE block's output (scores of the attention are not kept:
# SDPA); besides them the gate, up and activation products of each routed (token, expert) pair
LAYER_HIDDEN_STATES = 8
# On a GPU, batches of thousands of tokens: the same tensors counted float32-sized and twice over (the
# norms', router's and softmax's float32 upcasts, the caching allocator's freed blocks not yet reused);
# benchmarks/gpu_stages.py at OLMoE-1B-7B size, batch 8 x 4,096: calibrate -14%, cache-logits +0% (RESULTS.md)
GPU_LAYER_FLOAT32_STATES = 2 * LAYER_HIDDEN_STATES
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context and kernels on the device (NVML counts them; torch does not)
CACHE_ROW_BYTES = 12  # sample id, position and target of one cached row
FULL_PREFERRED_SHARE = 0.5  # full mode is the default while its cache takes at most this share of a device


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model, read without its weights."""

    model_type: str
    bytes: int  # weights in the dtype the stages run in
    expert_bytes: int  # all routed experts' weights together
    vocab: int
    hidden: int
    layers: int
    top_k: int
    expert_width: int  # an expert's intermediate size
    largest_tensor: int  # bytes of the largest single tensor: what loading and the weights hash hold at once
    itemsize: int = 2  # bytes per weight and activation in the dtype the stages run in
    dense_linear_bytes: int = 0  # nn.Linear weights run for every token (attention, shared experts), not the LM head


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a stage may use: host memory, memory per accelerator, their count, free disk."""

    host: int
    device: int = 0  # per accelerator; 0: none
    devices: int = 0
    disk: int | None = None


@dataclasses.dataclass(frozen=True)
class Data:
    """The data sizes a run will see (upper bounds: every token may be scored)."""

    calibrate_tokens: int
    cache_rows: int
    heldout_rows: int = 0


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: str
    host: int
    device: int  # on the busiest accelerator (0 on the CPU)
    disk: int
    temp: int
    refusal: str | None = None


def model_shape(uri: str, model_dtype: str = "auto") -> ModelShape:
    """The shape of the checkpoint at `uri` (path, fsspec URI or hub name) from config.json and headers alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from evoesap import moe
    from evoesap.moe import shards, stream_prune
    from evoesap.runtime import MODEL_DTYPES

    fs, root = stream_prune.checkpoint_files(uri, patterns=("*.json",))  # a hub model: no weights fetched
    config = stream_prune.read_config(fs, root)
    counts = getattr(config, moe.PER_LAYER_KEY, None)
    family = moe.FAMILIES.get(config.model_type) or moe.families.family_of(config.model_type)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    target = MODEL_DTYPES[model_dtype]
    if target == "auto":
        target = getattr(config, "dtype", None) or torch.float32
        target = getattr(torch, target) if isinstance(target, str) else target
    tensors = [(p.numel(), p.is_floating_point(), p.element_size()) for p in meta.state_dict().values()]
    if _has_weights(fs, root):  # the stored tensors: exact, also for pruned checkpoints
        tensors = []
        for name in stream_prune.shard_names(fs, root)[0]:
            with fs.open(f"{root}/{name}", "rb") as f:
                entries = shards.read_header(f)[1].values()
            tensors += [(math.prod(e.shape), e.dtype in shards.FLOATS, shards.itemsize(e.dtype)) for e in entries]
    sizes = [n * (target.itemsize if floating else size) for n, floating, size in tensors]
    per_expert = moe.expert_bytes(meta)  # meta tensors: sizes in the config's dtype, rescaled below
    spec = moe.inspect(meta)
    experts = [int(counts[str(layer.decoder_index)]) for layer in spec.layers] if counts else list(spec.num_experts)
    scale = target.itemsize / next(meta.parameters()).element_size()
    routed = {id(m) for block in moe.moe_blocks(meta) for m in block.experts.modules()}
    head = meta.get_output_embeddings()
    dense = sum(m.weight.numel() for m in meta.modules()
                if isinstance(m, torch.nn.Linear) and m is not head and id(m) not in routed)
    return ModelShape(
        model_type=config.model_type,
        bytes=sum(sizes),
        expert_bytes=int(sum(n * b for n, b in zip(experts, per_expert)) * scale),
        vocab=int(config.vocab_size),
        hidden=int(config.hidden_size),
        layers=int(config.num_hidden_layers),
        top_k=int(getattr(config, family.top_k_field)),
        expert_width=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size),
        largest_tensor=max(sizes),
        itemsize=target.itemsize,
        dense_linear_bytes=dense * target.itemsize,
    )


def _has_weights(fs: Any, root: str) -> bool:
    from evoesap.moe.stream_prune import INDEX_FILE, SINGLE_FILE

    return fs.exists(f"{root}/{SINGLE_FILE}") or (
        fs.exists(f"{root}/{INDEX_FILE}") and all(fs.exists(f"{root}/{n}") for n in _index_files(fs, root))
    )


def _index_files(fs: Any, root: str) -> set[str]:
    from evoesap.moe.stream_prune import INDEX_FILE

    with fs.open(f"{root}/{INDEX_FILE}", "rb") as f:
        return set(json.load(f)["weight_map"].values())


def cache_bytes(rows: int, vocab: int, mode: str, top_k: int, dtype: str) -> int:
    """Bytes of a teacher cache of `rows` scored positions, loaded (its Parquet files are as large)."""
    item = 2 if dtype == "float16" else 4
    width = vocab * item if mode == "full" else top_k * (4 + item) + 4
    return rows * (width + CACHE_ROW_BYTES)


def _forward(shape: ModelShape, tokens: int, on_gpu: bool = False) -> int:
    """Activations of a forward over `tokens` tokens without gradients or KV cache: one decoder layer's
    (earlier layers' are freed), in the model's dtype on the CPU, float32-sized on a GPU."""
    if on_gpu:
        return tokens * 4 * (GPU_LAYER_FLOAT32_STATES * shape.hidden + 3 * shape.top_k * shape.expert_width)
    return tokens * shape.itemsize * (LAYER_HIDDEN_STATES * shape.hidden + 3 * shape.top_k * shape.expert_width)


def plan_stages(shape: ModelShape, machine: Machine, data: Data, params: dict[str, Any], *, remote_out: bool = False,
                only: str | None = None) -> list[StagePlan]:
    """The predicted peaks of every stage (or the one named `only`), each with its refusal (None when it fits)."""
    plans = []
    on_gpu = machine.devices > 0
    for stage in ("calibrate", "cache-logits", "search", "prune", "evaluate"):
        if only is not None and stage != only:
            continue
        p = params[stage]
        host, device, disk, temp = _stage_peaks(stage, shape, machine, data, p, params)
        if stage in ("calibrate", "cache-logits", "search", "evaluate") and on_gpu:
            sharded = bool(getattr(p, "device_map", None)) and machine.devices > 1
            device = math.ceil(device / machine.devices) if sharded else device
        if not on_gpu:
            host, device = host + device, 0
        # the checkpoint's expert pages left mapped after restacking: resident, but the kernel drops them when short
        droppable = shape.expert_bytes if not on_gpu and stage != "prune" else 0
        temp = temp if remote_out else 0
        refusal = _refusal(stage, shape, machine, host - droppable, device, disk + temp, p, params, data)
        plans.append(StagePlan(stage, host, device, disk, temp, refusal))
    return plans


def _stage_peaks(stage: str, shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> tuple[int, int, int, int]:
    """(host, device, disk, temp) of one stage; device figures go to the host when there is no accelerator."""
    from evoesap.scoring.evaluator import HEAD_CHUNK_BYTES
    from evoesap.moe.shards import COPY_BYTES
    from evoesap.scoring.teacher import HEAD_BYTES, HEAD_TEMPORARIES, WRITE_QUEUE

    gpu = machine.devices > 0
    model = shape.bytes
    context = CUDA_CONTEXT_BYTES if gpu else 0
    if gpu:  # loading onto a GPU holds a tensor or two on the host at a time
        loading = RUNTIME_BYTES + 2 * shape.largest_tensor
    else:  # on the CPU transformers stacks the checkpoint's per-expert tensors into new ones while their
        # mapped file pages stay resident (the experts twice), and oneDNN keeps a reordered copy of every
        # half-precision dense nn.Linear weight it has run (measured: none with torch.backends.mkldnn off)
        loading = RUNTIME_BYTES + shape.expert_bytes + (shape.dense_linear_bytes if shape.itemsize == 2 else 0)
    cache_p = params["cache-logits"]
    cache = cache_bytes(data.cache_rows, shape.vocab, cache_p.mode, cache_p.top_k, cache_p.dtype)
    pruned = model - int(shape.expert_bytes * params["prune"].sparsity)
    if stage == "calibrate":  # the forward keeps one position's logits (logits_to_keep=1)
        tokens = min(data.calibrate_tokens, p.batch_size * p.max_length)
        return loading, context + model + _forward(shape, tokens, gpu), 0, 0
    if stage == "cache-logits":
        tokens = p.batch_size * p.max_length
        rows = min(tokens, max(1, HEAD_BYTES // (HEAD_TEMPORARIES * 4 * shape.vocab)))  # scored rows per head chunk
        queued = (WRITE_QUEUE + 2) * rows * (cache // max(1, data.cache_rows))  # chunks queued, being written, being built
        # the weights hash at the end copies one tensor at a time to the host, after the last chunk is written
        head = rows * shape.vocab * HEAD_TEMPORARIES * 4
        return loading + max(queued, shape.largest_tensor), context + model + _forward(shape, tokens, gpu) + head, cache, cache
    if stage == "search":
        s = params["search"]
        tokens = s.batch_size * cache_p.max_length
        heldout = cache_bytes(data.heldout_rows, shape.vocab, cache_p.mode, cache_p.top_k, cache_p.dtype)
        head = HEAD_CHUNK_BYTES["gpu" if machine.devices else "cpu"] * HEAD_TEMPORARIES
        device = context + model + _forward(shape, tokens, gpu) + head
        on_device = gpu and cache <= (machine.device - device) // 2
        device += cache if on_device else 0
        if s.prefix_reuse:
            device += _prefix_budget(shape, machine, s, cache_p, data, used=device if gpu else device + loading + cache + heldout)
        # the evaluator hashes the weights (one tensor copied to the host at a time) with the caches loaded
        return loading + cache + heldout + shape.largest_tensor, device, 1 << 20, 0
    if stage == "prune":
        return RUNTIME_BYTES + COPY_BYTES, 0, pruned, pruned
    tokens = (p.batch_size if isinstance(p.batch_size, int) else 1) * (p.max_length or cache_p.max_length)
    return loading, context + pruned + _forward(shape, tokens, gpu) + 2 * tokens * shape.vocab * 4, 1 << 20, 0


def _prefix_budget(shape: ModelShape, machine: Machine, s: Any, cache_p: Any, data: Data, used: int) -> int:
    """The search's prefix cache: its set budget, else CandidateEvaluator's automatic one (half the memory
    the rest of the stage leaves on the model's device, at most the states of the allocations worth keeping)."""
    from evoesap.scoring.evaluator import auto_prefix_budget

    if s.prefix_cache_bytes is not None:
        return s.prefix_cache_bytes
    tokens = cache_p.samples * cache_p.max_length if cache_p.samples else data.cache_rows  # search-set tokens, at most
    room = machine.device if machine.devices else machine.host
    return auto_prefix_budget(room - used, s.elites, shape.layers, tokens * shape.hidden * shape.itemsize)


def _refusal(stage: str, shape: ModelShape, machine: Machine, host: int, device: int, disk: int, p: Any,
             params: dict[str, Any], data: Data) -> str | None:
    """One line naming what is short and the settings that would make the stage fit; None when it fits."""
    def gib(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    fixes = {
        "calibrate": "calibrate.batch_size or calibrate.max_length, or device_map: auto over more GPUs",
        "cache-logits": "cache_logits.batch_size, or device_map: auto over more GPUs",
        "search": "cache_logits.mode: topk (top_k 64), fewer cache_logits.samples or max_length, search.batch_size, "
                  "or search.device_map: auto over more GPUs",
        "prune": "a larger volume for the pruned checkpoint",
        "evaluate": "evaluate.batch_size or evaluate.max_length, or device_map: auto over more GPUs",
    }
    if machine.devices and device > machine.device:
        return f"{stage} needs {gib(device)} per GPU but a GPU has {gib(machine.device)}: change {fixes[stage]}"
    if host > machine.host:
        where = "host memory" if machine.devices else "memory (no GPU: the model and its work sit on the host)"
        return f"{stage} needs {gib(host)} of {where} but {gib(machine.host)} is available: change {fixes[stage]}"
    if machine.disk is not None and disk > machine.disk:
        return f"{stage} writes {gib(disk)} but the storage has {gib(machine.disk)} free: change {fixes[stage]}"
    return None


def default_cache_mode(shape: ModelShape, machine: Machine, data: Data, cache_p: Any,
                       search_p: Any = None) -> tuple[str, str]:
    """(mode, why) for a cache whose mode is unset: `full` while the full cache takes at most
    FULL_PREFERRED_SHARE of the search's memory (the GPU's, else the host's) and a search holding it
    fits `machine`; `topk` otherwise."""
    from evoesap.stages.search import SearchParams

    full = dataclasses.replace(cache_p, mode="full")
    size = cache_bytes(data.cache_rows, shape.vocab, "full", full.top_k, full.dtype)
    room = machine.device if machine.devices else machine.host
    if size > FULL_PREFERRED_SHARE * room:
        where = "a GPU's" if machine.devices else "the host's"
        return "topk", (f"the full cache ({size / GiB:.1f} GiB) would take more than {FULL_PREFERRED_SHARE:.0%} of "
                        f"{where} {room / GiB:.1f} GiB")
    params = {"cache-logits": full, "search": search_p or SearchParams(), "prune": types.SimpleNamespace(sparsity=0.0)}
    search = plan_stages(shape, machine, data, params, only="search")[0]
    if search.refusal:
        return "topk", f"with the full cache ({size / GiB:.1f} GiB) the search would not fit: {search.refusal}"
    return "full", f"the full cache ({size / GiB:.1f} GiB) fits the search"


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
        lines.append(f"| {plan.stage} | {gib(plan.host)} | {gib(plan.device)} | {gib(plan.disk)} | {gib(plan.temp)} | "
                     f"{'yes' if plan.refusal is None else 'NO'} |")
    refusals = [p.refusal for p in plans if p.refusal]
    if refusals:
        lines += ["", *(f"- {r}" for r in refusals)]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """'80GB', '64Gi', '512M' -> bytes (decimal and binary suffixes, as Kubernetes writes them)."""
    import re

    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?)?B?\s*", str(text).upper())
    if match is None:
        raise ConfigError(f"{text!r} is not a size: write e.g. 80GB, 64Gi or 512M")
    return int(float(match.group(1)) * units[match.group(2) or ""])


def pipeline_plan(config: Any, machine: Machine) -> tuple[ModelShape, Data, dict[str, Any], list[StagePlan]]:
    """The plan of a pipeline configuration (`pipeline.config.PipelineConfig`) on `machine`."""
    from evoesap.steps import make_params

    point = config.grid()[0]
    params = {
        "calibrate": make_params("calibrate", config.calibrate),
        "cache-logits": make_params("cache-logits", config.cache_logits),
        "search": make_params("search", {**config.search, **point}),
        "prune": make_params("prune", {**config.prune, **point}),
        "evaluate": make_params("evaluate", {**config.evaluate, "method": "full"}),
    }
    shape = model_shape(config.pinned_model, params["search"].model_dtype)
    cache_p = params["cache-logits"]
    if cache_p.samples is None:
        raise ConfigError("cache_logits.samples is unset (all samples): set it so that the cache can be planned")
    rows = cache_p.samples * cache_p.max_length
    data = Data(params["calibrate"].samples * params["calibrate"].max_length, rows, rows if config.heldout_data else 0)
    if cache_p.mode is None:  # unset: full unless the full cache would crowd or not fit the search
        mode, _ = default_cache_mode(shape, machine, data, cache_p, params["search"])
        params["cache-logits"] = dataclasses.replace(cache_p, mode=mode)
    remote = "://" in config.storage_root and not config.storage_root.startswith("file://")
    return shape, data, params, plan_stages(shape, machine, data, params, remote_out=remote)


def local_machine(device: str = "auto") -> Machine:
    """What this process may use: free host memory (cgroup-aware) and, on a GPU, each device's free memory."""
    import torch

    from evoesap.runtime import free_memory_bytes, resolve_device

    host = free_memory_bytes(torch.device("cpu"))
    count = torch.cuda.device_count() if resolve_device(device).startswith("cuda") else 0
    if count:  # `cuda` where there is none: the host alone (a stage refuses it first, runtime.check_device)
        return Machine(host, min(int(torch.cuda.mem_get_info(i)[0]) for i in range(count)), count)
    return Machine(host)


def check_stage(stage: str, inputs: dict[str, Any], params: Any) -> StagePlan | None:
    """Refuse (ResourceError) a stage that would not fit this machine, before it loads anything; its plan."""
    from evoesap import artifacts, bounds
    from evoesap.errors import EvoESAPError, ResourceError
    from evoesap.stages.cache_logits import CacheLogitsParams
    from evoesap.stages.search import SearchParams

    if stage not in ("calibrate", "cache-logits", "search", "prune", "evaluate"):
        return None
    bounds.check_stage(params, inputs["model"])  # the device and the checkpoint, before either is measured
    cache_p, rows, heldout = CacheLogitsParams(), 0, 0
    try:
        shape = model_shape(inputs["model"], getattr(params, "model_dtype", "auto"))
        if stage == "search":
            meta = artifacts.read_json(artifacts.join(inputs["cache"], "cache.json"))
            cache_p = CacheLogitsParams(mode=meta["mode"], top_k=meta["top_k"] or 1, dtype=meta["dtype"])
            rows = int(meta["num_positions"])
            if inputs.get("heldout_cache"):
                heldout = int(artifacts.read_json(artifacts.join(inputs["heldout_cache"], "cache.json"))["num_positions"])
    except (EvoESAPError, OSError, ValueError, KeyError, TypeError) as exc:
        log.info("%s: no memory plan (%s)", stage, exc)  # an unreadable input: the stage itself says what is wrong
        return None
    machine = local_machine(getattr(params, "device", "cpu"))
    if stage == "cache-logits":
        rows = (params.samples or 0) * params.max_length
        cache_p = params if params.mode else dataclasses.replace(params, mode=default_cache_mode(shape, machine, Data(0, rows), params)[0])
    calibrate_tokens = params.samples * params.max_length if stage == "calibrate" else 0
    all_params = {
        "calibrate": params, "cache-logits": cache_p, "search": params if stage == "search" else SearchParams(),
        # evaluate's model is already pruned: nothing more comes off its bytes
        "prune": params if stage == "prune" else types.SimpleNamespace(sparsity=0.0), "evaluate": params,
    }
    data = Data(calibrate_tokens, rows, heldout)
    plan = _stage_plan(stage, shape, machine, data, all_params)
    if plan.refusal:
        raise ResourceError(plan.refusal)
    if stage == "cache-logits" and params.mode == "full":  # asked for: a full cache the search could not hold is refused now
        search = _stage_plan("search", shape, machine, data, all_params).refusal
        if search:
            raise ResourceError(f"cache_logits.mode is full, but {search}")
    return plan


def cache_mode(model: str, params: Any, rows: int) -> str:
    """The cache-logits stage's mode: `params.mode` when set, else `default_cache_mode` on this machine
    for `rows` scored rows, with a log line saying why."""
    if params.mode:
        return params.mode
    shape = model_shape(model, params.model_dtype)
    mode, why = default_cache_mode(shape, local_machine(params.device), Data(0, rows), params)
    if mode == "topk":
        log.warning("cache mode topk (top_k %d; ESAP only): %s. Set --mode full (cache_logits.mode: full) to force "
                    "the full cache", params.top_k, why)
    else:
        log.info("cache mode full: %s", why)
    return mode


def _stage_plan(stage: str, shape: ModelShape, machine: Machine, data: Data, params: dict[str, Any]) -> StagePlan:
    for plan in plan_stages(shape, machine, data, params, only=stage):
        return plan
    raise ConfigError(f"no plan for stage {stage!r}")
