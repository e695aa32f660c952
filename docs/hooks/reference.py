"""MkDocs hook: the reference pages, generated from the code at every build so they cannot drift from it.

Stages and their inputs come from the stage registry (`evoesap.registry.STAGES`), every parameter from its
dataclass field (`evoesap.params.param`: type, default, help, its choices (a `Literal` type) and its range (`ge`, `lt`,
...) where it declares them), the CLI from the click command the `evoesap` entry point runs, the pipeline YAML from its
pydantic model and its JSON schema, the component interfaces from `components/*.yaml`, the artifact records from their dataclasses
and the families from `evoesap.moe.families.FAMILIES`. The API pages are one per module of the package tree,
found on disk at build time, so a module that moves moves its page.

`tests/system/test_docs_reference.py` checks that these pages list every stage and parameter of the registry.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What a parameter field may declare that is shown as its own column, when some field declares it.
SHOWN_METADATA = ("choices", "range")
_PLAIN_METADATA = ("help", "keyed", "bounds", "unset", "finite")  # shown otherwise (range; default; finite) or not at all


# ---------------------------------------------------------------- helpers


def _cell(value: Any) -> str:
    """A value as one Markdown table cell: its text escaped (`_text`), pipes escaped, no newlines."""
    return _text(value).replace("|", "\\|")


def _text(value: Any) -> str:
    """Text as Markdown shows it literally, on one line: HTML and emphasis marks escaped outside its `code spans`
    (the docstrings' and help texts' own), so `<registry>/stage` stays visible and `*` or `_` makes no emphasis."""
    parts = re.split(r"(`[^`]+`)", str(value).replace("\n", " "))
    return "".join(
        part if i % 2 else re.sub(r"([\\*_\[\]])", r"\\\1", html.escape(part, quote=False)) for i, part in enumerate(parts)
    )


def _code(value: Any) -> str:
    """A value as a Markdown code span (empty for no text); a fence longer than any backtick run inside it."""
    text = str(value).replace("\n", " ")
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _type_name(annotation: Any) -> str:
    plain = isinstance(annotation, type) and typing.get_origin(annotation) is None
    text = annotation.__name__ if plain else str(annotation)
    return re.sub(r"\b(typing|evoesap(\.\w+)*)\.", "", text).replace("NoneType", "None")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _module_defining(pattern: str, package: str = "evoesap") -> str | None:
    """The dotted name of the first module under `package` whose source matches `pattern` (a regex): finds a
    definition wherever a reorganisation of the package has put it, without importing every module."""
    base = ROOT / package.replace(".", "/")
    regex = re.compile(pattern, re.MULTILINE)
    for path in sorted(base.rglob("*.py")):
        if regex.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def _defined(name: str, kind: str = "class") -> Any | None:
    """The object called `name` defined by `class name`, `def name` or `name =` somewhere in the package, or None."""
    patterns = {"class": rf"^class {name}\b", "function": rf"^def {name}\b"}
    pattern = patterns.get(kind, rf"^{name}\b[^=\n]*=")
    module = _module_defining(pattern)
    return getattr(importlib.import_module(module), name) if module else None


def _field_comments(cls: type) -> dict[str, str]:
    """The trailing `# comment` of each annotated field in the source of a class and its bases (the records and
    the pipeline settings document their fields that way)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            match = re.match(r"^    (\w+): [^#]+?#\s*(.+)$", line)
            if match and not re.match(r"(type:|noqa)", match.group(2)):
                found[match.group(1)] = match.group(2).strip()
    return found


# ---------------------------------------------------------------- parameters and stages


@dataclasses.dataclass(frozen=True)
class ParameterRow:
    """One parameter of one stage, as the reference shows it."""

    stage: str
    name: str
    type: str
    default: Any
    help: str
    keyed: bool
    extra: dict[str, Any]  # choices, range and any other metadata the field declares
    unset: Any = None  # what the default None means for this stage (`params.effective_default`), where it means one
    finite: bool = True  # False: a number field that takes NaN and infinities (`param(finite=False)`)


