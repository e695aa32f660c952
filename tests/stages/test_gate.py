"""The release gate: the verdict's checks against independent arithmetic, the stage's artifact, and publish refusing a
failing verdict (and publishing under a passing one)."""

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
from evoesap.components.verdict import make_verdict_check
from hypothesis import given, settings
from hypothesis import strategies as st
from kfp.dsl import Artifact

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.release.gate import GateFailed, raise_on_failed, verdict
from evoesap.stages.gate import GateParams, run_gate
from evoesap.store import artifacts

TASKS = ("arith", "recall", "logic")


def _metrics(values: dict[str, float], esap: float | None = None, method: str = "searched") -> records.MetricsRecord:
    return records.MetricsRecord(
        schema=1,
        model=f"/models/{method}",
        records=tuple(
            records.TaskMetric(task=t, domain="demo", metric="acc", filter="none", value=v, primary=True)
            for t, v in values.items()
        ),
        memory=records.Memory(parameters=10, parameter_bytes=20, bf16_bytes=20),
        experts=records.Experts(family="olmoe", num_experts=(4,), top_k=(2,), decoder_index=(0,)),
        labels=records.Labels(method=method),
        heldout_esap=None if esap is None else records.HeldoutEsap(esap=esap, esap_upper=esap, samples=8),
    )


def test_a_task_drop_beyond_the_threshold_fails_and_names_its_numbers():
    full = _metrics({"arith": 0.80, "recall": 0.60}, method="full")
    candidate = _metrics({"arith": 0.75, "recall": 0.60})
    record = verdict(GateParams(max_task_drop=0.02), candidate, full)
    assert not record.passed
    (failed,) = [c for c in record.checks if not c.passed]
    assert failed.name.startswith("arith acc vs full model")
    assert failed.value == 0.75 and failed.reference == 0.80 and failed.limit == pytest.approx(0.78)
    line = record.line()
    assert "\n" not in line and "arith" in line and "0.7500" in line and "0.7800" in line and "recall" not in line
    assert verdict(GateParams(max_task_drop=0.06), candidate, full).passed


def test_missing_values_fail_their_checks_rather_than_pass():
    full = _metrics({"arith": 0.8, "recall": 0.6}, method="full")
    candidate = _metrics({"arith": 0.8})  # recall not evaluated, no held-out ESAP
    record = verdict(GateParams(min_heldout_esap=0.5, max_task_drop=0.1), candidate, full)
    assert [c.passed for c in record.checks] == [False, True, False]
    assert "held-out ESAP missing" in record.line() and "recall acc vs full model" in record.line()


def test_previous_release_checks_tasks_and_heldout_esap():
    full = _metrics({"arith": 0.9}, method="full")
    previous = _metrics({"arith": 0.80}, esap=0.95)
    candidate = _metrics({"arith": 0.81}, esap=0.90)
    record = verdict(GateParams(max_previous_drop=0.02), candidate, full, previous, "/releases/v1/metrics.json")
    assert [c.passed for c in record.checks] == [True, False]  # task kept up; ESAP fell 0.05 > 0.02
    assert record.previous == "/releases/v1/metrics.json"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=len(TASKS), max_size=len(TASKS)),
    st.lists(st.floats(0, 1), min_size=len(TASKS), max_size=len(TASKS)),
    st.floats(0, 0.5),
    st.floats(0.01, 1),
    st.floats(0, 1),
)
def test_verdict_passes_exactly_when_every_threshold_holds(full_values, values, drop, least_esap, esap):
    full = _metrics(dict(zip(TASKS, full_values)), method="full")
    candidate = _metrics(dict(zip(TASKS, values)), esap=esap)
    record = verdict(GateParams(min_heldout_esap=least_esap, max_task_drop=drop), candidate, full)
    # a value within 1e-9 of its limit meets it (the metrics' resolution), computed here in exact fractions
    meets = lambda v, limit: Fraction(v) >= Fraction(limit) - Fraction(1, 10**9)  # noqa: E731
    expected = meets(esap, least_esap) and all(meets(v, Fraction(f) - Fraction(drop)) for v, f in zip(values, full_values))
    assert record.passed == expected
    assert len(record.checks) == 1 + len(TASKS)
    assert records.GateRecord.from_json(json.loads(json.dumps(record.to_json())), "gate.json") == record


