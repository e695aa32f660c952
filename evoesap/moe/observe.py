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

from evoesap.moe.spec import MoEBlock, moe_blocks

# callback(ordinal, top_k_index [T, k] long, top_k_weights [T, k] float32, expert_out [T, k, H] float32)
RoutingCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@contextlib.contextmanager
def observe_routing(model: nn.Module, callback: RoutingCallback) -> Iterator[nn.Module]:
    """During forwards, call `callback` for every MoE layer with its routing and expert outputs."""
    handles = []
    try:
        for block in moe_blocks(model):
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
