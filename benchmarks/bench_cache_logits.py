"""cache-logits against its floor: one teacher forward plus LM head and log-softmax over the same samples.

The ratio (cache-logits time / floor time, same process, same model) says what the cache costs beyond
the forward itself: chunking the head, moving rows to the host, Arrow and Parquet. Target: within 2x.

    PYTHONPATH=$PWD python benchmarks/bench_cache_logits.py                       # CPU, OLMoE vocabulary
    PYTHONPATH=$PWD python benchmarks/bench_cache_logits.py --device cuda --hidden 2048 --layers 4 --length 2048
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from evoesap import moe
from evoesap.data import TokenizedSample
from evoesap.machine import runtime
from evoesap.scoring import forward, teacher


def floor_seconds(model: torch.nn.Module, samples: list[TokenizedSample], batch_size: int) -> float:
    """One forward + head + log-softmax over every scored row, results discarded: the unavoidable work."""
    device = forward.model_device(model)
    start = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, len(samples), batch_size):
            chunk = samples[a : a + batch_size]
            ids, mask = forward.pad_right([torch.tensor(s.input_ids) for s in chunk])
            hidden = forward.final_hidden(model, ids.to(device), mask.to(device))  # [B, T, H]
            rows = [(r, t) for r, s in enumerate(chunk) for t in teacher.scored_positions(s.answer_mask)]
            picked = hidden[torch.tensor([r for r, _ in rows]), torch.tensor([t for _, t in rows])]  # [P, H]
            logprobs = torch.log_softmax(forward.head_logits(model, picked).float(), dim=-1)  # [P, V]
            float(logprobs[-1, -1])  # waits for the device
    return time.perf_counter() - start


def cache_seconds(model: torch.nn.Module, samples: list[TokenizedSample], batch_size: int, mode: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        teacher.write_cache(model, samples, tmp, mode=mode, top_k=64, batch_size=batch_size)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=50304)  # OLMoE's
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mode", default="full", choices=teacher.MODES)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    model = (
        moe.tiny_model(
            "olmoe",
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=args.hidden // 2,
            num_attention_heads=max(1, args.hidden // 64),
            num_key_value_heads=max(1, args.hidden // 64),
            max_position_embeddings=max(256, args.length),
        )
        .to(dtype=torch.bfloat16 if args.device != "cpu" else torch.float32, device=args.device)
        .eval()
    )
    runtime.use_cpu_threads(runtime.parameter_count(model))  # 1 thread for a tiny model, as the stages do
    rng = np.random.default_rng(0)
    prompt = args.length // 4
    samples = [
        TokenizedSample(i, rng.integers(3, args.vocab, args.length).tolist(), [False] * prompt + [True] * (args.length - prompt))
        for i in range(args.samples)
    ]
    cache_seconds(model, samples[:2], 2, args.mode)  # warm-up
    floors, caches = [], []
    for _ in range(args.repeat):  # interleaved, so that load on a shared machine hits both alike
        floors.append(floor_seconds(model, samples, args.batch_size))
        caches.append(cache_seconds(model, samples, args.batch_size, args.mode))
    rows = sum(len(teacher.scored_positions(s.answer_mask)) for s in samples)
    print(
        json.dumps(
            {
                "device": args.device,
                "mode": args.mode,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "layers": args.layers,
                "samples": args.samples,
                "length": args.length,
                "scored_rows": rows,
                "floor_s": min(floors),
                "cache_logits_s": min(caches),
                "ratio": min(caches) / min(floors),
            }
        )
    )


if __name__ == "__main__":
    main()
