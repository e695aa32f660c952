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

Families whose decoder layers the search cannot run in halves (`layerwise=False`: the multimodal checkpoints) are
refused by the search in one line, before their weights load. The non-uniform checkpoint's loading through `evoesap.moe.load_pruned` is the
unit matrix's (tests/unit/test_moe.py), not repeated here.
"""

import pytest
import transformers
from tiny_world import make_tiny_inputs

from evoesap import moe
from evoesap.errors import ModelError
from evoesap.machine import runtime
from evoesap.method import allocation as alloc
from evoesap.records import MetricsRecord, read
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.search import SearchParams, run_search
from evoesap.store import artifacts

FULL_CHAIN = ("kimi_linear", "deepseek_v3", "qwen3_next", "minimax_m2", "granitemoehybrid")
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


def _refuses_search_before_loading(files: dict, scores: str, cache: str, out: str, monkeypatch) -> None:
    def load_model(*args, **kwargs):
        raise AssertionError("the search loaded the weights of a family it cannot score")

    with monkeypatch.context() as patched:
        patched.setattr(runtime, "load_model", load_model)
        with pytest.raises(ModelError, match=r"cannot be scored layer by layer: .*calibrate, prune and evaluate"):
            run_search(files["model"], scores, cache, SEARCH, out)
    assert not artifacts.exists(out)


@pytest.mark.parametrize("family", sorted(moe.FAMILIES))
def test_stage_chain_runs_on_every_family(family, tmp_path, monkeypatch):
    row = moe.FAMILIES[family]
    files = make_tiny_inputs(tmp_path, family=family)
    scores, uniform = str(tmp_path / "scores"), str(tmp_path / "uniform")
    run_calibrate(files["model"], files["calibration"], CALIBRATE, scores)
    spec = runtime.inspect_checkpoint(files["model"])
    cache, search, searched = (str(tmp_path / name) for name in ("cache", "search", "searched"))
    if not row.layerwise:
        run_cache_logits(files["model"], files["search"], CACHE, cache)  # a whole forward: every family caches
        _refuses_search_before_loading(files, scores, cache, search, monkeypatch)
    elif family in FULL_CHAIN:
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


def test_held_out_esap_and_scoring_refuse_a_family_the_search_cannot_score_before_its_weights_load(tmp_path, monkeypatch):
    """evaluate with a teacher cache (held-out ESAP) and `evoesap esap` run the layers in halves as the search does:
    a family that cannot be run so is refused from config.json, not after loading and running lm-eval."""
    from evoesap.scoring.evaluator import score_allocation

    files = make_tiny_inputs(tmp_path, family="qwen3_vl_moe")
    cache, out = str(tmp_path / "cache"), str(tmp_path / "evaluated")
    run_cache_logits(files["model"], files["search"], CACHE, cache)

    def load_model(*args, **kwargs):
        raise AssertionError("the weights of a family ESAP cannot score were loaded")

    monkeypatch.setattr(runtime, "load_model", load_model)
    refused = r"qwen3_vl_moe cannot be scored layer by layer: a multimodal checkpoint.*evaluate without a teacher cache do"
    with pytest.raises(ModelError, match=refused):
        _evaluate(files["model"], files["tasks"], out, teacher_cache=cache)
    assert not artifacts.exists(out)
    with pytest.raises(ModelError, match=refused):
        score_allocation(files["model"], cache, device="cpu")
