"""Racing: successive halving inside the level-switch search, its schedule and its subsets."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_search import concave

from evoesap.errors import ConfigError
from evoesap.method import racing, search

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

    result = search.level_switch_search(
        full, N, K, BUDGET, generations=6, population=12, elites=3, racing=SCHEDULE, subset_fitness=noisy
    )
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
        search.level_switch_search(FULL, N, K, BUDGET, generations=6, population=12, elites=3, checkpoint=uri, resume=True)


def test_racing_off_leaves_the_search_untouched():
    plain = search.level_switch_search(FULL, N, K, BUDGET, generations=4, population=10, elites=2)
    assert all(h.level is None for h in plain.history)
    assert len(plain.history) == 5 * 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(racing=SCHEDULE), "both"),
        (dict(subset_fitness=noisy), "both"),
    ],
)
def test_racing_needs_its_schedule_and_its_subset_fitness(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        search.level_switch_search(FULL, N, K, BUDGET, generations=2, population=6, elites=2, **kwargs)


@pytest.mark.parametrize(
    "fractions, advance, minimums",
    [
        ((0.5, 0.25), 0.25, {}),
        ((0.5, 1.0), 0.25, {}),
        ((), 0.25, {}),
        ((0.5,), 0.0, {}),
        ((0.5,), 0.25, {"min_samples": 0}),
        ((0.5,), 0.25, {"min_positions": -1}),
    ],
)
def test_bad_schedules_are_refused(fractions, advance, minimums):
    with pytest.raises(ConfigError):
        racing.Racing(fractions, advance, **minimums)


def test_schedule_parses_from_text():
    assert racing.Racing.parse("0.125,0.5:0.25") == racing.Racing((0.125, 0.5), 0.25)
    assert racing.Racing.parse("0.2") == racing.Racing((0.2,), 0.25)
    assert racing.Racing.parse("0.2", 2, 64) == racing.Racing((0.2,), 0.25, min_samples=2, min_positions=64)
    assert racing.Racing.parse(racing.Racing().text) == racing.Racing()
    with pytest.raises(ConfigError, match="fractions:advance"):
        racing.Racing.parse("a,b")


def test_subsets_are_nested_within_a_generation_and_redrawn_across_generations():
    samples, positions = list(range(100, 180)), [300] * 80
    small, large = SCHEDULE.subset(samples, positions, 0, 7, 3), SCHEDULE.subset(samples, positions, 1, 7, 3)
    assert len(small) == 10 and len(large) == 40 and set(small) <= set(large) <= set(samples)
    assert SCHEDULE.subset(samples, positions, 0, 7, 3) == small
    assert SCHEDULE.subset(samples, positions, 0, 7, 4) != small


@settings(max_examples=60, deadline=None)
@given(
    positions=st.lists(st.integers(0, 400), min_size=1, max_size=60),
    fractions=st.sampled_from([(0.0625, 0.25), (0.125, 0.5), (0.3,)]),
    min_samples=st.integers(1, 8),
    min_positions=st.integers(0, 1000),
    generation=st.integers(0, 5),
)
def test_every_level_scores_its_minimum_samples_and_positions_and_no_more_than_needed(
    positions, fractions, min_samples, min_positions, generation
):
    schedule = racing.Racing(fractions, 0.25, min_samples=min_samples, min_positions=min_positions)
    samples = list(range(1000, 1000 + len(positions)))
    scored = dict(zip(samples, positions))
    order = np.random.default_rng([9, generation]).permutation(len(samples))  # independent: the documented draw
    previous: set[int] = set()
    for level, fraction in enumerate(fractions):
        chosen = schedule.subset(samples, positions, level, 9, generation)
        share = max(min_samples, math.ceil(fraction * len(samples)))
        enough = len(chosen) >= min(share, len(samples)) and sum(scored[s] for s in chosen) >= min_positions
        assert enough or len(chosen) == len(samples)  # the minimums, or everything there is
        # the shortest prefix of the generation's order: one sample fewer would miss a requirement
        assert sorted(chosen) == sorted(samples[i] for i in order[: len(chosen)])
        if len(chosen) > 1:
            fewer = [samples[i] for i in order[: len(chosen) - 1]]
            assert len(fewer) < share or sum(scored[s] for s in fewer) < min_positions
        assert previous <= set(chosen)  # nested
        previous = set(chosen)


def test_a_16_sample_search_set_no_longer_races_on_one_sample():
    """The issue's case: 16 packed sequences of ~360 scored positions, 1/16 of which is one sample."""
    positions = [360] * 16
    schedule = racing.Racing((0.25,), 0.25)  # the default minimums: 4 samples, 256 positions
    schedule.check(positions)
    assert all(len(schedule.subset(list(range(16)), positions, 0, 0, g)) == 4 for g in range(5))


