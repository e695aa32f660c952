"""The memory model: each stage's peak memory, disk and temporary space, predicted before any weight is read.

From a checkpoint's config.json (and its safetensors headers when present, else a meta-device model
built from the config), the data sizes and the stage parameters: host memory, memory per accelerator,
disk for the artifact and temporary space, for calibrate, cache-logits, search, prune and evaluate,
and the teacher cache in full and top-K modes, with the refusal of a stage whose prediction exceeds what
the machine has, naming the setting to change. Each stage contributes its formula through the registry
(`evoesap.registry.Stage.peak`); this module imports no stage. `evoesap.planning.plan` applies it to a pipeline
configuration and to a stage about to run.

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
from typing import Any

log = logging.getLogger(__name__)
GiB = 1 << 30
RUNTIME_BYTES = 320 << 20  # anonymous memory of a stage process before its model or cache (bench_memory: 315 MiB)
# [tokens, hidden] tensors alive in one decoder layer's forward: the residual, its norm, q, k, v, the
# attention output, its projection and the MoE block's output (scores of the attention are not kept:
# SDPA); besides them the gate, up and activation products of each routed (token, expert) pair
LAYER_HIDDEN_STATES = 8
# On a GPU, batches of thousands of tokens: the same tensors counted float32-sized and twice over (the
# norms', router's and softmax's float32 upcasts, the caching allocator's freed blocks not yet reused);
# benchmarks/gpu_stages.py at OLMoE-1B-7B size, batch 8 x 4,096: calibrate -14%, cache-logits +0% (docs/results/memory.md)
GPU_LAYER_FLOAT32_STATES = 2 * LAYER_HIDDEN_STATES
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context and kernels on the device (NVML counts them; torch does not)
# host -> GPU copies of offloaded weights: accelerate's hooks copy from pageable host memory, about 12 GB/s on
# PCIe 4.0 x16 (an assumption from the bus, not measured here: no GPU machine with offload has run this planner)
OFFLOAD_BYTES_PER_S = 12e9
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
    offloaded: int = 0  # weights waiting in host memory (offload: true), copied to a GPU by every forward
    note: str | None = None  # what the offload costs


def model_shape(uri: str, model_dtype: str = "auto") -> ModelShape:
    """The shape of the checkpoint at `uri` (path, fsspec URI or hub name) from config.json and headers alone."""
    import torch

    from evoesap import moe
    from evoesap.machine.runtime import MODEL_DTYPES
    from evoesap.moe import shards, stream_prune

    fs, root = stream_prune.checkpoint_files(uri, patterns=("*.json",))  # a hub model: no weights fetched
    config = stream_prune.read_config(fs, root)
    counts = getattr(config, moe.PER_LAYER_KEY, None)
    meta = moe.spec.meta_model(config)  # an unsupported model is refused before the meta model is built
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
    text = moe.families.family_of(config.model_type).expert_config(config)  # a multimodal model: its language model
    dense = sum(
        m.weight.numel() for m in meta.modules() if isinstance(m, torch.nn.Linear) and m is not head and id(m) not in routed
    )
    return ModelShape(
        model_type=config.model_type,
        bytes=sum(sizes),
        expert_bytes=int(sum(n * b for n, b in zip(experts, per_expert)) * scale),
        vocab=int(text.vocab_size),
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        top_k=max(spec.top_k),
        expert_width=max(_expert_width(block.experts) for block in moe.moe_blocks(meta)),
        largest_tensor=max(sizes),
        itemsize=target.itemsize,
        dense_linear_bytes=dense * target.itemsize,
    )


def _expert_width(experts: Any) -> int:
    """An expert's intermediate size, as the experts module itself was built (whichever config field gave it)."""
    width = getattr(experts, "intermediate_dim", None) or getattr(experts, "intermediate_size", None)
    if width is None:
        from evoesap.errors import ModelError

        raise ModelError(f"{type(experts).__name__} names no intermediate_dim or intermediate_size: its expert width is unknown")
    return int(width)


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