def parameter_rows() -> list[ParameterRow]:
    """Every parameter of every stage of the registry, in registry and field order."""
    from evoesap import params as parameters
    from evoesap import registry as stages

    rows = []
    for stage in stages.STAGES:
        cls = stage.params_class()
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            default = field.default
            if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            hint = hints.get(field.name, field.type)
            declared = {"choices": parameters.choices_of(hint), "range": parameters.range_of(field)}
            extra = {k: v for k, v in declared.items() if v}
            extra.update({k: v for k, v in field.metadata.items() if k not in _PLAIN_METADATA})
            effective = parameters.effective_default(cls, field)
            rows.append(
                ParameterRow(
                    stage=stage.name,
                    name=field.name,
                    type=_type_name(hints.get(field.name, field.type)),
                    default="(required)" if default is dataclasses.MISSING else default,
                    help=str(field.metadata.get("help", "")),
                    keyed=bool(field.metadata.get("keyed", True)),
                    extra=extra,
                    unset=effective if effective != default else None,
                    finite=bool(field.metadata.get("finite", True)),
                )
            )
    return rows


def _extra_text(value: Any) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_code(v) for v in value)
    return _code(value)


def _definition(title: str, anchor: str, meaning: str, facts: list[tuple[str, str]]) -> list[str]:
    """One documented key as a block: a heading with its anchor, its meaning, then one line per fact (type,
    default, ...). A block per key, not a table row: a long meaning wraps at any page width instead of being cut."""
    out = [f"### {title} {{#{anchor}}}", "", meaning or "(undocumented)", ""]
    out += [f"- **{label}:** {value}" for label, value in facts if value]
    return [*out, ""]


def parameter_block(row: ParameterRow) -> list[str]:
    """One parameter's block on the Parameters page: name, type, default, its choices and range where it declares
    them, keyed or not, and its meaning (the `help` of its declaration)."""
    default = "(required)" if row.default == "(required)" else _code(repr(row.default))
    if row.unset is not None:
        default += f" (unset: {_code(repr(row.unset))})"
    facts = [("Type", _code(row.type)), ("Default", default)]
    facts += [(name.capitalize(), _extra_text(row.extra[name])) for name in SHOWN_METADATA if name in row.extra]
    facts += [(name, _extra_text(value)) for name, value in sorted(row.extra.items()) if name not in SHOWN_METADATA]
    if not row.finite:
        facts.append(("Non-finite values", "accepted (NaN, infinities)"))
    keyed = "yes: part of the artifact's reuse key and manifest" if row.keyed else "no: how the stage runs, not what it makes"
    facts.append(("Keyed", keyed))
    return _definition(_code(row.name), f"{row.stage}-{row.name}", _text(row.help), facts)


def parameters_page() -> str:
    from evoesap import registry as stages

    rows = parameter_rows()
    out = [
        "# Parameters",
        "",
        "Every parameter of every stage, read from its declaration (the stage's parameter dataclass). The same name "
        "is the Python keyword, the YAML key in the stage's section of the pipeline configuration, the key of the "
        "KFP component's `params` input, and the CLI option with `-` for `_` (`max_length` is `--max-length`). "
        "*Keyed* parameters decide the artifact (they are in its reuse key and its manifest); the others only how "
        "the stage runs.",
        "",
    ]
    for stage in stages.STAGES:
        out += [f"## {stage.name} {{#{stage.name}}}", "", f"YAML section `{stage.section}`; CLI `evoesap {stage.name}`.", ""]
        if stage.grid:
            out += [f"Set per point of the criterion x sparsity grid, not in the section: {', '.join(stage.grid)}.", ""]
        names = [row for row in rows if row.stage == stage.name]
        out += [" · ".join(f"[{_code(row.name)}](#{row.stage}-{row.name})" for row in names), ""]
        for row in names:
            out += parameter_block(row)
    return "\n".join(out)