@pytest.mark.parametrize(
    "positions, schedule, message",
    [
        # the default schedule on 16 samples: both levels would score the same 4 samples
        ([360] * 16, racing.Racing(), r"racing level 0 \(share 0.0625\) may score 4 of the 16 search samples.*level 1's 4"),
        # short answers: 16 samples of 15 positions never reach 256, so the level would be the whole set
        ([15] * 16, racing.Racing((0.25,)), r"racing level 0 \(share 0.25\) may score 16 of the 16 .*whole search set"),
        # fewer samples than the minimum
        ([500] * 3, racing.Racing((0.5,)), r"may score 3 of the 3 search samples"),
    ],
)
def test_a_schedule_that_cannot_grow_within_the_search_set_is_refused_with_the_sizes(positions, schedule, message):
    with pytest.raises(ConfigError, match=message) as info:
        schedule.check(positions)
    assert "racing_min_samples" in str(info.value) and "racing_schedule" in str(info.value)


def test_the_worst_case_checks_the_fewest_positions_first():
    schedule = racing.Racing((0.0625, 0.25), 0.25, min_samples=1, min_positions=100)  # on 16: 1, then 4 samples
    schedule.check([40] * 3 + [100] * 13)  # at worst the three short ones: 3 samples, fewer than level 1's 4
    with pytest.raises(ConfigError, match="level 0 .* may score 4 of the 16 .*level 1's 4"):
        schedule.check([30] * 4 + [100] * 12)  # at worst all four short ones: as many as level 1


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    from tiny_world import make_tiny_inputs

    from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate

    root = tmp_path_factory.mktemp("racing-stage")
    files = make_tiny_inputs(root)
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=16, max_length=256), str(root / "scores"))
    run_cache_logits(
        files["model"], files["search"], CacheLogitsParams(samples=12, max_length=256, dtype="float32"), str(root / "cache")
    )
    return root, files["model"]


def test_search_stage_records_cost_and_prefix_reuse_changes_only_the_cost(stage_inputs):
    """Same allocation and fitness (1e-6) with and without prefix reuse, less work with it; racing runs
    through the stage, and the manifest carries the cost in full-forward equivalents."""
    from evoesap.stages.search import SearchParams, run_search
    from evoesap.store import artifacts

    root, model = stage_inputs
    small = dict(criterion="reap", sparsity=0.5, population=6, elites=2, generations=3, batch_size=8)
    docs = {}
    # 9 search samples: 1/4 of them or 3, whichever is more, and 8 positions, are the level that fits
    race = dict(racing=True, racing_mode="schedule", racing_schedule="0.25:0.25", racing_min_samples=3, racing_min_positions=8)
    for name, extra in {"exact": dict(prefix_reuse=False), "reuse": {}, "racing": race}.items():
        out = str(root / f"search-{name}")
        run_search(model, str(root / "scores"), str(root / "cache"), SearchParams(**small, **extra), out)
        docs[name] = {**artifacts.read_json(artifacts.join(out, "allocation.json")), **artifacts.read_manifest(out).run}
    exact, reuse, raced = docs["exact"], docs["reuse"], docs["racing"]
    assert reuse["searched"]["removal_counts"] == exact["searched"]["removal_counts"]
    assert abs(reuse["searched"]["fitness"] - exact["searched"]["fitness"]) < 1e-6
    assert exact["cost"]["full_forward_equivalents_per_candidate"] > 0.9  # each candidate: about one forward
    assert reuse["cost"]["full_forward_equivalents"] < exact["cost"]["full_forward_equivalents"]
    assert raced["cost"]["subset_evaluations"] > 0
    assert raced["cost"]["full_set_evaluations"] < exact["cost"]["full_set_evaluations"]


