"""Choices and ranges declared with a parameter field (`evoesap.params.param`, `Literal`): the same declaration
refuses a bad value on construction, shows in `--help` and in the components' docs."""

import dataclasses
import typing

import pytest
from click.testing import CliRunner
from evoesap.components.interface import params_description

from evoesap import params as parameters
from evoesap.cli import command, main
from evoesap.errors import ConfigError
from evoesap.registry import STAGES
from evoesap.scoring.criteria import CRITERIA

BOUNDED = [
    (stage.name, field.name, op, limit)
    for stage in STAGES
    for field in dataclasses.fields(stage.params_class())
    for op, limit in parameters.bounds_of(field).items()
]


def _outside(op: str, limit: float, kind: set) -> float:
    step = 1 if int in kind and float not in kind else 1e-9
    return {"ge": limit - step, "gt": limit, "le": limit + step, "lt": limit}[op]


@pytest.mark.parametrize(("stage", "name", "op", "limit"), BOUNDED)
def test_a_value_outside_the_declared_range_is_refused_naming_the_field(stage, name, op, limit):
    cls = next(s for s in STAGES if s.name == stage).params_class()
    kind = parameters.kinds(typing.get_type_hints(cls)[name])
    bad = _outside(op, limit, kind)
    with pytest.raises(ConfigError, match=rf"^{name} must be .*, got {bad!r}$"):
        cls(**{name: bad})
    with pytest.raises(ConfigError, match=rf"{name} must be"):  # the YAML / KFP path: the same declaration
        parameters.make(cls, {name: bad}, stage)


def test_the_declared_bounds_cover_the_checks_they_replaced():
    assert {(s, n) for s, n, _, _ in BOUNDED} >= {
        ("search", "sparsity"), ("search", "heldout_fraction"), ("search", "elites"), ("search", "generations"),
        ("search", "max_transfer"), ("search", "max_steps"), ("search", "workers"), ("search", "gpus_per_worker"),
        ("search", "prefix_cache_bytes"), ("prune", "sparsity"), ("prune", "granularity"),
        ("calibrate", "samples"), ("calibrate", "batch_size"), ("calibrate", "max_length"),
    }  # fmt: skip


def test_a_value_outside_the_declared_choices_is_refused():
    search = next(s for s in STAGES if s.name == "search").params_class()
    with pytest.raises(ConfigError, match="^criterion 'rep' is not one of frequency, seer, ean, reap$"):
        search(criterion="rep")
    with pytest.raises(ConfigError, match="metric 'tv' is not one of esap, sap, kl, nll"):
        parameters.make(search, {"metric": "tv"}, "search")
    assert search(criterion="seer", metric="kl", sparsity=0.5).criterion == "seer"


def test_the_declared_choices_are_the_library_s_own_names():
    from evoesap.scoring.importance import COLUMNS
    from evoesap.scoring.metrics import METRICS

    hints = typing.get_type_hints(next(s for s in STAGES if s.name == "search").params_class())
    assert parameters.choices_of(hints["metric"]) == tuple(METRICS)
    assert parameters.choices_of(hints["criterion"]) == CRITERIA
    assert set(CRITERIA) < set(COLUMNS)


@pytest.mark.parametrize("stage", ["calibrate", "search", "prune", "evaluate"])
def test_model_dtypes_and_device_maps_are_declared_choices_that_the_loader_knows(stage):
    from evoesap.machine.runtime import MODEL_DTYPES

    cls = next(s for s in STAGES if s.name == stage).params_class()
    hints = typing.get_type_hints(cls)
    assert parameters.choices_of(hints["model_dtype"]) == tuple(MODEL_DTYPES)
    with pytest.raises(ConfigError, match="model_dtype 'fp8' is not one of auto, bfloat16, float16, float32$"):
        parameters.make(cls, {"model_dtype": "fp8"}, stage)
    if "device_map" in hints:
        assert parameters.choices_of(hints["device_map"]) == parameters.DEVICE_MAPS
        with pytest.raises(ConfigError, match="device_map 'cuda:0' is not one of auto, balanced"):
            parameters.make(cls, {"device_map": "cuda:0"}, stage)


