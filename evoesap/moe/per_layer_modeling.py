"""Opens an EvoESAP non-uniformly pruned MoE checkpoint in plain transformers (trust_remote_code=True).

EvoESAP removed a different number of experts from each MoE layer, so config.json keeps one expert
count per decoder layer, which the stock model class cannot express. The class at the end of this file
subclasses the stock class: its constructor builds the stock model, then gives each MoE layer's router
and expert tensors that layer's count before the weights load, so loading stays strict (every stored
tensor must match its shape; nothing is re-initialised).

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

This file imports only torch and transformers. EvoESAP writes it beside every non-uniformly pruned
checkpoint from its template (evoesap/moe/per_layer_modeling.py) and its family table; EvoESAP's own
loaders use the same functions without remote code.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn


def moe_layers(model: nn.Module, facts: Mapping[str, Any]) -> dict[int, nn.Module]:
    """{decoder layer index: MoE block} of a model; dense layers (no router or experts) are left out."""
    layers = model
    for name in facts.get("layers", "base_model.layers").split("."):
        layers = getattr(layers, name)
    blocks = {i: getattr(layer, facts["block"], None) for i, layer in enumerate(layers)}
    return {
        i: block
        for i, block in blocks.items()
        if getattr(block, facts["router"], None) is not None and getattr(block, facts["experts"], None) is not None
    }


def resize_experts(
    block: nn.Module, facts: Mapping[str, Any], num_experts: int, make: Callable[[torch.Tensor, int], torch.Tensor]
) -> None:
    """Replace every expert-indexed tensor of an MoE block by `make(old, expert_axis)` and set the modules'
    expert counts to `num_experts`."""
    router, experts = getattr(block, facts["router"]), getattr(block, facts["experts"])
    owners = ((router, facts["router_tensors"]), (experts, facts["expert_tensors"]), (block, facts.get("block_tensors", ())))
    with torch.no_grad():
        for module, tensors in owners:
            for path, axis in tensors:
                parent, _, name = path.rpartition(".")
                owner = module.get_submodule(parent)
                old = getattr(owner, name, None)
                if old is None and module is block:  # a config may switch a block's tensor off (LFM2-MoE's expert_bias)
                    continue
                new = make(old, axis)
                if isinstance(old, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=old.requires_grad)
                setattr(owner, name, new)  # a buffer stays a buffer: nn.Module routes it to _buffers
    for module in (block, router, experts):
        if hasattr(module, "num_experts"):
            module.num_experts = num_experts  # every experts backend reads the module's own count


def empty_like_resized(old: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """An uninitialised tensor like `old` with `size` entries along `axis`, for the weights to load into."""
    shape = list(old.shape)
    shape[axis] = size
    return torch.empty(shape, dtype=old.dtype, device=old.device)


def resize_moe_layers(model: nn.Module, facts: Mapping[str, Any], counts: Mapping[str, int]) -> None:
    """Give the MoE layer at decoder index `i` `counts[str(i)]` empty experts, refusing counts for other layers."""
    blocks = moe_layers(model, facts)
    if sorted(int(i) for i in counts) != sorted(blocks):
        raise ValueError(
            f"config.json {facts['per_layer_key']} names decoder layers {sorted(counts, key=int)}, but the model "
            f"has MoE layers {sorted(blocks)}: the config does not belong to this checkpoint"
        )
    for index, block in blocks.items():
        n = int(counts[str(index)])
        resize_experts(block, facts, n, lambda old, axis, n=n: empty_like_resized(old, axis, n))


def per_layer_class(stock: type, facts: Mapping[str, Any]) -> type:
    """The subclass of `stock` (a transformers MoE causal-LM class) that builds each MoE layer with the
    expert count config.json gives it."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        stock.__init__(self, config, *args, **kwargs)
        counts = getattr(config, facts["per_layer_key"], None)
        if not counts:
            raise ValueError(
                f"config.json has no {facts['per_layer_key']}: {facts['class_name']} opens non-uniformly pruned "
                f"checkpoints; load a uniform one with the stock {stock.__name__}"
            )
        resize_moe_layers(self, facts, counts)

    doc = f"{stock.__name__} with a different number of routed experts in each MoE layer."
    return type(facts["class_name"], (stock,), {"__init__": __init__, "__module__": __name__, "__doc__": doc})
