import collections
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_allocation import assert_feasible, problems

from evoesap.errors import ArtifactError, ConfigError, DataError
from evoesap.method import allocation, search


def concave(weights, n):
    """sum_l w_l log(n_l - r_l + 1): separable and concave, so its optimum can be computed exactly."""

    def fitness(r):
        return float(sum(w * math.log(n_l - r_l + 1) for w, n_l, r_l in zip(weights, n, r)))

    return fitness


def optimum_by_dp(fitness_terms, n, k, budget, g):
    """Exact maximiser by dynamic programming over layers (independent of the search)."""
    best = {0: (0.0, ())}
    for layer, (n_l, k_l) in enumerate(zip(n, k)):
        nxt = {}
        for spent, (value, r) in best.items():
            for r_l in range(0, n_l - k_l + 1, g):
                if spent + r_l <= budget:
                    cand = (value + fitness_terms(layer, r_l), r + (r_l,))
                    if spent + r_l not in nxt or cand[0] > nxt[spent + r_l][0]:
                        nxt[spent + r_l] = cand
        best = nxt
    return best[budget]


def never_called(r):
    raise AssertionError(f"fitness called with {r} although the input is invalid")


@settings(max_examples=250, deadline=None)
@given(problems(), st.data())
def test_every_candidate_ever_produced_is_feasible(problem, data):
    n, k, b, g = problem
    assume(allocation.FeasibleSet(n, k, b, g).size >= 2)
    population = data.draw(st.integers(2, 10))
    elites = data.draw(st.integers(1, population - 1))
    generations = data.draw(st.integers(0, 4))
    weights = [data.draw(st.floats(-3, 3)) for _ in n]
    seen = []

    def fitness(r):
        assert_feasible(r, n, k, b, g)
        seen.append(r)
        return float(np.dot(weights, r))

    for pattern in search.seed_patterns(n, k, b, g).values():
        assert_feasible(pattern, n, k, b, g)
    result = search.level_switch_search(
        fitness,
        n,
        k,
        b,
        population=population,
        elites=elites,
        generations=generations,
        max_transfer=data.draw(st.integers(1, 6)),
        max_steps=data.draw(st.integers(1, 4)),
        granularity=g,
        seed=data.draw(st.integers(0, 2**32)),
    )
    assert len(result.history) == (generations + 1) * population
    for gen in range(generations + 1):
        records = [h for h in result.history if h.generation == gen]
        assert [h.candidate for h in records] == list(range(population))
        assert sum(h.elite for h in records) == elites
    for h in result.history:
        assert_feasible(h.allocation, n, k, b, g)
    assert len(seen) == len(set(seen)) == result.evaluations  # each allocation evaluated once
    assert result.best_fitness == max(h.fitness for h in result.history) == fitness(result.best)


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("instance", range(10))
def test_default_search_reaches_the_optimum_of_a_separable_concave_fitness(g, instance):
    n, k = [16] * 8, [2] * 8
    budget = allocation.budget(0.25, n, k, g)
    weights = np.random.default_rng(instance).uniform(0.5, 2.0, size=8)
    opt_value, opt = optimum_by_dp(lambda layer, r: weights[layer] * math.log(17 - r), n, k, budget, g)
    result = search.level_switch_search(concave(weights, n), n, k, budget, granularity=g)
    assert result.best == opt
    assert result.best_fitness == pytest.approx(opt_value, abs=1e-9)


@pytest.mark.parametrize("g", [1, 2])
def test_default_search_closes_nearly_all_the_gap_at_olmoe_scale(g):
    # 16 layers x 64 experts, 25%: the optimum lies ~200 experts (L1) from uniform, and the last exchanges
    # gain ~1e-5 each, so 50 generations get within a few experts of it rather than onto it.
    n, k = [64] * 16, [8] * 16
    budget = allocation.budget(0.25, n, k, g)
    weights = np.random.default_rng(0).uniform(0.5, 2.0, size=16)
    opt_value, _ = optimum_by_dp(lambda layer, r: weights[layer] * math.log(65 - r), n, k, budget, g)
    fitness = concave(weights, n)
    uniform_value = fitness(allocation.uniform(n, k, budget, g))
    result = search.level_switch_search(fitness, n, k, budget, granularity=g)
    assert opt_value - result.best_fitness <= 0.01 * (opt_value - uniform_value)


