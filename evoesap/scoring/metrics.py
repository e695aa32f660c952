"""Per-position fitness maths between the full model p (teacher) and a pruned candidate q.

Every function takes [N, V] rows (N scored positions, V vocabulary) in any float dtype and does its
softmax and sums in float32, because bf16/fp16 sums over a 50k vocabulary lose the third decimal of
ESAP, which is where candidates differ. The teacher side is always log-probabilities (what the cache
stores); the candidate side is raw logits straight from the LM head.

Sign convention for search fitness (`METRICS`): higher is better. ESAP and SAP are used as they are;
KL(p||q) and the NLL are negated, so a search maximises every metric the same way.
"""

from __future__ import annotations

import dataclasses
import torch

from evoesap.errors import ConfigError


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def esap(teacher_logprobs: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """Expected speculative acceptance probability, sum_v min(p, q) = 1 - TV(p, q), per row -> [N] float32.

    Computed as sum_v exp(min(log p, log q)) in one [N, V] float32 buffer: the minimum reads the teacher
    in its stored dtype (float16 upcasts exactly), so no float32 copy of the teacher rows is made."""
    log_q = torch.log_softmax(_f32(candidate_logits), dim=-1)  # [N, V] float32
    return torch.minimum(log_q, teacher_logprobs.to(log_q.device), out=log_q).exp_().sum(dim=-1)  # [N]


def sap_draws(candidate_logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Proposal tokens y ~ q by inverse CDF from uniforms in [0, 1) -> [N] long.

    Inverse CDF (not torch.multinomial) so that the draw is a documented function of the uniforms:
    an evaluator can fix the uniforms once per position and give every candidate the same random
    numbers, and a reference implementation can reproduce the draw.
    """
    q = torch.softmax(_f32(candidate_logits), dim=-1)  # [N, V] float32
    cdf = torch.cumsum(q, dim=-1)  # [N, V] float32
    u = _f32(uniforms).to(cdf.device).unsqueeze(-1) * cdf[:, -1:]  # [N, 1], scaled so rounding never overshoots
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(q.shape[-1] - 1)  # [N] long


def sap(
    teacher_logprobs: torch.Tensor,
    candidate_logits: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled acceptance probability: draw y ~ q, accept with min(1, p(y) / q(y)) -> [N] float32.

    Its expectation over y is ESAP; it is the single-sample estimate speculative decoding sees.
    Pass either a seeded `generator` (uniforms drawn from it, one per row) or the `uniforms` [N].
    """
    if (generator is None) == (uniforms is None):
        raise ConfigError("sap needs exactly one of a seeded torch.Generator or uniforms [N]")
    n = candidate_logits.shape[0]
    if uniforms is None:
        uniforms = torch.rand(n, generator=generator, device=generator.device)  # [N] float32
    y = sap_draws(candidate_logits, uniforms).unsqueeze(-1)  # [N, 1] long
    log_q = torch.log_softmax(_f32(candidate_logits), dim=-1)  # [N, V] float32
    log_p_y = _f32(teacher_logprobs).gather(-1, y.to(teacher_logprobs.device)).squeeze(-1)  # [N]
    log_q_y = log_q.gather(-1, y).squeeze(-1)  # [N]
    return torch.exp(torch.clamp(log_p_y - log_q_y, max=0.0))  # min(1, p/q), [N]


def kl(teacher_logprobs: torch.Tensor, candidate_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row -> [N] float32; tokens with p = 0 contribute 0."""
    log_p = _f32(teacher_logprobs)  # [N, V]
    log_q = torch.log_softmax(_f32(candidate_logits), dim=-1)  # [N, V]
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))  # [N, V]
    return terms.sum(dim=-1)


def nll(candidate_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the candidate on the target tokens -> [N] float32."""
    log_q = torch.log_softmax(_f32(candidate_logits), dim=-1)  # [N, V]
    return -log_q.gather(-1, targets.long().to(log_q.device).unsqueeze(-1)).squeeze(-1)


def esap_topk_bounds(
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    tail_mass: torch.Tensor,
    candidate_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact bounds on ESAP from the teacher's top-K only -> (lower [N], upper [N]) float32.

    lower = sum over the top-K of min(p, q) (the tail's min terms are >= 0);
    upper = lower + min(p_tail, q_tail), since sum_tail min(p, q) <= min(sum_tail p, sum_tail q).
    """
    q = torch.softmax(_f32(candidate_logits), dim=-1)  # [N, V]
    ids = topk_ids.long().to(q.device)  # [N, K]
    q_top = q.gather(-1, ids)  # [N, K]
    p_top = _f32(topk_logprobs).to(q.device).exp()  # [N, K]
    lower = torch.minimum(p_top, q_top).sum(dim=-1)  # [N]
    q_tail = (1.0 - q_top.sum(dim=-1)).clamp_min(0.0)  # [N]
    upper = lower + torch.minimum(_f32(tail_mass).to(q.device).clamp_min(0.0), q_tail)
    return lower, upper


def per_sample_mean(values: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Mean of `values` [N] within each sample (sample_index [N] in 0..S-1) -> [S] float32, NaN where empty.

    Each sample weighs the same in the dataset score however many answer tokens it has.
    """
    values = _f32(values)
    idx = sample_index.long().to(values.device)
    sums = torch.zeros(num_samples, dtype=torch.float32, device=values.device).index_add_(0, idx, values)
    counts = torch.zeros(num_samples, dtype=torch.float32, device=values.device).index_add_(0, idx, torch.ones_like(values))
    return sums / counts  # 0/0 = NaN marks a sample with no scored position


def dataset_mean(sample_means: torch.Tensor) -> float:
    """Dataset-level score: mean over samples of their per-sample means (empty samples skipped)."""
    kept = sample_means[~torch.isnan(sample_means)]
    if kept.numel() == 0:
        raise ConfigError("no sample has a scored position: nothing to average (check the answer masks)")
    return float(kept.double().mean())


@dataclasses.dataclass(frozen=True)
class Metric:
    """A search fitness: per-position raw values and the sign that makes higher better."""

    name: str
    sign: float  # +1 for ESAP/SAP, -1 for KL/NLL so that the search always maximises
    needs_full_vocab: bool  # False when a top-K cache suffices (ESAP gives bounds, NLL needs only targets)
    doc: str
    best: float  # the best raw value a sample can score (ESAP/SAP 1, KL/NLL 0): bounds a sample not scored yet


METRICS: dict[str, Metric] = {
    "esap": Metric("esap", 1.0, False, "sum_v min(p, q) = 1 - TV; a top-K cache gives its lower bound", 1.0),
    "sap": Metric("sap", 1.0, True, "min(1, p(y)/q(y)) for y ~ q, fixed uniforms per position", 1.0),
    "kl": Metric("kl", -1.0, True, "-KL(p || q)", 0.0),
    "nll": Metric("nll", -1.0, False, "-NLL of the candidate on the answer tokens", 0.0),
}


def metric(name: str) -> Metric:
    """The registered metric `name`, or a clear error listing the valid names."""
    try:
        return METRICS[name]
    except KeyError:
        raise ConfigError(f"unknown metric {name!r}: choose one of {', '.join(METRICS)}") from None
