"""Model shapes and training schedules of the demo world, by name.

Kept apart from the training code: the cache key hashes the training code and the chosen profile's values.
"""

from __future__ import annotations

from dataclasses import dataclass

from evoesap.errors import ConfigError


@dataclass(frozen=True)
class Profile:
    """Model shape and training schedule; `default` is the demo world (built for CPU), `quick` only smoke-tests."""

    hidden_size: int = 128  # residual width
    num_layers: int = 4  # every layer is MoE (OLMoE)
    num_experts: int = 16  # experts per layer
    top_k: int = 2  # experts per token
    intermediate_size: int = 128  # per-expert MLP width
    num_heads: int = 4
    max_positions: int = 128  # longest chat sample is ~90 characters
    steps: int = 2000  # optimiser steps: 1,200 left code and math at 0.89-0.94 exact match, too close to the bar
    batch_size: int = 32  # samples per step, domains drawn by `domain_weights`
    lr: float = 5e-3  # peak AdamW learning rate
    warmup: int = 50  # linear warmup steps before cosine decay
    weight_decay: float = 0.01
    aux_loss_coef: float = 0.01  # router load-balancing loss: balanced yet specialised experts
    train_size: int = 8000  # distinct training prompts per generative domain
    # torch intra-op threads, fixed: the weights depend on it (a reduction split over 2 threads rounds otherwise),
    # and one thread neither waits for a core another process holds nor depends on the machine's core count
    threads: int = 1
    # How the experts run while training: "grouped_mm" (one grouped matmul; transformers 5.24's default too)
    # took 1.6 s/step against 21 s for "eager" (a Python loop over experts) and 28 s for "batched_mm" on 2
    # loaded CPU cores (old data, batch 32). It is not saved in the checkpoint's config.
    experts_implementation: str = "grouped_mm"
    # Share of each domain in a batch (sorted domain order: code, copy, facts, math); None = uniform.
    domain_weights: tuple[float, ...] | None = (0.3, 0.15, 0.25, 0.3)


PROFILES: dict[str, Profile] = {
    "default": Profile(),
    "quick": Profile(
        hidden_size=32, num_layers=2, num_experts=4, intermediate_size=32, num_heads=2, steps=12, batch_size=8, train_size=200
    ),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ConfigError(f"unknown demo profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]