def plan_stages(
    shape: ModelShape, machine: Machine, data: Data, params: dict[str, Any], *, remote_out: bool = False, only: str | None = None
) -> list[StagePlan]:
    """The predicted peaks of every stage of the registry that has a peak formula (or the one named `only`),
    each with its refusal (None when it fits). `params`: the parameter dataclasses by stage name; the
    search and prune entries may be left out where the stages planned do not read them."""
    from evoesap.registry import STAGES

    plans = []
    on_gpu = machine.devices > 0
    for stage in STAGES:
        if stage.peak is None or only is not None and stage.name != only:
            continue
        p = params[stage.name]
        host, device, disk, temp = stage.peak_function()(shape, machine, data, p, params)
        offloaded = 0
        if stage.loads_model and on_gpu and getattr(p, "device_map", None):
            host, device, offloaded = _spread(shape, machine, p, params, host, device)
        if not on_gpu:
            host, device = host + device, 0
        # the checkpoint's expert pages left mapped after restacking: resident, but the kernel drops them when short
        droppable = shape.expert_bytes if not on_gpu and stage.loads_model else 0
        temp = temp if remote_out else 0
        refusal = _refusal(stage.name, stage.fits_with, machine, host - droppable, device, disk + temp)
        if refusal is None and offloaded and not p.offload:
            refusal = (
                f"{stage.name} needs {offloaded / GiB:.1f} GiB more than its GPUs hold{_at_cap(p)}: set "
                f"{stage.section}.offload: true to keep that in host memory (slower: see the note), raise max_memory, "
                f"or spread device_map over more GPUs"
            )
        note = _offload_note(stage.name, offloaded, data, p, params) if offloaded and p.offload else None
        plans.append(StagePlan(stage.name, host, device, disk, temp, refusal, offloaded, note))
    return plans


def _spread(shape: ModelShape, machine: Machine, p: Any, params: dict[str, Any], host: int, device: int) -> tuple[int, int, int]:
    """(host, busiest GPU, offloaded) of a model placed by device_map: the weights spread evenly over the GPUs one
    replica spans (a search worker's group, else every GPU), each holding at most `max_memory` (unset, with
    `offload`: what the stage's own work leaves of it), and what no GPU holds waits in host memory; the rest of
    the stage's device memory (activations, caches) spread as evenly."""
    from evoesap.machine.sizes import parse_bytes

    gpus = p.gpus_per_worker if getattr(p, "workers", 1) > 1 else machine.devices
    gpus = max(1, min(gpus, machine.devices))
    weights = model_weights(shape, p, params)
    work = math.ceil((device - weights) / gpus)
    share = math.ceil(weights / gpus)
    if p.max_memory:
        share = min(share, parse_bytes(p.max_memory))
    elif p.offload:  # what the stage's own work leaves of each GPU
        share = min(share, max(0, machine.device - work))
    offloaded = max(0, weights - share * gpus)  # neither: the whole share, refused when a GPU cannot hold it
    return host + offloaded, share + work, offloaded


def model_weights(shape: ModelShape, p: Any, params: dict[str, Any]) -> int:
    """Bytes of the model a stage loads: the pruned model for an evaluation (the prune entry's sparsity; none
    given: evaluated as it is), else the full one."""
    if hasattr(p, "tensor_parallel"):  # evaluate's parameters
        return shape.bytes - int(shape.expert_bytes * (params["prune"].sparsity if "prune" in params else 0.0))
    return shape.bytes


def _at_cap(p: Any) -> str:
    return f" at max_memory {p.max_memory}" if p.max_memory else ""


def _offload_note(stage: str, offloaded: int, data: Data, p: Any, params: dict[str, Any]) -> str:
    """How slow an offloaded stage runs: every forward copies the offloaded weights to a GPU."""
    per_batch = offloaded / OFFLOAD_BYTES_PER_S
    note = (
        f"{stage}: {offloaded / GiB:.1f} GiB of weights wait in host memory and cross PCIe on every forward: at least "
        f"{per_batch:.1f} s more per batch (at {OFFLOAD_BYTES_PER_S / 1e9:.0f} GB/s)"
    )
    if stage == "search":
        batches = math.ceil(params["cache-logits"].sample_count / p.batch_size)
        note += f", {batches * per_batch:.0f} s per candidate ({batches} batches; prefix reuse skips some)"
    return note


Peaks = tuple[int, int, int, int]  # (host, device, disk, temp) bytes; device figures go to the host without a GPU


