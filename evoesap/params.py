"""Stage parameters, each declared once: a dataclass field carries its default and its meaning.

The CLI options (`evoesap.cli.stages`), the pipeline YAML's stage sections, the KFP components'
`params` documentation and the Python API all read the same fields, so a name, a default or a help
text can only be written in one place. `make` builds a stage's parameters from plain values (a YAML
section, a KFP dict, CLI options) with the one coercion that orchestrators need.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from evoesap.errors import ConfigError

_HELP = "help"
_KEYED = "keyed"
_BOUNDS = "bounds"
_UNSET = "unset"
_FINITE = "finite"
_OPERATORS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def param(
    default: Any,
    help: str,  # noqa: A002 - the word every CLI library uses
    keyed: bool = True,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    unset: str | None = None,
    finite: bool = True,
) -> Any:
    """A parameter field: its default and the one sentence that documents it everywhere. `keyed=False`: how the
    stage runs, not what it makes (the artifact is the same for every value), so it stays out of the reuse key.
    `ge`/`gt`/`le`/`lt`: the range of a number (None always passes); the choices of a word are its type
    (`Literal[...]`). Both are checked on construction (`check_declared`) and shown by the CLI's --help and the
    components' docs. `unset`: the class attribute giving what None means for this stage (`DEFAULT_SAMPLES`).
    `finite=False`: a number field that may be NaN or infinite (by default both are refused: no range check can
    hold them, and no JSON record can)."""
    bounds = {k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt}.items() if v is not None}
    metadata = {_HELP: help, _KEYED: keyed, _BOUNDS: bounds, _UNSET: unset, _FINITE: finite}
    return dataclasses.field(default=default, metadata=metadata)


def bounds_of(field: dataclasses.Field) -> dict[str, float]:
    """The declared range of a number field: {"ge": 1, "lt": 1, ...}."""
    return dict(field.metadata.get(_BOUNDS, {}))


def choices_of(field_type: Any) -> tuple[Any, ...]:
    """The values a `Literal[...]` field (or `Literal[...] | None`) may take; () for any other field."""
    if typing.get_origin(field_type) is typing.Literal:
        return typing.get_args(field_type)
    return tuple(c for arg in typing.get_args(field_type) for c in choices_of(arg))


def range_of(field: dataclasses.Field) -> str:
    """The declared range of a number field in words (`> 0 and < 1`); "" when there is none."""
    return " and ".join(f"{_OPERATORS[op]} {value:g}" for op, value in bounds_of(field).items())


def constraint(field: dataclasses.Field, field_type: Any) -> str:
    """The declared choices or range in words (`one of esap, sap`, `> 0 and < 1`); "" when there are none."""
    choices = choices_of(field_type)
    if choices:
        return "one of " + ", ".join(map(str, choices))
    return range_of(field)


def effective_default(params_class: type, field: dataclasses.Field) -> Any:
    """What the field's default means for this stage: the class's `unset` attribute where the default is None."""
    unset = field.metadata.get(_UNSET)
    return getattr(params_class, unset) if unset and field.default is None else field.default


def describe(params_class: type, field: dataclasses.Field, field_type: Any) -> str:
    """The field's help with its declared choices or range and, where None stands for a per-stage default, that
    default: the one text the CLI, the YAML reference and the components' docs show."""
    text = help_of(field)
    rule = constraint(field, field_type)
    extra = [rule] if rule else []
    if field.metadata.get(_UNSET) and field.default is None:
        extra.append(f"unset here: {effective_default(params_class, field)}")
    return f"{text} [{'; '.join(extra)}]" if extra else text


def check_declared(params: Any) -> None:
    """Each field against its declared choices, range and finiteness: the first offender refused in one line."""
    hints = typing.get_type_hints(type(params))
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value) and field.metadata.get(_FINITE, True):
            raise ConfigError(f"{field.name} must be a finite number, got {value!r}")
        choices = choices_of(hints[field.name])
        if choices and value not in choices:
            raise ConfigError(f"{field.name} {value!r} is not one of {', '.join(map(str, choices))}")
        for op, limit in bounds_of(field).items():
            ok = {"ge": value >= limit, "gt": value > limit, "le": value <= limit, "lt": value < limit}[op]
            if not ok:
                raise ConfigError(f"{field.name} must be {constraint(field, hints[field.name])}, got {value!r}")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", tuple: "array", type(None): "null"}
