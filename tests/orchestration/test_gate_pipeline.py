"""The release gate in a real local run (kfp.local): a failing verdict stops publish, and with `stop_on_fail: false`
given at run time the team's pipeline that embeds EvoESAP branches on the `verdict` output and runs its own notify
task (the embed guide's recipe); a passing one publishes, and the verdicts are an output of the run. The passing run
prunes to a quality target, whose finder task chooses the sparsity the fan-out then prunes, evaluates, gates and
publishes."""

import json
from typing import List  # noqa: UP035 - kfp reads typing.List

import pytest
from evoesap.components.reference import make_reference
from evoesap.components.verdict import make_verdict_reader
from evoesap.pipeline.config import PipelineConfig, load_config
from evoesap.pipeline.dag import build_subpipeline
from evoesap.pipeline.run import run_local
from kfp import dsl
from kfp.dsl import Artifact, Input
from test_pipeline_run import _artifacts, _config
from tiny_world import make_tiny_inputs

from evoesap import records
from evoesap.store import artifacts

pytestmark = pytest.mark.slow


def notify(verdicts: Input[List[Artifact]], out: str):  # noqa: UP006
    """The team's own step: write each failing verdict's line where the team reads it."""
    import json

    lines = [v.metadata["verdict"] for v in verdicts if not v.metadata["passed"]]
    with open(out, "w") as f:
        json.dump(lines, f)


def team_pipeline(config: PipelineConfig):
    """The embed guide's recipe: EvoESAP as a step, the team's notify task under `dsl.If` on its verdict."""
    evoesap = build_subpipeline(config)
    reference, reader = make_reference(config.default_image), make_verdict_reader(config.default_image)
    notifier = dsl.component(base_image=config.default_image, install_kfp_package=False)(notify)

    @dsl.pipeline(name="team-release")
    def release(gate_params: dict, notes: str) -> str:
        model = reference(model=config.pinned_model)
        pruned = evoesap(model=model.outputs["reference"], gate_params=gate_params)
        gate = reader(verdict=pruned.outputs["verdict"])
        with dsl.If(gate.output == "fail", name="gate-failed"):
            notifier(verdicts=pruned.outputs["verdicts"], out=notes)
        return pruned.outputs["verdict"]

    return release


def test_a_failing_gate_stops_publish_and_a_passing_one_publishes(tmp_path):
    files = make_tiny_inputs(tmp_path / "tiny")
    storage = tmp_path / "run" / "artifacts"

    # no pruned model of a random tiny OLMoE at 50% sparsity matches its full model's distributions exactly; the
    # configuration stops on a failed gate (the default), the run's own gate_params say not to: the team acts on it
    config = load_config(_config(files, storage, publish_models=True, gate={"min_heldout_esap": 1.0}))
    assert config.parsed_params("gate").stop_on_fail is True
    notes = tmp_path / "notes.json"
    gate_params = {"min_heldout_esap": 1.0, "stop_on_fail": False}
    outputs = run_local(
        config, log_path=tmp_path / "fail.log", build=team_pipeline, arguments={"gate_params": gate_params, "notes": str(notes)}
    )
    assert outputs["Output"] == "fail"
    (line,) = json.loads(notes.read_text())  # the team's notify task ran, with the failing verdict's one line
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
    assert outputs["verdict"] == "pass"
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