def test_search_finds_an_optimum_far_from_uniform():
    n, k = [16, 16, 32, 32, 16, 16, 32, 32], [2] * 8  # layers of different sizes
    budget = allocation.budget(0.4, n, k)
    weights = [40.0, 0.2, 0.3, 25.0, 0.1, 30.0, 0.2, 15.0]  # cheap layers lose nearly everything
    opt_value, opt = optimum_by_dp(lambda layer, r: weights[layer] * math.log(n[layer] - r + 1), n, k, budget, 1)
    uniform = allocation.uniform(n, k, budget)
    assert sum(abs(a - b) for a, b in zip(opt, uniform)) >= budget // 2  # far from uniform indeed
    result = search.level_switch_search(concave(weights, n), n, k, budget)
    assert result.best == opt
    assert result.best_fitness == pytest.approx(opt_value, abs=1e-9)


def small_search(**kwargs):
    n, k = [8] * 6, [2] * 6
    weights = np.random.default_rng(3).uniform(0.5, 2.0, size=6)
    kwargs = {"generations": 8, "population": 10, "elites": 3, **kwargs}
    return search.level_switch_search(concave(weights, n), n, k, 12, **kwargs)


def test_same_seed_same_history_other_seed_other_history():
    first, again, other = small_search(seed=5), small_search(seed=5), small_search(seed=6)
    assert first == again
    assert first.history != other.history


def test_history_is_identical_in_a_fresh_interpreter():
    code = (
        "import json, math; from evoesap.method import search\n"
        "r = search.level_switch_search(lambda r: -sum((x - 2 * i) ** 2 for i, x in enumerate(r)),"
        " [8] * 5, [2] * 5, 12, generations=5, population=8, elites=2)\n"
        "print(json.dumps([(h.allocation, h.fitness, h.elite) for h in r.history]))"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)]
    here = search.level_switch_search(
        lambda r: -sum((x - 2 * i) ** 2 for i, x in enumerate(r)), [8] * 5, [2] * 5, 12, generations=5, population=8, elites=2
    )
    assert runs[0] == runs[1]
    assert json.loads(runs[0]) == [[list(h.allocation), h.fitness, h.elite] for h in here.history]


class Killed(Exception):
    pass


@pytest.mark.parametrize("where", ["local", "memory"])
def test_killed_at_generation_3_and_resumed_gives_the_uninterrupted_result(tmp_path, where):
    uri = str(tmp_path / "ckpt" / "search.json") if where == "local" else f"memory://evoesap-test/{tmp_path.name}.json"
    n, k = [8] * 6, [2] * 6
    weights = np.random.default_rng(3).uniform(0.5, 2.0, size=6)
    fitness = concave(weights, n)
    uninterrupted = search.level_switch_search(fitness, n, k, 12, generations=8, population=10, elites=3)

    generation = {"done": -1}

    def crashing(r):
        if generation["done"] == 2:  # generation 3 is being evaluated
            raise Killed
        return fitness(r)

    def track(gen, *_):
        generation["done"] = gen

    with pytest.raises(Killed):
        search.level_switch_search(
            crashing, n, k, 12, generations=8, population=10, elites=3, checkpoint=uri, on_generation=track
        )
    calls, progress = [], []

    def counting(r):
        calls.append(r)
        return fitness(r)

    resumed = search.level_switch_search(
        counting,
        n,
        k,
        12,
        generations=8,
        population=10,
        elites=3,
        checkpoint=uri,
        resume=True,
        on_generation=lambda g, *_: progress.append(g),
    )
    assert resumed == uninterrupted
    assert progress == list(range(2, 9))  # restored generation 2, then 3..8
    first_three = {h.allocation for h in uninterrupted.history if h.generation <= 2}
    assert not first_three & set(calls)  # nothing before the checkpoint was evaluated again


