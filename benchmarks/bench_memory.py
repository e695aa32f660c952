"""Peak memory of every stage against model and cache bytes, and the planner's prediction of it.

Random-weight OLMoE-shaped models of growing size (bf16, OLMoE's vocabulary) run calibrate,
cache-logits, search and prune on the CPU, each stage in its own process (`python -m evoesap ...`)
sampled every 10 ms: from /proc/PID/status peak RSS, anonymous memory (RssAnon: what the process
allocated) and file-backed memory (RssFile); from /proc/PID/smaps the resident pages of the
memory-mapped safetensors, and the peak of anonymous + those weights at one instant (what the
planner's host figure predicts). A first process loads a teacher cache alone. Each row gives the
peak anonymous memory over model bytes, the loaded cache over its bytes, and the planner's host
prediction (`evoesap.planning.plan`) with its error; `--repredict` recomputes only the planner's columns of
an earlier run's --json rows (from config.json of the same models).

    PYTHONPATH=$PWD python benchmarks/bench_memory.py                    # 0.3, 1 and 2 GB
    PYTHONPATH=$PWD python benchmarks/bench_memory.py --sizes 0.3 --json out.json
    PYTHONPATH=$PWD python benchmarks/bench_memory.py --repredict out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

HIDDEN, EXPERTS, TOP_K, WIDTH, VOCAB = 1024, 16, 4, 512, 50304
LAYER_PARAMS = 4 * HIDDEN * HIDDEN + EXPERTS * 3 * HIDDEN * WIDTH + EXPERTS * HIDDEN  # attention, experts, router
SETTINGS = dict(samples=4, max_length=128, batch_size=2)
# what every stage process imports before it loads anything: the baseline subtracted from its peaks
RUNTIME_PROBE = (
    "import torch, transformers, pyarrow, pandas, evoesap.stages.search, evoesap.stages.prune, "
    "evoesap.planning.plan, evoesap.scoring.teacher, transformers.models.olmoe.modeling_olmoe"
)
CACHE_PROBE = """
import sys
import pyarrow.parquet
from evoesap.scoring import teacher
if len(sys.argv) > 1:
    teacher.load_cache(sys.argv[1])
"""
CACHE_SAMPLES = 24  # x 127 scored rows x OLMoE's vocabulary in float16: a 307 MB cache to load


def layers_for(gigabytes: float) -> int:
    """Decoder layers that make an OLMoE-shaped model of about `gigabytes` in bf16."""
    return max(2, round((gigabytes * 1e9 / 2 - 2 * VOCAB * HIDDEN) / LAYER_PARAMS))  # two: something to search


def olmoe_config(layers: int) -> AutoConfig:
    return AutoConfig.for_model(
        "olmoe",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )


def build(root: Path, layers: int) -> Path:
    """Save a random bf16 model (sharded like hub checkpoints) with the demo tokenizer."""
    from evoesap.demo.tokenizer import build_tokenizer

    model = AutoModelForCausalLM.from_config(olmoe_config(layers), dtype=torch.bfloat16)
    model.save_pretrained(root / "model", max_shard_size="500MB")
    build_tokenizer().save_pretrained(root / "model")
    del model
    return root / "model"


class Probe:
    """Peaks of a process's RSS, RssAnon, RssFile (/proc/PID/status) and of its resident safetensors pages
    (/proc/PID/smaps: the memory-mapped weights), and the peak of anonymous + weights at the same instant."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "weights": 0, "anon+weights": 0}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                smaps = Path(f"/proc/{self.pid}/smaps").read_text()
            except OSError:
                return
            now = {
                line.split(":")[0]: int(line.split()[1]) * 1024
                for line in status.splitlines()
                if line.split(":")[0] in ("VmRSS", "RssAnon", "RssFile")
            }
            if len(now) < 3:  # a zombie: the process has ended
                return
            now["weights"], mapped = 0, False
            for line in smaps.splitlines():
                if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split(" ")[0]:
                    mapped = line.rstrip().endswith(".safetensors")
                elif mapped and line.startswith("Rss:"):
                    now["weights"] += int(line.split()[1]) * 1024
            now["anon+weights"] = now["RssAnon"] + now["weights"]
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(0.01)

    def join(self) -> dict[str, int]:
        self._thread.join()
        return self.peak


