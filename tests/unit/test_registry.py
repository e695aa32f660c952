"""One registry, one declaration: the CLI, the pipeline YAML, the KFP components and the Python
API are all derived from `evoesap.registry.STAGES` and the parameter fields, and a mismatch fails here."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import click
import pytest
from scripts import load_script

from evoesap import params as parameters
from evoesap import registry as stages
from evoesap.cli import command, main
from evoesap.errors import ConfigError

STAGE_NAMES = [stage.name for stage in stages.STAGES]


def cli_options(stage: stages.Stage) -> dict[str, click.Option]:
    verb = command().commands[stage.name]
    with click.Context(verb) as ctx:
        return {p.name: p for p in verb.get_params(ctx) if isinstance(p, click.Option) and not p.is_eager}


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_cli_options_are_exactly_the_inputs_out_revision_and_parameter_fields(name):
    stage = stages.get(name)
    fields = {f.name for f in dataclasses.fields(stage.params_class())}
    expected = {i.name for i in stage.inputs} | {"out"} | fields
    if any(i.model for i in stage.inputs):
        expected.add("revision")
    assert set(cli_options(stage)) == expected


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_help_shows_every_parameter_with_its_declared_help_and_default(name, capsys):
    stage = stages.get(name)
    options = cli_options(stage)
    for field in dataclasses.fields(stage.params_class()):
        option = options[field.name]
        assert option.help == parameters.help_of(field)
        if isinstance(field.default, tuple):
            assert option.default == ",".join(field.default)
        else:
            assert option.default == field.default
    assert main([name, "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert stage.example.split()[1] in shown and "--out" in shown
    for field in dataclasses.fields(stage.params_class()):
        assert "--" + field.name.replace("_", "-") in shown


@pytest.mark.parametrize("name", [s.name for s in stages.STAGES if s.loads_model])
def test_every_stage_that_loads_a_model_takes_device_map(name):
    assert "device_map" in cli_options(stages.get(name))


def test_the_yaml_has_one_section_per_stage_and_resources_take_every_stage_name():
    from evoesap.pipeline.config import PipelineConfig, load_config

    sections = {stage.section for stage in stages.STAGES}
    assert sections <= set(PipelineConfig.model_fields)
    base = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl"}
    for stage in stages.STAGES:
        config = load_config({**base, stage.section: {}, "resources": {stage.name: {"cpu": "1"}}})
        assert config.stage_params(stage.name) == {}
    with pytest.raises(ConfigError, match="unknown parameter"):
        load_config({**base, "search": {"populaton": 3}})


def test_the_configuration_schema_shows_each_section_s_parameters_with_choices_and_ranges():
    """An editor (or the docs) reading the configuration's JSON schema sees what a section takes; the dataclass still
    validates, with its own messages."""
    from evoesap.pipeline.config import PipelineConfig, load_config

    from evoesap.scoring.metrics import METRICS

    sections = PipelineConfig.model_json_schema()["properties"]
    search = sections["search"]
    assert search["additionalProperties"] is False and "criterion" not in search["properties"]  # the grid: top level
    assert search["properties"]["metric"] == {
        "type": "string",
        "enum": list(METRICS),
        "default": "esap",
        "description": "Fitness (scoring.metrics.METRICS). [one of esap, sap, kl, nll]",
    }
    assert search["properties"]["population"] | {"description": ""} == {
        "type": "integer", "minimum": 2, "default": 32, "description": "",
    }  # fmt: skip
    assert {k: search["properties"]["heldout_fraction"][k] for k in ("minimum", "exclusiveMaximum")} == {
        "minimum": 0,
        "exclusiveMaximum": 1,
    }
    samples = sections["calibrate"]["properties"]["samples"]
    assert samples["type"] == ["integer", "null"] and samples["minimum"] == 1 and "unset here: 1024" in samples["description"]
    base = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl"}
    with pytest.raises(ConfigError, match="metric 'tv' is not one of esap, sap, kl, nll"):
        load_config({**base, "search": {"metric": "tv"}})


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_yaml_cli_and_python_build_the_same_parameters(name):
    """A value given in the YAML section, on the command line, or to the dataclass ends up the same."""
    stage = stages.get(name)
    cls = stage.params_class()
    python = cls()
    from evoesap.pipeline.config import load_config

    base = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl"}
    from_yaml = load_config({**base, stage.section: {}}).parsed_params(name)
    grid_defaults = {"criterion": "reap", "sparsity": 0.25}
    assert from_yaml == dataclasses.replace(python, **{k: grid_defaults[k] for k in stage.grid})
    from_cli = {o.name: o.default for o in cli_options(stage).values() if o.name in {f.name for f in dataclasses.fields(cls)}}
    from evoesap.steps import make_params

    assert make_params(name, from_cli) == python


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_the_kfp_component_documents_every_parameter_from_the_same_declaration(name):
    from evoesap.components.interface import params_description

    stage = stages.get(name)
    text = params_description(name)
    for field in dataclasses.fields(stage.params_class()):
        assert f"{field.name} (" in text and parameters.help_of(field).rstrip(".") in text


def test_components_are_made_for_every_stage_of_the_registry():
    from evoesap.components import make_components

    made = make_components()
    assert [f.name for f in dataclasses.fields(made)] == [stage.section for stage in stages.STAGES]


def test_an_unknown_stage_names_the_nearest_one():
    with pytest.raises(ConfigError, match="did you mean 'cache-logits'"):
        stages.get("cache_logits")


@pytest.mark.parametrize(
    "value,message", [(2.7, "must be an integer"), (True, "must be an integer"), ("3", "must be an integer")]
)
def test_integers_are_coerced_once_and_refused_when_not_whole(value, message):
    from evoesap.steps import make_params

    assert make_params("search", {"generations": 3.0}).generations == 3
    assert isinstance(make_params("search", {"generations": 3.0}).generations, int)
    with pytest.raises(ConfigError, match=message):
        make_params("search", {"generations": value})


def test_listing_the_verbs_imports_no_stage_code():
    code = (
        "import sys; from evoesap.cli import command; command(); "
        "print(sorted(m for m in sys.modules if m.startswith('evoesap.stages.') or m == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2]
    ).stdout
    assert out.strip() == "[]"


def _imports_of_the_package() -> dict[str, set[str]]:
    """evoesap's modules (components/ and pipeline/ under their installed names) -> the evoesap modules each
    imports anywhere in its text, function-local imports included: the package graph's own reading of the imports
    (docs/package_graph.py)."""
    return load_script("docs/package_graph.py").module_imports()


def test_no_module_imports_itself_back_through_others():
    graph = _imports_of_the_package()

    def reaches(start: str, target: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for nxt in graph.get(node, ()):
                if nxt == target:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    # a package's __init__ importing its own submodules is how packages work, not a cycle between layers
    cycles = sorted(m for m in graph if any(reaches(dep, m) for dep in graph[m] if not dep.startswith(m + ".")))
    assert cycles == []


def test_the_memory_model_and_scoring_import_no_stage():
    graph = _imports_of_the_package()
    for module in ("evoesap.planning.footprint", *(m for m in graph if m.startswith("evoesap.scoring"))):
        assert not {m for m in graph[module] if m.startswith("evoesap.stages.")}, module


@pytest.mark.parametrize(
    "args,words",
    [
        (["foo"], "No such command 'foo'"),
        (["prune", "--data", "x"], "No such option '--data'"),
        (["search"], "Missing option '--"),
    ],
)
def test_usage_errors_exit_2_with_the_parsers_message(args, words, capsys):
    assert main(args) == 2
    assert words in capsys.readouterr().err
