"""benchmarks/bench_race_bound.py: a replay on cached vectors is the search itself, its bound is Wald's formula, and
the vectors it caches come back without pickle."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
from scripts import load_script

from evoesap.method import allocation as alloc
from evoesap.method import racing, search
from evoesap.scoring.importance import pruning_order

TINY = ["--world", "tiny", "--samples", "16", "--calibration-samples", "4", "--max-length", "64", "--batch-size", "4"]
TINY += ["--population", "8", "--elites", "2", "--generations", "3", "--seeds", "0", "1"]


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_race_bound.py")


def test_a_replay_is_the_search_on_the_evaluator(bench, tmp_path):
    """The replay on cached full-set vectors follows the same course as statistical racing that scores each candidate
    only on the samples it reaches: the same history, level by level, and the same answer."""
    args = argparse.Namespace(
        world="tiny", model=None, data=None, samples=16, calibration_samples=4, max_length=64, batch_size=4, sparsity=0.5,
        population=8, elites=2, generations=3,
    )  # fmt: skip
    race = racing.Sequential(0.05, 2)
    with bench.scored_world(args) as w:
        orders = pruning_order(w.scores, "reap")
        vectors = bench.Vectors(tmp_path / "v.npz", w.evaluator, orders, w.samples)
        replayed, work, decisions, share = bench.replay(vectors, w, args, 0, race)
        order = list(race.order(w.positions, 0))

        def sample_fitness(r, count):
            chosen = order[:count] if count else order
            return (
                w.evaluator.metric.sign * w.evaluator.sample_values(alloc.pruned_sets(r, orders), samples=chosen).double().numpy()
            )

        direct = search.level_switch_search(
            lambda r, floor=None: float(vectors(r).mean()), w.n, w.k, w.budget, population=8, elites=2, generations=3,
            seed=0, racing=race, sample_fitness=sample_fitness,
        )  # fmt: skip
    assert [(h.generation, h.allocation, h.level, h.elite) for h in replayed.history] == [
        (h.generation, h.allocation, h.level, h.elite) for h in direct.history
    ]
    assert replayed.best == direct.best
    assert any(h.level is not None for h in replayed.history)  # the race did stop some: the comparison has teeth
    assert 0 < work < len({h.allocation for h in replayed.history})  # stops cost less than full forwards
    assert share[0] == 0 and share[-1] == pytest.approx(1.0) and np.all(np.diff(share) > 0)
    assert {r for r, *_ in decisions} <= {h.allocation for h in replayed.history}


def test_the_bound_is_walds_formula(bench):
    """A candidate below the boundary by g needs 2 s^2 ln(1/delta) / g^2 samples; one within the tolerance, the full set."""
    values = {(0,): np.full(10, 0.5), (1,): np.full(10, 0.4), (2,): np.full(10, 0.49995), (3,): np.full(10, 0.6)}
    share = np.linspace(0, 1, 11)  # 10 equal samples
    race = racing.Sequential(0.05, 2, tolerance=1e-4)
    decisions = [((1,), (0,), 0.1, True), ((2,), (0,), 0.1, False), ((3,), (0,), 0.1, False)]
    got = bench.bound(values.__getitem__, decisions, share, race, {(0,)}, 1.0)
    samples = math.ceil(2 * 0.1**2 * math.log(20) / (0.1 - 1e-4) ** 2)  # 6 of the 10
    assert got == pytest.approx(1.0 + share[samples] + 1.0 + 1.0)  # the boundary, (1,), (2,) and (3,) in full
    halved = bench.bound(values.__getitem__, decisions, share, race, {(0,)}, 0.5)
    assert halved == pytest.approx(1.0 + share[math.ceil(samples / 4)] + 2.0)
    perfect = bench.bound(values.__getitem__, decisions, share, race, {(0,)}, 0.0)  # one sample settles (1,)
    assert perfect == pytest.approx(1.0 + share[1] + 2.0)


def test_the_table_and_its_vectors_round_trip(bench, tmp_path, capsys, monkeypatch):
    """One row per seed and delta; a second run reads every vector from the .npz (no pickle) and prints the same."""
    bench.main([*TINY, "--vectors", str(tmp_path), "--racing-delta", "0.05", "0.5"])
    first = capsys.readouterr().out.splitlines()
    rows = [line for line in first if line.startswith("| reap |")]
    assert (
        len(rows) == 4
        and all(line.count("|") == 15 for line in rows)
        and all(line.endswith(("| yes |", "| no |")) for line in rows)
    )
    saved = np.load(tmp_path / "tiny-reap-16.npz", allow_pickle=False)
    assert saved["allocations"].shape[0] == saved["values"].shape[0] > 0 and saved["values"].shape[1] == 16
    computed = []
    real = bench.Vectors.__call__

    def counting(self, r):
        computed.append(r not in self.values)
        return real(self, r)

    monkeypatch.setattr(bench.Vectors, "__call__", counting)
    bench.main([*TINY, "--vectors", str(tmp_path), "--racing-delta", "0.05", "0.5"])
    assert capsys.readouterr().out.splitlines() == first
    assert computed and not any(computed)


def test_the_demo_world_needs_its_files(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--world", "demo"])
    assert "--model and --data" in capsys.readouterr().err


def test_vectors_of_another_world_are_refused_and_kept(bench, tmp_path, capsys):
    """A cached file that is not this world's (here: another criterion's vectors under this one's name, then a file
    that is no vectors file at all) stops the run with the fix, and is left as it was."""
    bench.main([*TINY, "--seeds", "0", "--vectors", str(tmp_path), "--criteria", "frequency"])
    capsys.readouterr()
    (tmp_path / "tiny-frequency-16.npz").rename(tmp_path / "tiny-reap-16.npz")
    before = (tmp_path / "tiny-reap-16.npz").read_bytes()
    with pytest.raises(SystemExit, match="another model, data or pruning order: delete it"):
        bench.main([*TINY, "--seeds", "0", "--vectors", str(tmp_path)])
    assert (tmp_path / "tiny-reap-16.npz").read_bytes() == before
    (tmp_path / "tiny-reap-16.npz").write_bytes(b"not an npz")
    with pytest.raises(SystemExit, match="not a vectors file of this benchmark"):
        bench.main([*TINY, "--seeds", "0", "--vectors", str(tmp_path)])
    assert (tmp_path / "tiny-reap-16.npz").read_bytes() == b"not an npz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-reap-16.npz"]  # no temporary file left
