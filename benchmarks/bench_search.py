"""Search cost against the reference method, in one run on the same data: seconds and work per candidate.

Rows:
  (a) reference  the original method re-implemented: full-vocabulary teacher logits held in host
                 memory as bfloat16, and per candidate a full masked forward (evoesap.moe.masked), the
                 LM head at every position, float32 softmax of both and the minimum over the whole
                 vocabulary at every position, the (shifted) answer mask applied afterwards.
  (b) exact      CandidateEvaluator without prefix reuse (teacher cache, head at scored positions only).
  (c) prefix     prefix reuse alone;  racing: racing alone;  prefix+racing: both.
(b) and (c) run the same short level-switch search (same seed and settings); (a) scores candidates of
that search's history, half before and half after the searches, so machine load hits it like the rest.
Figures: seconds per candidate, full-forward equivalents per candidate (decoder-layer x token work /
one plain forward over the search samples), peak memory (process peak RSS per row, reset between rows
through /proc/self/clear_refs, plus the bytes of teacher data and cached states the row holds), and the
search's final allocation with its full-set fitness. `--sweep` adds racing against exact search over
seeds x criteria x sparsities (cost per generation, full-set ESAP loss).

`--shape olmoe-1b-7b` (or `qwen3-30b-a3b`) replaces the demo world by a random-weight model with the
real depth, expert count, top-k and vocabulary of that model but a reduced width (`SHAPE_WIDTH`), so
that it runs on a CPU, and random search samples (`--samples` sequences of `--max-length` tokens,
alternating prompt and answer spans, about 70% of positions scored). It also prints what a whole search
with the default settings would cost, from the per-candidate figures.

Examples (the demo world; add --pad-vocab 50304 for OLMoE's vocabulary size; a real-depth shape):
    .venv/bin/python benchmarks/bench_search.py --model .cache/demo-world/model \\
        --data .cache/demo-world/data/{code,copy,facts,math}/search.jsonl
    .venv/bin/python benchmarks/bench_search.py --shape olmoe-1b-7b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from evoesap import moe
from evoesap.data import TokenizedSample, load_samples, scored_mask, tokenize_samples
from evoesap.machine import runtime
from evoesap.method import allocation as alloc
from evoesap.method import racing, search
from evoesap.scoring import forward, teacher
from evoesap.scoring.evaluator import CandidateEvaluator
from evoesap.scoring.importance import observe, pruning_order


def peak_rss_reset() -> None:
    """Reset the process's peak RSS (Linux); silently nothing elsewhere."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# Real depth, experts, top-k and vocabulary (gpu_search.SHAPES); this width, so that a search runs on a CPU.
SHAPES = {"olmoe-1b-7b": "olmoe", "qwen3-30b-a3b": "qwen3"}
SHAPE_WIDTH = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=4096,
)


def build_shape(args: argparse.Namespace) -> tuple[torch.nn.Module, list[TokenizedSample], list[TokenizedSample]]:
    """A seeded random-weight model of a real MoE's depth, experts, top-k and vocabulary, and random samples."""
    from gpu_search import SHAPES as REAL
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = REAL[SHAPES[args.shape]]
    config = AutoConfig.for_model(model_type, **{**values, **SHAPE_WIDTH})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)

    def sample(i: int) -> TokenizedSample:
        ids = rng.integers(3, config.vocab_size, args.max_length).tolist()
        mask, answer = [], False
        while len(mask) < args.max_length:  # prompt spans of 16-48 tokens, answers of 48-144
            mask += [answer] * int(rng.integers(48, 145) if answer else rng.integers(16, 49))
            answer = not answer
        return TokenizedSample(i, ids, mask[: args.max_length])

    return model, [sample(i) for i in range(args.samples)], [sample(i) for i in range(args.calibration_samples)]


