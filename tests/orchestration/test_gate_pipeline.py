"""The release gate in a real local run (kfp.local), through a team's pipeline that embeds EvoESAP (the embed guide's
recipe): a failing verdict publishes nothing, and with `stop_on_fail: false` given at run time the team's pipeline
branches on the `verdict` output and runs its own notify task, while its release-notes task reads `released_models`
and finds only withheld entries; a passing one publishes, the release-notes task reads the released model's URI and
metadata, and the verdicts are an output of the run. The passing run prunes to a gate target, whose finder task
chooses the sparsity the fan-out then prunes, evaluates, gates (each found finished) and publishes."""

import json
from pathlib import Path
from typing import List, NamedTuple  # noqa: UP035 - kfp reads typing.List

import pytest
from evoesap.components.reference import make_reference
from evoesap.components.register import make_registrar
from evoesap.components.verdict import make_verdict_reader
from evoesap.pipeline.config import PipelineConfig, load_config
from evoesap.pipeline.dag import build_subpipeline
from evoesap.pipeline.run import run_local
from kfp import dsl
from kfp.dsl import Artifact, Input, Model
from test_pipeline_run import _artifacts, _config
from test_register import _api
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


def release_notes(released: Input[List[Model]], out: str):  # noqa: UP006
    """The team's own step after EvoESAP, whatever the verdict: each released model's URI and metadata, or the
    withheld entry of a release the gate refused."""
    import json

    with open(out, "w") as f:
        json.dump([{**m.metadata, "kfp_uri": m.uri} for m in released], f)


class TeamOutputs(NamedTuple):
    verdict: str
    verdicts: List[Artifact]  # noqa: UP006
    pruned_models: List[Model]  # noqa: UP006


def team_pipeline(config: PipelineConfig):
    """The embed guide's recipe: EvoESAP as a step, the team's notify task under `dsl.If` on its verdict, its
    release-notes task on `released_models`, and the registrar handing each released model to MLflow's registry (it
    skips a withheld entry)."""
    evoesap = build_subpipeline(config)
    reference, reader = make_reference(config.default_image), make_verdict_reader(config.default_image)
    registrar = make_registrar(config.default_image)
    notifier, notes_task = (
        dsl.component(base_image=config.default_image, install_kfp_package=False)(step) for step in (notify, release_notes)
    )

    @dsl.pipeline(name="team-release")
    def release(gate_params: dict, notes: str, released: str) -> TeamOutputs:
        model = reference(model=config.pinned_model)
        evo = evoesap(model=model.outputs["reference"], gate_params=gate_params)
        gate = reader(verdict=evo.outputs["verdict"])
        with dsl.If(gate.output == "fail", name="gate-failed"):
            notifier(verdicts=evo.outputs["verdicts"], out=notes)
        notes_task(released=evo.outputs["released_models"], out=released)
        registrar(released=evo.outputs["released_models"], name="tiny-olmoe-pruned")
        return TeamOutputs(evo.outputs["verdict"], evo.outputs["verdicts"], evo.outputs["pruned_models"])

    return release


def _run(config: PipelineConfig, tmp_path: Path, name: str, gate_params: dict) -> tuple[dict, Path, list[dict]]:
    """The team's pipeline run here: its outputs, where its notify task writes, what its release-notes task read."""
    notes, released = tmp_path / f"{name}-notes.json", tmp_path / f"{name}-released.json"
    arguments = {"gate_params": gate_params, "notes": str(notes), "released": str(released)}
    outputs = run_local(config, log_path=tmp_path / f"{name}.log", build=team_pipeline, arguments=arguments)
    return outputs, notes, json.loads(released.read_text())


