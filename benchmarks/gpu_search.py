"""Per-candidate scoring time at real model dimensions: the reference method against the evaluator.

Builds random-weight models from configs alone (no download): an OLMoE-1B-7B shape (16 layers, hidden
2048, 64 experts top-8, expert width 1024, vocabulary 50304) and a Qwen3-30B-A3B shape (48 layers,
hidden 2048, 128 experts top-8, expert width 768, vocabulary 151936), in bfloat16 on the GPU, and times
scoring at the paper's search size (64 samples x 4096 tokens, the second half of each an answer):

  (a) reference: masked full forward, LM head at every position, float32 softmax and minimum over the
      vocabulary at every position against bf16 teacher logits copied from pinned host memory per batch
      (the teacher's values are random: only the work matters);
  (b) exact: CandidateEvaluator over an in-memory top-K teacher cache, no prefix reuse;
  (c) prefix: a parent allocation, then children one level-switch step away (first changed MoE layer
      uniform over pairs of layers, as in the search), starting from the parent's cached states.

With `--search-generations G`, each shape then runs the level-switch search itself (paper defaults:
population 32, elites 4, seed 42; `--racing` for the default racing schedule) for G generations over
the same random cache, with prefix reuse, and reports seconds per generation, FFE per candidate and the
estimated time and FFE per candidate of a default 50-generation search; `--statistical` adds the same search with
statistical racing (`racing.Sequential`'s defaults, the search stage's `racing_mode: statistical`).

Meant to finish within 8 minutes on one H100 (80 GB). `--tiny` shrinks the models for a CPU smoke run
(the tests run it in-process). Prints a short markdown table.

Examples:
    python benchmarks/gpu_search.py                                   # both shapes, paper size, cuda
    python benchmarks/gpu_search.py --shapes olmoe --samples 16 --length 2048
    python benchmarks/gpu_search.py --tiny --device cpu --samples 4 --length 32
    python benchmarks/gpu_search.py --shapes olmoe --search-generations 3 --racing
    python benchmarks/gpu_search.py --shapes olmoe --search-generations 2 --elite-floor   # floor off, then on
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from evoesap import moe
from evoesap.method import allocation as alloc
from evoesap.method import racing, search
from evoesap.scoring.evaluator import CandidateEvaluator
from evoesap.scoring.teacher import CacheMeta, TeacherCache

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "olmoe": (
        "olmoe",
        dict(
            num_hidden_layers=16,
            hidden_size=2048,
            num_experts=64,
            num_experts_per_tok=8,
            intermediate_size=1024,
            vocab_size=50304,
            num_attention_heads=16,
            num_key_value_heads=16,
            max_position_embeddings=4096,
        ),
    ),
    "qwen3": (
        "qwen3_moe",
        dict(
            num_hidden_layers=48,
            hidden_size=2048,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            vocab_size=151936,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            norm_topk_prob=True,
            max_position_embeddings=40960,
        ),
    ),
}
# --tiny: the same families at test size
TINY = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    moe_intermediate_size=32,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


@dataclasses.dataclass
class Timing:
    shape: str
    method: str
    seconds: float
    candidates: int
    ffe: float  # full-forward equivalents per candidate
    note: str = ""


def build_model(shape: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model_type, values = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **{**values, **(TINY if tiny else {})})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_cache(vocab: int, samples: int, length: int, top_k: int, seed: int) -> TeacherCache:
    """An in-memory top-K teacher cache of random values; the second half of each sample is scored."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = [torch.randint(3, vocab, (length,), generator=gen) for _ in range(samples)]
    per = length // 2 - 1
    positions = torch.arange(length // 2, length - 1).repeat(samples)  # [P]
    rows = samples * per
    logprobs = torch.log_softmax(torch.randn(rows, top_k + 1, generator=gen), -1)  # [P, K+1]: K kept + tail
    meta = CacheMeta(
        mode="topk",
        dtype="float16",
        top_k=top_k,
        vocab_size=vocab,
        model_hash="random",
        tokenizer_hash=None,
        data_hash="random",
        num_samples=samples,
        num_positions=rows,
        shards=(),
    )
    return TeacherCache(
        meta=meta,
        sample_ids=list(range(samples)),
        input_ids=input_ids,
        offsets=torch.arange(0, rows + 1, per),
        positions=positions,
        targets=torch.randint(3, vocab, (rows,), generator=gen),
        topk_ids=torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(min(rows, 64))]).repeat(
            (rows + 63) // 64, 1
        )[:rows],
        topk_logprobs=logprobs[:, :top_k].half(),
        tail_mass=logprobs[:, top_k].exp(),
    )


