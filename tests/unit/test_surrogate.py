"""The per-sample additive model of statistical racing (evoesap.method.surrogate): what it predicts from what."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evoesap.method.surrogate import Additive

CAPS = (4, 4, 4)
allocations = st.tuples(*(st.integers(0, c) for c in CAPS))


def additive_world(seed: int, members: int = 40, samples: int = 16):
    """Per-sample fitness that is exactly a sum over layers of a value per (layer, removal count, sample), on random
    allocations -> (the values [L, cap + 1, S], the allocations, their fitness vectors [members, S])."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 1.0, size=(len(CAPS), max(CAPS) + 1, samples)).cumsum(axis=1)  # a random walk in r
    rs = [tuple(int(rng.integers(0, c + 1)) for c in CAPS) for _ in range(members)]
    return table, rs, np.stack([truth(table, r) for r in rs])


def truth(table: np.ndarray, r) -> np.ndarray:
    return sum(table[layer, v] for layer, v in enumerate(r))


@given(allocations, allocations)
def test_an_untrained_model_predicts_no_difference(a, b):
    model = Additive.fit(CAPS, [], np.zeros((0, 7)))
    assert np.array_equal(model.difference(a, b), np.zeros(7))


@given(st.integers(0, 10_000), allocations, allocations)
@settings(max_examples=50, deadline=None)
def test_on_additive_fitness_it_predicts_the_per_sample_differences(seed, a, b):
    """Within 5% of the largest true difference on every sample (the ridge's small pull towards smooth, small values),
    antisymmetric, and zero between an allocation and itself."""
    table, rs, vectors = additive_world(seed)
    model = Additive.fit(CAPS, rs, vectors)
    true = truth(table, a) - truth(table, b)
    scale = max(1.0, float(np.abs(table[:, 1:] - table[:, :-1]).max()))
    assert np.abs(model.difference(a, b) - true).max() <= 0.05 * scale * len(CAPS)
    assert np.allclose(model.difference(b, a), -model.difference(a, b))
    assert np.array_equal(model.difference(a, a), np.zeros(vectors.shape[1]))


def test_the_model_is_far_closer_than_the_plain_difference_on_additive_fitness():
    """The spread of what the race still has to estimate shrinks: per-sample differences minus the prediction
    spread far less than the differences themselves."""
    table, rs, vectors = additive_world(1)
    model = Additive.fit(CAPS, rs, vectors)
    a, b = (4, 0, 2), (0, 3, 1)
    d = truth(table, a) - truth(table, b)
    assert np.std(d - model.difference(a, b)) < 0.05 * np.std(d)


def test_the_spread_is_the_leave_one_out_error_of_the_members_means():
    """Against refitting without each member in turn and predicting its full-set mean (the closed form's claim)."""
    table, rs, vectors = additive_world(2, members=14)
    vectors = vectors + np.random.default_rng(3).normal(0.0, 0.5, size=(len(rs), 1))  # a deviation of each allocation
    model = Additive.fit(CAPS, rs, vectors)
    errors = [
        Additive.fit(CAPS, rs[:i] + rs[i + 1 :], np.delete(vectors, i, axis=0)).mean(rs[i]) - vectors[i].mean()
        for i in range(len(rs))
    ]
    assert model.spread == pytest.approx(float(np.sqrt(np.mean(np.square(errors)))), rel=1e-6)
    assert model.members == len(rs)
    assert Additive.fit(CAPS, rs[:1], vectors[:1]).spread == np.inf  # nothing to leave one out against


@given(st.integers(0, 10_000), allocations, allocations)
@settings(max_examples=50, deadline=None)
def test_the_predicted_mean_moves_with_the_predicted_differences(seed, a, b):
    """mean(a) - mean(b) is the full-set mean of the per-sample differences, and on additive fitness mean(a) is close
    to the true full-set mean (the ridge's small pull)."""
    table, rs, vectors = additive_world(seed)
    model = Additive.fit(CAPS, rs, vectors)
    assert model.mean(a) - model.mean(b) == pytest.approx(float(model.difference(a, b).mean()), abs=1e-9)
    scale = max(1.0, float(np.abs(table[:, 1:] - table[:, :-1]).max()))
    assert abs(model.mean(a) - float(truth(table, a).mean())) <= 0.05 * scale * len(CAPS)


def test_the_model_covers_only_removal_counts_some_member_has():
    model = Additive.fit(CAPS, [(0, 1, 2), (3, 1, 4)], np.zeros((2, 5)))
    assert model.covers((0, 1, 4)) and model.covers((3, 1, 2))
    assert not model.covers((1, 1, 2))  # no member removes one expert in layer 0
    assert not Additive.fit(CAPS, [], np.zeros((0, 5))).covers((0, 1, 2))
