"""Bytes of a model's weights, and of each routed expert, for memory figures of pruned models."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn

from evoesap.moe.spec import Pruned, check_pruned, expert_tensors, inspect, model_family, moe_blocks


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of what a checkpoint stores: parameters and persistent buffers, tied tensors once."""
    saved = set(model.state_dict(keep_vars=True))
    tensors = {id(p): p for p in model.parameters()}
    tensors.update({id(b): b for name, b in model.named_buffers() if name in saved})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expert_bytes(model: nn.Module) -> tuple[int, ...]:
    """Bytes of one routed expert per MoE layer: its slice of every expert-indexed tensor."""
    family = model_family(model)
    sizes = []
    for block in moe_blocks(model):
        total = 0
        for owner, name, axis in expert_tensors(block, family):
            tensor = getattr(owner, name)
            total += tensor.numel() // tensor.shape[axis] * tensor.element_size()
        sizes.append(total)
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class BytesReport:
    """Weight bytes of a model before and after removing a pruned set."""

    full: int
    pruned: int
    per_expert: tuple[int, ...]  # bytes of one routed expert, per MoE layer
    removed_experts: tuple[int, ...]  # experts removed, per MoE layer

    @property
    def saved(self) -> int:
        return self.full - self.pruned

    @property
    def ratio(self) -> float:
        return self.pruned / self.full


def bytes_report(model: nn.Module, pruned: Pruned | None = None) -> BytesReport:
    """The bytes `model` would store after removing `pruned`, without removing anything."""
    spec = inspect(model)
    sets: Mapping[int, tuple[int, ...]] = check_pruned(spec, pruned or {})
    per_expert = expert_bytes(model)
    removed = tuple(len(sets.get(layer.ordinal, ())) for layer in spec.layers)
    full = parameter_bytes(model)
    return BytesReport(full, full - sum(n * b for n, b in zip(removed, per_expert)), per_expert, removed)
