"""Each family's routing maths, recomputed from masked router logits.

transformers' routers take softmax/sigmoid and top-k inside their forward, so masking the returned
logits changes nothing. These functions redo the routing from the raw logits plus an additive mask
(0 for kept experts, -inf for removed ones), with the family's own maths, so that the result equals
the routing of the model with those experts physically removed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from evoesap.moe.families import (
    SIGMOID_GROUP_TOPK,
    SOFTMAX_BIAS_TOPK,
    SOFTMAX_TOPK,
    SPARSEMIXER,
    TOPK_SIGMOID,
    TOPK_SOFTMAX,
    Family,
)

# Group-limited routing scores a group by the sum of its best experts; DeepSeek-V3 takes two.
GROUP_SCORE_TOP = 2
# Routing kinds whose recomputation implements group-limited top-k (others refuse to mask it).
GROUP_AWARE = frozenset({SIGMOID_GROUP_TOPK})


@dataclasses.dataclass(frozen=True)
class RouteParams:
    """The per-layer numbers a routing function needs, read once from the config."""

    top_k: int
    renormalize: bool
    scale: float
    n_group: int
    topk_group: int
    norm_min: float
    threshold: float = 0.0  # sparsemixer: experts further than this relative gap below the best are left out
    epsilon: float = 1e-20  # sigmoid routing: added to the sum of the top-k weights before dividing by it


def route_params(family: Family, config: object, top_k: int, n_group: int, topk_group: int) -> RouteParams:
    renormalize = family.renormalize
    if isinstance(renormalize, str):
        renormalize = bool(getattr(config, renormalize, False))
    scale = getattr(config, family.scaling_field) if family.scaling_field else 1.0
    norm_min = getattr(config, family.norm_min_field) if family.norm_min_field else 0.0
    threshold = 2 * getattr(config, family.threshold_field) if family.threshold_field else 0.0
    return RouteParams(
        top_k, renormalize, float(scale), n_group, topk_group, float(norm_min), float(threshold), family.renorm_epsilon
    )


Route = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", RouteParams], tuple[torch.Tensor, torch.Tensor]]


def _softmax_topk(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """OLMoE, Qwen2/3-MoE, Mixtral, DeepSeek-V2 (greedy): softmax over all, top-k, renorm?, scale."""
    probs = torch.softmax(logits.float() + mask, dim=-1)  # [T, E] float32, removed experts get 0
    # Adding the mask again keeps removed experts out of top-k even where kept probs underflow to 0.
    weights, index = torch.topk(probs + mask, p.top_k, dim=-1)  # [T, k]
    if p.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * p.scale, index


def _sigmoid_group_topk(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """DeepSeek-V3: sigmoid; group-limited top-k on scores + bias; unbiased weights, renorm?, scale."""
    scores = torch.sigmoid(logits.float())  # [T, E] float32
    choice = scores + mask if bias is None else scores + bias + mask  # [T, E]; no bias: LFM2-MoE without expert_bias
    if p.n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, p.n_group, experts // p.n_group)  # [T, G, E/G]
        group_scores = grouped.topk(GROUP_SCORE_TOP, dim=-1).values.sum(dim=-1)  # [T, G]
        chosen = torch.topk(group_scores, p.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        in_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)  # [T, G]
        choice = choice.masked_fill(~in_group.repeat_interleave(experts // p.n_group, dim=1), float("-inf"))
    index = torch.topk(choice, p.top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, index)  # [T, k]
    if p.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + p.epsilon)
    return weights * p.scale, index


def _softmax_bias_topk(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """ERNIE-4.5: softmax, top-k on probs + bias, gather unbiased probs, renormalise (clamped).

    The softmax runs over kept experts only (the mask), as removal would: selecting on the full
    softmax plus a -inf bias would rank kept experts differently once the bias is non-zero.
    """
    probs = torch.softmax(logits.float() + mask, dim=-1)  # [T, E] float32
    index = torch.topk(probs + bias + mask, p.top_k, dim=-1).indices  # [T, k]
    weights = probs.gather(1, index)  # [T, k]
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=p.norm_min), index


def _topk_softmax(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """GPT-OSS: top-k on the raw (biased) logits, softmax over the k chosen, in the logits' dtype."""
    values, index = torch.topk(logits + mask.to(logits.dtype), p.top_k, dim=-1)  # [T, k]
    return torch.softmax(values, dim=-1), index


def _topk_sigmoid(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """Llama 4: top-k on the raw logits in their dtype, then the sigmoid of each chosen logit, in float32."""
    values, index = torch.topk(logits + mask.to(logits.dtype), p.top_k, dim=1)  # [T, k]
    return torch.sigmoid(values.float()), index


def _sparsemixer(logits: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, p: RouteParams):
    """Phi-3.5-MoE at inference: two rounds, each taking the best remaining expert and the softmax weight it
    gets among the experts within a relative gap of it; always two experts, whatever top-k says.

    Removed experts are left out of every maximum and softmax explicitly: their -inf logits would turn the
    relative gap into inf/inf, which is not the "absent" that removal means.
    """
    removed = torch.isinf(mask)  # [E]
    scores = logits.masked_fill(removed, float("-inf"))  # [T, E] in the logits' dtype, as the router computes

    def best(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, index = candidates.max(dim=-1, keepdim=True)  # [T, 1]
        factor = scores.abs().clamp(min=top)  # [T, E]
        far = ((top - scores) / factor) > p.threshold
        gates = torch.softmax(candidates.masked_fill(far | removed, float("-inf")), dim=-1)  # [T, E]
        return gates.gather(-1, index), index

    first, index = best(scores)
    second, index2 = best(scores.scatter(-1, index, float("-inf")))
    return torch.cat((first, second), dim=-1), torch.cat((index, index2), dim=-1)


ROUTES: dict[str, Route] = {
    SPARSEMIXER: _sparsemixer,
    SOFTMAX_TOPK: _softmax_topk,
    SIGMOID_GROUP_TOPK: _sigmoid_group_topk,
    SOFTMAX_BIAS_TOPK: _softmax_bias_topk,
    TOPK_SOFTMAX: _topk_softmax,
    TOPK_SIGMOID: _topk_sigmoid,
}
