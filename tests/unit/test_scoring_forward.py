"""Batching, the layer-by-layer decoder stack and the LM head, checked against the model's own forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scoring_teacher import VOCAB, tiny

from evoesap import moe
from evoesap.errors import ModelError
from evoesap.scoring import forward
from evoesap.scoring.forward import LayerRunner

FAMILIES = sorted(name for name, family in moe.FAMILIES.items() if family.layerwise)
# windows shorter than the samples, so that sliding-attention layers mask differently from full ones
SLIDING = {
    "gpt_oss": dict(sliding_window=4),
    "mixtral": dict(sliding_window=5),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=4, max_window_layers=4),
}


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
    model = moe.tiny_model(family, seed=1, **SLIDING.get(family, {}))
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
    for row, s in enumerate(seqs):  # real tokens only: padded rows are never read
        torch.testing.assert_close(whole[row, : len(s)], expected[row, : len(s)], atol=0, rtol=0)
        torch.testing.assert_close(split[row, : len(s)], expected[row, : len(s)], atol=0, rtol=0)


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


@pytest.mark.parametrize("family", ["granitemoe", "flex_olmo", "afmoe", "minimax", "granitemoehybrid", "jamba", "llama4_text"])
def test_a_family_whose_layer_is_not_the_pre_norm_pair_is_refused_layer_by_layer_not_scored_wrongly(family):
    with pytest.raises(ModelError, match=f"{family}'s decoder layer is not the pre-norm residual pair"):
        LayerRunner(moe.tiny_model(family))


def test_the_layerwise_check_reads_config_json_alone_and_leaves_an_unreadable_one_to_the_loader(tmp_path):
    granite, olmoe, broken = tmp_path / "granite", tmp_path / "olmoe", tmp_path / "broken"
    moe.tiny_model("granitemoe").config.save_pretrained(granite)  # config.json only: no weights to load
    moe.tiny_model("olmoe").config.save_pretrained(olmoe)
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="granitemoe's decoder layer is not the pre-norm residual pair"):
        forward.check_checkpoint_layerwise(str(granite))
    for readable_or_not in (olmoe, broken, tmp_path / "missing"):
        forward.check_checkpoint_layerwise(str(readable_or_not))  # nothing to refuse here
