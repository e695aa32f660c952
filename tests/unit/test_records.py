"""Typed records: every record survives JSON and back, documents written by the earlier dict-building writers parse
and re-serialise to the same bytes, and a bad field is refused naming the file, the field and the rebuild."""

from __future__ import annotations

import ast
import dataclasses
import json
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap import records
from evoesap.errors import ArtifactError
from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[2]
RECORDS = (
    records.AllocationRecord,
    records.PruningRecord,
    records.MetricsRecord,
    records.QuantizationRecord,
    records.GateRecord,
    records.TargetRecord,
)


def strategy(kind: Any) -> st.SearchStrategy:
    """Any value of an annotation, every optional field drawn too (present or None); floats finite or whole ints."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        return st.one_of(*[strategy(a) for a in args])
    if kind is type(None):
        return st.none()
    if isinstance(kind, type) and issubclass(kind, records.Record):
        hints = get_type_hints(kind)
        return st.builds(kind, **{f.name: strategy(hints[f.name]) for f in dataclasses.fields(kind)})
    if origin is tuple:
        return st.lists(strategy(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(strategy(args[0]), strategy(args[1]), max_size=3)
    return {int: st.integers(), float: st.floats(allow_nan=False) | st.integers(), str: st.text(), bool: st.booleans()}[kind]


def text(document: dict[str, Any]) -> str:
    """A document's file text as the writers have always made it: json.dumps, indent 2, sorted keys."""
    return json.dumps(document, indent=2, sort_keys=True)


