"""Model shapes and training schedules of the demo world, by name.

Kept apart from the training code: the cache key hashes the training code and the chosen profile's values.
"""

from __future__ import annotations

from dataclasses import dataclass

from evoesap.errors import ConfigError


@dataclass(frozen=True)
class Profile:
    """Model shape and training schedule; `default` meets the quality bar, `quick` only smoke-tests."""

    hidden_size: int = 128  # residual width
    num_layers: int = 4  # every layer is MoE (OLMoE)
    num_experts: int = 16  # experts per layer
    top_k: int = 2  # experts per token
    intermediate_size: int = 128  # per-expert MLP width
    num_heads: int = 4
    max_positions: int = 256  # longest chat sample is ~120 characters
    steps: int = 2000  # optimiser steps
    batch_size: int = 32  # samples per step, domains drawn uniformly
    lr: float = 3e-3  # peak AdamW learning rate
    warmup: int = 100  # linear warmup steps before cosine decay
    weight_decay: float = 0.01
    aux_loss_coef: float = 0.01  # router load-balancing loss: balanced yet specialised experts
    train_size: int = 8000  # distinct training prompts per generative domain
    threads: int = 2  # torch intra-op threads, fixed so results do not depend on the machine's core count


PROFILES: dict[str, Profile] = {
    "default": Profile(),
    "quick": Profile(hidden_size=32, num_layers=2, num_experts=4, intermediate_size=32, num_heads=2,
                     steps=12, batch_size=8, train_size=200),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ConfigError(f"unknown demo profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]
