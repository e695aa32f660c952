"""The fault catalogue: kill -9 at every stage's boundary and during its publish, disk full, an
object-store outage during publish, orphans of killed runs, inputs changed in place, concurrent publishes.

After each fault: nothing unfinished counts as an artifact, an earlier artifact is either intact or
absent (never half-replaced), and the next run of the same stage finishes and removes what was left.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from tiny_artifacts import CACHE, CALIBRATE, SEARCH

from evoesap import steps
from evoesap.errors import ArtifactError, ConfigError
from evoesap.store import artifacts

_KILLER = """
import json, os, signal, sys
from evoesap.store import artifacts
from evoesap import steps

spec = json.loads(sys.argv[1])

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if spec["point"] == "boundary":  # the payload is staged, nothing is published yet
    artifacts._publish = die
else:  # during publish: the earlier artifact has just been renamed aside
    real_publish, real_replace = artifacts._publish_local, os.replace

    def publish(staging, dest, manifest):
        def replace_then_die(src, dst):
            real_replace(src, dst)
            die()
        artifacts.os.replace = replace_then_die
        real_publish(staging, dest, manifest)

    artifacts._publish_local = publish
steps.run_stage(spec["stage"], spec["inputs"], steps.make_params(spec["stage"], spec["params"]), spec["out"])
"""


def rerun_cases(world: dict[str, str]) -> dict[str, tuple[str, dict, dict]]:
    """Per stage: (the earlier artifact, inputs, parameters that differ from it, so the stage really runs)."""
    return {
        "calibrate": ("scores", {"model": world["model"], "data": world["calibration"]}, {"samples": 6, "max_length": 128}),
        "cache-logits": (
            "cache",
            {"model": world["model"], "data": world["search"]},
            {"samples": 4, "max_length": 128, "dtype": "float32"},
        ),
        "search": (
            "search_out",
            {"model": world["model"], "scores": world["scores"], "cache": world["cache"]},
            {"criterion": "reap", "sparsity": 0.5, "population": 4, "elites": 1, "generations": 1, "seed": 7},
        ),
        "prune": ("pruned", {"model": world["model"], "scores": world["scores"]}, {"criterion": "reap", "sparsity": 0.5}),
        "evaluate": (
            "evaluated",
            {"model": world["pruned"]},
            {"tasks": [world["tasks"]], "limit": 1, "batch_size": 2, "device": "cpu", "max_length": 128},
        ),
        "report": ("report", {"runs": [world["evaluated"]]}, {"title": "after a kill"}),
    }


def leftovers(out: Path, tmpdir: Path) -> list[str]:
    beside = [p.name for p in out.parent.glob(f".{out.name}.*")]
    return sorted(beside + [p.name for p in tmpdir.glob("evoesap-*")])


@pytest.mark.slow
@pytest.mark.parametrize("point", ["boundary", "publish"])
@pytest.mark.parametrize("stage", ["calibrate", "cache-logits", "search", "prune", "evaluate", "report"])
def test_kill_9_leaves_no_false_artifact_and_the_next_run_finishes_and_cleans_up(
    stage, point, tiny_artifacts, tmp_path, monkeypatch
):
    name, inputs, params = rerun_cases(tiny_artifacts)[stage]
    out = tmp_path / "out"
    shutil.copytree(tiny_artifacts[name], out)
    earlier = artifacts.read_manifest(str(out))
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    spec = {"stage": stage, "inputs": inputs, "params": params, "out": str(out), "point": point}
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _KILLER, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    if point == "boundary":  # the earlier artifact is untouched and still verifies
        assert artifacts.verify(str(out), stage) == earlier
        assert [n for n in leftovers(out, tmpdir) if ".partial-" in n]
    else:  # renamed aside: no artifact at out, so nothing half-made can be taken for a finished one
        assert not out.exists()
        with pytest.raises(ArtifactError, match="not a finished artifact"):
            artifacts.read_manifest(str(out))
        # killed holding the output's swap lock: its file stays until the next publish takes and removes it
        assert {n.split("-")[0] for n in leftovers(out, tmpdir)} == {".out.lock", ".out.old", ".out.partial"}

    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    monkeypatch.setattr(artifacts, "_STARTED", time.time())  # the next run: the killed one is older
    if point == "boundary":  # what the next run does first (the publish case below runs it whole)
        artifacts.clean_orphans(str(out), stage)
    else:
        manifest = steps.run_stage(stage, inputs, steps.make_params(stage, params), str(out))
        assert artifacts.verify(str(out), stage) == manifest != earlier
    assert leftovers(out, tmpdir) == []


def test_disk_full_while_writing_leaves_nothing_and_keeps_the_earlier_artifact(tiny_artifacts, tmp_path, monkeypatch, capsys):
    import pandas as pd

    from evoesap.cli import main

    out = tmp_path / "scores"
    shutil.copytree(tiny_artifacts["scores"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(self, path, *args, **kwargs):
        Path(path).write_bytes(b"PAR1 half a file")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full_disk)
    code = main(
        [
            "--quiet",
            "calibrate",
            "--model",
            tiny_artifacts["model"],
            "--data",
            tiny_artifacts["calibration"],
            "--samples",
            "6",
            "--max-length",
            "128",
            "--out",
            str(out),
        ]
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and line.startswith("error: no space left on the device") and "nothing was published" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores"]


def test_orphans_are_removed_only_when_dead_and_older_than_the_run(tiny_artifacts, tmp_path, monkeypatch):
    import fcntl

    out = tmp_path / "scores"
    tmpdir = tmp_path / "tmp"
    dead = [
        tmp_path / ".scores.partial-dead",
        tmp_path / ".scores.old-dead",
        tmpdir / "evoesap-calibrate-dead",
        tmpdir / "evoesap-in-dead",
    ]
    alive = tmp_path / ".scores.partial-alive"  # a concurrent run still holds its lock
    other_stage = tmpdir / "evoesap-search-dead"  # another stage's staging: its own runs clean it
    for path in (*dead, alive, other_stage):
        path.mkdir(parents=True)
        (path / "payload").write_bytes(b"x" * 1024)
    lock = os.open(alive, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        monkeypatch.setattr(artifacts, "_STARTED", time.time())
        young = tmp_path / ".scores.partial-young"  # made after this run started: never an orphan of it
        time.sleep(0.01)
        young.mkdir()
        removed = artifacts.clean_orphans(str(out), "calibrate")
    finally:
        os.close(lock)
    assert sorted(removed) == sorted(dead)
    assert alive.exists() and young.exists() and other_stage.exists()
    assert not any(p.exists() for p in dead)


def test_concurrent_publishes_of_one_output_leave_one_intact_artifact(tmp_path):
    out = str(tmp_path / "art")
    errors = []

    def publish(i: int) -> None:
        try:
            with artifacts.stage_output(out, "demo", {"same": 1}, {}) as staging:
                (staging / "x.txt").write_text("identical payload")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert artifacts.verify(out, "demo").files == {"x.txt": artifacts.sha256_bytes(b"identical payload")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


# ------------------------------------------------------------------------ inputs changed in place


def test_a_local_checkpoint_whose_weights_are_overwritten_is_run_again(tiny_artifacts, tmp_path, monkeypatch):
    from evoesap import moe
    from evoesap.stages import calibrate as calibrate_stage

    model = tmp_path / "model"
    shutil.copytree(tiny_artifacts["model"], model)
    inputs = {"model": str(model), "data": tiny_artifacts["calibration"]}
    out = str(tmp_path / "scores")
    first = steps.run_stage("calibrate", inputs, CALIBRATE, out)
    runs = []
    real = calibrate_stage.run_calibrate
    monkeypatch.setattr(calibrate_stage, "run_calibrate", lambda **kw: runs.append(1) or real(**kw))
    assert steps.run_stage("calibrate", inputs, CALIBRATE, out) == first and runs == []
    vocab = moe.load_pruned(str(model)).config.vocab_size
    moe.tiny_model("olmoe", seed=11, vocab_size=vocab).save_pretrained(model)  # same shapes, other weights
    again = steps.run_stage("calibrate", inputs, CALIBRATE, out)
    assert runs == [1] and again.inputs["model"] != first.inputs["model"]


# ------------------------------------------------------------------------ object store: in-place change, outage


def test_a_remote_data_file_changed_in_place_is_run_again(tiny_artifacts, tmp_path, s3, monkeypatch):
    from evoesap.stages import calibrate as calibrate_stage

    _, fs, bucket = s3
    data = f"s3://{bucket}/data/calibration.jsonl"
    rows = Path(tiny_artifacts["calibration"]).read_text().splitlines(keepends=True)
    fs.pipe(data, "".join(rows).encode())
    inputs = {"model": tiny_artifacts["model"], "data": data}
    out = str(tmp_path / "scores")
    first = steps.run_stage("calibrate", inputs, CALIBRATE, out)
    assert first.inputs["data"]["ETag"]
    runs = []
    real = calibrate_stage.run_calibrate
    monkeypatch.setattr(calibrate_stage, "run_calibrate", lambda **kw: runs.append(1) or real(**kw))
    steps.run_stage("calibrate", inputs, CALIBRATE, out)
    assert runs == []
    fs.pipe(data, "".join(reversed(rows)).encode())  # same URI, same size, other content
    fs.invalidate_cache()
    again = steps.run_stage("calibrate", inputs, CALIBRATE, out)
    assert runs == [1] and again.inputs["data"]["ETag"] != first.inputs["data"]["ETag"]


def test_an_object_store_outage_during_publish_leaves_no_finished_artifact_and_a_rerun_finishes(
    tiny_artifacts, tmp_path, s3, monkeypatch
):
    server, fs, bucket = s3
    out = f"s3://{bucket}/runs/cache"
    inputs = {"model": tiny_artifacts["model"], "data": tiny_artifacts["search"]}
    steps.run_stage("cache-logits", inputs, CACHE, out)  # an earlier artifact, then a re-run that meets the outage
    s3_class = type(fs)
    real_put = s3_class._put_file
    calls = []

    async def put_during_outage(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first payload file is up, then the endpoint goes away
            server.stop()
        return await real_put(self, *args, **kwargs)

    monkeypatch.setattr(s3_class, "_put_file", put_during_outage)
    monkeypatch.setattr(s3_class, "retries", 1)
    s3_class.clear_instance_cache()  # sync methods are bound when an instance is made
    changed = steps.make_params("cache-logits", {"samples": 4, "max_length": 128, "dtype": "float32"})
    with pytest.raises(ArtifactError, match="is not a finished artifact; re-run `evoesap cache-logits`") as caught:
        steps.run_stage("cache-logits", inputs, changed, out)
    assert "testing" not in str(caught.value)  # no credential in the one line
    server.start()
    monkeypatch.setattr(s3_class, "_put_file", real_put)
    s3_class.clear_instance_cache()
    fs = s3_class(skip_instance_cache=True)
    with pytest.raises(ArtifactError, match="not a finished artifact"):
        artifacts.read_manifest(out)
    assert fs.exists(f"{bucket}/runs/cache/publishing.json")
    manifest = steps.run_stage("cache-logits", inputs, changed, out)
    assert artifacts.verify(out, "cache-logits") == manifest
    assert not fs.exists(f"{bucket}/runs/cache/publishing.json")
    assert sorted(fs.find(f"{bucket}/runs/cache")) == sorted(
        f"{bucket}/runs/cache/{rel}" for rel in [*manifest.files, artifacts.MANIFEST]
    )


def test_search_then_prune_against_s3_verify_every_payload(tiny_artifacts, s3):
    _, fs, bucket = s3
    root = f"s3://{bucket}/runs"
    scores = steps.run_step(
        "calibrate",
        root,
        {"model": tiny_artifacts["model"], "data": tiny_artifacts["calibration"]},
        {"samples": 8, "max_length": 128},
    )
    cache = steps.run_step(
        "cache-logits",
        root,
        {"model": tiny_artifacts["model"], "data": tiny_artifacts["search"]},
        {"samples": 6, "max_length": 128, "dtype": "float32"},
    )
    params = {k: v for k, v in SEARCH.__dict__.items() if k in ("population", "elites", "generations", "batch_size")}
    searched = steps.run_step(
        "search",
        root,
        {"model": tiny_artifacts["model"], "scores": scores, "cache": cache},
        {**params, "criterion": "reap", "sparsity": 0.5},
    )
    for uri, stage in ((scores, "calibrate"), (cache, "cache-logits"), (searched, "search")):
        assert artifacts.verify(uri, stage).stage == stage
    fs.pipe(f"{scores[5:]}/scores.parquet", b"PAR1 replaced")
    with pytest.raises(ArtifactError, match="scores.parquet does not match the sha256"):
        steps.run_step(
            "prune",
            root,
            {"model": tiny_artifacts["model"], "scores": scores, "allocation": searched},
            {"criterion": "reap", "sparsity": 0.5},
        )


def test_a_user_file_in_an_earlier_remote_artifact_is_never_removed_as_stale(tiny_artifacts, s3):
    """Only files the replaced artifact's manifest lists are ours to remove; a re-run is refused, nothing changes."""
    from evoesap.errors import ConfigError

    _, fs, bucket = s3
    out = f"s3://{bucket}/runs/scores"
    inputs = {"model": tiny_artifacts["model"], "data": tiny_artifacts["calibration"]}
    steps.run_stage("calibrate", inputs, CALIBRATE, out)
    fs.pipe(f"{bucket}/runs/scores/NOTES.md", b"mine")
    before = sorted(fs.find(f"{bucket}/runs/scores"))
    with pytest.raises(ConfigError, match="NOTES.md"):
        steps.run_stage("calibrate", inputs, steps.make_params("calibrate", {"samples": 8, "max_length": 128, "seed": 4}), out)
    fs.invalidate_cache()
    assert sorted(fs.find(f"{bucket}/runs/scores")) == before and fs.cat(f"{bucket}/runs/scores/NOTES.md") == b"mine"


