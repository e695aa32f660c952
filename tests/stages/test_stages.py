"""The search and prune stages end to end on a tiny OLMoE with the demo tokenizer and demo data."""

import dataclasses
import json
import logging

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_world import make_tiny_inputs
from transformers import AutoModelForCausalLM

from evoesap import moe
from evoesap.errors import ArtifactError, ConfigError
from evoesap.method import allocation as alloc
from evoesap.scoring.evaluator import CandidateEvaluator
from evoesap.scoring.importance import pruning_order, read_scores
from evoesap.stages import search as search_stage
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.search import SearchParams, generalisation, run_search
from evoesap.store import artifacts

SMALL = dict(population=6, elites=2, generations=3, heldout_fraction=0.25, batch_size=8)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    files = make_tiny_inputs(root)
    scores = str(root / "scores")
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=16, max_length=256), scores)
    cache = str(root / "cache")
    run_cache_logits(files["model"], files["search"], CacheLogitsParams(samples=12, max_length=256, dtype="float32"), cache)
    return {"root": root, "model": files["model"], "scores": scores, "cache": cache}


@pytest.fixture(scope="module")
def searched(inputs):
    out = str(inputs["root"] / "search-reap-50")
    run_search(inputs["model"], inputs["scores"], inputs["cache"], SearchParams(criterion="reap", sparsity=0.5, **SMALL), out)
    return out


def _allocation(uri):
    return artifacts.read_json(artifacts.join(uri, "allocation.json"))


def test_search_stage_publishes_a_feasible_allocation_with_history_and_plots(inputs, searched):
    doc = _allocation(searched)
    n, k = doc["num_experts"], doc["top_k"]
    assert doc["budget"] == alloc.budget(0.5, n, k, 1)
    assert alloc.is_feasible(doc["removal_counts"], n, k, doc["budget"], 1)
    orders = pruning_order(read_scores(inputs["scores"]), "reap")
    expected = alloc.pruned_sets(doc["removal_counts"], orders)
    assert {int(layer): ids for layer, ids in doc["pruned"].items()} == dict(expected)
    history = pd.read_parquet(f"{searched}/history.parquet")
    assert len(history) == (SMALL["generations"] + 1) * SMALL["population"]
    assert set(history.columns) == {"generation", "candidate", "allocation", "fitness", "elite"}
    manifest = artifacts.read_manifest(searched)
    assert {"allocation.json", "history.parquet", "search_curve.png", "density.png"} <= set(manifest.files)
    assert not artifacts.exists(f"{searched}.checkpoint.json")
    cost = manifest.run["cost"]  # prefix reuse on, budget from the free memory: some states kept, never over budget
    assert 0 < cost["prefix_cache_peak_bytes"] <= cost["prefix_cache_budget_bytes"]
    assert 0 < cost["full_forward_equivalents_per_candidate"] < 1


def test_searched_fitness_is_recomputed_exactly_and_never_below_uniform(inputs, searched):
    doc = _allocation(searched)
    teacher_model = moe.load_pruned(inputs["model"])
    evaluator = CandidateEvaluator(teacher_model, inputs["cache"])
    search_ids, _ = search_stage.split_samples(evaluator.num_samples, SMALL["heldout_fraction"], 42)
    orders = pruning_order(read_scores(inputs["scores"]), "reap")
    again = evaluator.score(alloc.pruned_sets(doc["removal_counts"], orders), samples=search_ids)
    assert again == pytest.approx(doc["fitness"], abs=1e-6)
    assert doc["fitness"] >= doc["uniform"]["fitness"]  # uniform is in the initial population
    assert doc["heldout"]["samples"] == doc["heldout_samples"] == 3


def test_pruned_checkpoint_scores_like_the_masked_model(inputs, searched):
    out = str(inputs["root"] / "pruned-searched")
    run_prune(inputs["model"], inputs["scores"], PruneParams(criterion="reap", sparsity=0.5), out, allocation=searched)
    doc = _allocation(searched)
    pruned_model = moe.load_pruned(out)
    assert list(moe.inspect(pruned_model).num_experts) == [n - r for n, r in zip(doc["num_experts"], doc["removal_counts"])]
    full = moe.load_pruned(inputs["model"])
    masked_score = CandidateEvaluator(full, inputs["cache"]).score({int(layer): ids for layer, ids in doc["pruned"].items()})
    pruned_score = CandidateEvaluator(pruned_model, inputs["cache"], verify=False).score({})
    assert pruned_score == pytest.approx(masked_score, abs=1e-5)
    summary = json.loads((inputs["root"] / "pruned-searched" / "pruning.json").read_text())
    removed = sum(r * b for r, b in zip(doc["removal_counts"], moe.expert_bytes(full)))
    assert summary["parameter_bytes_pruned"] == summary["parameter_bytes_full"] - removed


