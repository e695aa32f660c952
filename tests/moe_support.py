"""Shared pieces of the MoE-layer tests: one torch thread, cached tiny models, token batches."""

import functools

import pytest
import torch

from evoesap import moe

FAMILIES = sorted(moe.FAMILIES)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; two stall badly when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def cached_model(family: str, **overrides) -> torch.nn.Module:
    """One tiny model per family and overrides; tests deepcopy it before changing anything."""
    return moe.tiny_model(family, **overrides)


def tokens(seed: int = 0, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
