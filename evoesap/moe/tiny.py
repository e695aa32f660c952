"""Tiny random models of every family, for tests and benchmarks: seconds on a CPU, no download."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel

from evoesap.moe.families import family_of
from evoesap.moe.spec import expert_tensors, moe_blocks

# Shared by every family; each table row's `tiny` adds its experts, top-k and dense/shared layout.
_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,  # dense layers and families whose experts use it are overridden per row
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # wider than 0.02 so that tiny routers make distinct choices
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_BIAS_STD = 0.05  # selection and expert biases start random, so dropping a wrong row shows up


def tiny_model(family: str, seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """A tiny random float32 model of `family` (a transformers model_type), deterministic per seed."""
    row = family_of(family)
    if row.text_config:  # a multimodal model: the shared sizes and the overrides go to its language model
        tiny = dict(row.tiny)
        text = {**_BASE, **tiny.pop(row.text_config), **config_overrides}
        config = AutoConfig.for_model(row.model_type, **{row.text_config: text, **tiny})
    else:
        config = AutoConfig.for_model(row.model_type, **{**_BASE, **row.tiny, **config_overrides})
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's global RNG is left untouched
        torch.manual_seed(seed)
        model = getattr(transformers, row.auto_class).from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for block in moe_blocks(model):
                for owner, name, _ in expert_tensors(block, row):
                    if name.endswith("bias"):
                        getattr(owner, name).normal_(0.0, _BIAS_STD)
    return model.eval()
