"""The pipeline run for real: kfp.local end to end, stage reuse, restart after a kill, and S3 storage."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from evoesap.pipeline.config import load_config
from evoesap.pipeline.run import report_uri, run_local
from tiny_world import make_tiny_inputs

from evoesap.steps import run_step
from evoesap.store import artifacts

pytestmark = pytest.mark.slow

SEARCH = {"population": 6, "elites": 2, "generations": 2, "batch_size": 8}
CACHE = {"samples": 12, "max_length": 256, "dtype": "float32"}
CALIBRATE = {"samples": 16, "max_length": 256}


def _config(files: dict, storage: Path, **overrides) -> dict:
    config = {
        "name": "tiny",
        "model": files["model"],
        "calibration_data": files["calibration"],
        "search_data": files["search"],
        "heldout_data": files["heldout"],
        "criteria": ["reap"],
        "sparsities": [0.5],
        "storage_root": str(storage),
        "pipeline_root": str(storage.parent / f"{storage.name}-kfp"),
        "calibrate": CALIBRATE,
        "cache_logits": CACHE,
        "search": {**SEARCH, "resume": True},
        "evaluate": {"tasks": [files["tasks"]], "limit": 3, "batch_size": 4},
    }
    config.update(overrides)
    return config


def _artifacts(storage: Path, stage: str) -> list[Path]:
    return sorted(p for p in (storage / stage).glob("*") if (p / "manifest.json").exists())


def _allocation_at(storage: Path, sparsity: float) -> dict:
    found = [json.loads((p / "allocation.json").read_text()) for p in _artifacts(storage, "search")]
    (allocation,) = [a for a in found if a["sparsity"] == sparsity]
    return allocation


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_tiny_inputs(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def first_run(files, tmp_path_factory):
    storage = tmp_path_factory.mktemp("run") / "artifacts"
    config = load_config(_config(files, storage))
    log = storage.parent / "pipeline.log"
    outputs = run_local(config, log_path=log)
    return {"storage": storage, "report": report_uri(outputs), "outputs": outputs, "config": config, "log": log}


def test_pipeline_runs_end_to_end_locally(first_run):
    storage = first_run["storage"]
    assert "published calibrate artifact" in first_run["log"].read_text()  # task logs went to the file
    report_dir = Path(first_run["report"])
    assert artifacts.read_manifest(str(report_dir)).stage == "report"
    text = (report_dir / "report.md").read_text()
    assert "reap" in text and "uniform" in text and "searched" in text
    assert len(_artifacts(storage, "calibrate")) == 1
    assert len(_artifacts(storage, "cache-logits")) == 2  # search set and held-out set
    assert len(_artifacts(storage, "search")) == 1
    assert len(_artifacts(storage, "prune")) == 2  # searched and uniform
    assert len(_artifacts(storage, "evaluate")) == 3  # full, searched, uniform
    for run in _artifacts(storage, "evaluate"):
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["records"], run
    search = _artifacts(storage, "search")[0]
    manifest = artifacts.read_manifest(str(search))
    assert set(manifest.inputs) == {"model", "scores", "cache", "heldout_cache"}  # the held-out set judges the search
    calibrate = _artifacts(storage, "calibrate")[0]
    assert manifest.inputs["scores"]["manifest_sha256"] == artifacts.manifest_sha256(str(calibrate))
    caches = {artifacts.manifest_sha256(str(c)) for c in _artifacts(storage, "cache-logits")}
    assert {manifest.inputs["cache"]["manifest_sha256"], manifest.inputs["heldout_cache"]["manifest_sha256"]} == caches


def _recorded_artifacts(pipeline_root: Path) -> dict[str, list[dict]]:
    """Output artifacts as kfp.local recorded them (each task's executor_output.json), by output name."""
    found: dict[str, list[dict]] = {}
    for path in pipeline_root.rglob("executor_output.json"):
        for name, entry in json.loads(path.read_text()).get("artifacts", {}).items():
            found.setdefault(name, []).extend(entry["artifacts"])
    return found


def _same_task(evaluation: dict, metrics: dict, pipeline_root: Path) -> bool:
    """Whether one task's executor_output.json records both artifacts."""
    for path in pipeline_root.rglob("executor_output.json"):
        outputs = json.loads(path.read_text()).get("artifacts", {})
        if {"evaluation", "metrics"} <= set(outputs) and (
            outputs["evaluation"]["artifacts"][0]["uri"] == evaluation["uri"]
            and outputs["metrics"]["artifacts"][0]["uri"] == metrics["uri"]
        ):
            return True
    return False


def test_local_run_records_typed_artifacts_whose_metadata_matches_the_manifests(first_run):
    storage, outputs = first_run["storage"], first_run["outputs"]
    (pruned,) = outputs["pruned_models"]  # the searched prune output: under kfp.local, the stored checkpoint
    (searched,) = [
        p for p in _artifacts(storage, "prune") if json.loads((p / "pruning.json").read_text())["method"] == "searched"
    ]
    assert pruned.uri == pruned.path == str(searched)  # the artifact is the stored checkpoint, weights included
    recorded_prune = [
        a for a in _recorded_artifacts(Path(first_run["config"].pipeline_root))["pruned"] if a["uri"] == str(searched)
    ]
    summary = json.loads((searched / "pruning.json").read_text())
    (facts,) = [a["metadata"] for a in recorded_prune]  # the prune task's own output carries its facts
    assert facts["method"] == "searched" and [int(c) for c in facts["expert_counts"]] == summary["num_experts"]
    assert int(facts["parameter_bytes"]) == summary["parameter_bytes_pruned"]
    assert list(Path(pruned.path).glob("*.safetensors")) and artifacts.verify(pruned.uri, "prune").files  # sha256 checked
    assert re.search(r"<img [^>]*src=[\"']data:image/png;base64,", Path(outputs["report_html"].path).read_text())
    assert Path(outputs["report"].path).read_text() == (Path(first_run["report"]) / "report.md").read_text()
    recorded = _recorded_artifacts(Path(first_run["config"].pipeline_root))
    metrics = recorded["metrics"]
    assert len(metrics) == 3  # full, searched, uniform
    assert {name: len(v) for name, v in recorded.items()} == {
        "reference": 1, "scores": 1, "cache": 2, "allocation": 1, "pruned": 2, "evaluation": 3, "metrics": 3,
        "markdown": 1, "page": 1,
    }  # fmt: skip
    (reference,) = recorded.pop("reference")  # the full model, named (components.reference), not imported
    assert reference["metadata"] == {"model": first_run["config"].pinned_model}
    for name, entries in recorded.items():
        for entry in entries if name != "metrics" else ():
            manifest = artifacts.read_manifest(entry["metadata"]["uri"])
            assert entry["metadata"]["stage"] == manifest.stage
            assert entry["metadata"]["manifest_sha256"] == artifacts.manifest_sha256(entry["metadata"]["uri"])
            assert entry["metadata"]["inputs"] == {k: v["uri"] for k, v in manifest.inputs.items()}  # lineage = manifests
    (search,) = recorded["allocation"]
    allocation = json.loads((storage / "search" / Path(search["metadata"]["uri"]).name / "allocation.json").read_text())
    assert search["metadata"]["fitness"] == pytest.approx(allocation["fitness"])
    assert search["metadata"]["cost"] == artifacts.read_manifest(search["metadata"]["uri"]).run["cost"]
    for name in ("scores", "cache", "allocation", "pruned", "evaluation"):
        assert all(entry["uri"] == entry["metadata"]["uri"] for entry in recorded[name])  # each is the stored artifact
    for entry in metrics:
        evaluation = next(d for d in recorded["evaluation"] if _same_task(d, entry, Path(first_run["config"].pipeline_root)))
        records = json.loads((Path(evaluation["metadata"]["uri"]) / "metrics.json").read_text())["records"]
        primary = {f"{r['task']}/{r['metric']}": r["value"] for r in records if r["primary"]}
        assert entry["metadata"] == pytest.approx(primary)  # one scalar per task


def test_new_sparsity_reuses_calibration_and_teacher_cache(first_run, files):
    storage = first_run["storage"]
    before = {
        p: artifacts.read_manifest(str(p)).started for p in _artifacts(storage, "calibrate") + _artifacts(storage, "cache-logits")
    }
    run_local(load_config(_config(files, storage, sparsities=[0.25])))
    after = {
        p: artifacts.read_manifest(str(p)).started for p in _artifacts(storage, "calibrate") + _artifacts(storage, "cache-logits")
    }
    assert after == before  # calibration and teacher caching ran zero times
    assert len(_artifacts(storage, "search")) == 2  # the new sparsity was searched


def test_killed_local_run_restarts_and_finishes_with_the_same_allocation(first_run, files, tmp_path):
    storage = tmp_path / "artifacts"
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(_config(files, storage)))
    command = [sys.executable, "-m", "evoesap", "--quiet", "pipeline", "run", str(config_path)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(storage.glob("search/*.checkpoint.json")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _artifacts(storage, "calibrate"), "the run was killed before any stage finished"
    assert not _artifacts(storage, "report")
    started = {p: artifacts.read_manifest(str(p)).started for p in _artifacts(storage, "calibrate")}
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert {p: artifacts.read_manifest(str(p)).started for p in _artifacts(storage, "calibrate")} == started
    resumed = _allocation_at(storage, 0.5)
    original = _allocation_at(first_run["storage"], 0.5)  # the reuse test added a 25% search there
    assert resumed["removal_counts"] == original["removal_counts"]
    assert _artifacts(storage, "report")


def test_calibrate_to_prune_chain_against_s3(files, s3_bucket):
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(files["model"].rstrip("/") + "/", f"{s3_bucket}/models/tiny/", recursive=True)
    fs.put(files["calibration"], f"{s3_bucket}/data/calibration.jsonl")
    fs.put(files["search"], f"{s3_bucket}/data/search.jsonl")
    model = f"{s3_bucket}/models/tiny"
    root = f"{s3_bucket}/runs"
    scores = run_step("calibrate", root, {"model": model, "data": f"{s3_bucket}/data/calibration.jsonl"}, CALIBRATE)
    cache = run_step("cache-logits", root, {"model": model, "data": f"{s3_bucket}/data/search.jsonl"}, CACHE)
    point = {"criterion": "reap", "sparsity": 0.5}
    searched = run_step("search", root, {"model": model, "scores": scores, "cache": cache}, {**SEARCH, **point})
    pruned = run_step("prune", root, {"model": model, "scores": scores, "allocation": searched}, point)
    for uri, payload in (
        (scores, "scores.parquet"),
        (cache, "cache.json"),
        (searched, "allocation.json"),
        (pruned, "config.json"),
    ):
        assert uri.startswith(f"{s3_bucket}/runs/")
        manifest = artifacts.read_manifest(uri)
        assert payload in manifest.files
        assert fs.exists(f"{uri}/{payload}")
        assert "testing" not in manifest.to_json()
    assert artifacts.read_manifest(pruned).inputs["allocation"]["manifest_sha256"] == artifacts.manifest_sha256(searched)
    from evoesap import moe

    allocation = artifacts.read_json(f"{searched}/allocation.json")
    kept = [n - r for n, r in zip(allocation["num_experts"], allocation["removal_counts"])]
    assert list(moe.inspect(moe.load_pruned(pruned)).num_experts) == kept


def test_with_quantize_on_the_quantized_model_is_evaluated_reported_and_published(files, tmp_path, monkeypatch):
    from test_quantize import quantize_python

    monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", quantize_python())
    storage = tmp_path / "artifacts"
    config = load_config(_config(files, storage, quantize={"recipe": "fp8-dynamic"}, publish_models=True))
    text = (Path(report_uri(run_local(config))) / "report.md").read_text()
    (quantized,) = _artifacts(storage, "quantize")
    (searched,) = [p for p in _artifacts(storage, "prune") if "allocation" in artifacts.read_manifest(str(p)).inputs]
    assert artifacts.read_manifest(str(quantized)).inputs["model"]["manifest_sha256"] == artifacts.manifest_sha256(str(searched))
    runs = {artifacts.read_manifest(str(p)).inputs["model"]["uri"]: p for p in _artifacts(storage, "evaluate")}
    assert len(runs) == 4 and str(quantized) in runs  # full, uniform, searched and the quantized searched model
    assert "| 50% | reap | searched + fp8-dynamic |" in text
    stored = sum(p.stat().st_size for p in quantized.glob("*.safetensors"))
    assert "| 50% reap searched + fp8-dynamic |" in text and f"| {stored:,} |" in text
    (published,) = _artifacts(storage, "publish")
    assert (published / "config.json").read_bytes() == (quantized / "config.json").read_bytes()  # the quantized release
    inputs = artifacts.read_manifest(str(published)).inputs
    assert inputs["quantized"]["manifest_sha256"] == artifacts.manifest_sha256(str(quantized))
    assert "quantized (fp8-dynamic)" in (published / "README.md").read_text()


def test_a_quality_target_run_reports_each_decision_and_marks_it_on_the_frontier(first_run, files):
    """`pipeline run` with `target:` hands the finder's decisions to the report: it opens with each criterion's line
    (threshold, chosen sparsity) and lists the target artifact among its inputs. Reuses the first run's storage root:
    calibrate, the teacher caches and the full model's evaluation are found finished."""
    storage = first_run["storage"]
    config = _config(files, storage, target={"heldout_esap": 0.5})  # met everywhere: the bisection climbs the grid
    del config["sparsities"]
    report = Path(report_uri(run_local(load_config(config))))
    (target,) = _artifacts(storage, "target")
    decision = json.loads((target / "target.json").read_text())
    assert decision["chosen"] is not None and decision["threshold"] == 0.5
    text = (report / "report.md").read_text()
    section = text[text.index("## Sparsity target") : text.index("## Summary")]
    assert f"reap: sparsity {decision['chosen']:.4f} meets heldout_esap >= 0.5" in section
    assert f"{len(decision['probes'])} of the grid's {len(decision['grid'])} points probed" in section
    inputs = artifacts.read_manifest(str(report)).inputs
    assert inputs["targets.0"]["manifest_sha256"] == artifacts.manifest_sha256(str(target))
    assert (report / "frontier.png").exists()
