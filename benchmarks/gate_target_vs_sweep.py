"""A gate target and a choice of criterion against a brute-force sweep of verdicts, on the trained demo world: does
`target: {gate: true}` choose the largest sparsity whose model a sweep of evaluations says passes the gate, and does
`choose_criterion: true` choose the criterion whose own target reaches the largest sparsity, in fewer probes?

The sweep runs, per criterion and per grid point, what a gate target's probe runs (search, prune, evaluate, gate:
`evoesap.pipeline.target.Gating`), timing each point; then each criterion's own gate target and the choice over all
criteria run (`run_target`), their probes the sweep's artifacts (reused), so their cost is given as the probes they
need and the seconds those probes took in the sweep. Seconds are those of this run: give a new --storage for figures.

Example (the demo world, built by `evoesap demo build --out /work/demo-world`):
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gate_target_vs_sweep.py --world /work/demo-world --granularity 4 \
        --max-task-drop 0.05
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

SEARCH = {"population": 8, "elites": 2, "generations": 4, "batch_size": 16}  # as benchmarks/target_vs_sweep.py


def _settings(world_dir: Path, storage: Path, granularity: int, drop: float, criteria: list[str], choose: bool) -> dict:
    """The demo's configuration (`pipeline.demo.demo_config`) with a gate target in place of its sparsities and
    without quantize (a gate target probes the pruned model)."""
    from evoesap.pipeline.demo import demo_config

    from evoesap.demo.world import build_demo_world

    base = demo_config(build_demo_world(world_dir), storage.parent).model_dump(exclude_none=True)
    for key in ("sparsities", "quantize", "report", "pipeline_root"):
        base.pop(key, None)
    return {
        **base,
        "name": "gate-target-vs-sweep",
        "criteria": criteria,
        "storage_root": str(storage),
        "search": {**SEARCH, "granularity": granularity},
        "gate": {"max_task_drop": drop},
        "target": {"gate": True, "choose_criterion": choose},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, required=True, help="a built demo world (reused when up to date)")
    parser.add_argument("--granularity", type=int, default=4)
    parser.add_argument("--max-task-drop", type=float, default=0.05)
    parser.add_argument("--criteria", nargs="+", default=["reap", "frequency", "ean"])
    parser.add_argument("--storage", type=Path, default=None, help="storage root (default: a new temporary folder)")
    args = parser.parse_args()

    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import _search_step, gating_for, probe_inputs, run_target, target_grid

    from evoesap.planning.target import best

    storage = args.storage or Path(tempfile.mkdtemp(prefix="gate-target-vs-sweep-")) / "artifacts"
    settings = _settings(args.world, storage, args.granularity, args.max_task_drop, args.criteria, False)
    base = load_config(settings)
    _, points = target_grid(base)
    root = base.storage_root
    started = time.perf_counter()
    inputs = probe_inputs(base)
    judging = gating_for(base, inputs)
    shared = time.perf_counter() - started

    passed, seconds, failing = {}, {}, {}
    for criterion in args.criteria:
        search, judge = _search_step(root, inputs, base.stage_params("search"), criterion), judging.judge(root, inputs, criterion)
        for sparsity in points:
            started = time.perf_counter()
            _, verdict = judge(sparsity, search(sparsity, None)[0])
            seconds[criterion, sparsity] = time.perf_counter() - started
            passed[criterion, sparsity] = verdict.passed
            failing[criterion, sparsity] = "; ".join(c.line() for c in verdict.checks if not c.passed)

    sweep_seconds = sum(seconds.values())
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"calibrate, two teacher caches, the full model's evaluation: {shared:.0f} s (shared)")
    print(f"sweep: {len(points)} grid points x {len(args.criteria)} criteria (search, prune, evaluate, gate each), "
          f"{sweep_seconds:.0f} s")  # fmt: skip
    print("| sparsity | " + " | ".join(args.criteria) + " |")
    print("|---:|" + "---|" * len(args.criteria))
    for sparsity in points:
        cells = ["passes" if passed[c, sparsity] else f"fails ({failing[c, sparsity]})" for c in args.criteria]
        print(f"| {sparsity:.4f} | " + " | ".join(cells) + " |")

    agreed, own = True, []
    print("| target | sweep: largest passing | chose | agree | probes (at most) vs sweep | seconds vs sweep |")
    print("|---|---:|---:|---|---:|---:|")
    for criterion in args.criteria:
        ((_, record),) = run_target(load_config({**settings, "criteria": [criterion]}))
        meeting = [s for s in points if passed[criterion, s]]
        answer = meeting[-1] if meeting else None
        agreed &= record.chosen == answer
        spent = sum(seconds[criterion, p.sparsity] for p in record.probes)
        print(
            f"| {criterion} | {answer} | {record.chosen} | {'yes' if record.chosen == answer else '**no**'} | "
            f"{len(record.probes)} ({record.max_probes}) vs {len(points)} | {spent:.0f} vs "
            f"{sum(seconds[criterion, s] for s in points):.0f} |"
        )
        own.append(record)
    found = run_target(load_config(_settings(args.world, storage, args.granularity, args.max_task_drop, args.criteria, True)))
    chosen, expected = best([record for _, record in found]), best(own)
    probes = sum(len(record.probes) for _, record in found)
    same = (chosen and chosen.criterion, chosen and chosen.chosen) == (
        expected and expected.criterion,
        expected and expected.chosen,
    )
    agreed &= same
    spent = sum(seconds[record.criterion, p.sparsity] for _, record in found for p in record.probes)
    print(
        f"| choose_criterion | {expected and expected.criterion} at {expected and expected.chosen} | "
        f"{chosen and chosen.criterion} at {chosen and chosen.chosen} | {'yes' if same else '**no**'} | {probes} vs "
        f"{sum(len(r.probes) for r in own)} (each criterion's own) vs {len(points) * len(args.criteria)} | {spent:.0f} vs "
        f"{sweep_seconds:.0f} |"
    )
    for _, record in found:
        print(f"    {record.criterion}: {record.line()}")
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
