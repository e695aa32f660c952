"""A quality target against a brute-force sweep, on one world with the same seeds: does `target: {heldout_esap: X}`
choose the sparsity that a search at every grid point says is the largest meeting X, and in how many searches?

Both sides share calibration and the teacher caches (one storage root); the sweep searches every sparsity of the
granularity grid, timing each search; then, per X, the target brackets the grid (`evoesap.pipeline.target.run_target`).
Its probes are by default the sweep's own searches (reused: the same artifact), so its cost is given as the searches
it needs and the seconds those searches took in the sweep; with --warm-start the warm-started target runs too, timed
as it runs (its probes are other searches, which a later X may reuse). Seconds are those of this run: give a new
--storage for figures (over an old one, reused searches take no time). Printed: the sweep's held-out value per grid
point, then per X the sparsity each side chooses, the probes, searches and seconds. X: the thresholds given, where
`median` is the median of the sweep's held-out values (so the answer lies inside the grid); the median alone by
default.

Example (the demo world, built by `evoesap demo build --out /work/demo-world`):
    PYTHONPATH=$PWD .venv/bin/python benchmarks/target_vs_sweep.py --world /work/demo-world --granularity 2 \
        --threshold 0.9 median --warm-start
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


def _config(world: Path, storage: Path, granularity: int, threshold: float | None, samples: int = 64, warm: bool = False) -> dict:
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
        **({"target": {"heldout_esap": threshold, "warm_start": warm}} if threshold is not None else {}),
    }


def _thresholds(given: list[str], values: list[float]) -> list[float]:
    """The X to try: each given number, `median` the median of the sweep's held-out values."""
    median = round(statistics.median(values), 4)
    return [median if x == "median" else float(x) for x in given] or [median]


def _dips(meets: list[bool]) -> int:
    """Points that miss below a point that meets: where the sweep's answer is not monotone."""
    return sum(1 for i, ok in enumerate(meets) if not ok and any(meets[i + 1 :]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, required=True, help="a built demo world (or any folder of its layout)")
    parser.add_argument("--granularity", type=int, default=4)
    parser.add_argument("--threshold", nargs="*", default=[], help="X values (numbers or `median`); default: median")
    parser.add_argument("--samples", type=int, default=64, help="calibration and teacher-cache samples (the demo's 64)")
    parser.add_argument("--storage", type=Path, default=None, help="storage root (default: a new temporary folder)")
    parser.add_argument("--warm-start", action="store_true", help="also run the warm-started target per X")
    args = parser.parse_args()

    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import probe_inputs, run_target, target_grid

    from evoesap import records
    from evoesap.steps import run_step

    storage = args.storage or Path(tempfile.mkdtemp(prefix="target-vs-sweep-"))
    base = load_config(_config(args.world, storage, args.granularity, None, args.samples))
    _, points = target_grid(base)
    root = base.storage_root
    started = time.perf_counter()
    inputs = probe_inputs(base)
    shared = time.perf_counter() - started

    swept, seconds = [], {}
    for sparsity in points:
        started = time.perf_counter()
        uri = run_step("search", root, inputs, {**base.stage_params("search"), "criterion": "reap", "sparsity": sparsity})
        seconds[sparsity] = time.perf_counter() - started
        check = records.read(uri, records.AllocationRecord).heldout
        swept.append((sparsity, check.searched, check.searched_stderr))

    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"calibrate + two teacher caches: {shared:.0f} s (shared by both sides)")
    print(f"sweep: {len(points)} searches, {sum(seconds.values()):.0f} s")
    print("| sparsity | sweep held-out ESAP | stderr | seconds |")
    print("|---:|---:|---:|---:|")
    for sparsity, value, stderr in swept:
        print(f"| {sparsity:.4f} | {value:.4f} | {stderr:.4f} | {seconds[sparsity]:.1f} |")

    agreed = True
    modes = [False, True] if args.warm_start else [False]
    print("| X | dips | sweep: largest meeting X | probing | chose | agree | searches (at most) vs sweep | seconds vs sweep |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    for threshold in _thresholds(args.threshold, [v for _, v, _ in swept]):
        meets = [v >= threshold for _, v, _ in swept]
        meeting = [s for (s, _, _), ok in zip(swept, meets) if ok]
        answer = meeting[-1] if meeting else None
        for warm in modes:
            config = load_config(_config(args.world, storage, args.granularity, threshold, args.samples, warm))
            started = time.perf_counter()
            ((_, record),) = run_target(config)
            spent = time.perf_counter() - started if warm else sum(seconds[p.sparsity] for p in record.probes)
            agree = record.chosen == answer
            agreed &= agree or warm  # warm probes are other searches: they may rightly choose otherwise
            print(
                f"| {threshold} | {_dips(meets)} | {answer} | {'warm' if warm else 'cold'} | {record.chosen} | "
                f"{'yes' if agree else '**no**'} | {len(record.probes)} ({record.max_probes}) vs {len(points)} | "
                f"{spent:.0f} vs {sum(seconds.values()):.0f} |"
            )
            print(
                "    probes: "
                + ", ".join(f"{p.sparsity:.4f}: {p.heldout:.4f}{'' if p.meets else ' (misses)'}" for p in record.probes)
            )
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
