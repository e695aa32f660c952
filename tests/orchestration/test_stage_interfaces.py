"""A stage's interface is declared once, in its registry entry: its KFP component, its CLI command and its YAML
section agree with it, and a new entry alone makes a new stage everywhere that is generated from the registry."""

import dataclasses
import sys
from pathlib import Path

import click
import pytest
import yaml

from evoesap import registry
from evoesap.cli import main
from evoesap.cli.stages import stage_commands
from evoesap.pipeline import config as config_module
from evoesap.pipeline import dag
from evoesap.params import StageParams, param
from evoesap.registry import STAGES, Stage, StageInput, StageOutput

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
    declared = {name for item in stage.inputs for name in item.kfp_arguments}
    assert given == declared | set(stage.grid) | {"storage_root", "params"}
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


def run_toy(data: str, params: ToyParams, out_uri: str) -> None:
    raise AssertionError("never run here")


TOY = Stage(
    "toy-stage",
    f"{__name__}:run_toy",
    f"{__name__}:ToyParams",
    (StageInput("data", "Toy data."),),
    "the toy artifact",
    (StageOutput("toy", "Dataset"),),
    "Make a toy.",
    "evoesap toy-stage --data d.jsonl --out runs/toy",
    loads_model=False,
)


def test_a_new_registry_entry_is_a_cli_verb_a_yaml_section_and_a_pipeline_input(monkeypatch):
    """Only the registry changes (the list, wherever it was imported): the CLI, the configuration's schema and the
    DAG's per-stage parameter inputs follow."""
    staged = (*STAGES, TOY)
    for module in list(sys.modules.values()):
        for name, value in (("STAGES", STAGES), ("NAMES", registry.NAMES)):
            if getattr(module, name, None) is value:
                monkeypatch.setattr(module, name, staged if name == "STAGES" else tuple(s.name for s in staged))
    command = _command(TOY)
    options = _options(command)
    assert {"data", "out", "width"} <= set(options) and isinstance(options["width"].type, click.IntRange)
    assert main(["toy-stage", "--data", "d.jsonl", "--out", "o", "--width", "0"]) == 2  # its declared range, enforced

    model = config_module.config_model()
    assert "toy_stage" in model.model_json_schema()["properties"]
    config = model(model="/m", calibration_data="/c.jsonl", search_data="/s.jsonl", storage_root="/r", toy_stage={"width": 5})
    assert config.parsed_params("toy-stage") == ToyParams(width=5)
    defaults = dag._defaults(config)
    assert defaults["toy_stage_params"] == {"width": 5}
    inputs = {p.name: p for p in dag._params_parameters(config, defaults)}
    assert inputs["toy_stage_params"].default == {"width": 5} and inputs["toy_stage_params"].annotation is dict
