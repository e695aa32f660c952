"""Shared pieces of the MoE-layer tests: cached tiny models, token batches (one torch thread: tests/conftest.py)."""

import functools

import torch

from evoesap import moe

FAMILIES = sorted(moe.FAMILIES)


@functools.cache
def cached_model(family: str, **overrides) -> torch.nn.Module:
    """One tiny model per family and overrides; tests deepcopy it before changing anything."""
    return moe.tiny_model(family, **overrides)


def tokens(seed: int = 0, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def experts_implementations(model: torch.nn.Module, wanted: tuple[str, ...] = IMPLEMENTATIONS) -> tuple[str, ...]:
    """The experts backends to test `model` under: `wanted`, or only its own ("own") where its experts module has
    one forward and transformers refuses to switch it (Llama 4)."""
    return wanted if model._can_set_experts_implementation() else ("own",)


def set_experts_implementation(model: torch.nn.Module, implementation: str) -> None:
    if implementation != "own":
        model.set_experts_implementation(implementation)
