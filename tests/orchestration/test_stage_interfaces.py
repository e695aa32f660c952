"""A stage's interface is declared once, in its registry entry: its KFP component, its CLI command and its YAML
section agree with it, and a new entry alone makes a new stage everywhere that is generated from the registry."""

import dataclasses
import json
import sys
from pathlib import Path

import click
import pytest
import yaml
from evoesap.components.stages import component, write_component_yamls
from evoesap.pipeline import config as config_module
from evoesap.pipeline import dag
from kfp import dsl

from evoesap import registry
from evoesap.cli import main
from evoesap.cli.stages import stage_commands
from evoesap.params import StageParams, keyed, param
from evoesap.registry import STAGES, Stage, StageInput, StageOutput
from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[2]


def _component(stage: Stage) -> dict:
    return yaml.safe_load((ROOT / "components" / f"{stage.section}.yaml").read_text())


def _command(stage: Stage) -> click.Command:
    (command,) = [c for c in stage_commands() if c.name == stage.name]
    return command


def _options(command: click.Command) -> dict[str, click.Option]:
    """The command's own options, without click's --help."""
    found = command.get_params(click.Context(command))
    return {o.name: o for o in found if isinstance(o, click.Option) and o is not command.get_help_option(click.Context(command))}


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_component_cli_and_registry_agree_on_inputs_outputs_and_parameters(stage):
    component = _component(stage)
    root = component["root"]
    given = set(root["inputDefinitions"].get("artifacts", {})) | set(root["inputDefinitions"].get("parameters", {}))
    declared = {argument.name: argument for item in stage.inputs for argument in item.kfp_arguments}
    workspace = {"workspace"} if any(item.model for item in stage.inputs) else set()  # KFP only: the run's workspace
    assert given == set(declared) | set(stage.grid) | {"storage_root", "params"} | workspace
    for name, argument in declared.items():  # each argument typed as declared: artifact kind, list, optional
        if argument.kind == "str":
            assert root["inputDefinitions"]["parameters"][name]["parameterType"] == "STRING", name
        else:
            found = root["inputDefinitions"]["artifacts"][name]
            assert found["artifactType"]["schemaTitle"] == f"system.{argument.kind}", name
            assert found.get("isArtifactList", False) == argument.many, name
        definition = {**root["inputDefinitions"].get("artifacts", {}), **root["inputDefinitions"]["parameters"]}[name]
        assert definition.get("isOptional", False) == (not argument.required), name
        assert " ".join(definition["description"].split()).startswith(argument.help), name
    made = {name: a["artifactType"]["schemaTitle"] for name, a in root["outputDefinitions"]["artifacts"].items()}
    assert made == {out.name: f"system.{out.kind}" for out in stage.outputs}

    fields = [f.name for f in dataclasses.fields(stage.params_class())]
    options = set(_options(_command(stage)))
    revision = {"revision"} if any(item.model for item in stage.inputs) else set()
    assert options == {item.name for item in stage.inputs} | {"out"} | revision | set(fields)
    params_doc = root["inputDefinitions"]["parameters"]["params"]["description"]
    assert all(f"{name} (" in params_doc for name in fields if name not in given), stage.name


@dataclasses.dataclass(frozen=True)
class ToyParams(StageParams):
    width: int = param(3, "How wide the toy is.", ge=1)


def run_toy(data: str, params: ToyParams, out_uri: str, *, shape: str | None = None) -> artifacts.Manifest:
    """A stage: what it was given, written as an artifact."""
    inputs = {"data": data, "shape": shape}
    with artifacts.stage_output(out_uri, "toy-stage", keyed(params), inputs) as staging:
        (staging / "toy.json").write_text(json.dumps({"data": data, "shape": shape, "width": params.width}))
    return artifacts.read_manifest(out_uri)


