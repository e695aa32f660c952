"""The one body of the stage components (`components.runner`): what each component hands `run_step`, in the order
the stages key their artifacts by (`runs.0`, `evaluations.1`, ...), and how its outputs are filled."""

import pytest
from evoesap.components import kfp_artifacts
from evoesap.components.stages import component
from kfp import dsl

from evoesap import registry, steps


@pytest.fixture
def calls(monkeypatch):
    """Every run_step call as (stage, storage_root, inputs, params); every output fill as (fill, artifact name, uri)."""
    made = {"steps": [], "filled": []}

    def run_step(stage, storage_root, inputs, params):
        made["steps"].append((stage, storage_root, inputs, params))
        return f"{storage_root}/{stage}/key"

    monkeypatch.setattr(steps, "run_step", run_step)
    for name in ("publish", "publish_metrics", "publish_markdown", "publish_page"):
        monkeypatch.setattr(kfp_artifacts, name, lambda a, uri, name=name: made["filled"].append((name, a.name, uri)))
    return made


def _run(stage: str, **arguments):
    return component(registry.get(stage)).python_func(storage_root="/store", **arguments)


def _ours(name: str) -> dsl.Dataset:
    """An input artifact of ours: named by the storage URI in its metadata."""
    return dsl.Dataset(name=name, uri=f"kfp://{name}", metadata={"stage": "evaluate", "uri": f"/store/{name}"})


def test_report_gathers_its_runs_full_uniform_searched_then_quantized(calls):
    _run(
        "report",
        full=_ours("full"),
        searched=[_ours("s1"), _ours("s2")],
        uniform=[_ours("u1")],
        quantized=[_ours("q1")],
        searches=None,
        markdown=dsl.Markdown(name="markdown", uri="kfp://md"),
        page=dsl.HTML(name="page", uri="kfp://page"),
        params={"digits": 2},
    )
    ((stage, root, inputs, params),) = calls["steps"]
    assert (stage, root, params) == ("report", "/store", {"digits": 2})
    assert inputs == {
        "runs": ["/store/full", "/store/u1", "/store/s1", "/store/s2", "/store/q1"], "searches": [], "gates": [], "targets": [],
    }  # fmt: skip
    assert calls["filled"] == [
        ("publish_markdown", "markdown", "/store/report/key"),
        ("publish_page", "page", "/store/report/key"),
    ]


def _report_with(calls, decisions):
    _run(
        "report", full=_ours("full"), searched=[_ours("s1")], uniform=[_ours("u1")], decisions=decisions,
        markdown=dsl.Markdown(name="markdown", uri="kfp://md"), page=dsl.HTML(name="page", uri="kfp://page"),
    )  # fmt: skip
    ((_, _, inputs, _),) = calls["steps"]
    return inputs


def test_report_reads_the_target_artifact_of_every_criterion_the_finders_decisions_name(calls):
    """The target finder's one `decisions` output stands for each criterion's target artifact (its metadata
    `targets`), which the report stage reads, not the decisions file itself."""
    targets = {"reap": "/store/target/a", "frequency": "/store/target/b"}
    decisions = dsl.Artifact(name="decisions", uri="kfp://decisions", metadata={"chosen": {"reap": 0.25}, "targets": targets})
    assert _report_with(calls, decisions)["targets"] == ["/store/target/a", "/store/target/b"]


@pytest.mark.parametrize("metadata", [{}, {"targets": {}}, {"targets": "/store/target/a"}])
def test_report_refuses_a_decisions_input_that_names_no_target_artifact(calls, metadata):
    from evoesap.errors import ArtifactError

    decisions = dsl.Artifact(name="decisions", uri="kfp://other", metadata=metadata)
    with pytest.raises(ArtifactError, match=r"kfp://other names no target artifacts .*give the target finder's `decisions`"):
        _report_with(calls, decisions)
    assert calls["steps"] == []  # refused before the stage runs


