"""Cost of the calibration observer pass against a plain forward and against the all-experts approach.

All three run in one process over the same padded batches, each timed as the best of `--repeats` rounds
in which the methods take turns (so load from other processes hits all alike); the ratios come from one
run on one machine. The all-experts approach is the reference implementation's
method (every expert on every token from the fused weights, then select by the routing), written here
as batched einsums in a router hook: it costs E/k times the expert work of a forward.

    .venv/bin/python benchmarks/bench_calibrate.py [--family olmoe --samples 32 --length 256 --device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from transformers.activations import ACT2FN

from evoesap import moe
from evoesap.data import TokenizedSample, batches
from evoesap.machine import runtime
from evoesap.scoring import importance


def _forward(model: torch.nn.Module, tokenized: list[TokenizedSample], batch_size: int, device: torch.device) -> None:
    with torch.inference_mode():
        for batch in batches(tokenized, batch_size, pad_id=0):
            model(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                use_cache=False,
                logits_to_keep=1,
            )


def _all_experts(model: torch.nn.Module, tokenized: list[TokenizedSample], batch_size: int, device: torch.device) -> None:
    """Forward with a router hook that runs every expert on every token and accumulates the four sums."""
    blocks = moe.moe_blocks(model)
    act_fn = ACT2FN[model.config.hidden_act]
    sums = [torch.zeros(4, b.experts.gate_up_proj.shape[0], dtype=torch.float64, device=device) for b in blocks]

    def hook(layer: int, experts: torch.nn.Module):
        def run(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [T, H]
            h = torch.einsum("th,eoh->teo", x, experts.gate_up_proj.float())  # [T, E, 2I]
            inter = h.shape[-1] // 2
            out = torch.einsum("tei,ehi->teh", act_fn(h[..., :inter]) * h[..., inter:], experts.down_proj.float())  # [T, E, H]
            norms = out.norm(dim=-1).gather(1, output[2])  # [T, k]
            w, idx = output[1].float(), output[2].reshape(-1)
            s = sums[layer]
            s[0].index_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
            s[1].index_add_(0, idx, w.reshape(-1).double())
            s[2].index_add_(0, idx, norms.reshape(-1).double())
            s[3].index_add_(0, idx, (w * norms).reshape(-1).double())

        return run

    handles = [b.router.register_forward_hook(hook(i, b.experts)) for i, b in enumerate(blocks)]
    try:
        _forward(model, tokenized, batch_size, device)
    finally:
        for h in handles:
            h.remove()


def _interleaved_best(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best time of each method, the methods taking turns so that load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="olmoe")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    if args.family == "gpt_oss":
        ap.error("the all-experts baseline here covers the gate-rows-first layout; GPT-OSS's differs")
    device = torch.device(args.device)
    overrides = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        vocab_size=2048,
    )
    model = moe.tiny_model(args.family, seed=0, **overrides).to(device).eval()
    runtime.use_cpu_threads(runtime.parameter_count(model))  # 1 thread for a tiny model, as the stages do
    rng = np.random.default_rng(0)
    tokenized = [
        TokenizedSample(i, rng.integers(0, 2048, args.length).tolist(), [True] * args.length) for i in range(args.samples)
    ]

    run = {
        "plain forward": lambda: _forward(model, tokenized, args.batch_size, device),
        "observer pass (importance.observe)": lambda: importance.observe(model, tokenized, args.batch_size),
        "all experts on every token": lambda: _all_experts(model, tokenized, args.batch_size, device),
    }
    for fn in run.values():  # warm-up: kernels, allocator, lazy init
        fn()
    times = _interleaved_best(run, args.repeats)
    base = times["plain forward"]
    spec = moe.inspect(model)
    print(f"$ {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(
        f"{args.family}: {len(spec.layers)} MoE layers, {spec.num_experts[0]} experts, top-{spec.top_k[0]}, hidden {args.hidden}, "
        f"{args.samples} x {args.length} tokens, batch {args.batch_size}, {device}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'method':<38} {'seconds':>9} {'x plain':>8}")
    for name, t in times.items():
        print(f"{name:<38} {t:>9.3f} {t / base:>8.2f}")


if __name__ == "__main__":
    main()
