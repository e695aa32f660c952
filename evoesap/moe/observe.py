"""See each token's routing and its experts' unweighted outputs, for importance criteria.

Hooks on every experts module turn one call over T tokens with top-k routing into one call over
T*k (token, expert) rows with weight 1: the family's own expert maths (biases, GPT-OSS's clamped
activation, any experts backend) computes f_i(x) for routed tokens only. The hook then hands the
rows to the callback and returns their gate-weighted sum, so the layer's output is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from evoesap.moe.families import EXPERTS_SCALED_DENSE
from evoesap.moe.spec import MoEBlock, model_family, moe_blocks

# callback(ordinal, top_k_index [T, k] long, top_k_weights [T, k] float32, expert_out [T, k, H] float32)
RoutingCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@contextlib.contextmanager
def observe_routing(model: nn.Module, callback: RoutingCallback) -> Iterator[nn.Module]:
    """During forwards, call `callback` for every MoE layer with its routing and expert outputs."""
    handles = []
    try:
        family = model_family(model)
        for block in moe_blocks(model):
            if family.experts_input == EXPERTS_SCALED_DENSE:
                handles.extend(_observe_scaled_dense(block, callback))
            else:
                handles.extend(_observe(block, callback))
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _observe(block: MoEBlock, callback: RoutingCallback) -> list:
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []  # the call in flight: (index, weights)

    def expand(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = (*args, *kwargs.values())  # [T, H], [T, k], [T, k]
        tokens, k = index.shape
        routed.append((index, weights))
        rows = hidden.repeat_interleave(k, dim=0)  # [T*k, H]: row t*k+j is token t for its j-th expert
        ones = torch.ones(tokens * k, 1, dtype=weights.dtype, device=weights.device)  # [T*k, 1]
        return (rows, index.reshape(-1, 1), ones), {}

    def combine(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        index, weights = routed.pop()
        tokens, k = index.shape
        expert_out = output.view(tokens, k, -1)  # [T, k, H] unweighted, model dtype
        callback(block.ordinal, index, weights.float(), expert_out.float())
        return _weighted_sum(expert_out, index, weights)

    return [
        block.experts.register_forward_pre_hook(expand, with_kwargs=True),
        block.experts.register_forward_hook(combine, with_kwargs=True),
    ]


def _observe_scaled_dense(block: MoEBlock, callback: RoutingCallback) -> list:
    """Llama 4: the experts module runs every expert on every token, each input multiplied by the token's dense
    weight for it (0 where not chosen). The hooks append the unscaled tokens to that call, so one call also gives
    f_i(x) on the token itself; the model keeps the scaled half of the output, exactly what it computes alone.
    g_i(x) is the dense weight of each chosen expert (the model multiplies the expert's input by it)."""
    seen: dict[str, torch.Tensor] = {}  # the call in flight: the block's tokens and the router's dense weights

    def keep_tokens(module: nn.Module, args: tuple) -> None:
        seen["tokens"] = args[0].reshape(-1, args[0].shape[-1])  # [T, H]

    def keep_weights(module: nn.Module, args: tuple, output: tuple) -> None:
        seen["dense"] = output[0]  # [T, E], after any masking hook (registered first)

    def expand(module: nn.Module, args: tuple) -> tuple:
        scaled, tokens = args[0], seen["tokens"]  # [E*T, H], [T, H]
        experts = scaled.shape[0] // tokens.shape[0]
        both = torch.cat((scaled.view(experts, -1, tokens.shape[-1]), tokens.expand(experts, -1, -1)), dim=1)
        return (both.reshape(-1, tokens.shape[-1]),)  # [E*2T, H]: per expert, the scaled tokens then the unscaled

    def combine(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        tokens, dense = seen.pop("tokens"), seen.pop("dense")  # [T, H], [T, E]
        count, hidden = tokens.shape
        both = output.view(-1, 2 * count, hidden)  # [E, 2T, H]
        k = int(block.router.top_k)
        weights, index = dense.float().topk(k, dim=1)  # [T, k]: chosen experts have weight > 0, others exactly 0
        unscaled = both[:, count:].transpose(0, 1)  # [T, E, H]
        expert_out = unscaled.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden))  # [T, k, H]
        callback(block.ordinal, index, weights, expert_out.float())
        return both[:, :count].reshape(-1, hidden)  # [E*T, H], the model's own

    return [
        block.block.register_forward_pre_hook(keep_tokens),
        block.router.register_forward_hook(keep_weights),
        block.experts.register_forward_pre_hook(expand),
        block.experts.register_forward_hook(combine),
    ]


def _weighted_sum(expert_out: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts module's own sum: products cast to the model dtype, added in ascending expert id.

    Rounding like the experts backends do keeps a bfloat16 model's output bit-identical.
    """
    order = index.argsort(dim=1)  # [T, k]
    products = (expert_out * weights.unsqueeze(-1)).to(expert_out.dtype)  # [T, k, H]
    products = products.gather(1, order.unsqueeze(-1).expand_as(products))
    total = torch.zeros_like(products[:, 0])  # [T, H]
    for j in range(products.shape[1]):
        total = total + products[:, j]
    return total
