"""Every stage at a real model's dimensions on one GPU: peak host and device memory against the planner.

Saves a random-weight bf16 checkpoint of a real shape (`gpu_search.SHAPES`: OLMoE-1B-7B by default,
13.8 GB) with the demo's character tokenizer, writes synthetic chat samples of about `--length`
tokens, then runs calibrate, cache-logits (top-K at the paper's search size, then full on fewer
samples), search and the streamed prune, each as its own `python -m evoesap` process. Host memory is
sampled from /proc (bench_memory.Probe: RssAnon apart from file-backed pages), device memory from NVML
(memory used on the GPU above what was used before the stage started, CUDA context included). Each row
also carries the planner's prediction for the same settings (`evoesap.planning.plan`), so its error can be read
off; each stage's own output goes to WORKDIR/<stage>.log. Rows are printed (and appended to `--json`) as they come: a run cut short keeps what it measured.

    python benchmarks/gpu_stages.py --workdir /tmp/stages --json $OUT/stages.jsonl
    python benchmarks/gpu_stages.py --tiny --device cpu --workdir /tmp/s    # a CPU smoke run, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_memory import Probe
from gpu_search import SHAPES, build_model

from evoesap.planning import footprint
from evoesap.steps import make_params


class DeviceProbe:
    """Peak GPU memory in use (NVML, whole device) while a process runs, above the level before it started."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.base = self.used()
        self.peak, self._stop = self.base, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def run_stage(command: list[str], on_gpu: bool, log: Path) -> dict[str, Any]:
    """Run one stage process, its output to `log`; its host peaks, device peak and wall seconds."""
    device = DeviceProbe() if on_gpu else None
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        host = Probe(proc.pid)
        proc.wait()
    seconds = time.perf_counter() - start
    peak_device = device.stop() if device else 0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command[3:5])} failed: {log.read_text()[-3000:]}")
    peaks = host.join()
    return {
        "seconds": round(seconds, 1),
        "host_anon_gib": peaks["RssAnon"] / 2**30,
        "host_file_gib": peaks["RssFile"] / 2**30,
        "device_gib": peak_device / 2**30,
    }


