"""Per-layer routing-frequency histograms: the evidence that experts specialise by domain."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase


@torch.no_grad()
def routing_histograms(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    chats: Sequence[Sequence[dict]],
    batch_size: int = 32,
) -> np.ndarray:
    """Fraction of top-k slots each expert receives per layer over the chats' real tokens: [L, E] float64.

    Recomputes OLMoE's selection (softmax over all experts, then top-k) from the router logits that
    `output_router_logits=True` returns, so it counts what the model actually routes.
    """
    k = int(model.config.num_experts_per_tok)
    n_exp = int(model.config.num_experts)
    counts: np.ndarray | None = None
    for start in range(0, len(chats), batch_size):
        texts = [tokenizer.apply_chat_template(list(c), tokenize=False) for c in chats[start : start + batch_size]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model(**enc, output_router_logits=True)
        keep = enc["attention_mask"].reshape(-1).bool()  # [B*T]
        layers = []
        for logits in out.router_logits:  # each [B*T, E]
            top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices[keep]  # [N, k]
            layers.append(torch.bincount(top.reshape(-1), minlength=n_exp))
        batch = torch.stack(layers).double().numpy()  # [L, E]
        counts = batch if counts is None else counts + batch
    assert counts is not None, "no chats given"
    return counts / counts.sum(axis=1, keepdims=True)


def total_variation(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per-layer total variation distance between two [L, E] histograms: [L]."""
    return 0.5 * np.abs(p - q).sum(axis=1)
