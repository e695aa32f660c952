"""The single-stage component YAMLs other pipelines load: up to date, documented, usable as steps."""

import dataclasses
import json
import linecache
from pathlib import Path

import pytest
import yaml
from evoesap.components import DEFAULT_IMAGE, write_component_yamls
from evoesap.components.interface import param_docs
from kfp import compiler, dsl
from kfp.components import load_component_from_file

from evoesap.steps import params_class

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("calibrate", "cache-logits", "search", "prune", "evaluate", "report")


def _yaml(stage: str) -> Path:
    return ROOT / "components" / f"{stage.replace('-', '_')}.yaml"


def test_component_yamls_are_up_to_date_with_the_python_definitions(tmp_path):
    linecache.clearcache()  # the functions' sources are written from the registry, not read from a file: not lost
    written = write_component_yamls(tmp_path, DEFAULT_IMAGE)
    assert sorted(p.name for p in written) == sorted(p.name for p in (ROOT / "components").glob("*.yaml"))
    for path in written:
        assert path.read_text() == (ROOT / "components" / path.name).read_text(), (
            f"components/{path.name} is stale: run `make components` (evoesap pipeline components)"
        )


@pytest.mark.parametrize("stage", STAGES)
def test_every_input_and_output_of_a_component_is_described(stage):
    spec = yaml.safe_load(_yaml(stage).read_text())
    (component,) = spec["components"].values()
    inputs = {**component["inputDefinitions"].get("parameters", {}), **component["inputDefinitions"].get("artifacts", {})}
    outputs = component["outputDefinitions"]["artifacts"]
    for name, definition in {**inputs, **outputs}.items():
        assert len(definition.get("description", "")) > 10, f"{stage}: {name} has no description"
    assert "point" not in inputs  # the DAG's loop item is internal
    structs = [n for n, d in inputs.items() if d.get("parameterType") in ("STRUCT", "LIST")]
    assert structs == ["params"]  # the only mapping: the stage's documented parameters
    assert inputs["params"]["defaultValue"] == {} and inputs["params"]["isOptional"]
    described = " ".join(inputs["params"]["description"].split())
    own = set(inputs)
    for field in dataclasses.fields(params_class(stage)):
        if field.name not in own:
            assert f"{field.name} (" in described and f"default {field.default!r}" in described, (stage, field.name)


def test_every_stage_parameter_has_a_meaning():
    for stage in STAGES:
        docs = param_docs(stage)
        assert [d[0] for d in docs] == [f.name for f in dataclasses.fields(params_class(stage))]
        assert all(len(meaning) > 3 for *_, meaning in docs), stage


def test_a_yaml_component_is_a_step_of_a_team_pipeline(tmp_path):
    prune = load_component_from_file(str(_yaml("prune")))
    evaluate = load_component_from_file(str(_yaml("evaluate")))

    @dsl.component
    def train(model: dsl.Output[dsl.Model]):
        pass

    @dsl.pipeline
    def team(storage_root: str = "s3://bucket/evoesap"):
        trained = train()
        scores = dsl.importer(artifact_uri="s3://bucket/scores", artifact_class=dsl.Dataset)
        pruned = prune(model=trained.outputs["model"], scores=scores.output, criterion="reap", sparsity=0.5,
                       storage_root=storage_root)  # fmt: skip
        evaluate(model=pruned.outputs["pruned"], storage_root=storage_root, params={"tasks": ["mc"]})

    compiler.Compiler().compile(team, str(tmp_path / "team.yaml"))
    spec = yaml.safe_load((tmp_path / "team.yaml").read_text())
    prune_task = spec["root"]["dag"]["tasks"]["prune"]
    assert prune_task["inputs"]["artifacts"]["model"]["taskOutputArtifact"] == {
        "outputArtifactKey": "model",
        "producerTask": "train",
    }
    assert "allocation" not in prune_task["inputs"].get("artifacts", {})  # optional: uniform pruning


def test_overwritten_weights_at_the_same_uri_are_calibrated_again(tmp_path):
    """A nightly re-prune of a model overwritten in place must not get last week's scores."""
    from evoesap.components import make_components
    from tiny_world import make_tiny_inputs

    from evoesap import moe
    from evoesap.store import artifacts

    files = make_tiny_inputs(tmp_path / "inputs")
    calibrate = make_components().calibrate.python_func
    storage = str(tmp_path / "storage")

    def run(name: str) -> dsl.Dataset:
        scores = dsl.Dataset(name="scores", uri=str(tmp_path / "kfp" / name / "scores"))
        calibrate(model=dsl.Model(name="model", uri=files["model"]), data=files["calibration"], storage_root=storage,
                  scores=scores, params={"samples": 8, "max_length": 64})  # fmt: skip
        return scores

    first, again = run("first"), run("again")
    assert again.metadata["uri"] == first.metadata["uri"]  # unchanged model: reused
    vocab = json.loads((Path(files["model"]) / "config.json").read_text())["vocab_size"]
    weights = sorted(Path(files["model"]).glob("*.safetensors"))
    size = [w.stat().st_size for w in weights]
    moe.tiny_model("olmoe", seed=4, vocab_size=vocab).save_pretrained(files["model"])  # same shapes, new weights
    assert [w.stat().st_size for w in weights] == size  # same URI, same file sizes: only the content changed
    overwritten = run("overwritten")
    assert overwritten.metadata["uri"] != first.metadata["uri"]  # calibrated again, into a new artifact
    old, new = (artifacts.read_manifest(a.metadata["uri"]) for a in (first, overwritten))
    assert new.files["scores.parquet"] != old.files["scores.parquet"]  # scored from the new weights
    assert new.inputs["model"] != old.inputs["model"] and new.inputs["model"]["uri"] == old.inputs["model"]["uri"]


def test_a_hub_model_artifact_is_read_at_the_revision_in_its_metadata(tmp_path):
    from evoesap.components.kfp_artifacts import source

    from evoesap.errors import ConfigError

    assert source(dsl.Model(name="model", uri="org/moe", metadata={"revision": "v1.0"})) == "org/moe@v1.0"
    assert source(dsl.Model(name="model", uri="org/moe", metadata={"revision": ""})) == "org/moe"
    ours = dsl.Model(name="pruned", uri="kfp://x", metadata={"stage": "prune", "uri": "s3://root/prune/k", "revision": "v1"})
    assert source(ours) == "s3://root/prune/k"  # our artifacts are named by their storage URI, never pinned
    with pytest.raises(ConfigError, match="applies to hub models"):
        source(dsl.Model(name="model", uri=str(tmp_path), metadata={"revision": "v1.0"}))
