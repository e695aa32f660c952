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


def _blocks(section: str) -> dict[str, str]:
    """The level-3 blocks of a generated page's section by their title's code span (`### `name` {#anchor}`)."""
    parts = re.split(r"^### `([^`]+)` \{#[\w.<>-]+\}$", section, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _rendered_text(markdown_text: str) -> str:
    """What a reader sees of a page: its Markdown rendered as the site renders it, tags dropped, entities decoded."""
    import html

    import markdown

    rendered = markdown.markdown(markdown_text, extensions=["attr_list", "tables", "toc"])
    return html.unescape(re.sub(r"<[^>]+>", "", rendered))


def test_the_parameters_page_lists_every_parameter_of_every_stage_of_the_registry(reference):
    sections = _sections(reference.parameters_page())
    assert list(sections) == [stage.name for stage in stages.STAGES]
    for stage in stages.STAGES:
        blocks = _blocks(sections[stage.name])
        assert list(blocks) == [field.name for field in dataclasses.fields(stage.params_class())], stage.name
        for field in dataclasses.fields(stage.params_class()):
            block = blocks[field.name]
            assert parameters.help_of(field) in _rendered_text(block), (stage.name, field.name)
            if field.default is not dataclasses.MISSING:
                assert f"- **Default:** `{field.default!r}`" in block, (stage.name, field.name)
            keyed = field.metadata.get("keyed", True)
            assert ("- **Keyed:** yes" if keyed else "- **Keyed:** no") in block, (stage.name, field.name)


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
        note: str = param("<none>", "Shown as *written*: `<registry>/stage:<version>` and <registry>/stage.", keyed=False)

    fake = dataclasses.replace(stages.STAGES[0], name="fake", params="x:y")
    monkeypatch.setattr(type(fake), "params_class", lambda self: Declared)
    monkeypatch.setattr(stages, "STAGES", (fake,))
    blocks = _blocks(_sections(reference.parameters_page())["fake"])
    assert blocks["mode"].strip().split("\n- ")[1:] == [
        "**Type:** `Literal['full', 'topk']`",
        "**Default:** `'full'`",
        "**Choices:** `full`, `topk`",
        "**Keyed:** yes: part of the artifact's reuse key and manifest",
    ]
    assert "- **Default:** `None` (unset: `64`)" in blocks["top_k"] and "- **Range:** `>= 1 and <= 4096`" in blocks["top_k"]
    assert "Choices" not in blocks["top_k"] and "Range" not in blocks["mode"]  # a line only for what the field declares
    shown = _rendered_text(blocks["note"])
    assert "Shown as *written*: <registry>/stage:<version> and <registry>/stage." in shown  # escaped, not HTML or emphasis
    assert "Keyed: no" in shown


def test_the_yaml_reference_documents_every_key_of_every_section(reference):
    from evoesap.pipeline.cluster import StageSettings
    from evoesap.pipeline.config import PipelineConfig, Target

    page = reference.pipeline_yaml_page()
    blocks = _blocks(page)
    sections = {s.section for s in stages.STAGES}
    expected = [name for name in PipelineConfig.model_fields if name not in sections | {"target", "resources"}]
    expected += [f"target.{name}" for name in Target.model_fields]
    expected += [f"resources.<stage>.{name}" for name in StageSettings.model_fields]
    assert set(expected) <= set(blocks)
    assert {
        "resources.<stage>.secrets[].env",
        "resources.<stage>.scratch.size",
        "resources.<stage>.node_affinity[].weight",
    } <= set(blocks)
    for key, block in blocks.items():
        if key not in {s.section for s in stages.STAGES}:
            assert "(undocumented)" not in block, key  # every key has a description in its model
    shown = _rendered_text(page)
    assert "default: <registry>/stage:<version>." in shown  # escaped, not swallowed as an HTML tag
    for internal in ("Annotated", "Strict(", "typing.", "PydanticUndefined", "FieldInfo", "NoneType"):
        assert internal not in page, internal
    assert "strict (a value of another type is refused, not converted); >= 0" in _rendered_text(blocks["retries"])
    for stage in stages.STAGES:
        assert f"{{#section-{stage.section}}}" in page and f"{{#{stage.name}}}" not in page.split("## Stage sections")[0]


def test_the_yaml_reference_shows_each_section_s_choices_and_ranges(reference):
    section = _blocks(reference.pipeline_yaml_page())["search"]
    assert "- [`metric`](parameters.md#search-metric): one of esap, sap, kl, nll" in section
    assert "- [`population`](parameters.md#search-population): &gt;= 2" in section
    assert "`heldout_fraction`](parameters.md#search-heldout_fraction): &gt;= 0 and &lt; 1" in section
    assert "`criterion`" not in section.split("Set by the grid")[-1].split("\n", 1)[1]  # the grid's: set at the top level


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


def test_the_families_page_says_for_every_family_whether_the_vllm_plugin_serves_it(reference):
    served = reference.families_page().split("## Served on vLLM", 1)[1].split("## Other MoE model types", 1)[0]
    rows = {line.split(" | ")[0].strip("| `"): line for line in served.splitlines() if line.startswith("| `")}
    assert set(rows) == set(reference._defined("FAMILIES", kind="constant"))
    assert "| `EvoESAPOlmoeForCausalLM` | served |" in rows["olmoe"]  # from the plugin's own table
    assert "Triton" in rows["kimi_linear"] and "served" not in rows["kimi_linear"]  # its NOT_SERVED reason


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


def test_the_committed_dag_picture_is_the_one_the_pipeline_draws_now():
    """docs/dag.svg is redrawn (`python docs/draw_dag.py`, which needs graphviz) whenever the DAG changes: it records
    the digest of the graph it shows, and that is the graph the compiled spec gives now; every stage is a node's text."""
    import html

    draw_dag = load_script("docs/draw_dag.py", "docs_draw_dag")
    source = draw_dag.dot_source(draw_dag.compiled_spec(ROOT / "examples" / "demo.yaml"))
    svg = (ROOT / "docs" / "dag.svg").read_text()
    assert draw_dag.drawn_digest(svg) == draw_dag.digest(source), "docs/dag.svg is stale: run python docs/draw_dag.py"
    texts = {html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)}
    assert set(stages.NAMES) <= texts and {"model", "report", "publish"} <= texts
    assert any(t.startswith("for each criterion \u00d7 sparsity") for t in texts)  # the fan-out is one labelled box
    width = float(re.search(r'<svg width="([\d.]+)"', svg).group(1))
    sizes = [float(size) for size in re.findall(r'font-size="([\d.]+)"', svg)]
    # the docs site's content column beside both sidebars is about 690 px wide (GitHub's README about 830)
    assert sizes and min(sizes) * 690 / width >= 12, "labels under 12 px when the picture is 690 px wide"
