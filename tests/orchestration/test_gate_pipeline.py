"""The release gate in a real local run (kfp.local): a failing verdict stops publish and ends the run in one line after
the report shows it; a passing one publishes, and the verdicts are an output of the run. The passing run prunes to a
quality target, whose finder task chooses the sparsity the fan-out then prunes, evaluates, gates and publishes."""

import pytest
from evoesap.pipeline.config import load_config
from evoesap.pipeline.run import run_local
from test_pipeline_run import _artifacts, _config
from tiny_world import make_tiny_inputs

from evoesap import records
from evoesap.release.gate import GateFailed
from evoesap.store import artifacts

pytestmark = pytest.mark.slow


def test_a_failing_gate_stops_publish_and_a_passing_one_publishes(tmp_path):
    files = make_tiny_inputs(tmp_path / "tiny")
    storage = tmp_path / "run" / "artifacts"

    # no pruned model of a random tiny OLMoE at 50% sparsity matches its full model's distributions exactly
    with pytest.raises(GateFailed) as failed:
        run_local(
            load_config(_config(files, storage, publish_models=True, gate={"min_heldout_esap": 1.0})),
            log_path=tmp_path / "fail.log",
        )
    line = str(failed.value)
    assert "\n" not in line and line.startswith("release gate failed for") and "held-out ESAP 0." in line and "< 1.0000" in line
    assert not _artifacts(storage, "publish")
    (report,) = _artifacts(storage, "report")
    text = (report / "report.md").read_text()
    assert text.index("**FAIL:**") < text.index("## Summary")  # the verdict heads the report

    # the passing run chooses its sparsity by a quality target: the finder task before the fan-out
    passing = _config(files, storage, publish_models=True, gate={"min_heldout_esap": 0.01}, target={"heldout_esap": 0.5})
    passing["search"] = {**passing["search"], "granularity": 4}
    del passing["sparsities"]
    outputs = run_local(load_config(passing), log_path=tmp_path / "pass.log")
    (published,) = _artifacts(storage, "publish")
    (verdict,) = outputs["verdicts"]
    assert verdict.metadata["passed"] is True and verdict.metadata["verdict"].startswith("release gate passed")
    manifest = artifacts.read_manifest(str(published), "publish")
    assert manifest.inputs["gate"]["manifest_sha256"] == verdict.metadata["manifest_sha256"]

    (target,) = _artifacts(storage, "target")
    record = records.read(str(target), records.TargetRecord)
    assert record.chosen is not None and len(record.probes) <= record.max_probes
    (pruned,) = outputs["pruned_models"]
    assert pruned.metadata["sparsity"] == record.chosen
    allocation = artifacts.read_manifest(pruned.metadata["uri"], "prune").inputs["allocation"]["uri"]
    assert allocation.rstrip("/").rsplit("/", 1)[-1] == record.chosen_search.rstrip("/").rsplit("/", 1)[-1]
    # calibrate and the caches reused from the failing run; the point's search is the chosen probe, found finished
    assert len(_artifacts(storage, "calibrate")) == 1 and len(_artifacts(storage, "cache-logits")) == 2
    assert len(_artifacts(storage, "search")) == 1 + len(record.probes)