def test_a_verdict_names_its_candidate_by_criterion_sparsity_and_method():
    full = _metrics({"arith": 0.80}, method="full")
    candidate = dataclasses.replace(
        _metrics({"arith": 0.70}), labels=records.Labels(criterion="reap", sparsity=0.25, method="searched")
    )
    line = verdict(GateParams(max_task_drop=0.02), candidate, full).line()
    assert line.startswith("release gate failed for reap at sparsity 0.2500 (searched): arith acc") and "/models" not in line
    quantized = dataclasses.replace(candidate, quantization=records.Quantized(recipe="fp8-dynamic", scheme="FP8_DYNAMIC"))
    line = verdict(GateParams(max_task_drop=0.2), quantized, full).line()
    assert line == "release gate passed for reap at sparsity 0.2500 (searched, quantized fp8-dynamic) (1 checks)"
    unlabelled = _metrics({"arith": 0.70})  # no criterion or sparsity known: the model's location stands in
    assert verdict(GateParams(max_task_drop=0.2), unlabelled, full).line().startswith("release gate passed for /models/searched")


@pytest.mark.parametrize(
    "values, problem",
    [
        ({"min_heldout_esap": 0.0}, "min_heldout_esap must be > 0 and <= 1, got 0.0"),
        ({"min_heldout_esap": 1.5}, "min_heldout_esap must be > 0 and <= 1, got 1.5"),
        ({"max_task_drop": -0.1}, "max_task_drop must be >= 0, got -0.1"),
        ({"max_previous_drop": -1}, "max_previous_drop must be >= 0, got -1"),
    ],
)
def test_bad_thresholds_are_refused_in_one_line(values, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        GateParams(**values)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny world's artifacts plus an evaluation of the full model."""
    from tiny_artifacts import build, evaluate_params

    from evoesap.stages.evaluate import run_evaluate

    root = tmp_path_factory.mktemp("gate")
    out = build(root)
    out["evaluated_full"] = str(root / "evaluated_full")
    run_evaluate(out["model"], evaluate_params(out["tasks"], method="full"), out["evaluated_full"])
    return out


def _scores(uri: str) -> dict[str, float]:
    return {r.task: r.value for r in records.read(uri, records.MetricsRecord).primary()}


def test_gate_stage_writes_the_verdict_and_publish_follows_it(built, tmp_path):
    from evoesap.stages.publish import PublishParams, run_publish

    searched, full = _scores(built["evaluated"]), _scores(built["evaluated_full"])
    worst = max(full[t] - searched.get(t, 0.0) for t in full)
    # a threshold the candidate misses by construction (a negative drop allowance is refused, so ask for more than
    # the full model's score: allowed drop 0 plus a candidate below full), else one it meets by construction
    failing = GateParams(max_task_drop=max(worst, 0.0) / 2) if worst > 0 else None
    passing = GateParams(max_task_drop=max(worst, 0.0) + 0.01)
    evaluations = [built["evaluated"], built["evaluated_full"]]

    run_gate(built["evaluated"], built["evaluated_full"], passing, str(tmp_path / "pass"))
    record = records.read(str(tmp_path / "pass"), records.GateRecord)
    assert record.passed and len(record.checks) == len(full)
    pruning = records.read(built["pruned"], records.PruningRecord)  # named as the prune artifact made it, not by its path
    named = f"{pruning.criterion} at sparsity {pruning.sparsity:.4f} ({pruning.method})"
    assert record.line() == f"release gate passed for {named} ({len(full)} checks)" and pruning.method == "searched"
    run_publish(built["pruned"], evaluations, PublishParams(), str(tmp_path / "published"), gate=str(tmp_path / "pass"))
    manifest = artifacts.read_manifest(str(tmp_path / "published"), "publish")
    assert manifest.inputs["gate"]["manifest_sha256"] == artifacts.manifest_sha256(str(tmp_path / "pass"))

    if failing is None:  # the tiny model scored the same pruned as full: make the candidate miss ESAP instead
        failing = GateParams(min_heldout_esap=1.0)
    run_gate(built["evaluated"], built["evaluated_full"], failing, str(tmp_path / "fail"))
    assert not records.read(str(tmp_path / "fail"), records.GateRecord).passed
    with pytest.raises(GateFailed) as refused:
        run_publish(built["pruned"], evaluations, PublishParams(), str(tmp_path / "refused"), gate=str(tmp_path / "fail"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("release gate failed for") and "nothing published" in message
    assert not Path(tmp_path / "refused").exists()
    with pytest.raises(GateFailed, match="release gate failed"):
        raise_on_failed([str(tmp_path / "pass"), str(tmp_path / "fail")])
    raise_on_failed([str(tmp_path / "pass")])
    # the pipeline's last task: the verdicts' sum for the caller to branch on, or the run's end with stop_on_fail
    check = make_verdict_check("ghcr.io/evoesap/stage:test").python_func
    both = [
        Artifact(uri=str(tmp_path / name), metadata={"uri": str(tmp_path / name), "stage": "gate"}) for name in ("pass", "fail")
    ]
    assert check(verdicts=both, params={"stop_on_fail": False}) == "fail"
    assert check(verdicts=both[:1], params={}) == "pass"
    with pytest.raises(GateFailed, match="^release gate failed for"):
        check(verdicts=both, params={"min_heldout_esap": 1.0})  # stop_on_fail's default


def test_publish_refuses_a_verdict_on_another_evaluation(built, tmp_path):
    from tiny_artifacts import evaluate_params

    from evoesap.stages.evaluate import run_evaluate
    from evoesap.stages.publish import PublishParams, run_publish

    # a valid verdict, but on another evaluation of the pruned model than the one published beside it
    other = str(tmp_path / "evaluated_again")
    run_evaluate(built["pruned"], evaluate_params(built["tasks"], method="again"), other)
    run_gate(other, built["evaluated_full"], GateParams(max_task_drop=1.0), str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="not the published model's evaluation"):
        run_publish(
            built["pruned"],
            [built["evaluated"], built["evaluated_full"]],
            PublishParams(),
            str(tmp_path / "published"),
            gate=str(tmp_path / "other"),
        )


@pytest.fixture(scope="module")
def unrelated(built, tmp_path_factory):
    """An evaluation, labelled full, of another model than the one the candidate was pruned from (same layout and
    tokenizer, other weights), and a copy of the full model's directory at another path."""
    import shutil

    import torch
    from tiny_artifacts import evaluate_params
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoesap.stages.evaluate import run_evaluate

    root = tmp_path_factory.mktemp("unrelated")
    model = AutoModelForCausalLM.from_pretrained(built["model"])
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # one tensor changed: another model by content
    model.save_pretrained(root / "other_model")
    AutoTokenizer.from_pretrained(built["model"]).save_pretrained(root / "other_model")
    shutil.copytree(built["model"], root / "moved_model")  # the very model, byte for byte, elsewhere
    out = {"other": str(root / "evaluated_other"), "moved": str(root / "evaluated_moved")}
    run_evaluate(str(root / "other_model"), evaluate_params(built["tasks"], method="full"), out["other"])
    run_evaluate(str(root / "moved_model"), evaluate_params(built["tasks"], method="full"), out["moved"])
    return out


def test_the_gate_refuses_an_unrelated_model_as_the_reference(built, unrelated, tmp_path):
    with pytest.raises(
        ConfigError, match="but the candidate was made from .*: give the evaluation of the model it was pruned from"
    ):
        run_gate(built["evaluated"], unrelated["other"], GateParams(max_task_drop=1.0), str(tmp_path / "gate"))
    assert not (tmp_path / "gate").exists()


def test_the_gate_refuses_the_candidate_s_own_evaluation_as_the_reference(built, tmp_path):
    from tiny_artifacts import evaluate_params

    from evoesap.stages.evaluate import run_evaluate

    itself = str(tmp_path / "pruned_labelled_full")
    run_evaluate(built["pruned"], evaluate_params(built["tasks"], method="full"), itself)
    with pytest.raises(ConfigError, match="give the evaluation of the model it was pruned from") as refused:
        run_gate(built["evaluated"], itself, GateParams(max_task_drop=0.0), str(tmp_path / "gate"))
    assert "\n" not in str(refused.value)
    # nor may the candidate be a model that no prune or quantize artifact made (nothing records its origin)
    with pytest.raises(ConfigError, match="not a prune or quantize artifact"):
        run_gate(built["evaluated_full"], built["evaluated_full"], GateParams(max_task_drop=0.0), str(tmp_path / "g2"))


def test_the_reference_is_identified_by_content_not_by_location(built, unrelated, tmp_path):
    run_gate(built["evaluated"], unrelated["moved"], GateParams(max_task_drop=1.0), str(tmp_path / "gate"))
    record = records.read(str(tmp_path / "gate"), records.GateRecord)
    assert record.passed and record.reference == str(Path(unrelated["moved"]).parent / "moved_model")


def test_the_gate_refuses_evaluations_that_do_not_compare(built, tmp_path):
    from tiny_artifacts import evaluate_params

    from evoesap.stages.evaluate import run_evaluate

    fewer = str(tmp_path / "full_limit_1")
    run_evaluate(built["model"], dataclasses.replace(evaluate_params(built["tasks"], method="full"), limit=1), fewer)
    with pytest.raises(ConfigError, match=r"does not compare with the candidate's evaluation: limit 2 vs 1"):
        run_gate(built["evaluated"], fewer, GateParams(max_task_drop=1.0), str(tmp_path / "gate"))
    with pytest.raises(ConfigError, match="is a metrics file, whose lineage the gate cannot check"):
        run_gate(
            built["evaluated"],
            str(Path(built["evaluated_full"], "metrics.json")),
            GateParams(max_task_drop=1.0),
            str(tmp_path / "gate"),
        )


def test_a_gate_without_thresholds_is_refused_and_publish_refuses_a_verdict_that_checked_nothing(built, tmp_path):
    from evoesap.params import keyed
    from evoesap.stages.publish import PublishParams, run_publish

    with pytest.raises(ConfigError, match="the gate has no thresholds, so it would pass any model"):
        run_gate(built["evaluated"], built["evaluated_full"], GateParams(), str(tmp_path / "gate"))
    # a verdict with no checks (as an older gate wrote one): publish refuses it
    inputs = {"evaluation": built["evaluated"], "full_evaluation": built["evaluated_full"], "previous": None}
    empty = str(tmp_path / "empty")
    seen = artifacts.preflight(empty, "gate", inputs)
    with artifacts.stage_output(empty, "gate", keyed(GateParams()), inputs, seen) as staging:
        records.write(staging, records.GateRecord(passed=True, candidate=built["pruned"], checks=()))
    with pytest.raises(ConfigError, match="checked nothing, so it passes any model"):
        run_publish(
            built["pruned"], [built["evaluated"], built["evaluated_full"]], PublishParams(), str(tmp_path / "pub"), gate=empty
        )
    assert not (tmp_path / "pub").exists()


def test_a_drop_of_exactly_the_allowance_passes_and_lines_show_the_deciding_digits():
    full = _metrics({"arith": 0.8, "recall": 0.99945}, method="full")
    candidate = _metrics({"arith": 0.7, "recall": 0.99942})
    record = verdict(GateParams(max_task_drop=0.1), candidate, full)
    assert [c.passed for c in record.checks] == [True, True]  # 0.8 - 0.1 is 0.7000000000000001 in floats
    record = verdict(GateParams(min_heldout_esap=0.99945), _metrics({}, esap=0.99942), full)
    assert "held-out ESAP 0.99942 < 0.99945" in record.line()


def test_previous_metrics_are_read_from_a_metrics_json_file(built, tmp_path):
    previous = tmp_path / "release" / "metrics.json"
    previous.parent.mkdir()
    previous.write_text(Path(built["evaluated"], "metrics.json").read_text())
    params = GateParams(max_previous_drop=0.0)
    run_gate(built["evaluated"], built["evaluated_full"], params, str(tmp_path / "gate"), previous=str(previous))
    record = records.read(str(tmp_path / "gate"), records.GateRecord)
    assert record.passed and record.previous == str(previous)  # the same metrics as the previous release: no drop
    with pytest.raises(ConfigError, match="give its metrics"):
        run_gate(built["evaluated"], built["evaluated_full"], params, str(tmp_path / "gate2"))


def _pipeline_config(**overrides):
    from evoesap.pipeline.config import load_config

    values = dict(
        model="/models/full",
        calibration_data="/data/code.jsonl",
        search_data="/data/math.jsonl",
        heldout_data="/data/heldout.jsonl",
        storage_root="s3://bucket/runs",
        publish_models=True,
    )
    return load_config({**values, **overrides})


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"heldout_data": None, "gate": {"min_heldout_esap": 0.9}}, "gate.min_heldout_esap needs held-out ESAP"),
        ({"gate": {"max_previous_drop": 0.01}}, "gate.max_previous_drop and previous_metrics go together"),
        ({"previous_metrics": "/releases/v1/metrics.json"}, "gate.max_previous_drop and previous_metrics go together"),
        ({"gate": {"max_task_dorp": 0.01}}, "unknown parameter.*max_task_dorp.*valid: max_previous_drop, max_task_drop"),
    ],
)
def test_a_gate_without_what_it_compares_is_refused_at_load(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        _pipeline_config(**overrides)


def test_compiled_dag_publishes_from_the_verdict_and_hands_the_verdicts_on(tmp_path):
    """Publish runs under no condition and takes the gate's verdict: it releases on a passing one and hands on a
    withheld entry on a failing one (so `released_models` exists whatever the verdict)."""
    import yaml
    from evoesap.pipeline.dag import compile_pipeline

    spec = yaml.safe_load(compile_pipeline(_pipeline_config(gate={"max_task_drop": 0.02}), tmp_path / "p.yaml").read_text())
    components = spec["components"]
    tasks = {name: task for c in components.values() for name, task in c.get("dag", {}).get("tasks", {}).items()}
    assert not [name for name, task in tasks.items() if "triggerPolicy" in task]
    assert not [name for name in components if name.startswith("comp-condition")]
    verdict = tasks["publish"]["inputs"]["artifacts"]["gate"]["taskOutputArtifact"]
    assert verdict == {"outputArtifactKey": "verdict", "producerTask": "gate"}
    stages = components["comp-evoesap-stages"]
    assert {"verdicts", "released_models"} <= set(stages["outputDefinitions"]["artifacts"])
    assert "verdicts" in spec["root"]["outputDefinitions"]["artifacts"]
    assert set(stages["dag"]["tasks"]["check-verdicts"]["dependentTasks"]) >= {"report"}  # ends once the report exists


def test_without_thresholds_the_dag_has_no_gate(tmp_path):
    import yaml
    from evoesap.pipeline.dag import compile_pipeline

    text = compile_pipeline(_pipeline_config(), tmp_path / "p.yaml").read_text()
    spec = yaml.safe_load(text)
    assert "comp-gate" not in spec["components"] and "verdicts" not in spec["root"]["outputDefinitions"]["artifacts"]


def test_the_report_refuses_a_full_run_that_is_not_the_pruned_runs_base(built, unrelated, tmp_path):
    from evoesap.stages.report import ReportParams, run_report

    with pytest.raises(ConfigError, match="not from the full model that .* evaluated .*: give runs of one base model"):
        run_report([unrelated["other"], built["evaluated"]], ReportParams(html=False), str(tmp_path / "report"))
    with pytest.raises(ConfigError, match="both labelled full but evaluated different models"):
        run_report([built["evaluated_full"], unrelated["other"]], ReportParams(html=False), str(tmp_path / "report"))
    assert not (tmp_path / "report").exists()
    run_report([unrelated["moved"], built["evaluated"]], ReportParams(html=False), str(tmp_path / "report"))  # same bytes