def test_a_failing_gate_withholds_the_release_and_a_passing_one_hands_it_on(tmp_path, s3_bucket, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # the registrar task's server, from its environment
    files = make_tiny_inputs(tmp_path / "tiny")
    storage = tmp_path / "run" / "artifacts"

    # no pruned model of a random tiny OLMoE at 50% sparsity matches its full model's distributions exactly; the
    # configuration stops on a failed gate (the default), the run's own gate_params say not to: the team acts on it
    config = load_config(_config(files, storage, publish_models=True, gate={"min_heldout_esap": 1.0}))
    assert config.parsed_params("gate").stop_on_fail is True
    outputs, notes, released = _run(config, tmp_path, "fail", {"min_heldout_esap": 1.0, "stop_on_fail": False})
    assert outputs["verdict"] == "fail"
    (line,) = json.loads(notes.read_text())  # the team's notify task ran, with the failing verdict's one line
    assert "\n" not in line and line.startswith("release gate failed for") and "held-out ESAP 0." in line and "< 1.0000" in line
    assert not _artifacts(storage, "publish")
    # publish ran and released nothing: released_models is one withheld entry, saying why, with no files
    (withheld,) = released
    assert withheld["withheld"] is True and withheld["reason"] == f"{line}; nothing published"
    assert "uri" not in withheld and not [p for p in Path(withheld["kfp_uri"]).rglob("*") if p.is_file()]
    (report,) = _artifacts(storage, "report")
    text = (report / "report.md").read_text()
    assert text.index("**FAIL:**") < text.index("## Summary")  # the verdict heads the report

    # the passing run chooses its sparsity by a gate target: the finder task before the fan-out probes search, prune,
    # evaluate and gate, and the fan-out's own tasks at the chosen sparsity find them finished
    passing = _config(files, storage, publish_models=True, gate={"min_heldout_esap": 0.01}, target={"gate": True})
    passing["publish"] = {"to": f"{s3_bucket}/releases/tiny-olmoe-pruned"}  # where others read it: the registry's source
    passing["search"] = {**passing["search"], "granularity": 4}
    del passing["sparsities"]
    outputs, notes, released = _run(load_config(passing), tmp_path, "pass", {"min_heldout_esap": 0.01})
    (published,) = _artifacts(storage, "publish")
    (verdict,) = outputs["verdicts"]
    assert outputs["verdict"] == "pass" and not notes.exists()  # no notify
    assert verdict.metadata["passed"] is True and verdict.metadata["verdict"].startswith("release gate passed")
    manifest = artifacts.read_manifest(str(published), "publish")
    assert manifest.inputs["gate"]["manifest_sha256"] == verdict.metadata["manifest_sha256"]
    # the team's task downstream read the released model: where it is stored, what it is, the verdict it passed
    (release,) = released
    assert release["withheld"] is False and release["stage"] == "publish"
    assert Path(release["uri"]) == Path(release["kfp_uri"]) == published
    # the registrar task registered it (the failing run's withheld entry, nothing): one version, its lineage as tags
    versions = _api(mlflow_server, "model-versions/search", filter="name='tiny-olmoe-pruned'")["model_versions"]
    (version,) = versions
    tags = {t["key"]: t["value"] for t in version["tags"]}
    assert version["source"] == f"{s3_bucket}/releases/tiny-olmoe-pruned"
    assert tags["evoesap.criterion"] == "reap" and float(tags["evoesap.sparsity"]) == release["sparsity"]
    assert tags["evoesap.gate"] == verdict.metadata["verdict"]
    assert release["manifest_sha256"] == artifacts.manifest_sha256(str(published))
    assert (published / "README.md").is_file() and release["gate"] == verdict.metadata["verdict"]

    (target,) = _artifacts(storage, "target")
    record = records.read(str(target), records.TargetRecord)
    assert record.chosen is not None and len(record.probes) <= record.max_probes
    (pruned,) = outputs["pruned_models"]
    assert pruned.metadata["sparsity"] == release["sparsity"] == record.chosen and release["criterion"] == "reap"
    allocation = artifacts.read_manifest(pruned.metadata["uri"], "prune").inputs["allocation"]["uri"]
    assert allocation.rstrip("/").rsplit("/", 1)[-1] == record.chosen_search.rstrip("/").rsplit("/", 1)[-1]
    # calibrate and the caches reused from the failing run; the point's search is the chosen probe, found finished
    assert len(_artifacts(storage, "calibrate")) == 1 and len(_artifacts(storage, "cache-logits")) == 2
    assert len(_artifacts(storage, "search")) == 1 + len(record.probes)
    # the point's gate is the chosen probe's verdict: the failing run's gate and one per probe, nothing more
    (chosen,) = [p for p in record.probes if p.sparsity == record.chosen]
    assert record.metric == "gate" and chosen.meets and len(_artifacts(storage, "gate")) == 1 + len(record.probes)
    assert Path(verdict.metadata["uri"]).name == chosen.gate.rstrip("/").rsplit("/", 1)[-1]