def test_cache_modes_dtypes_and_evaluate_backends_are_declared_choices_of_the_library_s_own_names(capsys):
    from evoesap.evaluation.lmeval import BACKENDS
    from evoesap.scoring.teacher import DTYPES, MODES

    cache, evaluate = (next(s for s in STAGES if s.name == n).params_class() for n in ("cache-logits", "evaluate"))
    cache_hints, evaluate_hints = typing.get_type_hints(cache), typing.get_type_hints(evaluate)
    assert parameters.choices_of(cache_hints["mode"]) == MODES == ("full", "topk")
    assert parameters.choices_of(cache_hints["dtype"]) == tuple(DTYPES) == ("float16", "float32")
    assert parameters.choices_of(evaluate_hints["backend"]) == BACKENDS == ("hf", "vllm")
    runner = CliRunner()
    cache_help = " ".join(runner.invoke(command(), ["cache-logits", "--help"], terminal_width=200).output.split())
    assert "--mode [full|topk]" in cache_help and "--dtype [float16|float32]" in cache_help
    evaluate_help = " ".join(runner.invoke(command(), ["evaluate", "--help"], terminal_width=200).output.split())
    assert "--backend [hf|vllm]" in evaluate_help
    assert "[one of full, topk]" in params_description("cache-logits") and "[one of hf, vllm]" in params_description("evaluate")
    with pytest.raises(ConfigError, match="^dtype 'bfloat16' is not one of float16, float32$"):
        cache(dtype="bfloat16")
    with pytest.raises(ConfigError, match="backend 'tgi' is not one of hf, vllm"):
        parameters.make(evaluate, {"backend": "tgi"}, "evaluate")
    with pytest.raises(ConfigError, match="^top_k must be at least 1 for mode topk, got 0$"):  # the cross-field rule
        cache(mode="topk", top_k=0)
    assert cache(mode=None).mode is None  # unset: chosen by the machine (footprint.cache_mode)
    args = ["cache-logits", "--model", "m", "--data", "d", "--out", "o"]
    assert main([*args, "--mode", "top"]) == 2 and "'top' is not one of 'full', 'topk'" in capsys.readouterr().err


def test_unset_passes_the_range_and_means_the_stage_s_default():
    defaults = {"calibrate": 1024, "cache-logits": 64, "quantize": 256}
    for stage in STAGES:
        cls = stage.params_class()
        if "samples" not in {f.name for f in dataclasses.fields(cls)}:
            continue
        assert cls(samples=None).sample_count == defaults.pop(stage.name)
        field = next(f for f in dataclasses.fields(cls) if f.name == "samples")
        assert parameters.effective_default(cls, field) == cls.DEFAULT_SAMPLES
    assert defaults == {}


def test_help_shows_choices_ranges_and_the_stage_s_defaults():
    runner = CliRunner()
    text = " ".join(runner.invoke(command(), ["search", "--help"], terminal_width=200).output.split())
    assert "--criterion [frequency|seer|ean|reap]" in text
    assert "--metric [esap|sap|kl|nll]" in text
    assert "Global share of routed experts removed. [default: 0.25; 0<x<1]" in text
    assert "[default: 4; x>=1]" in text
    for stage, count in (("calibrate", 1024), ("cache-logits", 64), ("quantize", 256)):
        text = " ".join(runner.invoke(command(), [stage, "--help"], terminal_width=200).output.split())
        assert f"[default: ({count}); x>=1]" in text, stage


def test_a_value_out_of_range_on_the_command_line_is_a_usage_error(capsys):
    args = ["search", "--model", "m", "--scores", "s", "--cache", "c", "--out", "o"]
    assert main([*args, "--sparsity", "1.5"]) == 2
    assert "1.5 is not in the range 0<x<1" in capsys.readouterr().err
    assert main([*args, "--criterion", "rep"]) == 2
    assert "'rep' is not one of 'frequency', 'seer', 'ean', 'reap'" in capsys.readouterr().err


def test_the_components_docs_show_choices_ranges_and_the_stage_s_defaults():
    assert "criterion (str, default 'reap'): Importance criterion" in params_description("search")
    assert "[one of frequency, seer, ean, reap]" in params_description("search")
    assert "sparsity (float, default 0.25): Global share of routed experts removed. [> 0 and < 1]" in params_description("search")
    assert "[>= 1; unset here: 1024]" in params_description("calibrate")
    assert "[>= 1; unset here: 256]" in params_description("quantize")


