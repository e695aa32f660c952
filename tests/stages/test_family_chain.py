"""The stage chain on a tiny random model of every supported family, as cheaply as it can still say something.

Every family: calibrate -> prune (uniform) -> evaluate, and the uniform checkpoint loads in stock
AutoModelForCausalLM (a multimodal one in its own auto class) with the counts uniform pruning leaves. The full chain (cache-logits -> search -> prune the
searched allocation -> evaluate it) runs on one family per structure the shared code treats differently, since a
search costs as much as the rest of a family's chain:

- kimi_linear: linear-attention layers beside attention, the DeepSeek-V3 router (sigmoid, selection bias on the
  router), shared experts and a dense first layer, all in one model;
- deepseek_v3: group-limited sigmoid routing with more than one group (4 groups, top 2);
- qwen3_next: a gated shared expert and a dense layer in the middle of the stack (mlp_only_layers);
- minimax_m2: a selection bias held by the MoE block itself rather than by its router;
- granitemoehybrid: a decoder layer off the plain pre-norm pair (muP embedding, residual and logit multipliers, a
  dense MLP beside the MoE block, Mamba layers), run in halves from the family table's layer facts.

- qwen3_vl_moe: a multimodal checkpoint, whose language model (multimodal rotary positions on text) is searched
  and whose vision tower is kept as it is.

The non-uniform checkpoint's loading through `evoesap.moe.load_pruned` is the
unit matrix's (tests/unit/test_moe.py), not repeated here.
"""

import json

import pytest
import transformers
from tiny_world import make_tiny_inputs

from evoesap import moe
from evoesap.machine import runtime
from evoesap.method import allocation as alloc
from evoesap.records import MetricsRecord, read
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.search import SearchParams, run_search
from evoesap.store import artifacts

FULL_CHAIN = ("kimi_linear", "deepseek_v3", "qwen3_next", "minimax_m2", "granitemoehybrid", "qwen3_vl_moe")
CALIBRATE = CalibrateParams(samples=4, max_length=64)
CACHE = CacheLogitsParams(samples=4, max_length=64, dtype="float32")
# 25%: 50% of DeepSeek-V3's 16 experts in 4 groups (top 2 groups) leaves one allocation, nothing to search
SEARCH = SearchParams(criterion="reap", sparsity=0.25, population=2, elites=1, generations=1, batch_size=4, heldout_fraction=0.5)
PRUNE_SEARCHED = PruneParams(criterion="reap", sparsity=0.25)
PRUNE = PruneParams(criterion="reap", sparsity=0.5)


@pytest.fixture(autouse=True)
def _cheap_evaluations(monkeypatch):
    """Two fixed costs of every evaluation that nothing here reads: lm-eval's survey of the environment (pip list
    and more, in subprocesses: about a second), and the full garbage collection after a model is dropped (over this
    test process's whole heap; a tiny model's weights need none)."""
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    monkeypatch.setattr(runtime, "release_memory", lambda: None)


def _evaluate(model: str, tasks: str, out: str, **kwargs) -> MetricsRecord:
    params = EvaluateParams(tasks=(tasks,), limit=1, batch_size=1, device="cpu", max_length=64, method="uniform")
    run_evaluate(model, params, out, **kwargs)
    return read(out, MetricsRecord)


def _counts(checkpoint: str) -> list[int]:
    return artifacts.read_json(artifacts.join(checkpoint, "pruning.json"))["num_experts"]


@pytest.mark.parametrize("family", sorted(moe.FAMILIES))
def test_stage_chain_runs_on_every_family(family, tmp_path, monkeypatch):
    row = moe.FAMILIES[family]
    files = make_tiny_inputs(tmp_path, family=family)
    scores, uniform = str(tmp_path / "scores"), str(tmp_path / "uniform")
    run_calibrate(files["model"], files["calibration"], CALIBRATE, scores)
    spec = runtime.inspect_checkpoint(files["model"])
    cache, search, searched = (str(tmp_path / name) for name in ("cache", "search", "searched"))
    if family in FULL_CHAIN:
        run_cache_logits(files["model"], files["search"], CACHE, cache)
        run_search(files["model"], scores, cache, SEARCH, search)
        removal = artifacts.read_json(artifacts.join(search, "allocation.json"))["removal_counts"]
        budget = alloc.budget(SEARCH.sparsity, spec.num_experts, spec.top_k, 1)
        assert alloc.is_feasible(removal, spec.num_experts, spec.top_k, budget, 1)
        run_prune(files["model"], scores, PRUNE_SEARCHED, searched, allocation=search)
        kept = [n - r for n, r in zip(spec.num_experts, removal)]
        assert _counts(searched) == kept
        evaluated = _evaluate(searched, files["tasks"], str(tmp_path / "evaluated-searched"), allocation=search)
        assert list(evaluated.experts.num_experts) == kept and evaluated.primary()
    run_prune(files["model"], scores, PRUNE, uniform)
    halved = [n // 2 for n in spec.num_experts]  # 50% of every layer: uniform pruning of equal layers
    assert _counts(uniform) == halved
    stock = getattr(transformers, row.auto_class).from_pretrained(uniform)  # a multimodal checkpoint: its own class
    assert [layer.num_experts for layer in moe.inspect(stock).layers] == halved
    evaluated = _evaluate(uniform, files["tasks"], str(tmp_path / "evaluated-uniform"))
    assert list(evaluated.experts.num_experts) == halved and evaluated.primary()
    assert evaluated.memory.parameters == sum(p.numel() for p in stock.parameters())


def test_held_out_esap_of_a_multimodal_checkpoint_scores_its_language_model_on_text(tmp_path):
    """evaluate with a teacher cache (held-out ESAP) and `evoesap esap` run the language model in halves on text, as
    the search does: the full model against its own cache agrees with itself, and the pruned one records less."""
    from evoesap.scoring.evaluator import score_allocation

    files = make_tiny_inputs(tmp_path, family="qwen3_vl_moe")
    scores, cache, uniform = str(tmp_path / "scores"), str(tmp_path / "cache"), str(tmp_path / "uniform")
    run_calibrate(files["model"], files["calibration"], CALIBRATE, scores)
    run_cache_logits(files["model"], files["search"], CACHE, cache)
    assert score_allocation(files["model"], cache, device="cpu") == pytest.approx((1.0, 1.0))
    run_prune(files["model"], scores, PRUNE, uniform)
    evaluated = _evaluate(uniform, files["tasks"], str(tmp_path / "evaluated"), teacher_cache=cache)
    # the same removal as a mask on the full model: masking equals removal through the language model's halves
    masked = tmp_path / "masked.json"
    masked.write_text(json.dumps({"pruned": artifacts.read_json(artifacts.join(uniform, "pruning.json"))["pruned"]}))
    lower, upper = score_allocation(files["model"], cache, str(masked), device="cpu")
    assert evaluated.heldout_esap.esap == pytest.approx(lower, abs=1e-6) and lower == upper < 0.99