def reference_seconds(
    model: torch.nn.Module, cache: TeacherCache, pruned: dict[int, list[int]], batch_size: int, device: torch.device
) -> float:
    """One candidate the reference way; teacher logits come from (pinned) host memory each batch."""
    vocab = cache.meta.vocab_size
    length = int(cache.input_ids[0].numel())
    host = torch.randn(batch_size, length, vocab, dtype=torch.bfloat16)  # [B, T, V] one batch of teacher logits
    if device.type == "cuda":
        host = host.pin_memory()
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), moe.masked(model, pruned):
        for start in range(0, cache.num_samples, batch_size):
            ids = torch.stack(cache.input_ids[start : start + batch_size]).to(device)  # [B, T]
            p = torch.softmax(host[: ids.shape[0]].to(device, non_blocking=True).float(), -1)  # [B, T, V]
            q = torch.softmax(model(input_ids=ids).logits.float(), -1)  # [B, T, V]
            per_pos = torch.minimum(p, q).sum(-1)  # [B, T]
            keep = torch.zeros_like(per_pos, dtype=torch.bool)
            keep[:, length // 2 : length - 1] = True
            per_pos[keep].mean()
            del p, q
    sync(device)
    return time.perf_counter() - t0


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * 2**30)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def children(
    parent: Sequence[int], num_experts: Sequence[int], top_k: Sequence[int], count: int, rng: np.random.Generator
) -> list[tuple[int, ...]]:
    """Feasible allocations one level-switch step from `parent` (move `g=1` expert between two layers)."""
    out = []
    while len(out) < count:
        a, b = rng.choice(len(parent), size=2, replace=False)
        child = list(parent)
        child[a] += 1
        child[b] -= 1
        if alloc.is_feasible(child, num_experts, top_k, sum(parent), 1) and tuple(child) not in out:
            out.append(tuple(child))
    return out


