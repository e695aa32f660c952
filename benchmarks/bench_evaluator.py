"""Candidates scored per second: CandidateEvaluator against the reference method, in one run.

Reference path (what the original implementation does per candidate): re-run the full model for the
teacher, run the masked candidate, apply the LM head, softmax and min at every position, and only then
apply the scored mask. Evaluator path: teacher from the Parquet cache, LM head and metric only at
scored positions. Both score the same random allocations; their ESAP values are compared too.

Also prints, for a top-K cache with each K, the mean ESAP bound width and the cache size against full
mode, and the ESAP shift a float16 full cache causes.

Examples:
    .venv/bin/python benchmarks/bench_evaluator.py                          # tiny random OLMoE, random samples
    .venv/bin/python benchmarks/bench_evaluator.py --vocab 50304            # OLMoE's padded vocabulary
    .venv/bin/python benchmarks/bench_evaluator.py --model runs/demo/model --data runs/demo/search.jsonl
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from evoesap import moe
from evoesap.data import TokenizedSample, load_samples, scored_mask, tokenize_samples
from evoesap.machine import runtime
from evoesap.scoring import forward, teacher
from evoesap.scoring.evaluator import CandidateEvaluator


def build_world(args: argparse.Namespace) -> tuple[torch.nn.Module, list[TokenizedSample], str]:
    """The model and tokenized samples: a checkpoint and data file, or a demo-shaped random OLMoE."""
    if args.model:
        model = moe.load_pruned(args.model, dtype=torch.float32).eval()
        tok = moe.load_tokenizer(args.model)
        samples = load_samples(args.data, split=args.split, n=args.samples, seed=0)
        return model, tokenize_samples(samples, tok, max_length=args.max_length), args.model
    model = moe.tiny_model(
        "olmoe",
        seed=0,
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        max_position_embeddings=max(256, args.max_length),
    ).eval()
    rng = np.random.default_rng(0)
    tokenized = []
    for i in range(args.samples):  # chat-like: a prompt, then an answer of about the same length
        length = int(rng.integers(args.max_length // 2, args.max_length + 1))
        prompt = int(rng.integers(length // 4, 3 * length // 4))
        ids = rng.integers(3, args.vocab, size=length).tolist()
        tokenized.append(TokenizedSample(i, ids, [False] * prompt + [True] * (length - prompt)))
    return model, tokenized, f"tiny random OLMoE (vocab {args.vocab})"


def random_allocations(model: torch.nn.Module, count: int, sparsity: float, seed: int) -> list[dict[int, list[int]]]:
    """Feasible random allocations removing about `sparsity` of the experts, unevenly across layers."""
    spec = moe.inspect(model)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        pruned = {}
        for layer in spec.layers:
            most = layer.num_experts - layer.top_k
            r = int(np.clip(round(rng.normal(sparsity, 0.15) * layer.num_experts), 0, most))
            pruned[layer.ordinal] = sorted(rng.choice(layer.num_experts, size=r, replace=False).tolist())
        out.append(pruned)
    return out


def reference_score(model: torch.nn.Module, tokenized: list[TokenizedSample], pruned, batch_size: int) -> float:
    """The reference method: teacher re-run, head + softmax + min at every position, mask applied after."""
    sample_means = []
    with torch.inference_mode():
        for start in range(0, len(tokenized), batch_size):
            chunk = tokenized[start : start + batch_size]
            ids, mask = forward.pad_right([torch.tensor(s.input_ids) for s in chunk])
            p = torch.softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [B, T, V]
            with moe.masked(model, pruned):
                q = torch.softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # [B, T, V]
            per_pos = torch.minimum(p, q).sum(-1)  # [B, T]
            for row, s in enumerate(chunk):
                keep = torch.zeros(ids.shape[1], dtype=torch.bool)
                keep[: len(s.input_ids)] = torch.tensor(scored_mask(s.answer_mask))
                sample_means.append(per_pos[row][keep].mean())
    return float(torch.stack(sample_means).double().mean())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / teacher.SHARD_DIR).glob("*.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (with tokenizer); default: a random demo-shaped OLMoE")
    parser.add_argument("--data", help="samples file for --model (JSONL/JSON/Parquet/CSV with chat messages)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary of the random model")
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"], help="full cache storage")
    parser.add_argument("--top-k", default="8,32,128", help="K values for the bound-width table ('' to skip)")
    parser.add_argument(
        "--threads",
        type=int,
        help="intra-op threads (sets EVOESAP_CPU_THREADS); default: evoesap.machine.runtime's choice, 1 for tiny models",
    )
    args = parser.parse_args()
    if args.model and not args.data:
        parser.error("--model needs --data")
    if args.threads:
        os.environ[runtime.CPU_THREADS_ENV] = str(args.threads)

    model, tokenized, label = build_world(args)
    threads = runtime.use_cpu_threads(runtime.parameter_count(model))
    vocab = int(model.get_output_embeddings().weight.shape[0])
    scored = sum(sum(scored_mask(s.answer_mask)) for s in tokenized)
    tokens = sum(len(s.input_ids) for s in tokenized)
    allocations = random_allocations(model, args.candidates, args.sparsity, seed=1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {threads} threads")
    print(f"world: {label}; {len(tokenized)} samples, {tokens} tokens, {scored} scored ({scored / tokens:.0%}), vocab {vocab}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        teacher.write_cache(model, tokenized, tmp / "full", mode="full", dtype=args.dtype, batch_size=args.batch_size)
        cache_s = time.perf_counter() - t0
        full = teacher.load_cache(str(tmp / "full"))
        scorer = CandidateEvaluator(model, full, batch_size=args.batch_size)
        warm = random_allocations(model, 1, args.sparsity, seed=2)[0]
        scorer.score(warm)  # warm both paths up outside the timing (first-call overheads)
        reference_score(model, tokenized, warm, args.batch_size)

        # interleaved, so that load from other processes on the machine hits both paths alike
        ours, ref, ours_t, ref_t = [], [], [], []
        for allocation in allocations:
            t0 = time.perf_counter()
            ours.append(scorer.score(allocation))
            t1 = time.perf_counter()
            ref.append(reference_score(model, tokenized, allocation, args.batch_size))
            t2 = time.perf_counter()
            ours_t.append(t1 - t0)
            ref_t.append(t2 - t1)
        ours_s, ref_s = sum(ours_t), sum(ref_t)

        print(f"teacher cache ({args.dtype}): {cache_s:.2f} s once, {dir_bytes(tmp / 'full') / 2**20:.2f} MiB")
        print(f"evaluator: {len(allocations) / ours_s:8.2f} candidates/s ({ours_s / len(allocations):.3f} s each)")
        print(f"reference: {len(allocations) / ref_s:8.2f} candidates/s ({ref_s / len(allocations):.3f} s each)")
        print(
            f"speed-up : {ref_s / ours_s:8.2f}x total, {np.median(ref_t) / np.median(ours_t):.2f}x of medians "
            "(same run, same candidates)"
        )
        diff = np.abs(np.array(ours) - np.array(ref))
        print(
            f"ESAP evaluator vs reference: max |diff| {diff.max():.2e} (cache {args.dtype}); ESAP range "
            f"{min(ours):.4f}..{max(ours):.4f}"
        )

        if args.dtype == "float16":
            teacher.write_cache(model, tokenized, tmp / "f32", mode="full", dtype="float32", batch_size=args.batch_size)
            exact = CandidateEvaluator(model, teacher.load_cache(str(tmp / "f32")), batch_size=args.batch_size)
            shift = np.abs(np.array(ours) - np.array([exact.score(a) for a in allocations]))
            print(f"float16 cache vs float32 cache: mean |ESAP diff| {shift.mean():.2e}, max {shift.max():.2e}")
            full_bytes = dir_bytes(tmp / "f32")
        else:
            full_bytes = dir_bytes(tmp / "full")

        ks = [int(k) for k in args.top_k.split(",") if k.strip() and int(k) <= vocab]
        if ks:
            print(f"\n{'K (f16)':>7} {'cache MiB':>10} {'vs full f32':>12} {'mean width':>11} {'max width':>10}")
        for k in ks:
            teacher.write_cache(
                model, tokenized, tmp / f"k{k}", mode="topk", top_k=k, dtype="float16", batch_size=args.batch_size
            )
            bounded = CandidateEvaluator(model, teacher.load_cache(str(tmp / f"k{k}")), batch_size=args.batch_size)
            widths = np.array([np.subtract(*bounded.bounds(a)[::-1]) for a in allocations])
            size = dir_bytes(tmp / f"k{k}")
            print(f"{k:>7} {size / 2**20:>10.3f} {size / full_bytes:>11.1%} {widths.mean():>11.2e} {widths.max():>10.2e}")


if __name__ == "__main__":
    main()