def test_uniform_prune_loads_with_stock_transformers(inputs):
    out = inputs["root"] / "pruned-uniform"
    run_prune(inputs["model"], inputs["scores"], PruneParams(criterion="frequency", sparsity=0.25), str(out))
    summary = json.loads((out / "pruning.json").read_text())
    assert summary["method"] == "uniform" and len(set(summary["removal_counts"])) == 1
    stock = AutoModelForCausalLM.from_pretrained(out)
    ours = moe.load_pruned(str(out))
    ids = torch.randint(0, stock.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(stock(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_prune_refuses_an_allocation_searched_for_another_sparsity(inputs, searched):
    with pytest.raises(ConfigError, match="sparsity"):
        run_prune(inputs["model"], inputs["scores"], PruneParams(sparsity=0.25), str(inputs["root"] / "x"), allocation=searched)
    assert not (inputs["root"] / "x").exists()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"sparsity": 1.2}, "sparsity"),
        ({"sparsity": 0.0}, "sparsity"),
        ({"elites": 6, "population": 6}, "elites"),
        ({"metric": "bleu"}, "metric"),
        ({"criterion": "magnitude"}, "criterion"),
    ],
)
def test_bad_search_parameters_are_refused_on_construction(values, message):
    with pytest.raises(ConfigError, match=message):
        SearchParams(**values)


def test_budget_above_capacity_is_refused_before_the_model_loads(inputs, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not be loaded for an impossible budget")

    monkeypatch.setattr(search_stage.runtime, "load_model", no_loading)
    with pytest.raises(ConfigError, match="budget"):
        run_search(
            inputs["model"], inputs["scores"], inputs["cache"], SearchParams(sparsity=0.9, **SMALL), str(inputs["root"] / "y")
        )


def test_generalisation_verdict_needs_a_gain_beyond_two_standard_errors():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.8, 0.9, size=16)
    assert generalisation(base + 0.01 + rng.normal(0, 1e-3, 16), base).beats_uniform
    noise = rng.normal(0, 1e-2, 16)
    assert not generalisation(base + noise - noise.mean(), base).beats_uniform  # no gain on average
    assert not generalisation(base - 0.01, base).beats_uniform


def test_search_that_does_not_generalise_warns_and_can_fall_back_to_uniform(inputs, monkeypatch, caplog):
    monkeypatch.setattr(
        search_stage, "generalisation", lambda s, u: dataclasses.replace(generalisation(s, u), beats_uniform=False)
    )
    out = str(inputs["root"] / "search-fallback")
    params = SearchParams(criterion="reap", sparsity=0.5, fallback_to_uniform=True, **SMALL)
    with caplog.at_level(logging.WARNING, logger="evoesap.stages.search"):
        run_search(inputs["model"], inputs["scores"], inputs["cache"], params, out)
    assert "DOES NOT BEAT UNIFORM" in caplog.text
    doc = _allocation(out)
    assert doc["removal_counts"] == doc["uniform"]["removal_counts"]
    assert doc["fallback_applied"] == (doc["searched"]["removal_counts"] != doc["uniform"]["removal_counts"])
    assert len(doc["warnings"]) == 1 and "does not beat uniform" in doc["warnings"][0]


def test_interrupted_search_resumes_to_the_uninterrupted_result(inputs, searched, monkeypatch):
    calls = {"n": 0}
    real_score = CandidateEvaluator.score

    def flaky(self, pruned, samples=None):
        calls["n"] += 1
        if calls["n"] == SMALL["population"] * 2 + 3:  # inside generation 2
            raise RuntimeError("node lost")
        return real_score(self, pruned, samples)

    out = str(inputs["root"] / "search-resumed")
    params = SearchParams(criterion="reap", sparsity=0.5, resume=True, **SMALL)
    monkeypatch.setattr(CandidateEvaluator, "score", flaky)
    with pytest.raises(RuntimeError, match="node lost"):
        run_search(inputs["model"], inputs["scores"], inputs["cache"], params, out)
    assert artifacts.exists(f"{out}.checkpoint.json") and not artifacts.exists(f"{out}/manifest.json")
    monkeypatch.setattr(CandidateEvaluator, "score", real_score)
    run_search(inputs["model"], inputs["scores"], inputs["cache"], params, out)
    assert _allocation(out)["removal_counts"] == _allocation(searched)["removal_counts"]
    pd.testing.assert_frame_equal(pd.read_parquet(f"{out}/history.parquet"), pd.read_parquet(f"{searched}/history.parquet"))