def time_shape(shape: str, args: argparse.Namespace, device: torch.device) -> list[Timing]:
    dtype = torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16
    model = build_model(shape, args.tiny, device, dtype)
    spec = moe.inspect(model)
    n, k = spec.num_experts, spec.top_k
    orders = [list(range(e)) for e in n]
    parent = alloc.uniform(n, k, alloc.budget(args.sparsity, n, k))
    cache = random_cache(model.config.vocab_size, args.samples, args.length, args.top_k, seed=0)
    rng = np.random.default_rng(0)
    kids = children(parent, n, k, args.children, rng)
    out = []

    reference_seconds(model, cache, alloc.pruned_sets(kids[0], orders), args.reference_batch_size, device)  # warm-up
    ref = [
        reference_seconds(model, cache, alloc.pruned_sets(r, orders), args.reference_batch_size, device)
        for r in kids[: args.reference_candidates]
    ]
    out.append(Timing(shape, "(a) reference", float(np.mean(ref)), len(ref), 1.0))

    for name, budget in (("(b) exact", 0), ("(c) prefix", int(args.prefix_cache_gib * 2**30))):
        evaluator = CandidateEvaluator(
            model,
            cache,
            batch_size=args.batch_size,
            verify=False,
            prefix_cache_bytes=budget,
            keep=1,
            cache_device_bytes=_gib(args.cache_device_gib),
        )
        evaluator.score(alloc.pruned_sets(parent, orders))  # the parent (and warm-up) are not timed
        before = evaluator.work
        sync(device)
        t0 = time.perf_counter()
        for r in kids:
            evaluator.score(alloc.pruned_sets(r, orders))
        sync(device)
        seconds = (time.perf_counter() - t0) / len(kids)
        ffe = (evaluator.work - before) / evaluator.full_forward_work() / len(kids)
        out.append(Timing(shape, name, seconds, len(kids), ffe))
    for floor in ((False, True) if args.elite_floor else (False,)) if args.search_generations else ():
        out.append(search_timing(shape, model, cache, n, k, orders, args, device, floor))
    if args.statistical and args.search_generations:
        out.append(search_timing(shape, model, cache, n, k, orders, args, device, statistical=True))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def search_timing(
    shape: str,
    model: torch.nn.Module,
    cache: TeacherCache,
    n: Sequence[int],
    k: Sequence[int],
    orders: list[list[int]],
    args: argparse.Namespace,
    device: torch.device,
    floor: bool = False,
    statistical: bool = False,
) -> Timing:
    """A truncated default search (racing, elite floor optional); `seconds` is per candidate, `note` the
    extrapolation and the best fitness (equal with and without the floor)."""
    evaluator = CandidateEvaluator(
        model,
        cache,
        batch_size=args.batch_size,
        verify=False,
        prefix_cache_bytes=int(args.prefix_cache_gib * 2**30),
        keep=4,
        cache_device_bytes=_gib(args.cache_device_gib),
    )
    schedule = racing.Sequential() if statistical else racing.Racing() if args.racing else None
    samples = list(range(cache.num_samples))
    positions = (cache.offsets[1:] - cache.offsets[:-1]).tolist()  # scored positions per sample
    order = racing.Sequential().order(positions, 42) if statistical else []

    def sample_fitness(r: tuple[int, ...], count: int | None) -> np.ndarray:
        values = evaluator.sample_values(alloc.pruned_sets(r, orders), order[:count] if count else order)
        return evaluator.metric.sign * values.double().numpy()

    def fitness_of(r: tuple[int, ...], bound: float | None = None) -> float:
        return evaluator.score(alloc.pruned_sets(r, orders), floor=bound)

    def subset_fitness(r: tuple[int, ...], level: int, generation: int) -> float:
        assert schedule is not None
        return evaluator.score(alloc.pruned_sets(r, orders), schedule.subset(samples, positions, level, 42, generation))

    stamps: list[float] = []
    works: list[int] = []  # the evaluator's work at each generation's end
    sync(device)
    t0 = time.perf_counter()
    result = search.level_switch_search(
        fitness_of,
        n,
        k,
        alloc.budget(args.sparsity, n, k),
        generations=args.search_generations,
        granularity=1,
        racing=schedule,
        subset_fitness=subset_fitness if schedule and not statistical else None,
        sample_fitness=sample_fitness if statistical else None,
        on_generation=lambda *_: (sync(device), stamps.append(time.perf_counter()), works.append(evaluator.work)),
        elite_floor=floor,
    )
    seconds = time.perf_counter() - t0
    raced_only = len(
        {h.allocation for h in result.history if h.level is not None} - {h.allocation for h in result.history if h.level is None}
    )
    candidates = result.evaluations + raced_only
    ffe = evaluator.work / evaluator.full_forward_work() / candidates
    later = np.diff(stamps)  # seconds of each generation after the initial population
    estimate = stamps[0] - t0 + 50 * float(np.mean(later)) if len(later) else float("nan")
    race = " statistical racing" if statistical else " racing" if args.racing else ""
    method = f"search {args.search_generations} gen" + race + (" elite floor" if floor else "")
    note = f"gen 0 {stamps[0] - t0:.1f} s, then {float(np.mean(later)):.1f} s/gen; 50 generations ~{estimate / 60:.1f} min"
    if len(later):  # the same whole search's FFE per candidate: generation 0 as run, each later one as their mean
        population = search.level_switch_search.__kwdefaults__["population"]
        work = works[0] + 50 * float(np.mean(np.diff(works)))
        whole = population + 50 * (candidates - population) / args.search_generations
        note += f", {work / evaluator.full_forward_work() / whole:.3f} FFE/cand."
    note += f"; best fitness {result.best_fitness:.6f}"
    if evaluator.prefix is not None:
        note += f"; prefix peak {evaluator.prefix.peak_bytes / 2**30:.2f} GiB"
    return Timing(shape, method, seconds / candidates, candidates, ffe, note)


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--sparsity", type=float, default=0.25)
    parser.add_argument("--top-k", type=int, default=64, help="teacher cache entries per position")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--reference-batch-size", type=int, default=1)
    parser.add_argument("--reference-candidates", type=int, default=1)
    parser.add_argument("--children", type=int, default=3)
    parser.add_argument("--prefix-cache-gib", type=float, default=8.0)
    parser.add_argument(
        "--cache-device-gib",
        type=float,
        default=None,
        help="teacher cache budget on the GPU (0: stream it from pinned host memory; default: the evaluator's)",
    )
    parser.add_argument("--search-generations", type=int, default=0, help="then time a search of this many generations")
    parser.add_argument("--racing", action="store_true", help="the search races candidates (default schedule)")
    parser.add_argument("--elite-floor", action="store_true", help="time the search without, then with the elite floor")
    parser.add_argument("--statistical", action="store_true", help="then time the search with statistical racing too")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="test-size models (for a CPU smoke run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings = [t for shape in args.shapes for t in time_shape(shape, args, device)]
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {label}; {args.samples} samples x {args.length} tokens; tiny={args.tiny}")
    print("| shape | method | s / candidate | vs (a) | FFE / candidate | candidates | note |")
    print("|---|---|---|---|---|---|---|")
    for t in timings:
        ref = next(r for r in timings if r.shape == t.shape and r.method == "(a) reference")
        print(
            f"| {t.shape} | {t.method} | {t.seconds:.3f} | {ref.seconds / t.seconds:.1f}x | {t.ffe:.3f} | {t.candidates} | {t.note} |"
        )
    if device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    return timings


if __name__ == "__main__":
    main()