def test_publish_parameters_get_the_checks_every_stage_shares(monkeypatch):
    publish = next(s for s in STAGES if s.name == "publish").params_class()
    with pytest.raises(ConfigError, match="^digits must be >= 1 and <= 8, got 9$"):
        publish(digits=9)
    checked = []
    monkeypatch.setattr("evoesap.machine.bounds.check_params", checked.append)
    made = publish(digits=4)
    assert checked == [made]  # machine.bounds.check_params ran on it, as on every stage's parameters


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_a_section_s_json_schema_and_its_dataclass_agree_on_choices_ranges_and_keys(stage):
    """The schema an editor checks a YAML section with refuses what the dataclass refuses, and accepts the defaults."""
    import jsonschema

    cls = stage.params_class()
    schema = parameters.json_schema(cls, exclude=stage.grid)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = jsonschema.Draft202012Validator(schema)
    fields = [f for f in dataclasses.fields(cls) if f.name not in stage.grid]
    assert list(schema["properties"]) == [f.name for f in fields]
    defaults = {name: prop["default"] for name, prop in schema["properties"].items()}
    assert (
        valid.is_valid(defaults) and parameters.make(cls, defaults, stage.name) == cls()
    )  # the schema's defaults: the dataclass's
    assert not valid.is_valid({"no_such_key": 1})
    hints = typing.get_type_hints(cls)
    for field in fields:
        kind = parameters.kinds(hints[field.name])
        for op, limit in parameters.bounds_of(field).items():
            bad = _outside(op, limit, kind)
            assert not valid.is_valid({field.name: bad}), (field.name, bad)
            with pytest.raises(ConfigError):
                cls(**{field.name: bad})
        if parameters.choices_of(hints[field.name]):
            assert not valid.is_valid({field.name: "no-such-choice"}), field.name
            with pytest.raises(ConfigError):
                cls(**{field.name: "no-such-choice"})


FLOATS = [
    (stage.name, field.name)
    for stage in STAGES
    for field in dataclasses.fields(stage.params_class())
    if float in parameters.kinds(typing.get_type_hints(stage.params_class())[field.name])
]


@pytest.mark.parametrize(("stage", "name"), FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_number_field_refuses_nan_and_infinity(stage, name, value):
    """No range holds NaN, and a record cannot hold either (JSON has neither): refused on construction."""
    from evoesap.steps import make_params

    grid = {"criterion": "reap", "sparsity": 0.5} if stage in ("search", "prune") else {}
    with pytest.raises(ConfigError, match=f"{name} must be (a finite number|positive), got {value}"):
        make_params(stage, {**grid, name: value})


def test_a_number_field_declared_non_finite_takes_infinity():
    @dataclasses.dataclass(frozen=True)
    class Limits(parameters.StageParams):
        cap: float = parameters.param(1.0, "A cap; inf: none.", ge=0, finite=False)
        rate: float = parameters.param(1.0, "A rate.", ge=0)

    assert Limits(cap=float("inf")).cap == float("inf")
    with pytest.raises(ConfigError, match="rate must be a finite number, got inf"):
        Limits(rate=float("inf"))


def test_gate_refuses_an_infinite_threshold_on_the_command_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gate"
    argv = ["gate", "--evaluation", str(tmp_path / "e"), "--full-evaluation", str(tmp_path / "f"), "--out", str(out)]
    assert main([*argv, "--max-task-drop", "inf"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and line.endswith("max_task_drop must be a finite number, got inf"), line
    assert not out.exists()


@pytest.mark.parametrize(("field", "value"), [("split", 2024), ("device", True), ("messages_field", ["a"])])
def test_a_text_field_refuses_what_is_not_text(field, value):
    from evoesap.steps import make_params

    with pytest.raises(ConfigError, match=f"calibrate.{field} must be a string, got"):
        make_params("calibrate", {field: value})


def test_digits_python_reads_but_int_does_not_stay_text():
    from evoesap.steps import make_params

    assert make_params("evaluate", {"batch_size": " 16 "}).batch_size == 16
    with pytest.raises(ConfigError, match="batch_size"):  # "²" is a digit to str.isdigit, not to int()
        make_params("evaluate", {"batch_size": "²"})