def test_search_stage_refuses_a_racing_schedule_too_large_for_its_search_set_before_loading_the_model(stage_inputs, monkeypatch):
    from evoesap.machine import runtime
    from evoesap.stages.search import SearchParams, run_search

    root, model = stage_inputs

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the racing schedule was checked")

    monkeypatch.setattr(runtime, "load_model", no_model)
    params = SearchParams(
        criterion="reap", sparsity=0.5, population=6, elites=2, generations=1, racing=True, racing_mode="schedule"
    )
    with pytest.raises(ConfigError, match="racing level 0 .* of the 9 search samples"):
        run_search(model, str(root / "scores"), str(root / "cache"), params, str(root / "search-refused"))


def test_search_stage_records_its_work_in_allocation_json_for_each_racing_mode(stage_inputs):
    """allocation.json holds the work (FFE in all and per candidate, candidates, race stops by sample count), the
    same FFE as the manifest's run.cost; statistical racing records its delta and stops at its checkpoints."""
    from evoesap.stages.search import SearchParams, run_search
    from evoesap.store import artifacts

    root, model = stage_inputs
    small = dict(criterion="reap", sparsity=0.5, population=6, elites=2, generations=3, batch_size=8)
    modes = {
        "off": {},
        "schedule": dict(
            racing=True, racing_mode="schedule", racing_schedule="0.25:0.25", racing_min_samples=3, racing_min_positions=8
        ),
        "statistical": dict(
            racing=True,
            racing_mode="statistical",
            racing_delta=0.2,
            racing_min_samples=3,
            racing_screen=True,
            racing_tolerance=1e-3,
        ),
    }
    for mode, extra in modes.items():
        out = str(root / f"search-work-{mode}")
        run_search(model, str(root / "scores"), str(root / "cache"), SearchParams(**small, **extra), out)
        assert "work" not in artifacts.read_json(artifacts.join(out, "allocation.json"))  # deterministic: no run facts
        work = artifacts.read_manifest(out).run["cost"]
        history = pd.read_parquet(artifacts.join(out, "history.parquet"))
        assert work["racing"] == mode and work["racing_delta"] == (0.2 if mode == "statistical" else None)
        assert work["racing_tolerance"] == (1e-3 if mode == "statistical" else None)
        assert work["full_forward_equivalents"] > 0
        assert work["full_forward_equivalents_per_candidate"] == pytest.approx(
            work["full_forward_equivalents"] / work["candidates"]
        )
        full = {tuple(a) for a, f in zip(history["allocation"], history["fitness"]) if not np.isnan(f)}
        assert work["full_set_evaluations"] == len(full) and not work["resumed"]
        raced = history[history["fitness"].isna()] if mode != "off" else history.iloc[:0]
        stops = {(g, tuple(a), int(v)) for g, a, v in zip(raced["generation"], raced["allocation"], raced.get("race_level", []))}
        screened = {stop for stop in stops if stop[2] == -1}  # stopped by the model before any forward
        assert work["screened"] == len(screened) and (mode == "statistical" or not screened)
        assert work["stopped_early"] == len(stops - screened) == sum(int(v) for v in work["stopped_at"].values())
        assert work["candidates"] == len(full | {a for _, a, _ in stops})
        if mode == "statistical":  # 9 search samples: checkpoints at 3 and 6 samples
            assert set(work["stopped_at"]) <= {"3", "6"}
        if mode == "schedule":  # one level of 3 samples (a quarter of 9, at least 3)
            assert set(work["stopped_at"]) <= {"3"} and work["stopped_early"] > 0