# ------------------------------------------------------------------------ user files beside an output


def test_a_users_file_named_like_the_search_checkpoint_is_refused_before_work_and_never_touched(tiny_artifacts, tmp_path):
    out = tmp_path / "s"
    mine = tmp_path / "s.checkpoint.json"
    mine.write_text('{"my": "notes"}')
    inputs = {"model": tiny_artifacts["model"], "scores": tiny_artifacts["scores"], "cache": tiny_artifacts["cache"]}
    with pytest.raises(ConfigError, match="s.checkpoint.json is a file that is not a search checkpoint"):
        steps.run_stage("search", inputs, SEARCH, str(out))
    assert mine.read_text() == '{"my": "notes"}' and not out.exists()


def test_a_users_file_that_appears_where_the_search_checkpoint_goes_is_never_overwritten(tiny_artifacts, tmp_path, monkeypatch):
    from evoesap.method import search

    out = tmp_path / "s"
    mine = tmp_path / "s.checkpoint.json"
    real = search._write_checkpoint

    def user_saves_a_file_first(uri, *args, **kwargs):  # between the start of the search and its first checkpoint
        if not mine.exists():
            mine.write_text("mine")
        return real(uri, *args, **kwargs)

    monkeypatch.setattr(search, "_write_checkpoint", user_saves_a_file_first)
    inputs = {"model": tiny_artifacts["model"], "scores": tiny_artifacts["scores"], "cache": tiny_artifacts["cache"]}
    with pytest.raises(ArtifactError, match="is a file that is not a search checkpoint: it was left as it is"):
        steps.run_stage("search", inputs, SEARCH, str(out))
    assert mine.read_text() == "mine" and not out.exists()


def test_a_finished_search_removes_its_own_checkpoint(tiny_artifacts, tmp_path):
    out = tmp_path / "s"
    inputs = {"model": tiny_artifacts["model"], "scores": tiny_artifacts["scores"], "cache": tiny_artifacts["cache"]}
    steps.run_stage("search", inputs, SEARCH, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_pipeline_components_refuses_to_overwrite_a_users_yaml(tmp_path, capsys):
    from evoesap.cli import main

    mine = tmp_path / "calibrate.yaml"
    mine.write_text("my: own\n")
    assert main(["--quiet", "pipeline", "components", "--out", str(tmp_path)]) == 1
    assert "this command did not write" in capsys.readouterr().err
    assert mine.read_text() == "my: own\n" and sorted(p.name for p in tmp_path.iterdir()) == ["calibrate.yaml"]
    (tmp_path / "afile").write_text("x")
    assert main(["--quiet", "pipeline", "components", "--out", str(tmp_path / "afile" / "x")]) == 1
    assert "goes through the file" in capsys.readouterr().err