def _loading(shape: ModelShape, machine: Machine) -> int:
    """Host memory while a stage loads its model."""
    if machine.devices:  # loading onto a GPU holds a tensor or two on the host at a time
        return RUNTIME_BYTES + 2 * shape.largest_tensor
    # on the CPU transformers stacks the checkpoint's per-expert tensors into new ones while their mapped file
    # pages stay resident (the experts twice), and oneDNN keeps a reordered copy of every half-precision dense
    # nn.Linear weight it has run (measured: none with torch.backends.mkldnn off)
    return RUNTIME_BYTES + shape.expert_bytes + (shape.dense_linear_bytes if shape.itemsize == 2 else 0)


def _context(machine: Machine) -> int:
    return CUDA_CONTEXT_BYTES if machine.devices else 0


def _cache(shape: ModelShape, data: Data, cache_p: Any, rows: int | None = None) -> int:
    return cache_bytes(data.cache_rows if rows is None else rows, shape.vocab, cache_p.mode, cache_p.top_k, cache_p.dtype)


def calibrate_peak(shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> Peaks:
    """The forward keeps one position's logits (logits_to_keep=1)."""
    tokens = min(data.calibrate_tokens, p.batch_size * p.max_length)
    return _loading(shape, machine), _context(machine) + shape.bytes + _forward(shape, tokens, machine.devices > 0), 0, 0


def cache_logits_peak(shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> Peaks:
    """Head rows in chunks; chunks queued, being written and being built; the weights hash at the end copies
    one tensor at a time to the host, after the last chunk is written."""
    from evoesap.scoring.teacher import HEAD_BYTES, HEAD_TEMPORARIES, WRITE_QUEUE

    cache = _cache(shape, data, p)
    tokens = p.batch_size * p.max_length
    rows = min(tokens, max(1, HEAD_BYTES // (HEAD_TEMPORARIES * 4 * shape.vocab)))  # scored rows per head chunk
    queued = (WRITE_QUEUE + 2) * rows * (cache // max(1, data.cache_rows))
    head = rows * shape.vocab * HEAD_TEMPORARIES * 4
    device = _context(machine) + shape.bytes + _forward(shape, tokens, machine.devices > 0) + head
    return _loading(shape, machine) + max(queued, shape.largest_tensor), device, cache, cache


def search_peak(shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> Peaks:
    """The teacher caches (on the GPU when half of what is left holds it), the prefix cache, and the weights
    hash (one tensor copied to the host at a time) with the caches loaded."""
    from evoesap.scoring.evaluator import HEAD_CHUNK_BYTES
    from evoesap.scoring.teacher import HEAD_TEMPORARIES

    gpu = machine.devices > 0
    cache_p = params["cache-logits"]
    cache, heldout = _cache(shape, data, cache_p), _cache(shape, data, cache_p, rows=data.heldout_rows)
    tokens = p.batch_size * cache_p.max_length
    head = HEAD_CHUNK_BYTES["gpu" if gpu else "cpu"] * HEAD_TEMPORARIES
    device = _context(machine) + shape.bytes + _forward(shape, tokens, gpu) + head
    device += cache if gpu and cache <= (machine.device - device) // 2 else 0
    loading = _loading(shape, machine)
    if p.prefix_reuse:
        device += _prefix_budget(shape, machine, p, cache_p, used=device if gpu else device + loading + cache + heldout)
    return loading + cache + heldout + shape.largest_tensor, device, 1 << 20, 0


def prune_peak(shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> Peaks:
    """Streamed: one tensor copy buffer, whatever the model's size; the pruned checkpoint on disk."""
    from evoesap.moe.shards import COPY_BYTES

    pruned = shape.bytes - int(shape.expert_bytes * p.sparsity)
    return RUNTIME_BYTES + COPY_BYTES, 0, pruned, pruned


def evaluate_peak(shape: ModelShape, machine: Machine, data: Data, p: Any, params: dict[str, Any]) -> Peaks:
    """The pruned model (the prune entry's sparsity; none given: evaluated as it is) and full-vocabulary logits."""
    pruned = model_weights(shape, p, params)
    tokens = (p.batch_size if isinstance(p.batch_size, int) else 1) * (p.max_length or params["cache-logits"].max_length)
    device = _context(machine) + pruned + _forward(shape, tokens, machine.devices > 0) + 2 * tokens * shape.vocab * 4
    return _loading(shape, machine), device, 1 << 20, 0


def _prefix_budget(shape: ModelShape, machine: Machine, s: Any, cache_p: Any, used: int) -> int:
    """The search's prefix cache: its set budget, else CandidateEvaluator's automatic one (half the memory
    the rest of the stage leaves on the model's device, at most the states of the allocations worth keeping)."""
    from evoesap.scoring.evaluator import auto_prefix_budget

    if s.prefix_cache_bytes is not None:
        return s.prefix_cache_bytes
    tokens = cache_p.sample_count * cache_p.max_length  # search-set tokens, at most
    room = machine.device if machine.devices else machine.host
    return auto_prefix_budget(room - used, s.elites, shape.layers, tokens * shape.hidden * shape.itemsize)


def _refusal(stage: str, fits_with: str, machine: Machine, host: int, device: int, disk: int) -> str | None:
    """One line naming what is short and the settings that would make the stage fit; None when it fits."""

    def gib(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    if machine.devices and device > machine.device:
        return f"{stage} needs {gib(device)} per GPU but a GPU has {gib(machine.device)}: change {fits_with}"
    if host > machine.host:
        where = "host memory" if machine.devices else "memory (no GPU: the model and its work sit on the host)"
        return f"{stage} needs {gib(host)} of {where} but {gib(machine.host)} is available: change {fits_with}"
    if machine.disk is not None and disk > machine.disk:
        return f"{stage} writes {gib(disk)} but the storage has {gib(machine.disk)} free: change {fits_with}"
    return None


def default_cache_mode(shape: ModelShape, machine: Machine, data: Data, cache_p: Any, search_p: Any) -> tuple[str, str]:
    """(mode, why) for a cache whose mode is unset: `full` while the full cache takes at most
    FULL_PREFERRED_SHARE of the search's memory (the GPU's, else the host's) and a search with `search_p`
    holding it fits `machine`; `topk` otherwise."""
    full = dataclasses.replace(cache_p, mode="full")
    size = cache_bytes(data.cache_rows, shape.vocab, "full", full.top_k, full.dtype)
    room = machine.device if machine.devices else machine.host
    if size > FULL_PREFERRED_SHARE * room:
        where = "a GPU's" if machine.devices else "the host's"
        return "topk", (
            f"the full cache ({size / GiB:.1f} GiB) would take more than {FULL_PREFERRED_SHARE:.0%} of "
            f"{where} {room / GiB:.1f} GiB"
        )
    search = plan_stages(shape, machine, data, {"cache-logits": full, "search": search_p}, only="search")[0]
    if search.refusal:
        return "topk", f"with the full cache ({size / GiB:.1f} GiB) the search would not fit: {search.refusal}"
    return "full", f"the full cache ({size / GiB:.1f} GiB) fits the search"


def local_machine(device: str = "auto") -> Machine:
    """What this process may use: free host memory (cgroup-aware) and, on a GPU, each device's free memory."""
    import torch

    from evoesap.machine.runtime import free_memory_bytes, resolve_device

    host = free_memory_bytes(torch.device("cpu"))
    count = torch.cuda.device_count() if resolve_device(device).startswith("cuda") else 0
    if count:  # `cuda` where there is none: the host alone (a stage refuses it first, runtime.check_device)
        return Machine(host, min(int(torch.cuda.mem_get_info(i)[0]) for i in range(count)), count)
    return Machine(host)


def cache_mode(model: str, params: Any, rows: int) -> str:
    """The cache-logits stage's mode: `params.mode` when set, else `default_cache_mode` on this machine
    for `rows` scored rows, with a log line saying why."""
    if params.mode:
        return params.mode
    shape = model_shape(model, params.model_dtype)
    from evoesap.registry import get

    search_p = get("search").params_class()()  # the default search: what this cache will most likely serve
    mode, why = default_cache_mode(shape, local_machine(params.device), Data(0, rows), params, search_p)
    if mode == "topk":
        log.warning(
            "cache mode topk (top_k %d; ESAP only): %s. Set --mode full (cache_logits.mode: full) to force the full cache",
            params.top_k,
            why,
        )
    else:
        log.info("cache mode full: %s", why)
    return mode
