"""The chaos harness, short: random faults at random moments of the tiny world's pipeline.

`benchmarks/chaos.py` runs the DAG's stage sequence (`steps.run_step` under one storage root, publish pushing a
copy to S3) in a stage process, injects one fault at a random moment (kill -9, SIGTERM, S3 outage, disk full, a
corrupted artifact file, an outage of the store publish pushes to), re-runs it undisturbed, and compares every
artifact, and the pushed copy, with an undisturbed run's. The tiny world searches in one process and does not
quantize (each adds a minute a run); the long run (`make chaos`, the quick demo world, with a two-worker search
and quantize, and faults on a worker and the search's launcher) is recorded in docs/results/reliability.md.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import chaos  # noqa: E402 - benchmarks/ is not a package

pytestmark = pytest.mark.slow


def test_ten_random_faults_end_identical_or_with_a_clear_error_and_lose_no_user_data(tmp_path):
    kinds = [k for k in chaos.kinds_for("tiny") if k != "disk_full" or chaos.disk_full_available()]
    record = tmp_path / "outcomes.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "chaos.py"),
        "--world",
        "tiny",
        "--faults",
        "10",
        "--seed",
        "29",
        "--kinds",
        ",".join(kinds),
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(record),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    outcomes = json.loads(record.read_text()) if record.exists() else []
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(outcomes) == 10 and {o["kind"] for o in outcomes} == set(kinds)
    assert [o for o in outcomes if o["result"] not in ("identical", "clear error")] == []
    assert sum(o["user_bytes_lost"] for o in outcomes) == 0
    assert any(o["first_rc"] != 0 for o in outcomes)  # some fault really interrupted a run


def _copy(tree: dict[str, str], names: list[str], root: Path) -> None:
    for name in names:
        shutil.copytree(tree[name], root / name)


def test_the_comparison_matches_equal_artifacts_and_catches_one_changed_byte(tiny_artifacts, tmp_path):
    """The harness's verdict rests on `snapshot`: equal artifacts must compare equal, one byte must not."""
    root = tmp_path / "artifacts"
    names = ["scores", "cache", "search_out"]
    _copy(tiny_artifacts, names, root / "a")
    reference = chaos.snapshot(str(root))
    assert len(reference) == 3 and all(files for files in reference.values())
    shutil.rmtree(root)
    _copy(tiny_artifacts, names, root / "a")
    assert chaos.snapshot(str(root)) == reference
    allocation = root / "a" / "search_out" / "allocation.json"
    allocation.write_bytes(allocation.read_bytes().replace(b'"', b"'", 1))
    changed = chaos.snapshot(str(root))
    assert set(changed) == set(reference) and sum(changed[k] != reference[k] for k in reference) == 1


def _made(root: Path, stage: str, payload: bytes, inputs: dict[str, str], made: int = 1) -> str:
    """A `stage` artifact at `root/stage`; `made` is recorded in its manifest's run, so making it again gives another
    manifest of the same content (as a later time would)."""
    from evoesap.store import artifacts

    out = root / stage
    shutil.rmtree(out, ignore_errors=True)
    with artifacts.stage_output(str(out), stage, {}, inputs, run={"made": made}) as staging:
        (staging / "payload.bin").write_bytes(payload)
    return str(out)


def test_an_upstream_made_again_from_the_same_bytes_after_its_readers_compares_equal(tmp_path):
    """The pipeline reuses downstream artifacts when an upstream one is made again from the same bytes (a damaged
    payload repaired), so their manifests name a manifest that is gone: the comparison follows lineage by content, as
    the pipeline does; other bytes still differ."""
    from evoesap.store import artifacts

    root = tmp_path / "artifacts"
    cache = _made(root, "cache-logits", b"logits", {})
    _made(root, "evaluate", b"metrics", {"teacher_cache": cache})
    reference = chaos.snapshot(str(root), str(root / "evaluate"))
    assert len(reference) == 2
    first = artifacts.manifest_sha256(cache)
    _made(root, "cache-logits", b"logits", {}, made=2)  # made again: another manifest, the same content
    assert artifacts.manifest_sha256(cache) != first
    assert chaos.snapshot(str(root), str(root / "evaluate")) == reference
    _made(root, "cache-logits", b"other logits", {}, made=3)
    assert chaos.snapshot(str(root), str(root / "evaluate")) != reference
