"""Prefix reuse against from-scratch scoring, and the prefix cache's budget and eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_scoring_forward import tiny_overrides
from test_scoring_teacher import random_samples

from evoesap import moe
from evoesap.method import allocation as alloc
from evoesap.method import search
from evoesap.scoring import teacher
from evoesap.scoring.evaluator import CandidateEvaluator
from evoesap.scoring.forward import LayerRunner
from evoesap.scoring.prefix import PrefixCache, spread

HYBRIDS = ["qwen3_next", "qwen3_5_moe_text", "kimi_linear"]  # linear-attention layers between the cached states
# one family per other layer layout: scaled halves and a dense MLP beside the block (Granite), norms after each half
# only (FlexOlmo) or before and after (AFMoE), post-norm weighted residuals (MiniMax), Mamba or short convolutions
# with renamed norms (Jamba, LFM2-MoE), a flattened MoE output and the base model off its prefix (Llama 4), the
# language model of a multimodal checkpoint with multimodal rotary positions (Qwen3-VL)
LAYOUTS = ["granitemoeshared", "flex_olmo", "afmoe", "minimax", "jamba", "lfm2_moe", "llama4_text", "qwen3_vl_moe"]


def _world(family: str, tmp_path, samples: int = 7):
    model = moe.tiny_model(family, seed=2, vocab_size=96, **tiny_overrides(family))
    teacher.write_cache(model, random_samples(samples, seed=3), tmp_path, mode="full", dtype="float32", batch_size=4)
    return model, teacher.load_cache(str(tmp_path))


def _random_pruned(spec: moe.MoESpec, rng: np.random.Generator) -> dict[int, list[int]]:
    return {
        layer.ordinal: sorted(
            rng.choice(layer.num_experts, size=int(rng.integers(0, layer.num_experts - layer.top_k + 1)), replace=False).tolist()
        )
        for layer in spec.layers
    }


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "deepseek_v2", "gpt_oss", *HYBRIDS, *LAYOUTS])
def test_prefix_reuse_gives_from_scratch_fitness_on_random_allocations(family, tmp_path):
    """Children share a random-length prefix with a random earlier allocation; every value equals scratch."""
    model, cache = _world(family, tmp_path)
    spec = moe.inspect(model)
    rng = np.random.default_rng(0)
    seen = [_random_pruned(spec, rng)]
    for _ in range(11):
        parent = seen[int(rng.integers(len(seen)))]
        child = dict(parent)
        for layer in spec.layers[int(rng.integers(len(spec.layers))) :]:
            if rng.random() < 0.6:
                child[layer.ordinal] = _random_pruned(spec, rng)[layer.ordinal]
        seen.append(child)
    scratch = CandidateEvaluator(model, cache, batch_size=3)
    reuse = CandidateEvaluator(model, cache, batch_size=3, prefix_cache_bytes=1 << 30)
    for i, pruned in enumerate(seen):
        subset = None if i % 3 else [0, 2, 5]  # subsets too, as racing scores them
        a, b = reuse.sample_values(pruned, subset), scratch.sample_values(pruned, subset)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert reuse.work < scratch.work
    assert reuse.prefix.peak_bytes <= 1 << 30


def test_prefix_reuse_starts_at_the_moe_block_of_the_first_changed_layer(tmp_path):
    model, cache = _world("qwen2_moe", tmp_path)  # decoder layer 1 is dense: MoE ordinals 0, 1, 2 at layers 0, 2, 3
    starts = [layer.decoder_index for layer in moe.inspect(model).layers]
    assert starts == [0, 2, 3]
    evaluator = CandidateEvaluator(model, cache, batch_size=8, prefix_cache_bytes=1 << 30)
    (att0, ff0), (att1, ff1), (att2, ff2), (att3, ff3) = LayerRunner(model).half_costs()
    tokens = sum(evaluator._lengths)  # each sample cut after its last scored position
    scored = cache.meta.num_positions  # the last feed-forward half runs on scored positions only
    assert tokens < sum(int(ids.numel()) for ids in cache.input_ids)
    steps = [
        ({0: [1], 1: [2], 2: [3]}, (att0 + ff0 + att1 + ff1 + att2 + ff2 + att3) * tokens + ff3 * scored),
        ({0: [1], 1: [2], 2: [4]}, ff3 * scored),  # first change at MoE ordinal 2: decoder layer 3's MoE block
        ({0: [1], 1: [5], 2: [4]}, (ff2 + att3) * tokens + ff3 * scored),  # ordinal 1: layer 2's block on
        (
            {0: [2], 1: [5], 2: [4]},
            (ff0 + att1 + ff1 + att2 + ff2 + att3) * tokens + ff3 * scored,
        ),  # layer 0's attention is shared
    ]
    for pruned, work in steps:
        before = evaluator.work
        evaluator.score(pruned)
        assert evaluator.work - before == work


def test_rows_with_cached_states_at_different_layers_share_a_batch_and_stay_exact(tmp_path):
    """Racing leaves deep states for a few samples only: those rows join the batch at their own layer."""
    model, cache = _world("olmoe", tmp_path)
    reuse = CandidateEvaluator(model, cache, batch_size=8, prefix_cache_bytes=1 << 30)
    scratch = CandidateEvaluator(model, cache, batch_size=8)
    reuse.score({})  # every sample's state entering the first MoE block, shared by all allocations
    reuse.score({0: [1], 1: [2], 2: [3], 3: [4]}, samples=[0, 3])  # states at every boundary, two samples only
    child = {0: [1], 1: [2], 2: [3], 3: [5]}
    starts = {s: reuse.prefix.start(tuple(tuple(child.get(a, ())) for a in range(4)), s)[0] for s in range(7)}
    assert starts[0] == starts[3] == 3 and {starts[s] for s in (1, 2, 4, 5, 6)} == {0}
    torch.testing.assert_close(reuse.sample_values(child), scratch.sample_values(child), atol=1e-6, rtol=0)


def test_a_small_budget_keeps_fewer_boundaries_never_exceeds_it_and_stays_exact(tmp_path):
    model, cache = _world("olmoe", tmp_path)
    probe = CandidateEvaluator(model, cache, prefix_cache_bytes=1 << 30)
    one = sum(probe._lengths) * model.config.hidden_size * 4  # bytes of one boundary over all samples
    budget = 3 * one  # keep=1: two allocations of one boundary fit, not three boundaries each
    small = CandidateEvaluator(model, cache, batch_size=4, prefix_cache_bytes=budget, keep=1)
    assert small.prefix.boundaries == (2,)
    scratch = CandidateEvaluator(model, cache, batch_size=4)
    rng = np.random.default_rng(5)
    spec = moe.inspect(model)
    base = _random_pruned(spec, rng)
    for _ in range(8):
        pruned = {**base, 3: [int(rng.integers(8))]}  # vary only the last layer so boundary 2 is hit
        torch.testing.assert_close(small.sample_values(pruned), scratch.sample_values(pruned), atol=1e-6, rtol=0)
        assert small.prefix.bytes <= budget
    assert small.prefix.peak_bytes <= budget
    assert small.work < scratch.work


def test_eviction_keeps_the_fittest_allocations():
    cache = PrefixCache(budget_bytes=3 * 40, boundaries=[1], boundary_bytes=40, keep=1)
    state = torch.zeros(10)  # 40 bytes
    for i, fit in enumerate([0.5, 0.9, 0.1, 0.7]):
        sets = ((i,), ())
        cache.put(sets, 1, 0, state.clone())
        cache.commit(sets, fit)
    kept = {key[1][0][0] for key in cache._entries}
    assert kept == {0, 1, 3}  # the least fit (0.1) went first
    assert cache.bytes == cache.peak_bytes == 120


def test_spread_picks_evenly_spaced_boundaries():
    assert spread([1, 2, 3], 5) == (1, 2, 3)
    assert spread([1, 2, 3, 4, 5, 6, 7], 3) == (2, 4, 6)
    assert spread([1, 2, 3], 0) == ()


def test_prefix_reuse_gives_identical_values_along_a_real_search(tmp_path):
    """The search's own candidate sequence (elites' children): every fitness equal to scratch within 1e-6,
    and the same search result."""
    model, cache = _world("olmoe", tmp_path, samples=8)
    spec = moe.inspect(model)
    orders = [list(range(layer.num_experts)) for layer in spec.layers]
    n, k = spec.num_experts, spec.top_k
    budget = alloc.budget(0.5, n, k)
    runs = {}
    for name, nbytes in (("scratch", 0), ("reuse", 1 << 30)):
        evaluator = CandidateEvaluator(model, cache, batch_size=4, prefix_cache_bytes=nbytes)
        result = search.level_switch_search(
            lambda r, evaluator=evaluator: evaluator.score(alloc.pruned_sets(r, orders)),
            n,
            k,
            budget,
            population=8,
            elites=2,
            generations=4,
            seed=1,
        )
        runs[name] = (result, evaluator.work)
    (a, work_a), (b, work_b) = runs["scratch"], runs["reuse"]
    assert [h.allocation for h in a.history] == [h.allocation for h in b.history]
    np.testing.assert_allclose([h.fitness for h in b.history], [h.fitness for h in a.history], atol=1e-6, rtol=0)
    assert work_b < work_a


@pytest.mark.slow
def test_prefix_reuse_is_exact_along_a_search_on_the_demo_world(demo_world, tmp_path):
    """The trained demo OLMoE and its search data: the same history and fitness values (1e-6) with reuse."""
    from evoesap.data import load_samples, tokenize_samples

    model = moe.load_pruned(str(demo_world.model_dir), dtype=torch.float32).eval()
    tok = moe.load_tokenizer(str(demo_world.model_dir))
    samples = [
        s for d in ("math", "code") for s in load_samples(str(demo_world.data_file(d, "search")), split="train", n=8, seed=0)
    ]
    tokenized = [s.__class__(i, s.input_ids, s.answer_mask) for i, s in enumerate(tokenize_samples(samples, tok, max_length=256))]
    teacher.write_cache(model, tokenized, tmp_path, mode="full", dtype="float32", batch_size=8)
    cache = teacher.load_cache(str(tmp_path))
    spec = moe.inspect(model)
    orders = [list(range(layer.num_experts)) for layer in spec.layers]
    n, k = spec.num_experts, spec.top_k
    results = []
    for nbytes in (0, 1 << 30):
        evaluator = CandidateEvaluator(model, cache, batch_size=8, prefix_cache_bytes=nbytes, verify=False)
        results.append(
            search.level_switch_search(
                lambda r, evaluator=evaluator: evaluator.score(alloc.pruned_sets(r, orders)),
                n,
                k,
                alloc.budget(0.5, n, k),
                population=8,
                elites=2,
                generations=3,
                seed=0,
            )
        )
    scratch, reuse = results
    assert [h.allocation for h in scratch.history] == [h.allocation for h in reuse.history]
    np.testing.assert_allclose([h.fitness for h in reuse.history], [h.fitness for h in scratch.history], atol=1e-6, rtol=0)


def test_an_unset_budget_holds_a_generation_of_states_within_half_the_free_memory(tmp_path, monkeypatch):
    from evoesap.machine import runtime
    from evoesap.scoring import evaluator as evaluator_module

    model, cache = _world("olmoe", tmp_path)
    probe = CandidateEvaluator(model, cache, prefix_cache_bytes=1 << 30)
    one = sum(probe._lengths) * model.config.hidden_size * 4  # bytes of one boundary over all samples
    useful = evaluator_module.AUTO_ALLOCATIONS_PER_ELITE * (4 + 1) * 4 * one  # keep=4, four MoE layers
    seen = []
    for free, budget in ((1 << 40, useful), (useful, useful // 2)):
        monkeypatch.setattr(runtime, "free_memory_bytes", lambda device, free=free: seen.append(device) or free)
        auto = CandidateEvaluator(model, cache, prefix_cache_bytes=None, keep=4)
        assert auto.prefix.budget == budget
    assert seen == [torch.device("cpu")] * 2
    assert CandidateEvaluator(model, cache, prefix_cache_bytes=None, keep=4).prefix.boundaries == (0, 1, 2, 3)
