"""One candidate's scoring time split by part, with FLOP/s and bytes/s per part against the device's peaks.

Builds a random-weight model of a real MoE shape (`gpu_search.SHAPES`: OLMoE-1B-7B or Qwen3-30B-A3B) at
one of three sizes (`--size tiny`: test dimensions, the default; `narrow`: real depth, experts, top-k and
vocabulary at `bench_search.SHAPE_WIDTH`'s width; `real`: the real dimensions, for a GPU), a random top-K
teacher cache (`gpu_search.random_cache`), and profiles `CandidateEvaluator.score` of one level-switch child of
the uniform allocation with torch.profiler, after a warm-up candidate. Without `--prefix` the candidate runs
from the embeddings (the exact path); with it, the parent is scored first and the child starts from its
cached states.

Parts are `record_function` ranges opened and closed by forward hooks on the model's modules, so the
evaluator runs unchanged: attention (`self_attn`), router (the MoE block outside its experts: router
linear, softmax/top-k, the masking hook's re-routing, dispatch), experts (the experts module; dense MLPs
too), norm (the RMSNorms), head (LM head), metric (`_per_position`: softmax against the teacher's top-K).
Every profiled op is charged to its nearest enclosing range; ops outside all ranges are `copies` (copy,
clone, cat, index, pad, device transfers) or `other` (residual adds, masks, rotary, bookkeeping), and the
wall time the ops do not cover is `python/gaps` (interpreter time on a CPU, launch gaps on a GPU). Times
are self CPU time on a CPU, self device time on CUDA.

FLOPs and bytes are counted from the shapes the hooks see: attention 2 x tokens x projection weights
plus causal scores (2 x 2 x heads x head_dim x T(T+1)/2 per row); router 2 x tokens x H x E; experts
2 x tokens x top-k x one expert's weights (dense MLPs: all weights); norms 4 x elements; head
2 x rows x H x V; metric ~8 FLOP per logit (stated, not counted). Bytes: each call's weights (an MoE
layer's experts read once per call) plus its input and output activations; the metric's ~12 bytes per
float32 logit. Peaks: the stated dense bf16 and memory-bandwidth figures of H100 SXM and H200 (`PEAKS`);
on any other device (a CPU) both are measured here (a square matmul in the model's dtype, a large copy).

Examples:
    python benchmarks/profile_candidate.py                                   # tiny OLMoE, CPU
    python benchmarks/profile_candidate.py --size narrow --samples 8 --length 256 --prefix
    python benchmarks/profile_candidate.py --size real --samples 16 --length 4096   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.autograd.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_search import SHAPE_WIDTH as NARROW  # noqa: E402  real depth, experts, top-k and vocabulary, CPU-sized width
from gpu_search import SHAPES, TINY, children, random_cache, sync  # noqa: E402

from evoesap import moe  # noqa: E402
from evoesap.method import allocation as alloc  # noqa: E402
from evoesap.moe.families import family_of  # noqa: E402
from evoesap.scoring.evaluator import CandidateEvaluator  # noqa: E402

PARTS = ("attention", "router", "experts", "norm", "head", "metric", "copies", "other", "python/gaps")
COPY_OPS = {
    "aten::copy_",
    "aten::clone",
    "aten::cat",
    "aten::stack",
    "aten::to",
    "aten::_to_copy",
    "aten::index",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::zeros",
    "aten::full",
    "aten::fill_",
    "aten::constant_pad_nd",
    "aten::contiguous",
}
# Stated peaks: dense bf16 tensor-core FLOP/s and memory bytes/s (NVIDIA data sheets, SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
METRIC_FLOP_PER_LOGIT, METRIC_BYTES_PER_LOGIT = 8, 12


@dataclasses.dataclass
class Part:
    name: str
    seconds: float = 0.0
    flop: float = 0.0
    bytes: float = 0.0


def build(shape: str, size: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = SHAPES[shape]
    extra = {"tiny": TINY, "narrow": NARROW, "real": {}}[size]
    config = AutoConfig.for_model(model_type, **{**values, **extra})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _tensor(value: Any) -> torch.Tensor:
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


class Ranges:
    """record_function ranges around each part's modules (forward hooks), counting FLOPs and bytes as they pass."""

    def __init__(self, model: torch.nn.Module, evaluator: CandidateEvaluator) -> None:
        self.parts = {name: Part(name) for name in PARTS}
        self.handles: list[Any] = []
        config = model.config
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        family = family_of(config.model_type)
        routed = {id(b.block): b for b in moe.moe_blocks(model)}
        spec = {b.ordinal: layer for b, layer in zip(moe.moe_blocks(model), moe.inspect(model).layers)}
        for layer in evaluator._runner.layers:
            attn = layer.self_attn

            def attention_flop(x: torch.Tensor, out: Any, attn=attn) -> float:
                rows, length = (x.shape[0], x.shape[1]) if x.dim() == 3 else (1, x.shape[0])
                scores = 2 * 2 * rows * heads * head_dim * length * (length + 1) / 2
                return 2 * rows * length * _numel(attn) + scores

            self._hook(attn, "attention", attention_flop, _bytes(attn))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                self._hook(norm, "norm", lambda x, out: 4 * x.numel(), _bytes(norm))
            block = getattr(layer, family.block)
            info = routed.get(id(block))
            if info is None:  # a dense MLP layer: all its weights, every token
                self._hook(block, "experts", lambda x, out, b=block: 2 * x.numel() // hidden * _numel(b), _bytes(block))
                continue
            top_k, experts = spec[info.ordinal].top_k, spec[info.ordinal].num_experts
            router_flop = 2 * hidden * experts
            self._hook(block, "router", lambda x, out, f=router_flop: x.numel() // hidden * f, _bytes(info.router))
            per_expert = _numel(info.experts) // experts

            def expert_flop(x: torch.Tensor, out: Any, per=per_expert, k=top_k) -> float:
                return 2 * x.numel() // hidden * k * per

            self._hook(info.experts, "experts", expert_flop, _bytes(info.experts))
            shared = [m for n, m in block.named_children() if "shared" in n]
            for module in shared:
                self._hook(module, "experts", lambda x, out, m=module: 2 * x.numel() // hidden * _numel(m), _bytes(module))
        self._hook(evaluator._runner.base.norm, "norm", lambda x, out: 4 * x.numel(), 0)
        head = model.get_output_embeddings()
        self._hook(head, "head", lambda x, out: 2 * out.numel() * hidden, _bytes(head))
        measured = evaluator._per_position
        metric = self.parts["metric"]

        def per_position(logits: torch.Tensor, rows: torch.Tensor) -> Any:
            metric.flop += METRIC_FLOP_PER_LOGIT * logits.numel()
            metric.bytes += METRIC_BYTES_PER_LOGIT * logits.numel()
            with record_function("part::metric"):
                return measured(logits, rows)

        evaluator._per_position = per_position
        self._undo = lambda: evaluator.__dict__.pop("_per_position")

    def _hook(self, module: torch.nn.Module, name: str, flop: Any, weight_bytes: int) -> None:
        part, open_ranges = self.parts[name], []

        def before(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            rf = record_function(f"part::{name}")
            rf.__enter__()
            open_ranges.append(rf)

        def after(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            x, y = _tensor(args or kwargs.get("hidden_states")), _tensor(out)
            part.flop += float(flop(x, y))
            part.bytes += weight_bytes + x.numel() * x.element_size() + y.numel() * y.element_size()
            open_ranges.pop().__exit__(None, None, None)

        self.handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self.handles.append(module.register_forward_hook(after, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self._undo()


def attribute(events: Any, parts: dict[str, Part], cuda: bool) -> float:
    """Charge each op's self time to its nearest enclosing part range -> the total op time charged."""
    total = 0.0
    for event in events:
        seconds = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if seconds <= 0:
            continue
        node, name = event, None
        while node is not None:
            if node.name.startswith("part::"):
                name = node.name[len("part::") :]
                break
            node = node.cpu_parent
        if name is None:
            name = "copies" if event.name in COPY_OPS else "other"
        parts[name].seconds += seconds
        total += seconds
    return total


def peaks(device: torch.device, dtype: torch.dtype) -> tuple[float, float, str]:
    """(FLOP/s, bytes/s, where they come from): stated for H100/H200, measured here otherwise."""
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
        for key, (flops, bandwidth) in PEAKS.items():
            if key in label:
                return flops, bandwidth, f"{label}: stated dense bf16 {flops / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s"
    n = 2048 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    best_mm, best_copy = float("inf"), float("inf")
    big = torch.empty(1 << 25, device=device, dtype=torch.float32)  # 128 MiB
    dest = torch.empty_like(big)
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        a @ a
        sync(device)
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dest.copy_(big)
        sync(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
    flops, bandwidth = 2 * n**3 / best_mm, 2 * big.numel() * 4 / best_copy
    where = f"{device.type} ({torch.get_num_threads()} threads)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    return (
        flops,
        bandwidth,
        f"{where}: measured {n}x{n} {dtype} matmul {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s",
    )


def profile(args: argparse.Namespace) -> tuple[list[Part], dict[str, Any]]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build(args.shape, args.size, device, dtype)
    spec = moe.inspect(model)
    n, k = spec.num_experts, spec.top_k
    orders = [list(range(e)) for e in n]
    parent = alloc.uniform(n, k, alloc.budget(args.sparsity, n, k))
    warm, child = children(parent, n, k, 2, np.random.default_rng(args.seed))
    cache = random_cache(model.config.vocab_size, args.samples, args.length, args.top_k, seed=args.seed)
    evaluator = CandidateEvaluator(
        model,
        cache,
        batch_size=args.batch_size,
        verify=False,
        prefix_cache_bytes=int(args.prefix_cache_gib * 2**30) if args.prefix else 0,
        keep=1,
    )
    if args.prefix:
        evaluator.score(alloc.pruned_sets(parent, orders))
    evaluator.score(alloc.pruned_sets(warm, orders))  # warm-up: allocator, kernels, lazily built state
    ranges = Ranges(model, evaluator)
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    before = evaluator.work
    try:
        with torch.profiler.profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            evaluator.score(alloc.pruned_sets(child, orders))
            sync(device)
            wall = time.perf_counter() - t0
    finally:
        ranges.remove()
    parts = ranges.parts
    covered = attribute(prof.events(), parts, cuda)
    parts["python/gaps"].seconds = max(0.0, wall - covered)
    flops, bandwidth, source = peaks(device, dtype)
    info = {
        "shape": args.shape,
        "size": args.size,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "samples": args.samples,
        "length": args.length,
        "prefix": args.prefix,
        "wall_s": wall,
        "ffe": (evaluator.work - before) / evaluator.full_forward_work(),
        "peak_flops": flops,
        "peak_bytes_per_s": bandwidth,
        "peaks": source,
    }
    return list(parts.values()), info


def report(parts: Sequence[Part], info: dict[str, Any]) -> str:
    wall = info["wall_s"]
    lines = [
        f"candidate: {info['shape']} ({info['size']}), {info['samples']} samples x {info['length']} tokens, "
        f"{info['dtype']} on {info['device']}, prefix reuse {'on' if info['prefix'] else 'off'}: "
        f"{wall:.3f} s, {info['ffe']:.3f} FFE (profiled; the profiler adds overhead)",
        f"peaks: {info['peaks']}",
        "",
        "| part | s | share | GFLOP | GFLOP/s | % peak FLOP/s | GB | GB/s | % peak bytes/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in parts:
        rate = p.flop / p.seconds if p.seconds > 0 else 0.0
        bw = p.bytes / p.seconds if p.seconds > 0 else 0.0
        flop_cells = f"{p.flop / 1e9:.3f} | {rate / 1e9:.1f} | {100 * rate / info['peak_flops']:.1f}" if p.flop else "- | - | -"
        byte_cells = (
            f"{p.bytes / 1e9:.3f} | {bw / 1e9:.1f} | {100 * bw / info['peak_bytes_per_s']:.1f}" if p.bytes else "- | - | -"
        )
        lines.append(f"| {p.name} | {p.seconds:.4f} | {100 * p.seconds / wall:.1f}% | {flop_cells} | {byte_cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> tuple[list[Part], dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="olmoe", choices=list(SHAPES))
    parser.add_argument("--size", default="tiny", choices=("tiny", "narrow", "real"))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=64, help="teacher cache entries per position")
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--prefix", action="store_true", help="score the parent first; the child starts from its states")
    parser.add_argument("--prefix-cache-gib", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--json", help="append the parts and settings here as one JSON line")
    args = parser.parse_args(argv)
    parts, info = profile(args)
    print(report(parts, info), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({**info, "parts": [dataclasses.asdict(p) for p in parts]}) + "\n")
    return parts, info


if __name__ == "__main__":
    main()
