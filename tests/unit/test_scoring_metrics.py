"""Metrics (fitness maths) against an independent numpy (float64) reference, and the top-K bounds' invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap.errors import ConfigError
from evoesap.scoring import metrics


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _random_pair(seed: int, n: int = 64, v: int = 97, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    teacher_logits = rng.normal(0.0, scale, size=(n, v)).astype(np.float32)
    cand_logits = (teacher_logits + rng.normal(0.0, 1.0, size=(n, v))).astype(np.float32)
    return _np_log_softmax(teacher_logits).astype(np.float32), cand_logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_esap_kl_nll_match_numpy_reference(seed: int) -> None:
    lp, cl = _random_pair(seed)
    p = np.exp(lp.astype(np.float64))
    log_q = _np_log_softmax(cl)
    q = np.exp(log_q)
    targets = np.random.default_rng(seed + 100).integers(0, cl.shape[1], size=cl.shape[0])

    ref_esap = np.minimum(p, q).sum(axis=-1)
    ref_kl = (p * (lp.astype(np.float64) - log_q)).sum(axis=-1)
    ref_nll = -log_q[np.arange(len(targets)), targets]

    t_lp, t_cl = torch.from_numpy(lp), torch.from_numpy(cl)
    np.testing.assert_allclose(metrics.esap(t_lp, t_cl).numpy(), ref_esap, atol=1e-6)
    np.testing.assert_allclose(metrics.kl(t_lp, t_cl).numpy(), ref_kl, atol=1e-6)
    np.testing.assert_allclose(metrics.nll(t_cl, torch.from_numpy(targets)).numpy(), ref_nll, atol=1e-6)


def test_esap_is_one_minus_total_variation() -> None:
    lp, cl = _random_pair(7)
    p = np.exp(lp.astype(np.float64))
    q = np.exp(_np_log_softmax(cl))
    tv = 0.5 * np.abs(p - q).sum(axis=-1)
    np.testing.assert_allclose(metrics.esap(torch.from_numpy(lp), torch.from_numpy(cl)).numpy(), 1.0 - tv, atol=1e-6)


def test_esap_is_one_for_identical_distributions_in_half_precision() -> None:
    lp, _ = _random_pair(3, v=4096)
    logits = torch.from_numpy(lp).to(torch.bfloat16)
    values = metrics.esap(torch.log_softmax(logits.float(), -1), logits)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, torch.ones_like(values), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 5])
def test_sap_matches_numpy_reference_with_the_same_seed(seed: int) -> None:
    lp, cl = _random_pair(seed)
    n = cl.shape[0]
    # the reference draws y ~ q by inverse CDF from the uniforms that the same seed gives
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(seed)).double().numpy()
    log_q = _np_log_softmax(cl)
    q = np.exp(log_q)
    cdf = np.cumsum(q, axis=-1)
    y = np.array([min(int(np.searchsorted(cdf[i], uniforms[i] * cdf[i, -1], side="right")), q.shape[1] - 1) for i in range(n)])
    ref = np.minimum(1.0, np.exp(lp.astype(np.float64)[np.arange(n), y] - log_q[np.arange(n), y]))

    got = metrics.sap(torch.from_numpy(lp), torch.from_numpy(cl), torch.Generator().manual_seed(seed))
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-6)
    again = metrics.sap(torch.from_numpy(lp), torch.from_numpy(cl), torch.Generator().manual_seed(seed))
    assert torch.equal(got, again)


def test_sap_averages_to_esap() -> None:
    lp, cl = _random_pair(11, n=4, v=13, scale=1.0)
    t_lp = torch.from_numpy(np.repeat(lp, 20000, axis=0))
    t_cl = torch.from_numpy(np.repeat(cl, 20000, axis=0))
    draws = metrics.sap(t_lp, t_cl, torch.Generator().manual_seed(0)).view(4, 20000).mean(dim=1)
    torch.testing.assert_close(draws, metrics.esap(torch.from_numpy(lp), torch.from_numpy(cl)), atol=0.01, rtol=0)


def test_sap_needs_exactly_one_source_of_randomness() -> None:
    lp, cl = _random_pair(0, n=2, v=5)
    with pytest.raises(ConfigError):
        metrics.sap(torch.from_numpy(lp), torch.from_numpy(cl))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    v=st.integers(2, 200),
    k=st.integers(1, 200),
    scale=st.floats(0.1, 8.0),
    noise=st.floats(0.0, 4.0),
)
def test_topk_bounds_contain_the_full_vocabulary_esap(seed: int, v: int, k: int, scale: float, noise: float) -> None:
    k = min(k, v)
    g = torch.Generator().manual_seed(seed)
    teacher_logits = torch.randn(16, v, generator=g) * scale
    cand = teacher_logits + torch.randn(16, v, generator=g) * noise
    lp = torch.log_softmax(teacher_logits, -1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    tail = lp.exp().scatter(-1, top_ids, 0.0).sum(-1)
    lower, upper = metrics.esap_topk_bounds(top_ids, top_lp, tail, cand)
    exact = metrics.esap(lp, cand)
    assert bool((lower <= exact + 1e-6).all()), (lower - exact).max()
    assert bool((exact <= upper + 1e-6).all()), (exact - upper).max()
    if k == v:
        torch.testing.assert_close(lower, exact, atol=1e-6, rtol=0)


def test_per_sample_mean_weighs_samples_equally() -> None:
    values = torch.tensor([1.0, 1.0, 1.0, 0.0])
    index = torch.tensor([0, 0, 0, 1])
    means = metrics.per_sample_mean(values, index, 3)
    assert means[:2].tolist() == [1.0, 0.0] and torch.isnan(means[2])
    assert metrics.dataset_mean(means) == 0.5


def test_metric_registry_makes_higher_better() -> None:
    assert metrics.metric("esap").sign == 1.0 and metrics.metric("kl").sign == -1.0
    with pytest.raises(ConfigError, match="esap"):
        metrics.metric("tv")