TOY = Stage(
    "toy-stage",
    f"{__name__}:run_toy",
    f"{__name__}:ToyParams",
    (
        StageInput("data", "Toy data: a path or URI.", kind="str"),
        StageInput("shape", "A shape artifact the toy takes after.", required=False, kind="Artifact"),
    ),
    "the toy artifact",
    (StageOutput("toy", "Dataset", "The toy (toy.json)."),),
    "Make a toy.",
    "evoesap toy-stage --data d.jsonl --out runs/toy",
    loads_model=False,
)


def test_a_new_registry_entry_is_a_cli_verb_a_yaml_section_a_component_and_a_pipeline_input(monkeypatch, tmp_path):
    """Only the registry changes (the list, wherever it was imported): the CLI, the configuration's schema, the
    component YAMLs (and the component itself, run) and the DAG's per-stage parameter inputs follow."""
    staged = (*STAGES, TOY)
    for module in list(sys.modules.values()):
        for name, value in (("STAGES", STAGES), ("NAMES", registry.NAMES)):
            if getattr(module, name, None) is value:
                monkeypatch.setattr(module, name, staged if name == "STAGES" else tuple(s.name for s in staged))
    command = _command(TOY)
    options = _options(command)
    assert {"data", "shape", "out", "width"} <= set(options) and isinstance(options["width"].type, click.IntRange)
    assert main(["toy-stage", "--data", "d.jsonl", "--out", "o", "--width", "0"]) == 2  # its declared range, enforced

    model = config_module.config_model()
    section = model.model_json_schema()["properties"]["toy_stage"]
    assert section["properties"] == {
        "width": {"type": "integer", "minimum": 1, "default": 3, "description": "How wide the toy is. [>= 1]"}
    }
    config = model(model="/m", calibration_data="/c.jsonl", search_data="/s.jsonl", storage_root="/r", toy_stage={"width": 5})
    assert config.parsed_params("toy-stage") == ToyParams(width=5)
    defaults = dag._defaults(config)
    assert defaults["toy_stage_params"] == {"width": 5}
    inputs = {p.name: p for p in dag._params_parameters(config, defaults)}
    assert inputs["toy_stage_params"].default == {"width": 5} and inputs["toy_stage_params"].annotation is dict

    written = write_component_yamls(tmp_path / "components")
    assert sorted(p.name for p in written) == sorted(f"{s.section}.yaml" for s in staged)
    spec = yaml.safe_load((tmp_path / "components" / "toy_stage.yaml").read_text())["root"]
    given = spec["inputDefinitions"]
    assert set(given["parameters"]) == {"data", "storage_root", "params"} and set(given["artifacts"]) == {"shape"}
    assert given["artifacts"]["shape"]["isOptional"] and given["artifacts"]["shape"]["artifactType"]["schemaTitle"] == (
        "system.Artifact"
    )
    assert given["parameters"]["data"]["description"] == "Toy data: a path or URI."
    assert "width (int, default 3): How wide the toy is. [>= 1]" in given["parameters"]["params"]["description"]
    made = spec["outputDefinitions"]["artifacts"]
    assert list(made) == ["toy"] and made["toy"]["artifactType"]["schemaTitle"] == "system.Dataset"

    (tmp_path / "d.jsonl").write_text("{}\n")
    shape = dsl.Artifact(name="shape", uri=str(tmp_path / "shape"))
    (tmp_path / "shape").mkdir()
    toy = dsl.Dataset(name="toy", uri=str(tmp_path / "kfp" / "toy"))
    component(TOY).python_func(
        data=str(tmp_path / "d.jsonl"), storage_root=str(tmp_path / "store"), toy=toy, shape=shape, params={"width": 5}
    )
    assert toy.metadata["stage"] == "toy-stage" and toy.uri.startswith(str(tmp_path / "store" / "toy-stage"))
    assert json.loads(Path(toy.uri, "toy.json").read_text()) == {
        "data": str(tmp_path / "d.jsonl"),
        "shape": str(tmp_path / "shape"),
        "width": 5,
    }