def load_world(args: argparse.Namespace) -> tuple[torch.nn.Module, list[TokenizedSample], list[TokenizedSample]]:
    model = moe.load_pruned(args.model, dtype=torch.float32).eval()
    tok = moe.load_tokenizer(args.model)
    if args.pad_vocab:
        if args.pad_vocab < model.config.vocab_size:
            raise SystemExit(f"--pad-vocab {args.pad_vocab} is below the vocabulary size {model.config.vocab_size}")
        torch.manual_seed(0)  # the unused rows of the head and embeddings: seeded random init
        model.resize_token_embeddings(args.pad_vocab, mean_resizing=False)

    def read(files: list[str], n: int) -> list[TokenizedSample]:
        per = max(1, n // len(files))
        samples = [s for f in files for s in load_samples(f, split="train", n=per, seed=0)]
        tokenized = tokenize_samples(samples, tok, max_length=args.max_length)
        return [dataclasses.replace(s, sample_id=i) for i, s in enumerate(tokenized)]

    return model, read(args.data, args.samples), read(args.calibration or args.data, args.calibration_samples)


class Reference:
    """The reference method: bf16 full-vocabulary teacher logits on the host, everything at every position."""

    def __init__(self, model: torch.nn.Module, tokenized: list[TokenizedSample], batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        self.batches = []
        with torch.inference_mode():
            for start in range(0, len(tokenized), batch_size):
                chunk = tokenized[start : start + batch_size]
                ids, mask = forward.pad_right([torch.tensor(s.input_ids) for s in chunk])
                keep = torch.zeros(ids.shape, dtype=torch.bool)  # [B, T] scored positions
                for row, s in enumerate(chunk):
                    keep[row, : len(s.input_ids)] = torch.tensor(scored_mask(s.answer_mask))
                logits = model(input_ids=ids, attention_mask=mask).logits.to(torch.bfloat16)  # [B, T, V] bf16
                self.batches.append((ids, mask, keep, logits))
        self.bytes = sum(b[3].numel() * b[3].element_size() for b in self.batches)

    def score(self, pruned: dict[int, list[int]]) -> float:
        means = []
        with torch.inference_mode(), moe.masked(self.model, pruned):
            for ids, mask, keep, teacher_logits in self.batches:
                p = torch.softmax(teacher_logits.float(), -1)  # [B, T, V] float32, copied per batch
                q = torch.softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [B, T, V]
                per_pos = torch.minimum(p, q).sum(-1)  # [B, T]
                means += [per_pos[row][keep[row]].mean() for row in range(ids.shape[0])]
        return float(torch.stack(means).double().mean())


@dataclasses.dataclass
class Row:
    name: str
    seconds: float = 0.0
    candidates: int = 0
    ffe: float = float("nan")  # full-forward equivalents in all
    rss_mib: float = float("nan")
    held_mib: float = float("nan")
    best: tuple[int, ...] | None = None
    best_fitness: float = float("nan")
    generations: int = 0
    marks: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (seconds, FFE) at each generation's end

    def default_search(self, generations: int = 50) -> tuple[float, float]:
        """(seconds, FFE) of a whole search of `generations` (plus generation 0): generation 0 as measured,
        then each later one as the mean measured later generation."""
        first, later = np.array(self.marks[0]), np.diff(np.array(self.marks), axis=0).mean(axis=0)
        seconds, ffe = first + generations * later
        return float(seconds), float(ffe)


METHODS = {"exact": (False, False), "prefix": (True, False), "racing": (False, True), "prefix+racing": (True, True)}


def run_search(
    model, cache, orders, n, k, budget, search_ids, args, *, prefix: bool, race: bool | str, seed: int, elite_floor: bool = False
) -> tuple[Row, search.SearchResult, CandidateEvaluator]:
    """One search; `race`: False, True (the racing schedule of `args`) or "statistical" (`racing.Sequential` at
    `args.racing_delta`, first checkpoint `args.racing_min_samples`, the order stratified by length and seeded)."""
    evaluator = CandidateEvaluator(
        model,
        cache,
        batch_size=args.batch_size,
        prefix_cache_bytes=args.prefix_cache_bytes if prefix else 0,
        keep=args.elites,
        verify=False,
    )
    statistical = race == "statistical"
    if statistical:
        schedule = racing.Sequential(
            getattr(args, "racing_delta", 0.05),
            args.racing_min_samples,
            waves=getattr(args, "racing_waves", 4),
            surrogate=not getattr(args, "no_surrogate", False),
            screen=getattr(args, "screen", False),
            tolerance=getattr(args, "racing_tolerance", 0.0),
        )
    else:
        schedule = racing.Racing.parse(args.racing_schedule, args.racing_min_samples, args.racing_min_positions) if race else None
    positions = (cache.offsets[1:] - cache.offsets[:-1]).tolist()  # [S] scored positions per sample
    if schedule is not None:
        schedule.check([positions[i] for i in search_ids])
    order = [search_ids[i] for i in schedule.order([positions[i] for i in search_ids], seed)] if statistical else []

    def sample_fitness(r, count):
        values = evaluator.sample_values(alloc.pruned_sets(r, orders), samples=order[:count] if count else order)
        return evaluator.metric.sign * values.double().numpy()

    def fitness(r, floor=None):
        return evaluator.score(alloc.pruned_sets(r, orders), samples=search_ids, floor=floor)

    def subset_fitness(r, level, generation):
        samples = schedule.subset(search_ids, [positions[i] for i in search_ids], level, seed, generation)
        return evaluator.score(alloc.pruned_sets(r, orders), samples=samples)

    marks: list[tuple[float, float]] = []
    full = evaluator.full_forward_work(search_ids)
    t0 = time.perf_counter()
    result = search.level_switch_search(
        fitness,
        n,
        k,
        budget,
        population=args.population,
        elites=args.elites,
        generations=args.generations,
        seed=seed,
        elite_floor=elite_floor,
        racing=schedule,
        subset_fitness=subset_fitness if race and not statistical else None,
        sample_fitness=sample_fitness if statistical else None,
        on_generation=lambda *_: marks.append((time.perf_counter() - t0, evaluator.work / full)),
    )
    seconds = time.perf_counter() - t0
    raced = {h.allocation for h in result.history if h.level is not None} - {
        h.allocation for h in result.history if h.level is None
    }
    name = {(False, False): "(b) exact", (True, False): "(c) prefix", (False, True): "racing", (True, True): "prefix+racing"}.get(
        (prefix, race), f"{'prefix+' if prefix else ''}{race}"
    )
    row = Row(
        name,
        seconds,
        result.evaluations + len(raced),
        evaluator.work / evaluator.full_forward_work(search_ids),
        best=result.best,
        best_fitness=result.best_fitness,
        generations=args.generations,
        marks=marks,
    )
    row.held_mib = ((evaluator.prefix.peak_bytes if evaluator.prefix else 0) + tensor_bytes(evaluator.cache)) / 2**20
    return row, result, evaluator


def tensor_bytes(cache: teacher.TeacherCache) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in (cache.logprobs, cache.topk_ids, cache.topk_logprobs, cache.tail_mass, cache.positions, cache.targets)
        if t is not None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory with tokenizer (the demo world's model)")
    parser.add_argument("--data", nargs="+", help="search samples (JSONL chats), one or more files")
    parser.add_argument("--shape", choices=list(SHAPES), help="instead of --model/--data: a random model of that depth")
    parser.add_argument("--calibration", nargs="+", help="calibration samples for the pruning orders (default: --data)")
    parser.add_argument("--samples", type=int, default=64, help="search samples (split evenly over --data files)")
    parser.add_argument("--calibration-samples", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument(
        "--pad-vocab",
        type=int,
        default=0,
        help="pad the vocabulary to this size (50304: OLMoE's) with unused random rows, so that the "
        "head and softmax cost what they cost at real vocabulary sizes",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--criterion", default="reap")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--population", type=int, default=32)
    parser.add_argument("--elites", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--racing-schedule", default="0.0625,0.25:0.25")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHODS),
        default=list(METHODS),
        help="which searches to run beside the reference (the first non-racing one checks the values)",
    )
    parser.add_argument("--racing-min-samples", type=int, default=4)
    parser.add_argument("--racing-min-positions", type=int, default=256)
    parser.add_argument("--reference-batch-size", type=int, default=16)
    parser.add_argument("--prefix-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--reference-candidates", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also racing vs exact over seeds x {reap, frequency} x {25%%, 50%%}")
    parser.add_argument("--sweep-seeds", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (sets EVOESAP_CPU_THREADS); default: evoesap.machine.runtime's choice, 1 for tiny models",
    )
    args = parser.parse_args()
    if (args.shape is None) == (args.model is None or args.data is None):
        parser.error("give --model and --data (a demo world), or --shape (a random real-depth model)")
    if METHODS[args.methods[0]][1]:
        parser.error("--methods must start with exact or prefix (its search gives the reference's candidates)")
    if args.threads:
        os.environ[runtime.CPU_THREADS_ENV] = str(args.threads)

    model, tokenized, calibration = build_shape(args) if args.shape else load_world(args)
    threads = runtime.use_cpu_threads(runtime.parameter_count(model))
    spec = moe.inspect(model)
    n, k = spec.num_experts, spec.top_k
    scores = observe(model, calibration, batch_size=args.batch_size)
    tokens = sum(len(s.input_ids) for s in tokenized)
    scored = sum(sum(scored_mask(s.answer_mask)) for s in tokenized)
    print(
        f"machine: {platform.machine()} {platform.processor()}, torch {torch.__version__}, {threads} threads, "
        f"experts implementation {model.config._experts_implementation}"
    )
    print(
        f"world: {args.model or args.shape + ' (random weights, hidden ' + str(model.config.hidden_size) + ')'}; {len(tokenized)} search samples, {tokens} tokens, {scored} scored, vocab {model.config.vocab_size}, "
        f"{len(spec.layers)} MoE layers of {n[0]} experts top-{k[0]}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        teacher.write_cache(model, tokenized, Path(tmp), mode="full", dtype="float16", batch_size=args.batch_size)
        cache = teacher.load_cache(tmp)
        search_ids = list(range(cache.num_samples))
        orders = pruning_order(scores, args.criterion)
        budget = alloc.budget(args.sparsity, n, k)

        peak_rss_reset()
        reference = Reference(model, tokenized, args.reference_batch_size)
        ref_rss = peak_rss_mib()
        ref_times: list[float] = []
        ref_values: dict[tuple[int, ...], float] = {}

        def time_reference(candidates: list[tuple[int, ...]]) -> None:
            for r in candidates:
                t0 = time.perf_counter()
                ref_values[r] = reference.score(alloc.pruned_sets(r, orders))
                ref_times.append(time.perf_counter() - t0)

        first = search.seed_patterns(n, k, budget)
        half = args.reference_candidates // 2
        time_reference(list(first.values())[:half])
        rows, results = [], {}
        for prefix, race in (METHODS[m] for m in args.methods):
            peak_rss_reset()
            row, result, evaluator = run_search(
                model, cache, orders, n, k, budget, search_ids, args, prefix=prefix, race=race, seed=args.seed
            )
            row.rss_mib = peak_rss_mib()
            rows.append(row)
            results[row.name] = (result, evaluator)
        exact_result, exact_eval = results[rows[0].name]  # the first method's: (b) exact or (c) prefix, same values
        later = [h.allocation for h in exact_result.history if h.generation > 0][: args.reference_candidates - half]
        time_reference(later)
        ref_row = Row(
            "(a) reference",
            sum(ref_times),
            len(ref_times),
            float(len(ref_times)),
            rss_mib=ref_rss,
            held_mib=reference.bytes / 2**20,
        )
        checks = [abs(ref_values[r] - exact_eval.score(alloc.pruned_sets(r, orders))) for r in ref_values]

    full_fitness = {row.name: exact_eval.score(alloc.pruned_sets(row.best, orders)) for row in rows}
    ref_per = ref_row.seconds / ref_row.candidates
    print()
    print(
        "| method | s / candidate | vs (a) | FFE / candidate | FFE / generation | candidates | peak RSS MiB | held MiB | final allocation | full-set ESAP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| (a) reference | {ref_per:.3f} | 1.0x | 1.000 | {args.population - args.elites:.2f} | {ref_row.candidates} (timed) | "
        f"{ref_row.rss_mib:.0f} | {ref_row.held_mib:.1f} | - | - |"
    )
    for row in rows:
        per = row.seconds / row.candidates
        print(
            f"| {row.name} | {per:.3f} | {ref_per / per:.1f}x | {row.ffe / row.candidates:.3f} | {row.ffe / (row.generations + 1):.2f} | "
            f"{row.candidates} | {row.rss_mib:.0f} | {row.held_mib:.1f} | {list(row.best)} | {full_fitness[row.name]:.6f} |"
        )
    if args.shape:  # what a default search (population 32, 50 generations) would take here
        first = rows[0]
        per_gen = (first.candidates - args.population) / max(1, first.generations)  # distinct candidates per later generation
        default_candidates = args.population + 50 * per_gen
        print(
            f"\nwhole default search (50 generations, ~{default_candidates:.0f} distinct candidates), estimated from "
            f"generation 0 and the mean later generation of each row above: (a) reference "
            f"{ref_per * default_candidates / 60:.1f} min ({ref_per:.3f} s each)"
            + "".join(
                f"; {row.name} {row.default_search()[0] / 60:.1f} min, {row.default_search()[1] / default_candidates:.3f} "
                "FFE / candidate"
                for row in rows
            )
        )
    print(f"\n(a) vs {rows[0].name} ESAP on the same candidates: max |diff| {max(checks):.2e} (float16 cache vs bf16 logits)")
    print(
        f"search: {args.criterion} {args.sparsity:.0%}, population {args.population}, elites {args.elites}, "
        f"{args.generations} generations, seed {args.seed}; racing schedule {args.racing_schedule}"
    )
    if args.sweep:
        sweep(model, cache, scores, n, k, search_ids, args)
    print("\ncommand: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


def sweep(model, cache, scores, n, k, search_ids, args) -> None:
    """Racing against exact search (both with prefix reuse): cost per generation and full-set ESAP loss."""
    print("\n| criterion | sparsity | seed | exact ESAP | racing ESAP | loss % | exact FFE/gen | racing FFE/gen | cheaper |")
    print("|---|---|---|---|---|---|---|---|---|")
    losses, ratios = [], []
    for criterion in ("reap", "frequency"):
        orders = pruning_order(scores, criterion)
        for sparsity in (0.25, 0.5):
            budget = alloc.budget(sparsity, n, k)
            for seed in range(args.sweep_seeds):
                exact, _, ev = run_search(
                    model, cache, orders, n, k, budget, search_ids, args, prefix=True, race=False, seed=seed
                )
                raced, _, _ = run_search(model, cache, orders, n, k, budget, search_ids, args, prefix=True, race=True, seed=seed)
                e = ev.score(alloc.pruned_sets(exact.best, orders))
                r = ev.score(alloc.pruned_sets(raced.best, orders))
                loss, ratio = 100 * (e - r) / e, exact.ffe / raced.ffe
                losses.append(loss)
                ratios.append(ratio)
                print(
                    f"| {criterion} | {sparsity:.0%} | {seed} | {e:.6f} | {r:.6f} | {loss:+.3f} | "
                    f"{exact.ffe / (args.generations + 1):.2f} | {raced.ffe / (args.generations + 1):.2f} | {ratio:.1f}x |"
                )
    print(
        f"\nsweep: ESAP loss mean {np.mean(losses):+.3f}% max {np.max(losses):+.3f}%; racing cheaper per generation "
        f"{np.min(ratios):.1f}x..{np.max(ratios):.1f}x (mean {np.mean(ratios):.1f}x)"
    )


if __name__ == "__main__":
    main()
