"""The docs site's generated reference says what the code declares: every stage and every parameter of the
registry, every stage in the CLI reference and in the DAG picture."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from scripts import load_script

from evoesap import params as parameters
from evoesap import registry as stages
from evoesap.params import param

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference():
    return load_script("docs/hooks/reference.py", "docs_reference_hook")


def _sections(page: str) -> dict[str, str]:
    """Level-2 sections of a generated page by their anchor ({#name})."""
    parts = re.split(r"^## .*\{#([\w-]+)\}$", page, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_parameters_page_lists_every_parameter_of_every_stage_of_the_registry(reference):
    sections = _sections(reference.parameters_page())
    assert list(sections) == [stage.name for stage in stages.STAGES]
    for stage in stages.STAGES:
        declared = [field.name for field in dataclasses.fields(stage.params_class())]
        listed = re.findall(r"^\| `(\w+)` \|", sections[stage.name], flags=re.MULTILINE)
        assert listed == declared, stage.name
        for field in dataclasses.fields(stage.params_class()):
            row = next(line for line in sections[stage.name].splitlines() if line.startswith(f"| `{field.name}` |"))
            assert repr(field.default).replace("|", "\\|") in row or field.default is dataclasses.MISSING, (
                stage.name,
                field.name,
            )


def test_the_stages_page_lists_every_stage_with_every_input(reference):
    sections = _sections(reference.stages_page())
    assert list(sections) == [stage.name for stage in stages.STAGES]
    for stage in stages.STAGES:
        for given in stage.inputs:
            assert f"`--{given.name.replace('_', '-')}`" in sections[stage.name], (stage.name, given.name)
        assert stage.example in sections[stage.name]


def test_a_field_that_declares_choices_and_a_range_shows_them(reference, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Declared:
        DEFAULT_TOP_K: typing.ClassVar[int] = 64

        mode: typing.Literal["full", "topk"] = param("full", "Cache mode.")
        top_k: int | None = param(None, "Entries kept.", ge=1, le=4096, unset="DEFAULT_TOP_K")

    fake = dataclasses.replace(stages.STAGES[0], name="fake", params="x:y")
    monkeypatch.setattr(type(fake), "params_class", lambda self: Declared)
    monkeypatch.setattr(stages, "STAGES", (fake,))
    page = reference.parameters_page()
    assert "| parameter | type | default | choices | range | keyed | meaning |" in page
    assert "| `mode` | Literal['full', 'topk'] | `'full'` | `full`, `topk` |  | yes | Cache mode. |" in page
    assert "| `top_k` | int \\| None | `None` (unset: `64`) |  | `>= 1 and <= 4096` | yes | Entries kept. |" in page


def test_columns_for_choices_and_range_only_when_a_field_declares_them(reference):
    hints = {stage.name: typing.get_type_hints(stage.params_class()) for stage in stages.STAGES}
    fields = [(stage.name, f) for stage in stages.STAGES for f in dataclasses.fields(stage.params_class())]
    choices = any(parameters.choices_of(hints[name][f.name]) for name, f in fields)
    ranges = any(parameters.bounds_of(f) for _, f in fields)
    header = next(line for line in reference.parameters_page().splitlines() if line.startswith("| parameter |"))
    assert ("| choices |" in header) == choices and ("| range |" in header) == ranges


def test_the_yaml_reference_shows_each_section_s_choices_and_ranges(reference):
    page = reference.pipeline_yaml_page()
    row = next(line for line in page.splitlines() if line.startswith("| `search` |"))
    assert "`metric` one of esap, sap, kl, nll" in row and "`population` >= 2" in row
    assert "`heldout_fraction` >= 0 and < 1" in row and "`criterion`" not in row  # the grid's: set at the top level


def test_the_cli_reference_has_every_stage_verb(reference):
    page = reference.cli_page()
    assert f"in {len(stages.STAGES)} stages: {', '.join(stages.NAMES)}." in " ".join(page.split())  # `evoesap --help`
    for stage in stages.STAGES:
        assert f"## `evoesap {stage.name}`" in page
        assert f"Usage: evoesap {stage.name} [OPTIONS]" in page


def test_the_families_page_has_every_family(reference):
    families = reference._defined("FAMILIES", kind="constant")  # wherever the package keeps its family table
    page = reference.families_page()
    assert len(families) >= 8 and all(f"| `{name}` |" in page for name in families)
    unsupported = page.split("## Other MoE model types", 1)[1]  # generated from the installed transformers
    assert "| `jetmoe` |" in unsupported and "attention experts" in unsupported
    assert not any(f"| `{name}` |" in unsupported for name in families)


def test_the_api_pages_follow_the_package_tree(reference):
    modules = reference.api_modules()
    assert "evoesap.stages" in modules and "pipeline.config" in modules
    on_disk = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in (ROOT / "evoesap").rglob("*.py")}
    assert {m for m in modules if m.startswith("evoesap")} == {
        m.removesuffix(".__init__")
        for m in on_disk
        if not any(part.startswith("_") for part in m.split(".") if part != "__init__")
    }


def test_the_dag_picture_shows_every_stage_of_the_registry():
    draw_dag = load_script("docs/draw_dag.py", "docs_draw_dag")
    assert draw_dag.stages_drawn(draw_dag.compiled_spec(ROOT / "examples" / "demo.yaml")) == set(stages.NAMES)
