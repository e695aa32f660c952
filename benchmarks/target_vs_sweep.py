"""A quality target against a brute-force sweep, on one world with the same seeds: does `target: {heldout_esap: X}`
choose the sparsity that a search at every grid point says is the largest meeting X, and in how many searches?

Both sides share calibration and the teacher caches (one storage root); the sweep searches every sparsity of the
granularity grid (no warm start), the target bisects the grid (`evoesap.pipeline.target.run_target`, warm-started
probes). Printed: the sweep's held-out value per grid point, the sparsity each side chooses, the searches and the
seconds each side spent. X defaults to the median of the sweep's held-out values (so the answer lies inside the grid);
give --threshold to fix it.

Example (the demo world, built by `evoesap demo build --out /work/demo-world`):
    PYTHONPATH=$PWD .venv/bin/python benchmarks/target_vs_sweep.py --world /work/demo-world --granularity 4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

SEARCH = {"population": 8, "elites": 2, "generations": 4, "batch_size": 16}


def _config(world: Path, storage: Path, granularity: int, threshold: float | None, samples: int = 64) -> dict:
    data = world / "data" / "mix"
    return {
        "name": "target-vs-sweep",
        "model": str(world / "model"),
        "calibration_data": str(world / "data" / "code" / "calibration.jsonl"),
        "search_data": str(data / "search.jsonl"),
        "heldout_data": str(data / "search_heldout.jsonl"),
        "criteria": ["reap"],
        "storage_root": str(storage),
        "calibrate": {"samples": samples, "max_length": 256, "batch_size": 16},
        "cache_logits": {"samples": samples, "max_length": 256, "batch_size": 16, "dtype": "float32"},
        "search": {**SEARCH, "granularity": granularity},
        **({"target": {"heldout_esap": threshold}} if threshold is not None else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, required=True, help="a built demo world (or any folder of its layout)")
    parser.add_argument("--granularity", type=int, default=4)
    parser.add_argument("--threshold", type=float, default=None, help="X; default: the median of the sweep's values")
    parser.add_argument("--samples", type=int, default=64, help="calibration and teacher-cache samples (the demo's 64)")
    parser.add_argument("--storage", type=Path, default=None, help="storage root (default: a new temporary folder)")
    args = parser.parse_args()

    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import run_target, target_grid

    from evoesap import records
    from evoesap.steps import run_step

    storage = args.storage or Path(tempfile.mkdtemp(prefix="target-vs-sweep-"))
    base = load_config(_config(args.world, storage, args.granularity, None, args.samples))
    _, points = target_grid(base)
    root, model = base.storage_root, base.pinned_model
    cache_params = base.stage_params("cache-logits")
    started = time.perf_counter()
    scores = run_step("calibrate", root, {"model": model, "data": base.calibration_data}, base.stage_params("calibrate"))
    cache = run_step("cache-logits", root, {"model": model, "data": base.search_data}, cache_params)
    heldout = run_step("cache-logits", root, {"model": model, "data": base.heldout_data}, cache_params)
    shared = time.perf_counter() - started
    inputs = {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout}

    started, swept = time.perf_counter(), []
    for sparsity in points:
        uri = run_step("search", root, inputs, {**base.stage_params("search"), "criterion": "reap", "sparsity": sparsity})
        check = records.read(uri, records.AllocationRecord).heldout
        swept.append((sparsity, check.searched, check.searched_stderr))
    sweep_seconds = time.perf_counter() - started
    threshold = args.threshold if args.threshold is not None else round(statistics.median(v for _, v, _ in swept), 4)
    meeting = [s for s, v, _ in swept if v >= threshold]
    monotone = all(a[1] >= b[1] for a, b in zip(swept, swept[1:]))

    config = load_config(_config(args.world, storage, args.granularity, threshold, args.samples))
    started = time.perf_counter()
    ((_, record),) = run_target(config)
    target_seconds = time.perf_counter() - started

    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"calibrate + two teacher caches: {shared:.0f} s (shared by both sides)")
    print("| sparsity | sweep held-out ESAP | stderr | meets |")
    print("|---:|---:|---:|---|")
    for sparsity, value, stderr in swept:
        print(f"| {sparsity:.4f} | {value:.4f} | {stderr:.4f} | {'yes' if value >= threshold else 'no'} |")
    print(f"threshold X = {threshold}; the sweep's values fall monotonically: {monotone}")
    print(f"sweep:  {len(points)} searches, {sweep_seconds:.0f} s, largest meeting X: {meeting[-1] if meeting else None}")
    probes = ", ".join(f"{p.sparsity:.4f}: {p.heldout:.4f} ({'meets' if p.meets else 'misses'})" for p in record.probes)
    print(f"target: {len(record.probes)} searches (at most {record.max_probes}), {target_seconds:.0f} s, chose {record.chosen}")
    print(f"target probes: {probes}")
    agree = record.chosen == (meeting[-1] if meeting else None)
    print(f"agree: {agree}; searches {len(record.probes)} vs {len(points)} ({len(record.probes) / len(points):.2f}x)")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