_JSON_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def json_schema(params_class: type, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a stage's parameters as a configuration section writes them: each field's type, default,
    description (`describe`), choices (`enum`) and range (`minimum`, `exclusiveMaximum`, ...), unknown keys refused;
    for editors and the docs (the dataclass itself still validates). `exclude`: fields set elsewhere (the grid's)."""
    hints = typing.get_type_hints(params_class)
    properties = {}
    for field in dataclasses.fields(params_class):
        if field.name in exclude:
            continue
        found = kinds(hints[field.name])
        types = [_JSON_TYPES[kind] for kind in _JSON_TYPES if kind in found]
        if tuple in found:
            types.append("string")  # a comma-separated list (`make`)
        schema: dict[str, Any] = {}
        if found <= set(_JSON_TYPES):  # a type JSON has no name for is left open
            schema["type"] = types[0] if len(types) == 1 else types
        if tuple in found:
            schema["items"] = {"type": "string"}
        choices = choices_of(hints[field.name])
        if choices:
            schema["enum"] = [*choices, *([None] if type(None) in found else [])]
        schema.update({_JSON_BOUNDS[op]: limit for op, limit in bounds_of(field).items()})
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        schema.update(default=default, description=describe(params_class, field, hints[field.name]))
        properties[field.name] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


TOOLS = "tools"  # the key of the outside tools' versions in a keyed parameter record


def keyed(params: Any) -> dict[str, Any]:
    """The parameters that determine a stage's artifact: its reuse key and its manifest's record. A stage that runs
    a tool from an environment of its own (`evoesap.machine.side_env`) adds that tool's versions (its parameter class's
    `tool_versions()`), so a new version makes the artifact again."""
    from evoesap.store.identity import redact

    values = dataclasses.asdict(params)
    record = {
        f.name: redact(values[f.name]) if isinstance(values[f.name], str) else values[f.name]  # no user:password@ kept
        for f in dataclasses.fields(params)
        if f.metadata.get(_KEYED, True)
    }
    tools = getattr(params, "tool_versions", None)
    return {**record, TOOLS: tools()} if tools is not None else record


def help_of(field: dataclasses.Field) -> str:
    """The documented meaning of a parameter field; a field declared without one is a programming error."""
    if _HELP not in field.metadata:
        raise TypeError(f"parameter field {field.name!r} has no help: declare it with evoesap.params.param")
    return field.metadata[_HELP]


def kinds(field_type: Any) -> set[Any]:
    """The plain types a field accepts (`int | None` -> {int, NoneType}; `tuple[str, ...]` -> {tuple};
    `Literal["a", "b"]` -> {str})."""
    if typing.get_origin(field_type) is tuple:
        return {tuple}
    if typing.get_origin(field_type) is typing.Literal:
        return {type(choice) for choice in typing.get_args(field_type)}
    args = typing.get_args(field_type)
    return set().union(*(kinds(arg) for arg in args)) if args else {field_type}


def make(params_class: type, values: Mapping[str, Any], where: str) -> Any:
    """`params_class` from plain values: unknown names refused with the valid ones listed, values a
    config would otherwise coerce silently (2.7 or true for an integer, "yes" for a switch) refused, whole
    floats turned into integers (some orchestrators deliver every number as a float), a comma-separated
    string accepted for a list."""
    hints = typing.get_type_hints(params_class)
    names = [f.name for f in dataclasses.fields(params_class)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {', '.join(unknown)} for stage {where!r}; valid: {', '.join(sorted(names))}")
    coerced = {name: _coerce(f"{where}.{name}", kinds(hints[name]), value) for name, value in values.items()}
    try:
        return params_class(**coerced)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid parameters for stage {where!r}: {exc}") from exc


def _coerce(name: str, allowed: set[Any], value: Any) -> Any:
    if value is None and type(None) in allowed:
        return None
    if tuple in allowed:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{name} must be a list of names (or one comma-separated string), got {value!r}")
        return tuple(i.strip() for i in items if i.strip())
    if int in allowed and str in allowed and isinstance(value, str):  # an integer or a word ("auto")
        digits = value.strip()
        return int(digits) if digits.isascii() and digits.isdigit() else value  # not "²", which isdigit() takes
    if str in allowed and isinstance(value, str):
        return value
    if bool in allowed:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if int in allowed and float not in allowed:
        whole = isinstance(value, float) and value.is_integer()
        if not (isinstance(value, int) and not isinstance(value, bool) or whole):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(value)
    if float in allowed:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{name} {value} is too large for a number: give a finite one") from None
    if str in allowed:  # a text field takes text only (its JSON schema says so): 2024 or true would pass unread
        raise ConfigError(f"{name} must be a string, got {value!r:.80}: quote it")
    return value


# ---------------------------------------------------------------- fields shared by several stages


@dataclasses.dataclass(frozen=True)
class StageParams:
    """The base of every stage's parameters: each field's declared choices and range (`check_declared`), then the
    checks no single stage owns (`evoesap.machine.bounds`), run last."""

    def __post_init__(self) -> None:
        from evoesap.machine.bounds import check_params

        check_declared(self)
        check_params(self)


@dataclasses.dataclass(frozen=True)
class SampleParams(StageParams):
    """Which samples a data-reading stage draws from its data, and how they are read."""

    DEFAULT_SAMPLES: ClassVar[int] = 64

    samples: int | None = param(
        None,
        "Samples drawn from the data; unset: the stage's default count, or every row of a smaller file "
        "(with a warning). A count larger than the file is refused.",
        ge=1,
        unset="DEFAULT_SAMPLES",
    )
    max_length: int = param(2048, "Tokens per sample (truncated from the end, or per packed sequence).", ge=2)
    batch_size: int = param(8, "Sequences per forward.", ge=1)
    seed: int = param(0, "Seed of the sample selection: which samples are drawn.")
    split: str = param("train", "Dataset split (hub datasets, or a JSON object keyed by split).")
    subset: str | None = param(None, "Hub dataset configuration name.")
    messages_field: str = param("messages", "Field with chat turns [{role, content}].")
    prompt_field: str | None = param(None, "Field with the prompt, the user turn (with response_field).")
    response_field: str | None = param(None, "Field with the answer, the assistant turn (with prompt_field).")
    text_field: str | None = param(None, "Field with plain text; every token counts.")
    enable_thinking: bool = param(False, "Passed to the chat template (the switch of reasoning models).")

    def __post_init__(self) -> None:
        self.fields  # noqa: B018 - field combinations are checked here, not after the model has loaded
        super().__post_init__()  # the next parameter group's checks, StageParams' last

    @property
    def sample_count(self) -> int:
        """The samples asked for: `samples`, else the stage's default."""
        return self.samples if self.samples is not None else self.DEFAULT_SAMPLES

    @property
    def fields(self) -> Any:
        from evoesap.data import FieldMap

        return FieldMap(
            messages=self.messages_field, prompt=self.prompt_field, response=self.response_field, text=self.text_field
        )


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies
DeviceMap = Literal[DEVICE_MAPS]
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]  # auto: the checkpoint's own (machine.runtime.MODEL_DTYPES)


@dataclasses.dataclass(frozen=True)
class DeviceParams(StageParams):
    """Where and in which dtype a stage runs its model."""

    model_dtype: ModelDtype = param("auto", "Model dtype: auto is the checkpoint's own.")
    device: str = param("auto", "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...")
    device_map: DeviceMap | None = param(
        None, "How accelerate spreads a model too large for one GPU over several (auto); unset: the model on device."
    )


@dataclasses.dataclass(frozen=True)
class PlacementParams(DeviceParams):
    """A stage that places the model itself (`runtime.load_model`): how much of each GPU it may fill, and whether
    what does not fit may wait in host memory."""

    # where the weights sit, not what the stage computes: out of the reuse key
    max_memory: str | None = param(
        None, "With device_map: the most each GPU may hold of the model, e.g. 70GB (room for activations).", keyed=False
    )
    offload: bool = param(
        False,
        "With device_map: layers that fit on no GPU wait in host memory and cross PCIe every forward "
        "(evoesap plan says how slow); without it such a model is refused.",
        keyed=False,
    )

    def __post_init__(self) -> None:
        from evoesap.machine.sizes import parse_bytes

        if (self.max_memory is not None or self.offload) and self.device_map is None:
            raise ConfigError("max_memory and offload say how device_map places the model: set device_map: auto as well")
        if self.max_memory is not None and parse_bytes(self.max_memory) <= 0:
            raise ConfigError(f"max_memory must be a positive size such as 70GB, got {self.max_memory!r}")
        super().__post_init__()

    @property
    def placement(self) -> dict[str, Any]:
        """`runtime.load_model`'s placement arguments."""
        return {"device": self.device, "device_map": self.device_map, "max_memory": self.max_memory, "offload": self.offload}