def test_resume_can_extend_a_finished_search(tmp_path):
    uri = str(tmp_path / "search.json")
    short = small_search(generations=3, checkpoint=uri)
    longer = small_search(generations=7, checkpoint=uri, resume=True)
    assert longer == small_search(generations=7)
    assert longer.history[: len(short.history)] == short.history
    again = small_search(generations=7, checkpoint=uri, resume=True, population=10)
    assert again == longer


def test_resume_refuses_a_checkpoint_with_other_parameters(tmp_path):
    uri = str(tmp_path / "search.json")
    small_search(generations=2, checkpoint=uri)
    with pytest.raises(ConfigError, match="population: checkpoint 10, now 12"):
        small_search(generations=2, population=12, checkpoint=uri, resume=True)
    with pytest.raises(ConfigError, match="seed: checkpoint 42, now 1"):
        small_search(generations=2, seed=1, checkpoint=uri, resume=True)
    with pytest.raises(ConfigError, match="already has 2 generations"):
        small_search(generations=1, checkpoint=uri, resume=True)


def test_checkpoint_is_complete_json_and_leaves_no_partial_files(tmp_path):
    uri = str(tmp_path / "search.json")
    result = small_search(generations=2, checkpoint=uri)
    saved = json.loads((tmp_path / "search.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["search.json"]
    assert saved["generation"] == 2
    assert len(saved["memo"]) == result.evaluations
    assert len(saved["history"]) == len(result.history)


def test_resume_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "search.json").write_text('{"something": "else"}')
    with pytest.raises(ArtifactError, match="not a evoesap.search/1 checkpoint"):
        small_search(checkpoint=str(tmp_path / "search.json"), resume=True)


def test_resume_without_a_checkpoint_starts_afresh(tmp_path):
    assert small_search(checkpoint=str(tmp_path / "none.json"), resume=True) == small_search()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"elites": 10}, "elites 10 must be smaller than population 10"),
        ({"elites": 12}, "elites 12 must be smaller than population 10"),
        ({"population": 1, "elites": 1}, "population must be >= 2"),
        ({"budget": 40}, r"above sum\(n - k\) = 36"),
        ({"budget": 13, "granularity": 2}, "not a multiple of the granularity 2"),
        ({"num_experts": [7] * 6, "budget": 26, "granularity": 2}, "in multiples of granularity 2"),
        ({"budget": 36}, "single allocation"),
        ({"init": [(2, 2, 2, 2, 2, 3)]}, r"init\[0\]: allocation .* removes 13 experts"),
        ({"max_transfer": 0}, "max_transfer must be >= 1"),
        ({"generations": 1.5}, "generations must be an integer"),
        ({"resume": True}, "needs a checkpoint"),
    ],
)
def test_bad_input_is_refused_before_any_fitness_call(kwargs, message):
    args = {"num_experts": [8] * 6, "top_k": [2] * 6, "budget": 12, "population": 10, "elites": 3, **kwargs}
    with pytest.raises(ConfigError, match=message):
        search.level_switch_search(never_called, **args)


def test_nan_fitness_is_refused():
    with pytest.raises(DataError, match="NaN"):
        search.level_switch_search(lambda r: float("nan"), [8] * 4, [2] * 4, 8)


def test_seed_patterns_follow_their_documented_weights():
    n, k = [16] * 8, [2] * 8
    patterns = search.seed_patterns(n, k, 32)
    # early-heavy: weights 8..1 (sum 36), targets 32 * w / 36 = 7.11, 6.22, 5.33, 4.44, 3.56, 2.67, 1.78,
    # 0.89; floors sum to 28 and the 4 largest fractions (layers 7, 6, 5, 4) get one more
    assert patterns["early_heavy"] == (7, 6, 5, 4, 4, 3, 2, 1)
    assert patterns["late_heavy"] == (1, 2, 3, 4, 4, 5, 6, 7)
    # middle-heavy: weights 1,2,3,4,4,3,2,1 (sum 20): targets 1.6, 3.2, 4.8, 6.4, 6.4, 4.8, 3.2, 1.6;
    # floors sum to 28 and the 4 largest fractions (.8 at layers 2 and 5, .6 at layers 0 and 7) get one more
    assert patterns["middle_heavy"] == (2, 3, 5, 6, 6, 5, 3, 2)
    assert patterns["uniform"] == (4,) * 8


