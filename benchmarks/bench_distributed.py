"""Candidate-parallel search: candidates scored per second against workers, in one run on the same data.

Each worker count runs `evoesap search --workers N` (exact search, prefix reuse on, one CPU thread per
worker) twice, with `--generations` SHORT and LONG; the difference of the two wall times over the
difference of their candidate counts removes start-up (process launch, imports, model loading) and
leaves the search's steady rate, barriers included. The world is the tests' tiny inputs with the demo
tokenizer (tests/tiny_world.py), built once in a temporary directory; `--hidden`/`--layers`/`--experts`
replace its random OLMoE with a larger one, so that a candidate costs enough for the rate to be measured.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_distributed.py [--workers 1 2] [--population 32] [--hidden 1024 --layers 8 --experts 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def build(root: Path, hidden: int | None, layers: int, experts: int) -> dict[str, str]:
    from tiny_world import make_tiny_inputs
    from transformers import AutoTokenizer

    from evoesap import moe
    from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate

    files = make_tiny_inputs(root)
    if hidden:  # a larger random OLMoE in place of the tiny one, the same tokenizer
        vocab = len(AutoTokenizer.from_pretrained(files["model"]))
        heads = max(1, hidden // 64)
        shape = dict(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers, num_experts=experts)
        model = moe.tiny_model("olmoe", seed=3, vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=heads, **shape)
        model.save_pretrained(files["model"])
    inputs = {"model": files["model"], "scores": str(root / "scores"), "cache": str(root / "cache")}
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=16, max_length=256), inputs["scores"])
    run_cache_logits(
        files["model"], files["search"], CacheLogitsParams(samples=12, max_length=256, dtype="float32"), inputs["cache"]
    )
    return inputs


def timed_search(inputs: dict[str, str], out: Path, workers: int, generations: int, population: int) -> tuple[float, int]:
    """(wall seconds, candidates scored) of one `evoesap search` run."""
    from tiny_world import search_command

    from evoesap.stages.search import SearchParams

    params = SearchParams(
        criterion="reap", sparsity=0.5, population=population, elites=4, generations=generations, workers=workers
    )
    args = search_command(inputs, str(out), params)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"evoesap search --workers {workers} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wall, json.loads((out / "manifest.json").read_text())["run"]["cost"]["candidates"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--short", type=int, default=2, help="generations of the short run")
    parser.add_argument("--long", type=int, default=8, help="generations of the long run")
    parser.add_argument("--hidden", type=int, default=None, help="a larger model: its hidden size (and expert width)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        root = Path(tmp)
        inputs = build(root, args.hidden, args.layers, args.experts)
        rates = {}
        for workers in args.workers:
            short = timed_search(inputs, root / f"w{workers}-short", workers, args.short, args.population)
            long = timed_search(inputs, root / f"w{workers}-long", workers, args.long, args.population)
            rates[workers] = (long[1] - short[1]) / (long[0] - short[0])
            print(
                f"workers {workers}: {args.short} gen {short[0]:.1f} s ({short[1]} candidates), "
                f"{args.long} gen {long[0]:.1f} s ({long[1]} candidates): {rates[workers]:.2f} candidates/s",
                flush=True,
            )
        base = rates[args.workers[0]]
        for workers, rate in rates.items():
            print(f"workers {workers}: {rate / base:.2f}x the rate of {args.workers[0]} worker(s)")


if __name__ == "__main__":
    main()
