"""benchmarks/gpu_session.sh --dry-run: the prepared GPU run's code path at test size on the CPU, end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_session.sh"


def dry_run(tmp_path: Path, budget: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "BUDGET_S": budget}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)


def test_dry_run_prints_every_table_for_both_shapes(tmp_path):
    done = dry_run(tmp_path, "540")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = done.stdout
    for shape in ("olmoe", "qwen3"):
        for method in (
            "(a) reference",
            "(b) exact",
            "(c) prefix",
            "search 1 gen racing",
            "search 1 gen racing elite floor",
            "search 1 gen statistical racing",
        ):
            assert f"| {shape} | {method} |" in text, (shape, method)
        for race in ("racing", "statistical racing"):  # both searches give a whole default search's time and work
            (note,) = re.findall(
                rf"\| {shape} \| search 1 gen {race} \|.*50 generations ~([0-9.]+) min, ([0-9.]+) FFE/cand\.", text
            )
            assert float(note[0]) > 0 and 0 < float(note[1]) <= 1, (shape, race, note)
        best = re.findall(rf"\| {shape} \| search 1 gen racing.*best fitness ([0-9.]+)", text)
        assert len(best) == 2 and best[0] == best[1]  # the elite floor keeps the search's best
    assert text.count("| experts |") == 2 and "total:" in text
    profiles = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert [p["shape"] for p in profiles] == ["olmoe", "qwen3"]
    assert (tmp_path / "run.log").read_text() == text


def test_steps_past_the_budget_are_skipped_not_run(tmp_path):
    done = dry_run(tmp_path, "-1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("skipped") == 4 and "| olmoe |" not in done.stdout