def test_generation_0_holds_uniform_init_and_patterns_then_distinct_random_draws():
    n, k = [16] * 8, [2] * 8
    extra = (8, 8, 8, 8, 0, 0, 0, 0)
    result = search.level_switch_search(lambda r: 0.0, n, k, 32, generations=0, init=[extra])
    first = [h.allocation for h in result.history]
    patterns = search.seed_patterns(n, k, 32)
    assert first[:5] == [patterns["uniform"], extra, patterns["early_heavy"], patterns["middle_heavy"], patterns["late_heavy"]]
    assert len(set(first)) == 32


def test_random_members_are_drawn_uniformly_from_the_feasible_set():
    n, k, budget = [5, 5, 5], [1, 1, 1], 4  # 15 feasible allocations
    space = allocation.FeasibleSet(n, k, budget)
    seeds = set(search.seed_patterns(n, k, budget).values())
    counts = collections.Counter()
    for seed in range(400):
        result = search.level_switch_search(lambda r: 0.0, n, k, budget, population=6, elites=1, generations=0, seed=seed)
        counts.update(h.allocation for h in result.history if h.allocation not in seeds)
    others = space.size - len(seeds)
    assert len(counts) == others
    expected = sum(counts.values()) / others
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 40  # about 10 degrees of freedom: p < 1e-5 if the draws were not uniform


def test_population_larger_than_the_feasible_set_searches_it_exhaustively():
    n, k = [4, 4], [2, 2]  # budget 2: (0, 2), (1, 1), (2, 0)
    result = search.level_switch_search(lambda r: -abs(r[0] - 2), n, k, 2, population=8, elites=2, generations=3)
    assert result.best == (2, 0)
    assert result.evaluations == 3


def test_on_generation_reports_every_generation_monotonically():
    seen = []
    small_search(on_generation=lambda *args: seen.append(args))
    assert [s[0] for s in seen] == list(range(9))
    assert all(a[2] <= b[2] and a[4] <= b[4] for a, b in zip(seen, seen[1:]))


def test_search_never_imports_torch():
    code = "import sys, evoesap.method.search, evoesap.method.allocation; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.floats(0.0, 1.0), st.booleans())
def test_elite_floor_keeps_the_search_and_its_best(seed, slack, racing):
    """A scorer that returns, below the floor, any upper bound that stays below it: the same best, the same
    elites in every generation, the same evaluations, and only bounded candidates' history values differ."""
    n, k = [8] * 5, [2] * 5
    fitness = concave([1.0, 0.4, 2.0, 0.7, 1.3], n)
    floors = []

    def floored(r, floor):
        value = fitness(r)
        floors.append(floor)
        if floor is not None and value < floor:
            return value + slack * (floor - value) * 0.999  # an upper bound, still below the floor
        return value

    schedule = search.Racing() if racing else None
    subset = (lambda r, level, gen: fitness(r) + 0.01 * level) if racing else None
    common = dict(population=12, elites=3, generations=8, seed=seed, racing=schedule, subset_fitness=subset)
    plain = search.level_switch_search(fitness, n, k, 14, **common)
    bounded = search.level_switch_search(floored, n, k, 14, elite_floor=True, **common)
    assert (bounded.best, bounded.best_fitness, bounded.evaluations) == (plain.best, plain.best_fitness, plain.evaluations)
    elites = lambda result: [(h.generation, h.candidate, h.allocation) for h in result.history if h.elite]  # noqa: E731
    assert elites(bounded) == elites(plain)
    assert [h.allocation for h in bounded.history] == [h.allocation for h in plain.history]
    assert floors[0] is None and any(f is not None for f in floors)  # generation 0 has no parents to compare with
    for a, b in zip(plain.history, bounded.history):  # a bound is never below the value, never an elite's
        assert b.fitness == a.fitness or (b.fitness > a.fitness and not b.elite and a.level is None)