def test_run_stage_reuses_a_finished_artifact_only_for_the_same_parameters_and_inputs(inputs, searched, monkeypatch):
    from evoesap import steps

    stage_inputs = {"model": inputs["model"], "scores": inputs["scores"], "cache": inputs["cache"]}
    params = SearchParams(criterion="reap", sparsity=0.5, **SMALL)
    before = artifacts.read_manifest(searched)
    calls = []
    real = search_stage.run_search
    monkeypatch.setattr(search_stage, "run_search", lambda **kw: calls.append(kw) or real(**kw))
    assert steps.run_stage("search", stage_inputs, params, searched) == before  # what `searched` published
    assert calls == []
    other = str(inputs["root"] / "search-reap-50-seed-7")
    steps.run_stage("search", stage_inputs, SearchParams(criterion="reap", sparsity=0.5, **{**SMALL, "seed": 7}), other)
    steps.run_stage("search", stage_inputs, params, other)  # another seed's artifact there: runs again
    assert len(calls) == 2
    again, first = _allocation(other), _allocation(searched)
    assert (again["pruned"], again["fitness"]) == (first["pruned"], first["fitness"])


def test_a_heldout_cache_judges_the_search_which_then_uses_every_cached_sample(inputs, tmp_path):
    files = make_tiny_inputs(tmp_path)  # same seed: the same model weights and tokenizer as `inputs`
    heldout = str(tmp_path / "heldout-cache")
    run_cache_logits(inputs["model"], files["heldout"], CacheLogitsParams(samples=10, max_length=256, dtype="float32"), heldout)
    out = str(tmp_path / "search")
    params = SearchParams(criterion="reap", sparsity=0.5, **SMALL)
    run_search(inputs["model"], inputs["scores"], inputs["cache"], params, out, heldout_cache=heldout)
    doc = _allocation(out)
    assert (doc["search_samples"], doc["heldout_samples"], doc["heldout"]["samples"]) == (12, 10, 10)
    judge = CandidateEvaluator(AutoModelForCausalLM.from_pretrained(inputs["model"]), heldout)
    orders = pruning_order(read_scores(inputs["scores"]), "reap")
    for which in ("searched", "uniform"):
        expected = judge.bounds(alloc.pruned_sets(doc[which]["removal_counts"], orders))[0]
        assert doc["heldout"][which] == pytest.approx(expected, abs=1e-6)
    assert "heldout_cache" in artifacts.read_manifest(out).inputs


def test_a_heldout_cache_from_another_model_is_refused_before_the_search(inputs, tmp_path, monkeypatch):
    from evoesap.method import search

    other = tmp_path / "other"
    other.mkdir()
    files = make_tiny_inputs(other)
    model = moe.tiny_model("olmoe", seed=4, vocab_size=AutoModelForCausalLM.from_pretrained(inputs["model"]).config.vocab_size)
    model.save_pretrained(files["model"])  # other weights, same tokenizer
    foreign = str(tmp_path / "foreign-cache")
    run_cache_logits(files["model"], files["heldout"], CacheLogitsParams(samples=4, max_length=256, dtype="float32"), foreign)
    searches = []
    monkeypatch.setattr(search, "level_switch_search", lambda *a, **k: searches.append(a))
    with pytest.raises(ArtifactError, match="weights"):
        run_search(
            inputs["model"],
            inputs["scores"],
            inputs["cache"],
            SearchParams(criterion="reap", sparsity=0.5, **SMALL),
            str(tmp_path / "search"),
            heldout_cache=foreign,
        )
    assert searches == []
    assert not artifacts.exists(str(tmp_path / "search" / "manifest.json"))


@pytest.mark.parametrize("quiet", [False, True])
def test_search_command_ends_with_its_summary_on_stderr_and_only_the_uri_on_stdout(tiny_artifacts, tmp_path, capsys, quiet):
    from evoesap.cli import main
    from evoesap.progress import set_quiet

    w, out = tiny_artifacts, str(tmp_path / "search")
    args = ["search", "--model", w["model"], "--scores", w["scores"], "--cache", w["cache"], "--sparsity", "0.5",
            "--population", "4", "--elites", "1", "--generations", "1", "--out", out]  # fmt: skip
    try:
        assert main(["--quiet", *args] if quiet else args) == 0
    finally:
        set_quiet(False)
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines() == [out]
    record = json.loads((tmp_path / "search" / "allocation.json").read_text())
    summary = [line for line in captured.err.splitlines() if line.startswith("search: ")]
    if quiet:  # --quiet: warnings only
        assert summary == []
        return
    searched, uniform, check = record["searched"]["removal_counts"], record["uniform"]["removal_counts"], record["heldout"]
    pair = f"searched {searched} vs uniform {uniform}" if searched != uniform else f"searched = uniform {uniform}"
    assert summary == [
        f"search: {pair}, held-out esap {check['searched']:.5f} vs {check['uniform']:.5f} ({check['difference']:+.1e}"
        + (f", {check['difference'] / check['stderr']:.1f} standard errors" if check["stderr"] else "")
        + f", {check['samples']} samples): {'beats uniform' if check['beats_uniform'] else 'does not beat uniform (see the warning above)'}"
        + f"; details: {out}/allocation.json"
    ]
