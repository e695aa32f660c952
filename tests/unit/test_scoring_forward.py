"""Batching, the layer-by-layer decoder stack and the LM head, checked against the model's own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_moe import TOL, UNGROUPED, nonuniform_sets
from test_scoring_teacher import VOCAB, tiny

from evoesap import moe
from evoesap.scoring import forward
from evoesap.scoring.forward import LayerRunner

FAMILIES = sorted(moe.FAMILIES)  # every family, multimodal ones by their language model
# windows shorter than the samples, so that sliding-attention layers mask differently from full ones
SLIDING = {
    "gpt_oss": dict(sliding_window=4),
    "mixtral": dict(sliding_window=5),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=4, max_window_layers=4),
}
# the tiny configs leave every multiplier at 1 and muP off: these make each factor of a family's layer maths count
_GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.7, logits_scaling=2.5)
SCALED = {
    "granitemoe": _GRANITE,
    "granitemoeshared": _GRANITE,
    "granitemoehybrid": _GRANITE,
    "afmoe": dict(mup_enabled=True),
    "minimax": dict(
        full_attn_alpha_factor=1.3,
        full_attn_beta_factor=0.6,
        linear_attn_alpha_factor=0.8,
        linear_attn_beta_factor=1.7,
        mlp_alpha_factor=1.2,
        mlp_beta_factor=0.9,
    ),
}


def tiny_overrides(family: str) -> dict:
    """Config overrides of a family's tiny model for layer-by-layer checks: short sliding windows, real multipliers."""
    return {**SLIDING.get(family, {}), **SCALED.get(family, {})}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 8))
def test_batches_hold_every_sample_once_longest_first(lengths, batch_size):
    batches = list(forward.iter_batches(lengths, batch_size))
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(1 <= len(batch) <= batch_size for batch in batches)
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(1, 500), min_size=1, max_size=20), min_size=1, max_size=6))
def test_right_padding_keeps_each_sequence_at_the_start_of_its_row(seqs):
    ids, mask = forward.pad_right([torch.tensor(s) for s in seqs], pad_id=0)
    assert ids.shape == mask.shape == (len(seqs), max(map(len, seqs)))
    for row, s in enumerate(seqs):
        assert ids[row, : len(s)].tolist() == s and not ids[row, len(s) :].any()
        assert mask[row].tolist() == [1] * len(s) + [0] * (ids.shape[1] - len(s))


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_loop_equals_the_models_forward_for_each_family(family):
    model = moe.tiny_model(family, seed=1, **tiny_overrides(family))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 13, 6)]
    ids, mask = forward.pad_right(seqs)
    runner = LayerRunner(model)
    with torch.inference_mode():
        expected = forward.final_hidden(model, ids, mask)  # [B, T, H]
        embeds = runner.embed(ids)
        ctx = runner.context(embeds, mask)
        whole = runner.forward(ids, mask)
        split = runner.norm(runner.run(runner.run(embeds, ctx, 0, 2), ctx, 2, runner.num_layers))
        own_logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]: the family's own head and scaling
    for row, s in enumerate(seqs):  # real tokens only: padded rows are never read
        torch.testing.assert_close(whole[row, : len(s)], expected[row, : len(s)], atol=0, rtol=0)
        torch.testing.assert_close(split[row, : len(s)], expected[row, : len(s)], atol=0, rtol=0)
        with torch.inference_mode():
            torch.testing.assert_close(forward.head_logits(model, whole[row, : len(s)]), own_logits[row, : len(s)])


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_loop_of_a_masked_model_equals_the_pruned_models_forward_for_each_family(family):
    """Masking is removal where the scorer runs it: half-layer by half-layer, the router hooks firing there."""
    model = moe.tiny_model(family, seed=1, **tiny_overrides(family), **UNGROUPED.get(family, {}))  # any removal
    pruned = nonuniform_sets(moe.inspect(model), seed=len(family))
    removed = moe.prune_experts(copy.deepcopy(model), pruned)
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    runner = LayerRunner(model)
    with torch.inference_mode():
        full = runner.forward(ids, mask)
        with moe.masked(model, pruned):
            masked = runner.forward(ids, mask)
        expected = forward.final_hidden(removed, ids, mask)  # [B, T, H]
    assert (masked - expected).abs().max() <= TOL
    assert (masked - full).abs().max() > 1e-3  # the mask really changed the model


def test_half_costs_count_top_k_of_the_routed_experts():
    model = moe.tiny_model("olmoe", seed=0)
    runner = LayerRunner(model)
    block = moe.moe_blocks(model)[0]
    layer = runner.layers[0]
    spec = moe.inspect(model).layers[0]
    expert_params = sum(p.numel() for p in block.experts.parameters())
    attention, feed_forward = runner.half_costs()[0]
    assert attention == sum(p.numel() for m in (layer.input_layernorm, layer.self_attn) for p in m.parameters())
    assert feed_forward == (
        sum(p.numel() for m in (layer.post_attention_layernorm, layer.mlp) for p in m.parameters())
        - expert_params
        + expert_params * spec.top_k // spec.num_experts
    )


def test_head_at_scored_positions_equals_the_model_logits() -> None:
    model = tiny()
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = forward.final_hidden(model, ids, torch.ones_like(ids))
        torch.testing.assert_close(forward.head_logits(model, hidden[:, [3, 9]]), model(ids).logits[:, [3, 9]])


def test_granite_logits_are_divided_by_its_logits_scaling_as_its_own_forward_does():
    model = moe.tiny_model("granitemoe", seed=1, logits_scaling=4.0)
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = forward.final_hidden(model, ids, torch.ones_like(ids))[0]  # [T, H]
        torch.testing.assert_close(forward.head_logits(model, hidden), model.lm_head(hidden) / 4.0, atol=0, rtol=0)