def stages_page() -> str:
    from evoesap import registry as stages

    out = [
        "# Stages",
        "",
        f"The pipeline has {len(stages.STAGES)} stages: {', '.join(f'`{s.name}`' for s in stages.STAGES)}. Each is a "
        "CLI verb, a section of the pipeline configuration, a KFP component and a Python function "
        "`run_<stage>(inputs..., params, out_uri)`; all of them are derived from this one list.",
        "",
        _table(
            ["stage", "what it does", "output", "loads the model"],
            [
                [f"[`{s.name}`](#{s.name})", _cell(s.summary), _cell(s.output), "yes" if s.loads_model else "no"]
                for s in stages.STAGES
            ],
        ),
        "",
    ]
    for s in stages.STAGES:
        out += [f"## {s.name} {{#{s.name}}}", "", _cell(s.summary), ""]
        inputs = [
            [f"`--{i.name.replace('_', '-')}`", "yes" if i.required else "no", "yes" if i.many else "no", _cell(i.help)]
            for i in s.inputs
        ]
        out += [_table(["input", "required", "repeats", "what"], inputs), ""]
        out += [f"Writes {s.output} to `--out`. Runs in `{s.run}`; parameters: [{s.name}](parameters.md#{s.name}).", ""]
        if s.grid:
            out += [f"Per grid point: {', '.join(f'`{g}`' for g in s.grid)}.", ""]
        if s.fits_with:
            out += [f"When its memory plan is refused, change: {_cell(s.fits_with)}.", ""]
        out += ["```bash", s.example, "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- CLI


def _commands(cmd: Any, name: str, parent: Any = None) -> Iterator[tuple[Any, Any]]:
    """Every command under `cmd` with the context that names its whole path (`evoesap pipeline run`)."""
    if hasattr(cmd, "rich_markup_mode"):
        cmd.rich_markup_mode = None  # typer's plain help text (its rich help prints to the terminal instead)
    ctx = cmd.context_class(cmd, info_name=name, parent=parent, terminal_width=100, max_content_width=100)
    yield ctx, cmd
    for sub in sorted(getattr(cmd, "commands", {})):
        yield from _commands(cmd.commands[sub], sub, ctx)


def cli_page() -> str:
    from evoesap.cli import command

    out = [
        "# Command line",
        "",
        "The `--help` of every `evoesap` command, as the installed command prints it. Exit codes: 0 on success, "
        "2 on usage errors, 1 on other errors (one line; `--debug` for a traceback).",
        "",
    ]
    for ctx, cmd in _commands(command(), "evoesap"):
        anchor = ctx.command_path.replace(" ", "-")
        out += [f"## `{ctx.command_path}` {{#{anchor}}}", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- pipeline YAML


_SCHEMA_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
_LIMITS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _rule(prop: dict[str, Any]) -> str:
    """A JSON schema property's choices or range in words (`one of esap, sap`, `>= 2`); "" when it has none."""
    if "enum" in prop:
        return "one of " + ", ".join(str(v) for v in prop["enum"] if v is not None)
    return " and ".join(f"{op} {prop[key]:g}" for key, op in _SCHEMA_BOUNDS.items() if key in prop)


def _models_in(annotation: Any) -> list[type]:
    """The pydantic models a field's type holds (`list[Secret]` -> [Secret], `Scratch | None` -> [Scratch])."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def yaml_type(annotation: Any) -> str:
    """A field's type as a YAML writer reads it (`list of string`, `integer or null`), not pydantic's repr."""
    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return yaml_type(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(yaml_type(a) for a in args))
    if origin in (list, tuple):
        return f"list of {yaml_type(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {yaml_type(args[0])} to {yaml_type(args[1])}" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping (below)"
    names = {str: "string", int: "integer", float: "number", bool: "true or false", type(None): "null", Any: "any"}
    return names.get(annotation, _type_name(annotation))


def yaml_limits(metadata: list[Any]) -> str:
    """A pydantic field's constraints in words (`>= 0`, `at least 1 item`, `strict: no coercion`)."""
    words = []
    for item in metadata:
        for name, op in _LIMITS.items():
            if getattr(item, name, None) is not None:
                words.append(f"{op} {getattr(item, name)}")
        if getattr(item, "min_length", None):
            words.append(f"at least {item.min_length}")
        if getattr(item, "strict", None):
            words.append("strict (a value of another type is refused, not converted)")
    return "; ".join(words)


def yaml_default(info: Any) -> str:
    """A pydantic field's default as YAML writes it (`null`, `[]`, `reap`); "(required)" when it has none."""
    import json

    from pydantic_core import PydanticUndefined

    if info.default is PydanticUndefined and info.default_factory is None:
        return "(required)"
    value = info.default_factory() if info.default is PydanticUndefined else info.default
    try:
        return _code(json.dumps(value))
    except TypeError:
        return _code(repr(value))


def field_descriptions(model: type) -> dict[str, str]:
    """Each field's meaning: its `Field(description=...)`, else the comment the source gives it."""
    comments = _field_comments(model)
    return {name: info.description or comments.get(name, "") for name, info in model.model_fields.items()}


def model_blocks(model: type, path: str, anchor: str, skip: frozenset[str] = frozenset()) -> list[str]:
    """One block per field of a pydantic model, keys written as their dotted path in the YAML (`target.bytes`),
    then the same for each model a field holds (`resources.<stage>.secrets[].name`)."""
    meanings = field_descriptions(model)
    out: list[str] = []
    nested: list[tuple[type, str, str]] = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        key = f"{path}.{name}" if path else name
        facts = [("Type", _text(yaml_type(info.annotation))), ("Default", yaml_default(info))]
        facts.append(("Constraints", _text(yaml_limits(info.metadata))))
        out += _definition(_code(key), f"{anchor}-{name}" if anchor else name, _text(meanings[name]), facts)
        for inner in _models_in(info.annotation):
            listed = typing.get_origin(info.annotation) is list
            nested.append((inner, f"{key}[]" if listed else key, f"{anchor}-{name}" if anchor else name))
    for inner, key, inner_anchor in nested:
        doc = (inner.__doc__ or "").strip().split("\n\n")[0]
        intro = f"Each item of {_code(key.removesuffix('[]'))}" if key.endswith("[]") else _code(key)
        out += [f"{intro} takes these keys{': ' + _text(doc) if doc else '.'}", ""]
        out += model_blocks(inner, key, inner_anchor)
    return out


def pipeline_yaml_page() -> str:
    from evoesap.pipeline.cluster import StageSettings
    from evoesap.pipeline.config import PipelineConfig, Target

    from evoesap import registry as stages

    stage_sections = frozenset(s.section for s in stages.STAGES)
    schema = PipelineConfig.model_json_schema()["properties"]
    resources_keys = ", ".join(_code(k) for k in ("all", *stages.NAMES))
    out = [
        "# Pipeline configuration (YAML)",
        "",
        "The schema of the one YAML file `evoesap pipeline run|compile|submit` and `evoesap plan` read, from its "
        "pydantic model (`PipelineConfig`): every key, its type, default and constraints, and what it means. Unknown "
        "keys and bad values are refused before anything runs, naming the key. How to write one: "
        "[Configure a pipeline run](../guides/configure.md).",
        "",
        "Sections: [run settings](#run-settings) · [`target`](#target) · [`resources`](#resources) · "
        "[stage sections](#stage-sections).",
        "",
        "## Run settings {#run-settings}",
        "",
        "Top-level keys.",
        "",
        *model_blocks(PipelineConfig, "", "", skip=stage_sections | {"target", "resources"}),
        "## target {#target}",
        "",
        _text((Target.__doc__ or "").strip()),
        "",
        *model_blocks(Target, "target", "target"),
        "## resources {#resources}",
        "",
        f"What each stage's pods ask the cluster for: a mapping whose keys are {resources_keys} (`all` applies to "
        "every stage, a stage's own settings over it) and whose values take the keys below, written here for one "
        "stage as `resources.<stage>`. " + _text((StageSettings.__doc__ or "").strip()),
        "",
        *model_blocks(StageSettings, "resources.<stage>", "resources"),
        "## Stage sections {#stage-sections}",
        "",
        "One section per stage of the registry; each takes exactly that stage's parameters, documented one by one on "
        "the [Parameters](parameters.md) page. The choices and ranges are the configuration's JSON schema's "
        "(`PipelineConfig.model_json_schema()`).",
        "",
    ]
    for s in stages.STAGES:
        if s.section not in PipelineConfig.model_fields:
            continue
        out += [f"### `{s.section}` {{#section-{s.section}}}", "", _text(s.summary), ""]
        if s.grid:
            out += [f"Set by the grid, not here: {', '.join(_code(g) for g in s.grid)}.", ""]
        for key, prop in schema[s.section]["properties"].items():
            rule = _rule(prop)
            out.append(f"- [{_code(key)}](parameters.md#{s.name}-{key})" + (f": {_text(rule)}" if rule else ""))
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- components


def components_page() -> str:
    import yaml

    from evoesap import registry as stages

    out = [
        "# KFP components",
        "",
        "The inputs and outputs of each stage's component (`components/<stage>.yaml`, generated from the Python "
        "definitions by `make components`). Load one with `kfp.components.load_component_from_file`; see "
        "[Embed EvoESAP in your pipeline](../guides/embed.md).",
        "",
    ]
    for stage in stages.STAGES:
        path = ROOT / "components" / f"{stage.section}.yaml"
        if not path.exists():
            continue
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        (component,) = spec["components"].values()
        rows = []
        inputs = component.get("inputDefinitions", {})
        for kind, key in (("artifact", "artifacts"), ("parameter", "parameters")):
            for name, item in sorted(inputs.get(key, {}).items()):
                type_ = item.get("artifactType", {}).get("schemaTitle") or item.get("parameterType", "")
                optional = "yes" if item.get("isOptional") else "no"
                rows.append([f"`{name}`", kind, _code(type_), optional, _cell(item.get("description", ""))])
        outputs = component.get("outputDefinitions", {})
        out_rows = [
            [
                f"`{name}`",
                _code(item.get("artifactType", {}).get("schemaTitle") or item.get("parameterType", "")),
                _cell(item.get("description", "")),
            ]
            for key in ("artifacts", "parameters")
            for name, item in sorted(outputs.get(key, {}).items())
        ]
        out += [f"## {stage.name} {{#{stage.name}}}", "", f"`components/{path.name}`", ""]
        out += ["Inputs:", "", _table(["input", "kind", "type", "optional", "description"], rows), ""]
        out += ["Outputs:", "", _table(["output", "type", "description"], out_rows), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- artifacts


def _fields_table(cls: type) -> str:
    comments = _field_comments(cls)
    hints = typing.get_type_hints(cls)
    rows = [
        [f"`{f.name}`", _cell(_type_name(hints.get(f.name, f.type))), _cell(comments.get(f.name, ""))]
        for f in dataclasses.fields(cls)
    ]
    return _table(["field", "type", "meaning"], rows)


def artifacts_page() -> str:
    from evoesap import registry as stages

    out = [
        "# Artifact formats",
        "",
        "Every stage writes one artifact: a directory at `<storage_root>/<stage>/<key>` (or `--out`) holding its "
        "payload and a `manifest.json`. What each payload file holds is described in "
        "[What you get](../getting-started/what-you-get.md).",
        "",
        _table(["stage", "artifact"], [[f"`{s.name}`", _cell(s.output)] for s in stages.STAGES]),
        "",
    ]
    manifest = _defined("Manifest")
    if manifest is not None and dataclasses.is_dataclass(manifest):
        out += ["## manifest.json", "", _cell((manifest.__doc__ or "").strip().split("\n\n")[0]), "", _fields_table(manifest), ""]
    records = [
        (_defined(f"{name}_FILE", kind="constant"), _defined(cls))
        for name, cls in (
            ("ALLOCATION", "AllocationRecord"),
            ("PRUNING", "PruningRecord"),
            ("METRICS", "MetricsRecord"),
            ("QUANTIZATION", "QuantizationRecord"),
        )
    ]
    nested: dict[str, type] = {}
    for file_name, cls in records:
        if cls is None:
            continue
        out += [f"## {file_name or cls.__name__}", "", _cell((cls.__doc__ or "").strip()), "", _fields_table(cls), ""]
        for hint in typing.get_type_hints(cls).values():
            for arg in (hint, *typing.get_args(hint), *[a for h in typing.get_args(hint) for a in typing.get_args(h)]):
                if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                    nested[arg.__name__] = arg
    for name, cls in sorted(nested.items()):
        out += [f"### {name}", "", _cell((cls.__doc__ or "").strip().split("\n\n")[0]), "", _fields_table(cls), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- families


def families_page() -> str:
    families = _defined("FAMILIES", kind="constant") or {}
    coverage_fn = _defined("coverage", kind="function")
    notes_fn = _defined("supported_notes", kind="function")
    rows = []
    for name, family in families.items():
        rows.append(
            [
                f"`{name}`",
                _code(family.routing),
                _code(family.num_experts_field),
                _code(family.top_k_field),
                ", ".join(f"`{s}`" for s in family.shared_experts) or "none",
                _code(", ".join(family.group_fields)) if family.group_fields else "no",
                ", ".join(f"`{s}`" for s in family.dense_layer_fields) or "none",
                _cell(notes_fn(family)) if notes_fn else "",
            ]
        )
    others = [row for row in (coverage_fn() if coverage_fn else []) if row.model_type not in families]
    return "\n".join(
        [
            "# Supported families",
            "",
            f"{len(rows)} transformers MoE families (`model_type` in config.json), from the family table the MoE code "
            "reads. A model of another type is refused before any weight is read, in one line naming the nearest "
            "supported family. How masking and removal work for them: [Masking equals removal](../concepts/masking.md). "
            "`evoesap families` prints the same list for the transformers installed where it runs.",
            "",
            _table(
                [
                    "model_type",
                    "routing",
                    "expert count field",
                    "top-k field",
                    "shared experts",
                    "group-limited routing",
                    "dense-layer fields",
                    "notes",
                ],
                rows,
            ),
            "",
            *served_by_plugin(families),
            "## Other MoE model types of the installed transformers",
            "",
            "Every other `model_type` whose config declares an expert count, and why it is not supported.",
            "",
            _table(
                ["model_type", "expert count field", "reason"],
                [[f"`{r.model_type}`", _code(r.experts_field), _cell(r.reason)] for r in others],
            ),
            "",
        ]
    )


def served_by_plugin(families: Any) -> list[str]:
    """The section of the families page that says, from the evoesap-vllm plugin's own table, which families it serves
    on vLLM and why not the others (the plugin is a separate distribution: its table is read from its source)."""
    import importlib.util

    from transformers import AutoConfig

    source = ROOT / "serving" / "vllm" / "evoesap_vllm" / "families.py"
    spec = importlib.util.spec_from_file_location("_evoesap_vllm_families", source)
    if spec is None or spec.loader is None:
        return []
    plugin = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = plugin  # its dataclass looks its module up while it is defined
    spec.loader.exec_module(plugin)
    served = {f.architecture for f in plugin.FAMILIES}
    rows = []
    for name, family in families.items():
        architecture = family.model_class(AutoConfig.for_model(name)).__name__
        status = "served" if architecture in served else _cell(plugin.NOT_SERVED.get(architecture, "not served"))
        rows.append([f"`{name}`", f"`{plugin.ARCHITECTURE_PREFIX}{architecture}`", status])
    return [
        "## Served on vLLM",
        "",
        f"A non-uniformly pruned checkpoint names its architecture `{plugin.ARCHITECTURE_PREFIX}<class>`; the evoesap-vllm "
        f"plugin serves {len(served)} of these families on vLLM ([Serve with vLLM](../guides/serve-vllm.md)), from its own "
        "table (`serving/vllm/evoesap_vllm/families.py`). A uniformly pruned checkpoint keeps its stock name and runs on "
        "stock vLLM wherever vLLM has the family.",
        "",
        _table(["model_type", "non-uniform architecture", "vLLM plugin"], rows),
        "",
    ]


# ---------------------------------------------------------------- API


API_PACKAGES = ("evoesap", "components", "pipeline")  # components/ and pipeline/ install as evoesap.components, evoesap.pipeline


def api_modules() -> list[str]:
    """The public modules of the package tree, as found on disk now: one API page each."""
    found = []
    for package in API_PACKAGES:
        base = ROOT / package
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if any(p.startswith("_") and p != "__init__" for p in parts) or "templates" in parts:
                continue
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def api_pages() -> dict[str, str]:
    modules = api_modules()
    pages = {f"reference/api/{m}.md": f"# `{m}`\n\n::: {m}\n" for m in modules}
    index = [
        "# Python API",
        "",
        "One page per module, from the package tree and the modules' docstrings. `components` and `pipeline` are "
        "top-level folders of the repository that install as `evoesap.components` and `evoesap.pipeline`.",
        "",
    ]
    index += [f"- [`{m}`]({m}.md)" for m in modules]
    pages["reference/api/index.md"] = "\n".join(index) + "\n"
    return pages


def changelog_page() -> str:
    """The repository's CHANGELOG.md, its links made relative to the docs."""
    return (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").replace("](docs/", "](")


def reference_pages() -> dict[str, str]:
    """Every generated page: docs path -> Markdown."""
    pages = {
        "changelog.md": changelog_page(),
        "reference/stages.md": stages_page(),
        "reference/parameters.md": parameters_page(),
        "reference/cli.md": cli_page(),
        "reference/pipeline-yaml.md": pipeline_yaml_page(),
        "reference/components.md": components_page(),
        "reference/artifacts.md": artifacts_page(),
        "reference/families.md": families_page(),
    }
    pages.update(api_pages())
    return pages


# ---------------------------------------------------------------- the MkDocs hook


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, content in reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
