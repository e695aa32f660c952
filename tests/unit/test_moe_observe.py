"""observe_routing: the routing the model applies, each routed expert's own output, and no change to the model."""

from __future__ import annotations

import pytest
import torch
from moe_support import FAMILIES, cached_model, experts_implementations, tokens

from evoesap import moe


class Recorder:
    """What the callback received, and what the routers and experts modules saw and returned."""

    def __init__(self, model: torch.nn.Module):
        self.observed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.blocks = moe.moe_blocks(model)

    def callback(self, ordinal, index, weights, expert_out) -> None:
        assert ordinal not in self.observed  # one call per layer per forward
        self.observed[ordinal] = (index.clone(), weights.clone(), expert_out.clone())

    def router_hooks(self) -> list:
        return [b.router.register_forward_hook(self._keep_routing(b.ordinal)) for b in self.blocks]

    def _keep_routing(self, ordinal: int):
        def hook(module, args, output) -> None:
            if len(output) == 2:  # Llama 4: dense weights [T, E] (0 where not chosen), raw logits
                values, index = output[1].topk(module.top_k, dim=1)  # the router's own top-k, on its logits
                self.routed[ordinal] = (index, output[0].gather(1, index))
            else:
                self.routed[ordinal] = (output[2].clone(), output[1].clone())  # indices, weights

        return hook


def experts_outputs(model: torch.nn.Module, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each experts module's (gate-weighted) output in a plain forward."""
    outputs: dict[int, torch.Tensor] = {}
    handles = [
        b.experts.register_forward_hook(lambda m, a, o, ordinal=b.ordinal: outputs.__setitem__(ordinal, o.clone()))
        for b in moe.moe_blocks(model)
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return outputs


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_observe_routing_reports_applied_routing_and_unweighted_expert_outputs(family, implementation):
    model = cached_model(family)
    switchable = experts_implementations(model) != ("own",)
    if not switchable and implementation != "eager":
        pytest.skip(f"{family} has one experts forward, tested once")
    if switchable:
        model.set_experts_implementation(implementation)
    x = tokens()
    with torch.no_grad():
        expected_logits = model(x).logits
    expected_outputs = experts_outputs(model, x)

    recorder = Recorder(model)
    block_inputs: dict[int, torch.Tensor] = {}  # each MoE block's tokens [T, H]
    handles = recorder.router_hooks() + [
        b.block.register_forward_pre_hook(
            lambda m, a, ordinal=b.ordinal: block_inputs.__setitem__(ordinal, a[0].reshape(-1, a[0].shape[-1]).clone())
        )
        for b in recorder.blocks
    ]
    try:
        with torch.no_grad(), moe.observe_routing(model, recorder.callback):
            observed_logits = model(x).logits
    finally:
        for handle in handles:
            handle.remove()

    assert (observed_logits - expected_logits).abs().max() <= 1e-5  # the model's output is unchanged
    with torch.no_grad():  # hooks gone: the model is as before
        assert torch.equal(model(x).logits, expected_logits)
    assert sorted(recorder.observed) == [b.ordinal for b in recorder.blocks]
    hidden = model.config.get_text_config().hidden_size
    for block in recorder.blocks:
        index, weights, expert_out = recorder.observed[block.ordinal]
        router_index, router_weights = recorder.routed[block.ordinal]
        tokens_k = router_index.shape
        assert index.dtype == torch.long and weights.dtype == expert_out.dtype == torch.float32
        assert expert_out.shape == (*tokens_k, hidden)  # routed tokens only, not every expert
        assert torch.equal(index, router_index)
        assert torch.equal(weights, router_weights.float())
        if moe.FAMILIES[family].experts_input == "scaled_dense":  # Llama 4 weights each expert's input
            unscaled = block.experts(block_inputs[block.ordinal].repeat(block.experts.num_experts, 1))  # [E*T, H]
            unscaled = unscaled.view(block.experts.num_experts, -1, hidden).transpose(0, 1)  # [T, E, H]
            assert torch.allclose(expert_out, unscaled.gather(1, index.unsqueeze(-1).expand_as(expert_out)), atol=1e-6)
            continue
        # the gate-weighted sum is what the experts module returns in a plain forward
        weighted = (expert_out * weights.unsqueeze(-1)).sum(dim=1)
        assert (weighted - expected_outputs[block.ordinal]).abs().max() <= 1e-5
    if switchable:
        model.set_experts_implementation("grouped_mm")


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "deepseek_v3"])
def test_expert_out_is_each_experts_own_output_on_its_token(family):
    model = cached_model(family)
    x = tokens(1)
    recorder = Recorder(model)
    inputs: dict[int, torch.Tensor] = {}
    handles = [  # the experts' input tokens, captured before observe_routing repeats them
        b.experts.register_forward_pre_hook(lambda m, a, ordinal=b.ordinal: inputs.__setitem__(ordinal, a[0].clone()))
        for b in recorder.blocks
    ]
    try:
        with torch.no_grad(), moe.observe_routing(model, recorder.callback):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    block = recorder.blocks[-1]
    index, _, expert_out = recorder.observed[block.ordinal]
    hidden = inputs[block.ordinal]  # [T, H]
    for token in (0, 7, hidden.shape[0] - 1):
        for j in range(index.shape[1]):
            alone = torch.tensor([[index[token, j]]])  # one token sent to one expert with weight 1
            with torch.no_grad():
                expected = block.experts(hidden[token : token + 1], alone, torch.ones(1, 1))
            assert torch.allclose(expert_out[token, j], expected[0], atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_observe_routing_keeps_a_bfloat16_models_eager_output_bit_identical(family):
    model = moe.tiny_model(family, **{moe.FAMILIES[family].top_k_field: 4}).to(torch.bfloat16)
    model.set_experts_implementation("eager")
    x = tokens(3)
    with torch.no_grad():
        expected = model(x).logits
        with moe.observe_routing(model, lambda *args: None):
            assert torch.equal(model(x).logits, expected)


@pytest.mark.parametrize("observe_first", [False, True])
@pytest.mark.parametrize(
    "family, pruned", [("ernie4_5_moe", {0: [0, 1, 2, 3, 4, 5], 1: [6], 2: []}), ("llama4_text", {0: [0, 1, 2, 3, 4, 5], 1: [6]})]
)
def test_observe_routing_under_masking_never_reports_a_masked_expert(family, pruned, observe_first):
    model = cached_model(family)
    recorder = Recorder(model)
    contexts = [moe.masked(model, pruned), moe.observe_routing(model, recorder.callback)]
    with torch.no_grad(), contexts[observe_first], contexts[not observe_first]:  # either order of entering
        model(tokens(2))
    for ordinal, ids in pruned.items():
        assert not set(ids) & set(recorder.observed[ordinal][0].unique().tolist())


def test_observe_routing_removes_its_hooks_after_an_exception():
    model = cached_model("qwen2_moe")
    with pytest.raises(RuntimeError, match="stop"), moe.observe_routing(model, lambda *args: None):
        raise RuntimeError("stop")
    assert all(not b.experts._forward_hooks and not b.experts._forward_pre_hooks for b in moe.moe_blocks(model))
