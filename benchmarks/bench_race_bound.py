"""How close statistical racing comes to the least work any test at its error rate could do, over whole searches.

Replays whole searches on a world whose candidates' per-sample fitness is cached (`--vectors`, an .npz of
allocations and per-sample values that the plain evaluator computes once per criterion), so one search of 50
generations takes seconds. Per search, printed as a markdown row:

- the race's work: per distinct candidate, the share of the search set's tokens it was scored on, summed (full-forward
  equivalents without prefix reuse; the search stage's FFE also credits prefix reuse, about 0.4x this on the demo
  world, so read the ratios, not the level);
- Wald's bound for the same decisions: each time the race judges a candidate against the elite boundary member, a
  candidate truly below the boundary by g (beyond `racing_tolerance`) can only be stopped, by any sequential test
  that wrongly stops one at the boundary with chance at most delta, after about 2 s^2 ln(1/delta) / g^2 samples on
  average, s being the spread of the candidate's per-sample residual (paired difference minus the additive model's
  prediction at the time; known to this oracle, estimated by the race); a candidate truly within the tolerance of
  the boundary goes on to the full set. Per candidate the largest of its decisions counts. The same with s scaled
  by 0.7 and 0.5, what a better control variate could give, and by 0: a perfect model, where only the candidates
  that truly reach the boundary cost more than one sample (the floor of the elite semantics);
- wrong stops: decisions on candidates truly above the boundary plus the tolerance (distinct candidate and boundary
  pairs), and how many of them stopped;
- the final fitness, and whether it is exact search's (replayed first on the same vectors).

    PYTHONPATH=. python benchmarks/bench_race_bound.py --model .cache/demo-world/model \
        --data .cache/demo-world/data/{code,copy,facts,math}/search.jsonl --criteria reap frequency --seeds 0 1 2 3

The replay hooks the search's private `_Run.race_wave` to see each decision's boundary and model: a benchmark's view
of the race, not an interface.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_candidate_work import cached_world  # noqa: E402

from evoesap.method import allocation as alloc  # noqa: E402
from evoesap.method import racing, search  # noqa: E402
from evoesap.scoring.evaluator import CandidateEvaluator  # noqa: E402
from evoesap.scoring.importance import pruning_order  # noqa: E402

SCALES = (1.0, 0.7, 0.5, 0.0)  # residual spreads of the bound: the race's model, better ones, a perfect one


class Vectors:
    """Every allocation's full-set per-sample fitness (dataset order), computed on first use, kept in an .npz.

    A file read back must be this world's: its first allocation is scored again and must match (a rebuilt model,
    other data or another pruning order would otherwise pass stale values off as this world's)."""

    def __init__(self, path: Path, evaluator: CandidateEvaluator, orders, samples: list[int]) -> None:
        self.path, self.evaluator, self.orders, self.samples = path, evaluator, orders, samples
        self.values: dict[tuple[int, ...], np.ndarray] = {}
        if path.exists():
            self.values = self._read()
        self.computed = 0

    def __call__(self, r: tuple[int, ...]) -> np.ndarray:
        if r not in self.values:
            self.values[r] = self._score(r)
            self.computed += 1
        return self.values[r]

    def save(self) -> None:
        if self.computed:
            rs = list(self.values)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, suffix=".npz", delete=False) as tmp:
                np.savez(tmp, allocations=np.asarray(rs), values=np.stack([self.values[r] for r in rs]))
            Path(tmp.name).replace(self.path)
            self.computed = 0

    def _score(self, r: tuple[int, ...]) -> np.ndarray:
        raw = self.evaluator.sample_values(alloc.pruned_sets(r, self.orders), samples=self.samples)
        return self.evaluator.metric.sign * raw.double().numpy()

    def _read(self) -> dict[tuple[int, ...], np.ndarray]:
        fix = "delete it or point --vectors at another folder"
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                allocations, values = saved["allocations"], saved["values"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{self.path} is not a vectors file of this benchmark ({e}): {fix}") from None
        if values.ndim != 2 or values.shape != (len(allocations), len(self.samples)) or not len(allocations):
            raise SystemExit(f"{self.path} holds {values.shape} vectors, not n x {len(self.samples)} samples: {fix}")
        read = {tuple(int(x) for x in r): v for r, v in zip(allocations, values)}
        first = next(iter(read))
        if not np.allclose(self._score(first), read[first], rtol=0, atol=1e-6):
            raise SystemExit(f"{self.path} was computed for another model, data or pruning order: {fix}")
        return read


def replay(vectors: Vectors, w: argparse.Namespace, args: argparse.Namespace, seed: int, race: racing.Sequential | None):
    """One whole search on cached vectors (`w`: `scored_world`'s) -> (result, work, decisions [(candidate, boundary,
    residual spread, stopped)], token share of each prefix of the race's order)."""
    lengths, positions = w.lengths, w.positions
    order = list(race.order(positions, seed)) if race is not None else list(range(len(positions)))
    total = len(order)
    share = np.concatenate([[0.0], np.cumsum(lengths[order])]) / lengths.sum()  # [N + 1] token share of a prefix
    depth: dict[tuple[int, ...], int] = {}
    decisions: list[tuple[tuple[int, ...], tuple[int, ...], float, bool]] = []

    def sample_fitness(r, count):
        depth[r] = max(depth.get(r, 0), count or total)
        values = vectors(r)[order]
        return values[:count] if count else values

    def fitness(r, floor=None):
        depth[r] = total
        return float(vectors(r).mean())

    wave = search._Run.race_wave

    def watched(self, entrants, boundary, model, gen):
        stopped = wave(self, entrants, boundary, model, gen)
        for r in entrants:
            d = vectors(r)[order] - vectors(boundary)[order]
            shift = model.difference(r, boundary) if model is not None else np.zeros(total)
            decisions.append((r, boundary, float((d - shift).std()), r in stopped))
        return stopped

    search._Run.race_wave = watched
    try:
        result = search.level_switch_search(
            fitness,
            w.n,
            w.k,
            w.budget,
            population=args.population,
            elites=args.elites,
            generations=args.generations,
            seed=seed,
            racing=race,
            sample_fitness=sample_fitness if race is not None else None,
        )
    finally:
        search._Run.race_wave = wave
    return result, float(sum(share[d] for d in depth.values())), decisions, share


def bound(vectors: Vectors, decisions, share: np.ndarray, race, unraced: set, scale: float) -> float:
    """Wald's least expected work for the race's decisions (module docstring), residual spreads times `scale`;
    `unraced`: those scored on the full set without a decision (generation 0's first `elites`)."""
    total = len(share) - 1
    need: dict[tuple[int, ...], float] = {r: 1.0 for r in unraced}
    for r, boundary, spread, _ in decisions:
        gap = float(vectors(r).mean() - vectors(boundary).mean()) + race.tolerance
        if gap >= 0:
            work = 1.0
        else:
            samples = 2 * (scale * spread) ** 2 * math.log(1 / race.delta) / gap**2
            work = float(share[min(total, max(1, math.ceil(samples)))])
        need[r] = max(need.get(r, 0.0), work)
    return sum(need.values())


@contextlib.contextmanager
def scored_world(args: argparse.Namespace):
    """`cached_world` with what a replay needs besides: a plain evaluator (no prefix reuse, no racing), the search
    samples, each one's work and scored positions."""
    with cached_world(args.world, args) as w:
        w.evaluator = CandidateEvaluator(w.model, w.cache, batch_size=args.batch_size, prefix_cache_bytes=0, keep=1, verify=False)
        w.samples = list(range(w.cache.num_samples))
        w.lengths = np.asarray([w.evaluator.full_forward_work([s]) for s in w.samples], dtype=np.float64)
        w.positions = (w.cache.offsets[1:] - w.cache.offsets[:-1]).tolist()
        yield w


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="demo", choices=["demo", "tiny"], help="tiny: random weights, no files")
    parser.add_argument("--model", help="the demo world's model directory")
    parser.add_argument("--data", nargs="+", help="its search JSONL files")
    parser.add_argument("--criteria", nargs="+", default=["reap"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--calibration-samples", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--population", type=int, default=32)
    parser.add_argument("--elites", type=int, default=4)
    parser.add_argument("--generations", type=int, default=50)
    parser.add_argument("--racing-delta", type=float, nargs="+", default=[0.05])
    parser.add_argument("--racing-tolerance", type=float, default=0.0)
    parser.add_argument("--racing-min-samples", type=int, default=2, help="the first checkpoint (bench_candidate_work's)")
    parser.add_argument("--vectors", default=".cache/race-bound", help="folder of the cached per-sample vectors")
    args = parser.parse_args(argv)
    if args.world == "demo" and not (args.model and args.data):
        parser.error("--world demo needs --model and --data (the demo world's model directory and search files)")
    Path(args.vectors).mkdir(parents=True, exist_ok=True)
    print(
        "| criterion | seed | delta | tolerance | candidates | race work | Wald bound | x0.7 spread | x0.5 spread | "
        "perfect model | race / bound | above the boundary: decisions, stopped | final fitness | exact's |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    with scored_world(args) as w:
        for criterion in args.criteria:
            path = Path(args.vectors) / f"{args.world}-{criterion}-{args.samples}.npz"
            vectors = Vectors(path, w.evaluator, pruning_order(w.scores, criterion), w.samples)
            for seed in args.seeds:
                exact = replay(vectors, w, args, seed, None)[0]
                for delta in args.racing_delta:
                    race = racing.Sequential(delta, args.racing_min_samples, tolerance=args.racing_tolerance)
                    result, work, decisions, share = replay(vectors, w, args, seed, race)
                    candidates = {h.allocation for h in result.history}
                    unraced = {h.allocation for h in result.history if h.level is None} - {r for r, *_ in decisions}
                    bounds = [bound(vectors, decisions, share, race, unraced, s) for s in SCALES]
                    above = {
                        (r, b): stopped
                        for r, b, _, stopped in decisions
                        if vectors(r).mean() > vectors(b).mean() + race.tolerance
                    }
                    print(
                        f"| {criterion} | {seed} | {delta:g} | {race.tolerance:g} | {len(candidates)} | "
                        f"{work / len(candidates):.3f} | {bounds[0] / len(candidates):.3f} | {bounds[1] / len(candidates):.3f} | "
                        f"{bounds[2] / len(candidates):.3f} | {bounds[3] / len(candidates):.3f} | {work / bounds[0]:.2f} | {len(above)}, {sum(above.values())} | "
                        f"{result.best_fitness:.6f} | {'yes' if result.best == exact.best else 'no'} |",
                        flush=True,
                    )
                vectors.save()


if __name__ == "__main__":
    main()
