"""The release gate in a real local run (kfp.local): a failing verdict stops publish and ends the run in one line after
the report shows it; a passing one publishes, and the verdicts are an output of the run."""

import pytest
from evoesap.pipeline.config import load_config
from evoesap.pipeline.run import run_local
from test_pipeline_run import _artifacts, _config
from tiny_world import make_tiny_inputs

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

    outputs = run_local(
        load_config(_config(files, storage, publish_models=True, gate={"min_heldout_esap": 0.01})), log_path=tmp_path / "pass.log"
    )
    (published,) = _artifacts(storage, "publish")
    (verdict,) = outputs["verdicts"]
    assert verdict.metadata["passed"] is True and verdict.metadata["verdict"].startswith("release gate passed")
    manifest = artifacts.read_manifest(str(published), "publish")
    assert manifest.inputs["gate"]["manifest_sha256"] == verdict.metadata["manifest_sha256"]
    assert len(_artifacts(storage, "search")) == 1  # the second run reused every stage before the gate
