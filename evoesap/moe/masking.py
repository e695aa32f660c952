"""Switch experts off without touching weights, routing exactly as if they had been removed.

A forward hook on each affected router replaces its (weights, indices) with the routing recomputed
from its raw logits plus a -inf mask. Weights and buffers are never written, so leaving the context
(also through an exception) restores the model bit for bit, and entering it costs one small mask
tensor per pruned layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from evoesap.moe.routing import ROUTES, route_params
from evoesap.moe.spec import LayerSpec, MoEBlock, Pruned, check_pruned, has_path, inspect, model_family, moe_blocks
from evoesap.offload import module_device, stored


@contextlib.contextmanager
def masked(model: nn.Module, pruned: Pruned) -> Iterator[nn.Module]:
    """Inside the context, `model` routes as if the experts in `pruned` (ordinal -> ids) were removed."""
    spec = inspect(model)
    sets = check_pruned(spec, pruned)
    handles = []
    try:
        for block in moe_blocks(model):
            ids = sets.get(block.ordinal)
            if ids:
                hook = _masking_hook(model, block, spec.layers[block.ordinal], ids)
                handles.append(block.router.register_forward_hook(hook, prepend=True))  # others see the masked routing
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _masking_hook(model: nn.Module, block: MoEBlock, layer: LayerSpec, ids: tuple[int, ...]):
    family = model_family(model)
    params = route_params(family, family.expert_config(model.config), layer.top_k, layer.n_group, layer.topk_group)
    route = ROUTES[layer.routing]
    device = module_device(block.router)  # an offloaded router (device_map) computes where its hook says
    mask = torch.zeros(layer.num_experts, dtype=torch.float32, device=device)  # [E]
    mask[torch.tensor(ids, device=device)] = float("-inf")
    present = family.selection_bias and has_path(block.block, family.selection_bias)  # LFM2-MoE may have none
    bias = stored(block.block, family.selection_bias).reshape(-1).to(device) if present else None  # [E]

    names = family.router_outputs

    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
        out = dict(zip(names, output, strict=True))  # logits [T, E] raw; weights, index [T, k] or dense_weights [T, E]
        logits = out["logits"]
        new_weights, new_index = route(logits, mask, bias, params)  # [T, k], [T, k]
        if "dense_weights" in out:  # the chosen experts' weights in place, 0 elsewhere, as the router scatters them
            dense = out["dense_weights"]
            out["dense_weights"] = torch.zeros_like(dense).scatter_(1, new_index, new_weights.to(dense.dtype))
        else:
            out["weights"], out["index"] = new_weights.to(out["weights"].dtype), new_index
        return tuple(out[name] for name in names)

    return hook