def measure(args: list[str]) -> dict[str, int]:
    """Run a command, sampling its memory; its peaks in bytes."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = Probe(proc.pid)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} failed: {err[-2000:]}")
    return probe.join()


def stage_commands(root: Path, model: Path, data: dict[str, str]) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "evoesap"]
    common = [
        "--samples",
        str(SETTINGS["samples"]),
        "--max-length",
        str(SETTINGS["max_length"]),
        "--batch-size",
        str(SETTINGS["batch_size"]),
        "--model-dtype",
        "bfloat16",
        "--device",
        "cpu",
    ]
    return {
        "runtime": [sys.executable, "-c", RUNTIME_PROBE],
        "calibrate": [
            *cli,
            "calibrate",
            "--model",
            str(model),
            "--data",
            data["calibration"],
            "--out",
            str(root / "scores"),
            *common,
        ],
        "cache-logits": [
            *cli,
            "cache-logits",
            "--model",
            str(model),
            "--data",
            data["search"],
            "--out",
            str(root / "cache"),
            *common,
        ],
        "search": [
            *cli,
            "search",
            "--model",
            str(model),
            "--scores",
            str(root / "scores"),
            "--cache",
            str(root / "cache"),
            "--out",
            str(root / "search"),
            "--population",
            "2",
            "--elites",
            "1",
            "--generations",
            "0",
            "--batch-size",
            "2",
            "--model-dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--no-prefix-reuse",
        ],
        "prune": [
            *cli,
            "prune",
            "--model",
            str(model),
            "--scores",
            str(root / "scores"),
            "--out",
            str(root / "pruned"),
            "--sparsity",
            "0.5",
        ],
    }


def predictions(model: Path, cache_rows: int, mode: str) -> dict[str, int]:
    """The planner's host prediction of each stage on a CPU machine (a cache of `cache_rows` rows in `mode`)."""
    from evoesap.planning import footprint
    from evoesap.steps import make_params

    shape = footprint.model_shape(str(model), "bfloat16")
    params = {
        "calibrate": make_params("calibrate", SETTINGS),
        "cache-logits": make_params("cache-logits", {**SETTINGS, "mode": mode}),
        "search": make_params("search", {"batch_size": 2, "prefix_reuse": False}),
        "prune": make_params("prune", {"sparsity": 0.5}),
        "evaluate": make_params("evaluate", {}),
    }
    data = footprint.Data(SETTINGS["samples"] * SETTINGS["max_length"], cache_rows)
    plans = footprint.plan_stages(shape, footprint.Machine(host=1 << 50), data, params)
    return {p.stage: p.host for p in plans}


def config_only(root: Path, layers: int) -> Path:
    """config.json of the benchmark's model with `layers` layers, no weights: what the planner reads."""
    olmoe_config(layers).save_pretrained(root / f"config-{layers}")
    return root / f"config-{layers}"


def repredict(rows: list[dict], workdir: Path) -> list[dict]:
    """The rows of an earlier run with the current planner's predictions and errors (no stage is rerun)."""
    out = []
    for row in rows:
        if "layers" in row:
            predicted = predictions(config_only(workdir, row["layers"]), row["cache_rows"], row.get("cache_mode", "full"))
            row = {
                **row,
                "predicted_mb": predicted[row["stage"]] >> 20,
                "planner_error": round(predicted[row["stage"]] / (row["peak_held_mb"] << 20) - 1, 3),
            }
        out.append(row)
    return out