def build_checkpoint(shape: str, tiny: bool, root: Path, device: str) -> Path:
    """A random bf16 checkpoint of the shape (`gpu_search.build_model`), sharded like hub checkpoints, with the
    demo tokenizer and its special tokens."""
    from evoesap.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(model_max_length=1 << 20)
    model = build_model(shape, tiny, torch.device(device), torch.bfloat16)
    model.config.update(
        {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    )
    model.save_pretrained(root / "model", max_shard_size="5GB")
    tokenizer.save_pretrained(root / "model")
    del model
    if torch.cuda.is_available():  # the stages run in processes of their own: leave them the whole device
        torch.cuda.empty_cache()
    return root / "model"


def write_chats(path: Path, samples: int, length: int, seed: int) -> None:
    """Chat samples of about `length` characters (= tokens for the character tokenizer), half of it the answer."""
    rng = random.Random(seed)

    def words(chars: int) -> str:
        return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(chars // 6))

    with path.open("w") as f:
        for _ in range(samples):
            messages = [{"role": "user", "content": words(length // 2)}, {"role": "assistant", "content": words(length // 2)}]
            f.write(json.dumps({"messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="olmoe", choices=list(SHAPES))
    parser.add_argument("--samples", type=int, default=64, help="search-set samples (the paper's 64)")
    parser.add_argument("--calibration-samples", type=int, default=64)
    parser.add_argument("--full-samples", type=int, default=16, help="samples of the full-mode cache (26 GB at 64 x 4096)")
    parser.add_argument("--length", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--population", type=int, default=4, help="search population (the paper's 32)")
    parser.add_argument("--elites", type=int, default=1)
    parser.add_argument("--generations", type=int, default=1, help="search generations (the paper's 50)")
    parser.add_argument("--racing", action="store_true", help="search with the default racing schedule")
    parser.add_argument("--stages", default="calibrate,cache-logits,search,cache-logits-full,prune")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--json", default=None, help="append each row here as a JSON line")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="TINY dimensions instead of the shape's (CPU smoke run)")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    on_gpu = args.device.startswith("cuda")

    start = time.perf_counter()
    model = build_checkpoint(args.shape, args.tiny, root, args.device)
    print(
        f"checkpoint: {sum(f.stat().st_size for f in model.glob('*.safetensors')) / 1e9:.2f} GB "
        f"in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    write_chats(root / "calibration.jsonl", args.calibration_samples, args.length, 0)
    write_chats(root / "search.jsonl", args.samples, args.length, 1)
    machine = footprint.local_machine(args.device)
    shape = footprint.model_shape(str(model), "bfloat16")

    cli = [sys.executable, "-m", "evoesap"]
    run = ["--model-dtype", "bfloat16", "--device", args.device]
    data = ["--max-length", str(args.length), "--batch-size", str(args.batch_size)]
    settings = {"max_length": args.length, "batch_size": args.batch_size}
    cache_args = {
        "cache": ["--mode", "topk", "--samples", str(args.samples)],
        "cache-full": ["--mode", "full", "--samples", str(args.full_samples)],
    }
    stages = {  # name -> (stage, its own arguments, calibrate tokens, the cache it writes or reads)
        "calibrate": (
            "calibrate",
            ["--data", str(root / "calibration.jsonl"), "--samples", str(args.calibration_samples), *data, *run],
            args.calibration_samples * args.length,
            "cache",
        ),
        "cache-logits": ("cache-logits", ["--data", str(root / "search.jsonl"), *cache_args["cache"], *data, *run], 0, "cache"),
        "search": (
            "search",
            [
                "--scores",
                str(root / "scores"),
                "--cache",
                str(root / "cache"),
                "--sparsity",
                "0.5",
                "--population",
                str(args.population),
                "--elites",
                str(args.elites),
                "--generations",
                str(args.generations),
                *(["--racing"] if args.racing else []),
                "--batch-size",
                str(args.batch_size),
                *run,
            ],
            0,
            "cache",
        ),
        "cache-logits-full": (
            "cache-logits",
            ["--data", str(root / "search.jsonl"), *cache_args["cache-full"], *data, *run],
            0,
            "cache-full",
        ),
        "prune": ("prune", ["--scores", str(root / "scores"), "--sparsity", "0.5"], 0, "cache"),
    }
    for name in args.stages.split(","):
        stage, own, calibrate_tokens, cache_dir = stages[name]
        out = root / {"calibrate": "scores", "cache-logits": cache_dir}.get(stage, stage)
        measured = run_stage(
            [*cli, stage, "--model", str(model), "--out", str(out), *own], on_gpu and stage != "prune", root / f"{name}.log"
        )
        meta_file = root / cache_dir / "cache.json"  # calibrate runs before any cache exists
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {"mode": "topk", "top_k": 64, "num_positions": 0}
        cache_p = make_params("cache-logits", {**settings, "mode": meta["mode"], "top_k": meta["top_k"] or 64})
        params = {
            "calibrate": make_params("calibrate", {**settings, "samples": args.calibration_samples}),
            "cache-logits": cache_p,
            "search": make_params("search", {"batch_size": args.batch_size}),
            "prune": make_params("prune", {"sparsity": 0.5}),
            "evaluate": make_params("evaluate", {}),
        }
        rows = int(meta["num_positions"])
        predicted = footprint.plan_stages(shape, machine, footprint.Data(calibrate_tokens, rows), params, only=stage)[0]
        row = {
            "shape": args.shape,
            "stage": name,
            "model_gib": shape.bytes / 2**30,
            "cache_rows": rows,
            **measured,
            "planned_host_gib": predicted.host / 2**30,
            "planned_device_gib": predicted.device / 2**30,
            "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        }
        if stage == "search":  # what the search did: candidates, FFE per candidate, prefix cache (its manifest)
            row["search_cost"] = json.loads((out / "manifest.json").read_text())["run"]["cost"]
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