@pytest.mark.parametrize("kind", RECORDS, ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_record_survives_json_text_and_back(kind, data):
    record = data.draw(strategy(kind))
    assert kind.from_json(json.loads(text(record.to_json())), kind.FILE) == record


# Documents as the stages wrote them before the records were typed: the same keys, value types and nesting.
# Layers 0..10 so that "10" sorts before "2" in the text, as sort_keys always put it.
ALLOCATION = {
    "criterion": "reap",
    "sparsity": 0.25,
    "metric": "esap",
    "budget": 22,
    "granularity": 1,
    "num_experts": [8] * 11,
    "top_k": [2] * 11,
    "min_kept": [2] * 11,
    "removal_counts": [2] * 11,
    "pruned": {str(layer): [layer % 8, (layer + 3) % 8] for layer in range(11)},
    "fitness": 0.912345678901,
    "searched": {"removal_counts": [3, 1] + [2] * 9, "fitness": 0.9001},
    "uniform": {"removal_counts": [2] * 11, "fitness": 0.912345678901},
    "fallback_applied": True,
    "heldout": {
        "samples": 16,
        "searched": 0.8,
        "uniform": 0.81,
        "difference": -0.01,
        "stderr": None,
        "beats_uniform": False,
        "searched_stderr": 0.004,
    },
    "warnings": ["searched allocation does not beat uniform on held-out samples: ..."],
    "evaluations": 130,
    "search_samples": 48,
    "heldout_samples": 16,
}
WORK = {
    "full_forward_equivalents": 31.25,
    "full_forward_equivalents_per_candidate": 0.240384615384,
    "candidates": 130,
    "full_set_evaluations": 41,
    "stopped_early": 95,
    "stopped_at": {"4": 60, "8": 30, "16": 5},
    "racing": "statistical",
    "racing_delta": 0.05,
    "racing_tolerance": 0.0,
    "resumed": False,
    "screened": 12,
}
PRUNING = {
    "method": "searched",
    "criterion": "frequency",
    "sparsity": 0.5,
    "removal_counts": [4, 0, 6, 6],
    "pruned": {"0": [0, 1, 2, 3], "1": [], "2": [0, 1, 2, 3, 4, 5], "3": [2, 3, 4, 5, 6, 7]},
    "num_experts": [4, 8, 2, 2],
    "parameter_bytes_full": 123456789,
    "parameter_bytes_pruned": 98765432,
}
METRICS = {
    "schema": 1,
    "model": "s3://bucket/runs/pruned",
    "labels": {"criterion": "reap", "sparsity": 0.25, "method": "searched"},
    "records": [
        {
            "task": "gsm8k",
            "domain": "math",
            "metric": "exact_match",
            "filter": "strict-match",
            "value": 0.25,
            "stderr": 0.0125,
            "samples": 48,
            "primary": True,
        },
        {
            "task": "gsm8k",
            "domain": "math",
            "metric": "exact_match",
            "filter": "flexible-extract",
            "value": 1.0,
            "stderr": None,
            "samples": None,
            "primary": False,
        },
    ],
    "memory": {"parameters": 1000, "parameter_bytes": 4000, "bf16_bytes": 2000, "checkpoint_bytes": 4096},
    "experts": {"family": "olmoe", "num_experts": [6, 6], "top_k": [2, 2], "decoder_index": [0, 1]},
    "heldout_esap": {"esap": 0.93, "esap_upper": 0.95, "samples": 4},
    "limit": 48,  # a config's 48 stays an int, 48.0 stays a float
    "quantization": None,
}
QUANTIZATION = {
    "recipe": "w4a16-gptq",
    "scheme": "W4A16",
    "algorithm": "gptq",
    "calibration_samples": 8,
    "architectures": ["OlmoeForCausalLM"],
    "num_experts_per_layer": {"0": 6, "1": 8, "10": 4},
    "checkpoint_bytes_before": 5000000,
    "checkpoint_bytes_after": 1500000,
    "versions": {"llmcompressor": "0.14.0", "torch": "2.9.1"},
}
WRITTEN = [
    (records.AllocationRecord, ALLOCATION),
    (records.AllocationRecord, {**ALLOCATION, "heldout": None, "warnings": [], "fallback_applied": False}),
    (records.AllocationRecord, {**ALLOCATION, "heldout": {**ALLOCATION["heldout"], "searched_stderr": None}}),
    (records.PruningRecord, PRUNING),
    (records.MetricsRecord, METRICS),
    (records.MetricsRecord, {**METRICS, "labels": {"criterion": None, "sparsity": None, "method": "full"}, "limit": 0.5}),
    (records.MetricsRecord, {**METRICS, "heldout_esap": None, "limit": None}),
    (records.MetricsRecord, {**METRICS, "quantization": {"recipe": "fp8-dynamic", "scheme": "FP8_DYNAMIC"}}),
    (records.QuantizationRecord, QUANTIZATION),
    (records.QuantizationRecord, {**QUANTIZATION, "num_experts_per_layer": None, "calibration_samples": 0}),
]


@pytest.mark.parametrize("kind, document", WRITTEN, ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_a_document_the_earlier_writers_made_reads_and_writes_back_byte_identical(kind, document, tmp_path):
    record = kind.from_json(json.loads(text(document)), kind.FILE)
    records.write(tmp_path, record)
    assert (tmp_path / kind.FILE).read_text() == text(document)


def test_read_checks_the_manifest_then_gives_the_typed_record(tmp_path):
    with artifacts.stage_output(str(tmp_path / "prune"), "prune", {}, {}) as staging:
        (staging / records.PRUNING_FILE).write_text(text(PRUNING))
    record = records.read(str(tmp_path / "prune"), records.PruningRecord)
    assert record.pruned == {0: (0, 1, 2, 3), 1: (), 2: (0, 1, 2, 3, 4, 5), 3: (2, 3, 4, 5, 6, 7)}
    assert record.num_experts == (4, 8, 2, 2) and record.parameter_bytes_pruned == 98765432
    with pytest.raises(ArtifactError, match="is a 'prune' artifact, not 'search'"):
        records.read(str(tmp_path / "prune"), records.AllocationRecord)
    (tmp_path / "prune" / records.PRUNING_FILE).write_text(text({**PRUNING, "method": "uniform"}))
    with pytest.raises(ArtifactError, match="pruning.json does not match the sha256"):
        records.read(str(tmp_path / "prune"), records.PruningRecord)


@pytest.mark.parametrize(
    "edit, field, problem",
    [
        (lambda d: d["removal_counts"].__setitem__(1, True), "removal_counts[1]", "must be an int, got True"),
        (lambda d: d["removal_counts"].__setitem__(0, 2.0), "removal_counts[0]", "must be an int, got 2.0"),
        (lambda d: d.__setitem__("sparsity", "0.25"), "sparsity", "must be a float, got '0.25'"),
        (lambda d: d.pop("pruned"), "pruned", "is missing"),
        (lambda d: d["pruned"].__setitem__("first", [1]), "pruned", "keys must be integers, got 'first'"),
        (lambda d: d["heldout"].pop("beats_uniform"), "heldout.beats_uniform", "is missing"),
        (lambda d: d["uniform"].__setitem__("fitness", None), "uniform.fitness", "must be a float, got None"),
        (lambda d: d.__setitem__("warnings", "one"), "warnings", "must be a list, got 'one'"),
    ],
)
def test_a_bad_field_is_refused_naming_the_file_the_field_and_the_rebuild(edit, field, problem):
    document = json.loads(text(ALLOCATION))
    edit(document)
    with pytest.raises(ArtifactError) as caught:
        records.AllocationRecord.from_json(document, "runs/search/allocation.json")
    assert str(caught.value) == (f"runs/search/allocation.json: field {field!r} {problem}: rebuild it with `evoesap search`")


def test_fields_an_older_or_hand_written_allocation_lacks_take_the_defaults_readers_fell_back_to():
    """The report rebuilds warnings that searches before them lacked; prune needs only the allocation itself."""
    older = {k: v for k, v in ALLOCATION.items() if k != "warnings"}
    assert records.AllocationRecord.from_json(older, "a").warnings is None
    by_hand = {"criterion": "reap", "sparsity": 0.25, "removal_counts": [1, 0], "pruned": {"0": [3], "1": []}}
    record = records.AllocationRecord.from_json({**by_hand, "note": "keys it does not know are ignored"}, "a")
    assert (record.granularity, record.heldout, record.fallback_applied) == (1, None, None)
    assert record.pruned == {0: (3,), 1: ()}


def test_metrics_without_labels_read_as_unlabelled():
    unlabelled = {k: v for k, v in METRICS.items() if k != "labels"}
    assert records.MetricsRecord.from_json(unlabelled, "m").labels == records.Labels(None, None, None)


def test_metrics_written_before_checkpoint_bytes_and_quantization_were_recorded_read_as_unknown():
    memory = {k: v for k, v in METRICS["memory"].items() if k != "checkpoint_bytes"}
    older = {**{k: v for k, v in METRICS.items() if k != "quantization"}, "memory": memory}
    record = records.MetricsRecord.from_json(older, "m")
    assert record.memory.checkpoint_bytes is None and record.quantization is None


def test_no_scoring_module_imports_a_stage():
    """The scorer reads records from evoesap.records; a stage is never a library for it."""
    for path in sorted((ROOT / "evoesap" / "scoring").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module for a in n.names]
        assert not [m for m in names if m.startswith("evoesap.stages")], (path.name, names)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_record_holding_a_non_finite_number_is_refused_naming_the_field_and_nothing_is_written(tmp_path, bad):
    """Python's json would write NaN / -Infinity, which are not JSON: other readers (jq, JavaScript) refuse them."""
    check = records.GateCheck(name="task recall vs full", value=0.5, reference=0.6, limit=bad, passed=False)
    record = records.GateRecord(passed=False, candidate="s3://b/m", checks=(check,))
    out = tmp_path / "gate"
    refused = pytest.raises(ArtifactError, match=r"gate.json: checks\[0\]\.limit is not a finite number")
    with refused, artifacts.stage_output(str(out), "gate", {}, {}) as staging:
        records.write(staging, record)
    assert not out.exists()


def test_a_manifest_holding_a_non_finite_number_is_refused_and_nothing_is_published(tmp_path):
    out = tmp_path / "search"
    refused = pytest.raises(ArtifactError, match=r"manifest.json: run.seconds is not a finite number")
    with refused, artifacts.stage_output(str(out), "search", {}, {}, run={"seconds": float("inf")}) as staging:
        (staging / "a.txt").write_text("a")
    assert not out.exists()


DEEP = "[" * 100_000 + "]" * 100_000  # past any parser's recursion limit


def test_a_record_nested_too_deeply_is_refused_as_an_artifact_error(tmp_path):
    out = tmp_path / "evaluate"
    with artifacts.stage_output(str(out), "evaluate", {}, {}) as staging:
        (staging / records.METRICS_FILE).write_text(DEEP)
    with pytest.raises(ArtifactError, match=r"metrics.json: JSON nested too deeply to read.*evoesap evaluate"):
        records.read(str(out), records.MetricsRecord)


def test_a_manifest_nested_too_deeply_is_refused_as_malformed(tmp_path):
    out = tmp_path / "evaluate"
    with artifacts.stage_output(str(out), "evaluate", {}, {}) as staging:
        (staging / "a.txt").write_text("a")
    (out / artifacts.MANIFEST).write_text(DEEP)
    with pytest.raises(ArtifactError, match="manifest.json is malformed .*nests too deeply"):
        artifacts.read_manifest(str(out), "evaluate")


def test_previous_metrics_nested_too_deeply_are_refused_as_an_artifact_error(tmp_path):
    from evoesap.stages.gate import read_metrics

    path = tmp_path / "metrics.json"
    path.write_text(DEEP)
    with pytest.raises(ArtifactError, match="metrics.json: JSON nested too deeply to read .*: give the metrics.json"):
        read_metrics(str(path))


def test_the_search_work_round_trips_with_its_types():
    work = records.SearchWork.from_json(json.loads(json.dumps(WORK)), "manifest.json run.cost")
    assert work.stopped_at == {4: 60, 8: 30, 16: 5}  # sample counts come back as integers
    assert (work.candidates, work.full_set_evaluations, work.racing, work.racing_delta) == (130, 41, "statistical", 0.05)
    assert records.SearchWork.from_json(json.loads(json.dumps(work.to_json())), "x") == work
    off = {**WORK, "racing": "off", "racing_delta": None, "racing_tolerance": None, "screened": 0}
    assert records.SearchWork.from_json(off, "x").to_json() == off
    before_screening = {key: value for key, value in WORK.items() if key != "screened"}
    assert records.SearchWork.from_json(before_screening, "x").screened == 0  # run.cost written before the screen
    with pytest.raises(ArtifactError, match="stopped_at"):
        records.SearchWork.from_json({**WORK, "stopped_at": {"four": 1}}, "x")
