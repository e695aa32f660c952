"""The per-sample additive model of statistical racing (evoesap.method.surrogate): what it predicts from what."""

from __future__ import annotations

import numpy as np
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
