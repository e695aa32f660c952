import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from evoesap.method import allocation
from evoesap.errors import ConfigError


@st.composite
def problems(draw, max_layers=6, max_experts=12):
    """Random layer shapes (sizes may differ per layer), a granularity of 1 or 2 and a feasible budget."""
    n_layers = draw(st.integers(1, max_layers))
    n = [draw(st.integers(1, max_experts)) for _ in range(n_layers)]
    k = [draw(st.integers(1, n_l)) for n_l in n]
    g = draw(st.sampled_from([1, 2]))
    units = sum((a - b) // g for a, b in zip(n, k))
    b = g * draw(st.integers(0, units))
    return n, k, b, g


def assert_feasible(r, n, k, b, g):
    assert len(r) == len(n)
    assert sum(r) == b
    for r_l, n_l, k_l in zip(r, n, k):
        assert 0 <= r_l <= n_l - k_l
        assert r_l % g == 0


@pytest.mark.parametrize(
    ("sparsity", "n", "g", "expected"),
    [
        (0.25, [8, 8, 8], 1, 6),  # 6.0 exactly
        (0.3, [8, 8, 8], 1, 7),  # 7.2 -> 7
        (0.3, [8, 8, 8], 2, 8),  # 7.2 / 2 = 3.6 -> 4 units
        (0.25, [8, 8, 8], 4, 8),  # 6 / 4 = 1.5, a half: up to 2 units
        (0.15, [5, 5], 1, 2),  # 0.15 * 10 is 1.4999... in floats; meant as 1.5, a half: up
        (0.25, [64] * 16, 2, 256),  # OLMoE at 25%
    ],
)
def test_budget_rounds_to_nearest_multiple_of_granularity_halves_up(sparsity, n, g, expected):
    assert allocation.budget(sparsity, n, [2] * len(n), g) == expected


@pytest.mark.parametrize("sparsity", [0.0, 1.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_budget_refuses_sparsity_outside_open_unit_interval(sparsity):
    with pytest.raises(ConfigError, match="sparsity"):
        allocation.budget(sparsity, [8, 8], [2, 2])


def test_budget_refuses_more_than_n_minus_k():
    with pytest.raises(ConfigError, match=r"budget 12 is above sum\(n - k\) = 8"):
        allocation.budget(0.75, [8, 8], [4, 4])


def test_budget_refuses_granularity_no_allocation_meets():
    # n - k = 3 per layer: with g = 2 each layer can lose at most 2, so 4 in all, yet 60% of 10 is 6
    with pytest.raises(ConfigError, match="multiples of granularity 2"):
        allocation.budget(0.6, [5, 5], [2, 2], 2)
    with pytest.raises(ConfigError, match="granularity 4"):
        allocation.budget(0.3, [5, 5], [2, 2], 4)


def test_budget_refuses_a_sparsity_that_rounds_to_nothing():
    with pytest.raises(ConfigError, match="budget of 0"):
        allocation.budget(0.01, [8, 8], [2, 2])


@pytest.mark.parametrize(
    ("r", "message"),
    [
        ((2, 2), "3 MoE layers"),
        ((-1, 3, 2), r"r\[0\] = -1 is outside 0..6"),
        ((7, 0, -3), r"r\[0\] = 7 is outside 0..6"),
        ((1, 3, 0), r"r\[0\] = 1 is not a multiple of the granularity 2"),
        ((2, 2, 2), "removes 6 experts, not the budget 4"),
        ((2.0, 2, 0), "must be an integer"),
    ],
)
def test_check_names_the_offending_value(r, message):
    n, k = [8, 8, 8], [2, 2, 2]
    with pytest.raises(ConfigError, match=message):
        allocation.check(r, n, k, 4, 2)
    assert not allocation.is_feasible(r, n, k, 4, 2)
    assert allocation.is_feasible((2, 2, 0), n, k, 4, 2)


@pytest.mark.parametrize(
    ("n", "budget", "g", "expected"),
    [
        ([8] * 4, 8, 1, (2, 2, 2, 2)),
        ([8] * 4, 9, 1, (2, 2, 3, 2)),  # one left over: eligible layer floor(1 * 4 / 2) = 2
        ([8] * 4, 10, 1, (2, 3, 2, 3)),  # two: floor(1 * 4 / 4) = 1, floor(3 * 4 / 4) = 3
        ([8] * 4, 11, 1, (3, 2, 3, 3)),  # three: floor(4 / 6) = 0, floor(12 / 6) = 2, floor(20 / 6) = 3
        ([4, 8, 8], 10, 1, (2, 4, 4)),  # layer 0 stops at its bound 2, the others share the rest
        ([4, 8, 8], 11, 1, (2, 4, 5)),  # one left over among eligible layers [1, 2]: the second
        ([8] * 3, 10, 2, (4, 2, 4)),  # 5 units of 2: level 1, two left: eligible 0 and 2
    ],
)
def test_uniform_spreads_the_remainder_evenly_as_documented(n, budget, g, expected):
    assert allocation.uniform(n, [2] * len(n), budget, g) == expected


@settings(max_examples=200, deadline=None)
@given(problems())
def test_uniform_is_feasible_and_as_even_as_bounds_allow(problem):
    n, k, b, g = problem
    r = allocation.uniform(n, k, b, g)
    assert_feasible(r, n, k, b, g)
    bounds = [(a - c) // g * g for a, c in zip(n, k)]
    below = [r_l for r_l, u in zip(r, bounds) if r_l < u]
    if below:
        assert max(r) - min(below) <= g


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_proportional_and_frequency_global_are_feasible(problem, data):
    n, k, b, g = problem
    weights = [data.draw(st.floats(0.01, 100)) for _ in n]
    assert_feasible(allocation.proportional(weights, n, k, b, g), n, k, b, g)
    frequency = [[data.draw(st.integers(0, 5)) for _ in range(n_l)] for n_l in n]
    assert_feasible(allocation.frequency_global(frequency, n, k, b, g), n, k, b, g)


# Hand-made example: three layers of 4 experts, top-1 (so at most 3 removed per layer).
FREQ = [[5, 1, 9, 3], [2, 8, 8, 0], [7, 6, 4, 10]]


@pytest.mark.parametrize(
    ("frequency", "budget", "g", "expected"),
    [
        # global ascending: 0 (L1), 1 (L0), 2 (L1), 3 (L0), 4 (L2), ...
        (FREQ, 4, 1, (2, 2, 0)),
        (FREQ, 5, 1, (2, 2, 1)),
        # four zeros in L0 tie with one in L1: ties go to the earlier layer, so the first five are
        # L0 x4 + L1 x1; L0 clips to 3; the missing one goes to the cheaper next expert: L1's 2 < L2's 4
        ([[0, 0, 0, 0], [2, 8, 8, 0], [7, 6, 4, 10]], 5, 1, (3, 2, 0)),
        # g = 2: counts (2, 2, 0) are already multiples of 2
        (FREQ, 4, 2, (2, 2, 0)),
        # g = 2, budget 2: counts (1, 1, 0) round down to nothing; next pairs cost L0 1+3=4, L1 0+2=2,
        # L2 4+6=10, so L1 takes the unit
        (FREQ, 2, 2, (0, 2, 0)),
    ],
)
def test_frequency_global_matches_hand_computed_counts(frequency, budget, g, expected):
    assert allocation.frequency_global(frequency, [4, 4, 4], [1, 1, 1], budget, g) == expected


@settings(max_examples=200, deadline=None)
@given(problems(), st.data())
def test_frequency_global_walks_the_global_ranking_skipping_full_layers(problem, data):
    n, k, b, _ = problem
    frequency = [[data.draw(st.integers(0, 4)) for _ in range(n_l)] for n_l in n]
    # Independent reference: visit experts by (frequency, layer, expert), take one unless its layer is full.
    counts = [0] * len(n)
    for _, layer, _ in sorted((f, layer, e) for layer, fs in enumerate(frequency) for e, f in enumerate(fs)):
        if sum(counts) < b and counts[layer] < n[layer] - k[layer]:
            counts[layer] += 1
    assert allocation.frequency_global(frequency, n, k, b, 1) == tuple(counts)


def test_frequency_global_refuses_a_shape_mismatch():
    with pytest.raises(ConfigError, match=r"frequency\[1\] has 3 experts but the layer has 4"):
        allocation.frequency_global([[1, 2, 3, 4], [1, 2, 3]], [4, 4], [1, 1], 2)


def test_pruned_sets_take_the_first_r_of_each_order_and_are_nested():
    orders = [[3, 0, 2, 1], [1, 2, 3, 0]]
    assert allocation.pruned_sets((2, 1), orders) == {0: [3, 0], 1: [1]}
    assert allocation.pruned_sets((0, 4), orders) == {0: [], 1: [1, 2, 3, 0]}
    for r0, r1 in itertools.product(range(4), range(4)):
        smaller = allocation.pruned_sets((r0, r1), orders)
        larger = allocation.pruned_sets((r0 + 1, r1), orders)
        assert set(smaller[0]) < set(larger[0]) and smaller[1] == larger[1]
    with pytest.raises(ConfigError, match="repeats"):
        allocation.pruned_sets((1, 1), [[0, 0], [0, 1]])
    with pytest.raises(ConfigError, match=r"r\[1\] = 5 is outside 0..4"):
        allocation.pruned_sets((1, 5), orders)


@settings(max_examples=150, deadline=None)
@given(problems(max_layers=4, max_experts=7))
def test_feasible_set_counts_ranks_and_unranks_like_brute_force(problem):
    n, k, b, g = problem
    everything = sorted(r for r in itertools.product(*[range(0, a - c + 1, g) for a, c in zip(n, k)]) if sum(r) == b)
    assume(everything)
    space = allocation.FeasibleSet(n, k, b, g)
    assert space.size == len(everything)
    assert [space.unrank(i) for i in range(space.size)] == everything
    assert [space.rank(r) for r in everything] == list(range(len(everything)))


def test_layer_shapes_are_validated():
    with pytest.raises(ConfigError, match="top_k 9 must be between 1 and num_experts 8"):
        allocation.uniform([8, 8], [2, 9], 2)
    with pytest.raises(ConfigError, match="top_k has 1"):
        allocation.uniform([8, 8], [2], 2)
    with pytest.raises(ConfigError, match="granularity must be >= 1"):
        allocation.uniform([8, 8], [2, 2], 2, 0)