def run_size(gigabytes: float, workdir: Path) -> list[dict]:
    from evoesap.demo.domains import generate_splits, write_jsonl
    from evoesap.planning import footprint
    from evoesap.scoring import teacher

    root = Path(tempfile.mkdtemp(dir=workdir))
    layers = layers_for(gigabytes)
    model = build(root, layers)
    splits = generate_splits("math", seed=0, train_size=4)
    write_jsonl(splits["calibration"][:16], root / "calibration.jsonl")
    write_jsonl(splits["search"][:16], root / "search.jsonl")
    data = {"calibration": str(root / "calibration.jsonl"), "search": str(root / "search.jsonl")}
    model_bytes = footprint.model_shape(str(model), "bfloat16").bytes
    rows, peaks = [], {}
    for stage, command in stage_commands(root, model, data).items():
        peaks[stage] = measure(command)
    meta = teacher.CacheMeta.from_json((root / "cache" / teacher.META_FILE).read_text())
    predicted = predictions(model, meta.num_positions, meta.mode)
    runtime = peaks["runtime"]["RssAnon"]
    for stage in ("calibrate", "cache-logits", "search", "prune"):
        anon, held = peaks[stage]["RssAnon"], peaks[stage]["anon+weights"]
        rows.append(
            {
                "model_gb": round(model_bytes / 1e9, 2),
                "layers": layers,
                "cache_rows": meta.num_positions,
                "cache_mode": meta.mode,
                "stage": stage,
                "peak_rss_mb": peaks[stage]["VmRSS"] >> 20,
                "peak_anon_mb": anon >> 20,
                "peak_file_mb": peaks[stage]["RssFile"] >> 20,
                "peak_weights_mb": peaks[stage]["weights"] >> 20,
                "peak_held_mb": held >> 20,
                "runtime_anon_mb": runtime >> 20,
                "anon_over_model": round((anon - runtime) / model_bytes, 3),
                "predicted_mb": predicted[stage] >> 20,
                "planner_error": round(predicted[stage] / held - 1, 3),
            }
        )
    return rows


def cache_load_row(workdir: Path) -> dict:
    """Peak anonymous memory of loading a 307 MB full cache, over the cache's bytes (import baseline subtracted)."""
    import numpy as np

    from evoesap import moe
    from evoesap.data import TokenizedSample
    from evoesap.planning import footprint
    from evoesap.scoring import teacher

    model = moe.tiny_model("olmoe", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)
    rng = np.random.default_rng(0)
    samples = [TokenizedSample(i, rng.integers(3, VOCAB, 128).tolist(), [False] + [True] * 127) for i in range(CACHE_SAMPLES)]
    meta = teacher.write_cache(model, samples, workdir / "big-cache", mode="full", dtype="float16")
    cache = footprint.cache_bytes(meta.num_positions, VOCAB, "full", 64, "float16")
    base = measure([sys.executable, "-c", CACHE_PROBE])["RssAnon"]
    anon = measure([sys.executable, "-c", CACHE_PROBE, str(workdir / "big-cache")])["RssAnon"]
    return {
        "stage": "cache-load",
        "cache_mb": cache >> 20,
        "peak_anon_mb": anon >> 20,
        "runtime_anon_mb": base >> 20,
        "loaded_over_cache": round((anon - base) / cache, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.3,1,2", help="model sizes in GB (bf16), comma-separated")
    parser.add_argument("--workdir", default=None, help="where models and artifacts go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--repredict", default=None, help="a --json file of an earlier run: recompute the planner's columns only")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        if args.repredict:
            rows = repredict(json.loads(Path(args.repredict).read_text()), Path(tmp))
        else:
            rows = [cache_load_row(Path(tmp))]
            print(json.dumps(rows[-1]), flush=True)
            for size in args.sizes.split(","):  # rows as they come: a large size may take long on a shared machine
                for row in run_size(float(size), Path(tmp)):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
