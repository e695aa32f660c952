"""Train the demo's small OLMoE on CPU, deterministically for a seed.

The model has to actually learn the domains (so pruning has measurable consequences) and route them
to different experts (so importance scores mean something), within minutes on two cores.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM, PreTrainedTokenizerBase

from evoesap.data import Sample, encode_sample
from evoesap.demo.profiles import Profile
from evoesap.errors import ConfigError
from evoesap.machine.runtime import fixed_cpu_threads
from evoesap.progress import progress

log = logging.getLogger(__name__)

IGNORE = -100  # label value the loss skips


def make_model(profile: Profile, tokenizer: PreTrainedTokenizerBase, seed: int) -> OlmoeForCausalLM:
    """A freshly initialised OLMoE whose init depends only on `seed`."""
    config = OlmoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=profile.hidden_size,
        intermediate_size=profile.intermediate_size,
        num_hidden_layers=profile.num_layers,
        num_attention_heads=profile.num_heads,
        num_key_value_heads=profile.num_heads,
        max_position_embeddings=profile.max_positions,
        num_experts=profile.num_experts,
        num_experts_per_tok=profile.top_k,
        norm_topk_prob=False,
        router_aux_loss_coef=profile.aux_loss_coef,
        output_router_logits=False,  # off at inference; training asks for it per call
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OlmoeForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of a chat through its template, and the tokens learned: the answer mask of `evoesap.data`
    (assistant content and end of turn), so the model is trained on exactly what the search scores."""
    return encode_sample(Sample(id=0, messages=tuple((m["role"], m["content"]) for m in messages)), tokenizer)


def _batch(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels that keep only assistant tokens."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)  # [B, T]
    for i, (row, mask) in enumerate(rows):
        n = len(row)
        ids[i, :n] = torch.tensor(row)
        attn[i, :n] = 1
        keep = torch.tensor(mask)
        labels[i, :n] = torch.where(keep, torch.tensor(row), torch.tensor(IGNORE))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def train(
    model: OlmoeForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    train_sets: dict[str, list[list[dict]]],
    profile: Profile,
    seed: int,
) -> dict[str, float]:
    """Train in place on chat samples (domain -> list of messages); returns loss and timing figures.

    Each step draws `batch_size` samples, the domain of each by `profile.domain_weights`, from a numpy Generator seeded by
    `seed`, so the data order (and with fixed threads and deterministic kernels, the weights) repeat.
    """
    domains = sorted(train_sets)
    encoded = {d: [encode_chat(tokenizer, m) for m in train_sets[d]] for d in domains}
    too_long = [(d, len(ids)) for d in domains for ids, _ in encoded[d] if len(ids) > profile.max_positions]
    if too_long:
        raise ConfigError(f"training sample longer than max_positions={profile.max_positions}: {too_long[0]}")
    rng = np.random.default_rng([seed, 1])
    if profile.domain_weights is None:
        weights = np.full(len(domains), 1.0 / len(domains))
    else:
        if len(profile.domain_weights) != len(domains):
            raise ConfigError(f"domain_weights has {len(profile.domain_weights)} entries for domains {domains}")
        weights = np.asarray(profile.domain_weights, dtype=np.float64) / sum(profile.domain_weights)
    model.set_experts_implementation(profile.experts_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=profile.lr, betas=(0.9, 0.98), weight_decay=profile.weight_decay)

    def lr_at(step: int) -> float:
        if step < profile.warmup:
            return (step + 1) / profile.warmup
        frac = (step - profile.warmup) / max(1, profile.steps - profile.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    losses: list[torch.Tensor] = []
    with fixed_cpu_threads(profile.threads):
        for step in progress(range(profile.steps), desc="train demo model"):
            which = rng.choice(len(domains), size=profile.batch_size, p=weights)
            rows = [encoded[domains[d]][int(rng.integers(len(encoded[domains[d]])))] for d in which]
            out = model(**_batch(rows, tokenizer.pad_token_id), output_router_logits=True, use_cache=False)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(out.loss.detach())
            if step % 200 == 0 or step == profile.steps - 1:
                log.info(
                    "step %d loss %.4f aux %.4f %.2fs (cpu %.2fs)",
                    step,
                    float(out.loss.detach()),
                    float(out.aux_loss.detach()),
                    time.perf_counter() - start,
                    time.process_time() - cpu_start,
                )
    model.eval()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tail = torch.stack(losses[-50:]).mean()
    # cpu_seconds / threads estimates the wall time on idle cores when the machine is shared.
    return {
        "train_seconds": seconds,
        "train_cpu_seconds": cpu_seconds,
        "final_loss": float(tail),
        "steps": profile.steps,
        "load_average": list(os.getloadavg()),
    }