def test_publish_gathers_the_evaluations_quantized_first_and_skips_those_not_given(calls):
    pruned = dsl.Model(name="pruned", uri="kfp://p", metadata={"stage": "prune", "uri": "/store/pruned"})
    _run(
        "publish",
        pruned=pruned,
        evaluation=_ours("e"),
        full_evaluation=_ours("f"),
        published=dsl.Model(name="published", uri="kfp://o"),
    )
    ((_, _, inputs, _),) = calls["steps"]
    assert inputs == {
        "pruned": "/store/pruned",
        "evaluations": ["/store/e", "/store/f"],
        "search": None,
        "report": None,
        "quantized": None,
        "gate": None,
    }
    _run(
        "publish",
        pruned=pruned,
        evaluation=_ours("e"),
        quantized_evaluation=_ours("q"),
        published=dsl.Model(name="published", uri="kfp://o"),
    )
    assert calls["steps"][1][2]["evaluations"] == ["/store/q", "/store/e"]


def test_the_grid_s_arguments_win_over_params_and_an_empty_text_input_is_none(calls):
    scores = _ours("scores")
    _run(
        "prune",
        model=dsl.Model(name="model", uri="/models/moe"),
        scores=scores,
        criterion="seer",
        sparsity=0.5,
        pruned=dsl.Model(name="pruned", uri="kfp://pruned"),
        params={"criterion": "reap", "granularity": 2},
    )
    _run("quantize", model=dsl.Model(name="m", uri="/models/moe"), quantized=dsl.Model(name="q", uri="kfp://q"), data="")
    (_, _, prune_inputs, prune_params), (_, _, quantize_inputs, _) = calls["steps"]
    assert prune_params == {"criterion": "seer", "granularity": 2, "sparsity": 0.5}
    assert prune_inputs == {"model": "/models/moe", "scores": "/store/scores", "allocation": None}  # uniform
    assert quantize_inputs == {"model": "/models/moe", "data": None}


def test_evaluate_labels_its_run_from_the_model_s_metadata_and_fills_metrics_and_evaluation(calls):
    pruned = dsl.Model(
        name="pruned", uri="kfp://p", metadata={"stage": "prune", "uri": "/store/p", "method": "searched", "sparsity": 0.5}
    )
    outputs = {"metrics": dsl.Metrics(name="metrics", uri="kfp://m"), "evaluation": dsl.Dataset(name="evaluation", uri="kfp://e")}
    _run("evaluate", model=pruned, params={"method": "uniform", "criterion": "reap", "tasks": ["mc"]}, **outputs)
    _run("evaluate", model=dsl.Model(name="model", uri="/models/moe"), params={}, **outputs)
    (_, _, inputs, labelled), (_, _, _, full) = calls["steps"]
    assert inputs == {"model": "/store/p", "teacher_cache": None}  # the allocation is the CLI's lineage only
    assert labelled == {"method": "searched", "criterion": "reap", "sparsity": 0.5, "tasks": ["mc"]}
    assert full == {"method": "full"}  # a model without labels is the full model
    assert {(fill, name) for fill, name, _ in calls["filled"]} == {("publish_metrics", "metrics"), ("publish", "evaluation")}


def test_the_gate_returns_pass_or_fail_from_its_verdict(calls, monkeypatch):
    from evoesap.components import verdict

    passed = {"/store/gate/key": False}
    monkeypatch.setattr(verdict, "outcome", lambda uri: "pass" if passed[uri] else "fail")
    arguments = {"evaluation": _ours("e"), "full_evaluation": _ours("f"), "verdict": dsl.Artifact(name="verdict", uri="kfp://v")}
    assert _run("gate", **arguments) == "fail"
    passed["/store/gate/key"] = True
    assert _run("gate", previous="s3://old/metrics.json", **arguments) == "pass"
    assert [s[2]["previous"] for s in calls["steps"]] == [None, "s3://old/metrics.json"]
