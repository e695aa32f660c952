"""Racing: successive halving inside the level-switch search, its schedule and its subsets."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from evoesap import racing, search
from evoesap.errors import ConfigError

from test_search import concave

N, K, BUDGET = [8] * 6, [2] * 6, 12
WEIGHTS = np.random.default_rng(3).uniform(0.5, 2.0, size=6)
FULL = concave(WEIGHTS, N)
SCHEDULE = racing.Racing((0.125, 0.5), advance=0.25)


def noisy(r, level, generation) -> float:
    """A subset score: the full score plus noise fixed per (allocation, level, generation), shrinking with level."""
    digest = hashlib.sha256(repr((r, level, generation)).encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2**64 - 0.5
    return FULL(r) + u * 0.2 / (level + 1)


def run(**kwargs):
    options = dict(generations=6, population=12, elites=3, racing=SCHEDULE, subset_fitness=noisy)
    return search.level_switch_search(FULL, N, K, BUDGET, **{**options, **kwargs})


def test_racing_is_deterministic_and_differs_from_exact_search():
    a, b = run(), run()
    assert a == b
    exact = search.level_switch_search(FULL, N, K, BUDGET, generations=6, population=12, elites=3)
    assert a.subset_evaluations > 0 and exact.subset_evaluations == 0
    assert a.evaluations < exact.evaluations


def test_elites_and_best_are_ranked_on_full_set_scores_only():
    full_calls = []

    def full(r):
        full_calls.append(r)
        return FULL(r)

    result = search.level_switch_search(full, N, K, BUDGET, generations=6, population=12, elites=3,
                                        racing=SCHEDULE, subset_fitness=noisy)
    full_set = {h.allocation for h in result.history if h.level is None}
    assert full_set == set(full_calls)
    for gen in range(7):
        records = [h for h in result.history if h.generation == gen]
        elites = [h for h in records if h.elite]
        assert len(elites) == 3 and all(h.level is None and h.fitness == FULL(h.allocation) for h in elites)
        ranked = sorted({h.fitness for h in records if h.level is None}, reverse=True)
        assert sorted((h.fitness for h in elites), reverse=True) == ranked[:3]
        assert all(h.level in (0, 1) and not h.elite for h in records if h.level is not None)
    assert result.best_fitness == max(FULL(r) for r in full_set)
    assert result.best_fitness == FULL(result.best)


def test_each_level_scores_a_quarter_of_the_last_and_generation_0_keeps_enough_for_the_elites():
    calls = []
    run(subset_fitness=lambda r, level, gen: calls.append((gen, level)) or noisy(r, level, gen))
    per = {(g, lv): calls.count((g, lv)) for g, lv in set(calls)}
    assert per[(0, 0)] == 12 and per[(0, 1)] == 3  # generation 0: 12 -> 3 (ceil of a quarter) -> 3 >= elites
    for gen in range(1, 7):
        assert per[(gen, 1)] == math.ceil(per[(gen, 0)] / 4) and per[(gen, 0)] <= 9


class Killed(Exception):
    pass


def test_a_killed_racing_search_resumes_to_the_uninterrupted_result(tmp_path):
    uri = str(tmp_path / "ckpt.json")
    uninterrupted = run()
    done = {"gen": -1}

    def crashing(r, level, gen):
        if gen == 4:
            raise Killed
        return noisy(r, level, gen)

    with pytest.raises(Killed):
        run(subset_fitness=crashing, checkpoint=uri, on_generation=lambda g, *_: done.update(gen=g))
    assert done["gen"] == 3
    resumed = run(checkpoint=uri, resume=True)
    assert resumed == uninterrupted
    with pytest.raises(ConfigError, match="racing"):
        search.level_switch_search(FULL, N, K, BUDGET, generations=6, population=12, elites=3, checkpoint=uri,
                                   resume=True)


def test_racing_off_leaves_the_search_untouched():
    plain = search.level_switch_search(FULL, N, K, BUDGET, generations=4, population=10, elites=2)
    assert all(h.level is None for h in plain.history)
    assert len(plain.history) == 5 * 10


@pytest.mark.parametrize("kwargs, message", [
    (dict(racing=SCHEDULE), "both"),
    (dict(subset_fitness=noisy), "both"),
])
def test_racing_needs_its_schedule_and_its_subset_fitness(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        search.level_switch_search(FULL, N, K, BUDGET, generations=2, population=6, elites=2, **kwargs)


@pytest.mark.parametrize("fractions, advance", [((0.5, 0.25), 0.25), ((0.5, 1.0), 0.25), ((), 0.25), ((0.5,), 0.0)])
def test_bad_schedules_are_refused(fractions, advance):
    with pytest.raises(ConfigError):
        racing.Racing(fractions, advance)


def test_schedule_parses_from_text():
    assert racing.Racing.parse("0.125,0.5:0.25") == racing.Racing((0.125, 0.5), 0.25)
    assert racing.Racing.parse("0.2") == racing.Racing((0.2,), 0.25)
    with pytest.raises(ConfigError, match="fractions:advance"):
        racing.Racing.parse("a,b")


def test_subsets_are_nested_within_a_generation_and_redrawn_across_generations():
    samples = list(range(100, 180))
    small, large = racing.subset(samples, 0.125, 7, 3), racing.subset(samples, 0.5, 7, 3)
    assert len(small) == 10 and len(large) == 40 and set(small) <= set(large) <= set(samples)
    assert racing.subset(samples, 0.125, 7, 3) == small
    assert racing.subset(samples, 0.125, 7, 4) != small
    assert racing.subset([5], 0.125, 7, 0) == [5]


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate
    from tiny_world import make_tiny_inputs

    root = tmp_path_factory.mktemp("racing-stage")
    files = make_tiny_inputs(root)
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=16, max_length=256), str(root / "scores"))
    run_cache_logits(files["model"], files["search"], CacheLogitsParams(samples=12, max_length=256, dtype="float32"),
                     str(root / "cache"))
    return root, files["model"]


def test_search_stage_records_cost_and_prefix_reuse_changes_only_the_cost(stage_inputs):
    """Same allocation and fitness (1e-6) with and without prefix reuse, less work with it; racing runs
    through the stage, and allocation.json carries the cost in full-forward equivalents."""
    from evoesap import artifacts
    from evoesap.stages.search import SearchParams, run_search

    root, model = stage_inputs
    small = dict(criterion="reap", sparsity=0.5, population=6, elites=2, generations=3, batch_size=8)
    docs = {}
    for name, extra in {"exact": dict(prefix_reuse=False), "reuse": {}, "racing": dict(racing=True)}.items():
        out = str(root / f"search-{name}")
        run_search(model, str(root / "scores"), str(root / "cache"), SearchParams(**small, **extra), out)
        docs[name] = artifacts.read_json(artifacts.join(out, "allocation.json"))
    exact, reuse, raced = docs["exact"], docs["reuse"], docs["racing"]
    assert reuse["searched"]["removal_counts"] == exact["searched"]["removal_counts"]
    assert abs(reuse["searched"]["fitness"] - exact["searched"]["fitness"]) < 1e-6
    assert exact["cost"]["full_forward_equivalents_per_candidate"] > 0.9  # each candidate: about one forward
    assert reuse["cost"]["full_forward_equivalents"] < exact["cost"]["full_forward_equivalents"]
    assert raced["cost"]["subset_evaluations"] > 0
    assert raced["cost"]["full_set_evaluations"] < exact["cost"]["full_set_evaluations"]
