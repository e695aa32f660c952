"""A quality target instead of a sparsity: the largest sparsity on the granularity grid whose searched allocation
still meets a held-out threshold, found by bisection over the grid.

The grid holds every budget the model can search (multiples of the granularity, each admitting two allocations or
more), as sparsities that give back exactly that budget. Held-out quality falls as sparsity rises, but a search's
value is noisy, so one grid point can miss where its neighbour above meets: bisection, which never looks past a
miss, re-checks the point above the miss it ended on (`target.rechecks` times at most; each costs one probe, and one
more bisection when that point meets). The cost stays stated in advance: `max_probes(len(grid), rechecks)`, where a
sweep needs one search per point.

Each probe is an ordinary search artifact (`steps.run_step`): by default the cold search at that sparsity, the very
artifact a sweep or a `sparsities: [s]` run makes, reused both ways; warm-started probes (`find(..., warm=True)`) seed
generation 0 with the nearest probe's allocation rescaled: better allocations near the boundary, but other searches
than a sweep's. The decision is recorded with every probe's evidence (`TargetRecord`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from evoesap.errors import ConfigError
from evoesap.method import allocation as alloc
from evoesap.records import Probe, TargetRecord


def grid(num_experts: Sequence[int], min_kept: Sequence[int], granularity: int = 1) -> list[float]:
    """The searchable sparsities, ascending: one per budget in multiples of `granularity` whose feasible set holds two
    allocations or more, written so that `allocation.budget` gives that budget back."""
    total = sum(num_experts)
    most = sum(alloc.unit_caps(num_experts, min_kept, granularity)) * granularity
    found = []
    for budget in range(granularity, most + 1, granularity):
        if alloc.FeasibleSet(num_experts, min_kept, budget, granularity).size < 2:
            continue
        sparsity = round(budget / total, 6)
        assert alloc.budget(sparsity, num_experts, min_kept, granularity) == budget, (sparsity, budget)
        found.append(sparsity)
    return found


def max_probes(grid_size: int, rechecks: int, start: int | None = None) -> int:
    """The most searches `bracket` makes over `grid_size` points, whatever the answers: the depth of its decision
    tree, computed exactly. A monotone answer costs at most ceil(log2(grid_size + 1)), plus one re-check. From
    `start` (a challenger's first probe, then bisection above it): one more than the bracketing above `start`."""
    if start is not None:
        return 1 + _most(grid_size - start, (), rechecks)
    return _most(grid_size + 1, (), rechecks) if grid_size > 0 else 0


@functools.cache
def _most(gap: int, above: tuple[int, ...], left: int) -> int:
    """The most probes `bracket` still makes from lo = 0 (meets), hi = `gap` (misses), `above` the next known misses
    over hi (offsets from lo; the grid's end counts as one) and `left` re-checks. Only the first `left` of `above` can
    ever become hi again, so the rest are dropped: that keeps the states few."""
    if gap > 1:  # bisecting: the probe at gap // 2 meets (lo moves up) or misses (hi moves down)
        mid = gap // 2
        up = _most(gap - mid, tuple(a - mid for a in above), left)
        down = _most(mid, ((gap,) + above)[:left], left)
        return 1 + max(up, down)
    if left == 0 or not above or above[0] == gap + 1:
        return 0  # no re-check: none left, hi is the grid's end, or the point above hi is a known miss
    shift = gap + 1  # the re-check meets: bisect on between it and the next known miss
    return 1 + _most(above[0] - shift, tuple(a - shift for a in above[1:]), left - 1)


def bracket(
    grid_size: int, meets: Callable[[int], bool], rechecks: int, start: int | None = None
) -> tuple[int | None, list[int]]:
    """(the largest grid index found to meet, None when none did; the indices probed, in order, each once).

    Bisection between lo (meets; -1, sparsity 0, always does) and hi (misses; the grid's end at first) ends with
    hi = lo + 1. Then the index above hi is probed, unless it is past the grid or known to miss: when it meets, the
    miss at hi was a dip and bisection goes on between it and the least known miss above; at most `rechecks` times.
    Exact on a monotone answer (every index below one that meets meets) and on one with up to `rechecks` isolated
    one-point dips; at most `max_probes(grid_size, rechecks, start)` probes whatever the answers.

    With `start` (a challenger to the best index another answer reached), `start` is probed first: a miss there ends
    it (None: it cannot reach the best), a meet is lo and bisection goes on above it."""
    known: dict[int, bool] = {}
    probed: list[int] = []

    def probe(index: int) -> bool:
        known[index] = meets(index)
        probed.append(index)
        return known[index]

    lo, hi, left = -1, grid_size, rechecks
    if start is not None:
        if not probe(start):
            return None, probed
        lo = start
    while True:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
        above = hi + 1
        if left == 0 or above >= grid_size or known.get(above) is False:
            break
        left -= 1
        if not probe(above):
            break
        lo = above
        hi = min((i for i, ok in known.items() if not ok and i > lo), default=grid_size)
    return (lo if lo >= 0 else None), probed


def warm_start(
    neighbour: Sequence[int], num_experts: Sequence[int], min_kept: Sequence[int], budget: int, granularity: int
) -> tuple[int, ...]:
    """The neighbour probe's allocation rescaled to `budget`: removal in proportion to the neighbour's counts (plus
    half an expert per layer, so a layer the neighbour spared may still take some), feasible by construction."""
    return alloc.proportional([r + 0.5 for r in neighbour], num_experts, min_kept, budget, granularity)


def best(found: Sequence[TargetRecord]) -> TargetRecord | None:
    """Of several criteria's decisions, the one reaching the largest sparsity, a tie going to the higher held-out value
    at that sparsity (then to the first given); None when none meets."""
    met = [record for record in found if record.chosen is not None]

    def rank(record: TargetRecord) -> tuple[float, float]:
        at = next(p for p in record.probes if p.sparsity == record.chosen)
        return (float(record.chosen or 0.0), -math.inf if at.heldout is None else at.heldout)

    return max(met, key=rank, default=None)


def check_threshold(heldout_esap: float) -> float:
    """Refuse, before any work, a held-out ESAP target no pruning can meet or that asks for nothing."""
    if isinstance(heldout_esap, bool) or not isinstance(heldout_esap, (int, float)):
        raise ConfigError(f"target.heldout_esap must be a number in (0, 1), got {heldout_esap!r}")
    if not 0 < heldout_esap < 1:
        raise ConfigError(
            f"target.heldout_esap {heldout_esap} is unreachable or empty: held-out ESAP lies in (0, 1] and equals 1 only "
            "unpruned; give a value in (0, 1), e.g. 0.97"
        )
    return float(heldout_esap)


Judge = Callable[[float, str], tuple[str, Any]]  # (sparsity, search URI) -> (gate URI, records.GateRecord)


def find(
    threshold: float | None,
    points: Sequence[float],
    search: Callable[[float, tuple[int, ...] | None], tuple[str, Any]],
    num_experts: Sequence[int],
    min_kept: Sequence[int],
    granularity: int,
    criterion: str,
    *,
    warm: bool,
    rechecks: int,
    judge: Judge | None = None,
    gate: str | None = None,
    start: int | None = None,
) -> TargetRecord:
    """Bracket `points` for the largest sparsity whose search meets `threshold`. `search(sparsity, seed)` runs (or
    reuses) one search and returns (its URI, its `records.AllocationRecord`); the seed is None (the cold search a
    sweep makes) unless `warm`, when every probe after the first is seeded from the nearest probe's allocation.
    With `judge` (a gate target: `gate` its thresholds in words, `threshold` None) a probe meets when the gate passes
    the model its search prunes to. `start`: a challenger's first index (`bracket`)."""
    from evoesap.store import artifacts

    probes: dict[int, Probe] = {}
    order: list[Probe] = []

    def meets(index: int) -> bool:
        sparsity = points[index]
        budget = alloc.budget(sparsity, num_experts, min_kept, granularity)
        near = min(probes, key=lambda i: abs(i - index), default=None) if warm else None
        seed = None if near is None else warm_start(probes[near].removal_counts, num_experts, min_kept, budget, granularity)
        uri, record = search(sparsity, seed)
        check = record.heldout
        heldout = None if check is None else check.searched
        verdict = None if judge is None else judge(sparsity, uri)
        if verdict is None:
            passed, failing = heldout is not None and threshold is not None and heldout >= threshold, None
        else:
            passed = verdict[1].passed
            failing = "; ".join(c.line() for c in verdict[1].checks if not c.passed) or None
        probe = Probe(
            sparsity=sparsity,
            budget=budget,
            search=artifacts.redact(uri),
            removal_counts=tuple(record.removal_counts),
            fitness=record.fitness,
            heldout=heldout,
            stderr=None if check is None else check.searched_stderr,
            meets=passed,
            warm_start=seed,
            samples=None if check is None else check.samples,
            gate=None if verdict is None else artifacts.redact(verdict[0]),
            failing=failing,
        )
        probes[index] = probe
        order.append(probe)
        return probe.meets

    chosen, _ = bracket(len(points), meets, rechecks, start)
    return TargetRecord(
        criterion=criterion,
        metric="heldout_esap" if judge is None else "gate",
        threshold=threshold,
        grid=tuple(points),
        max_probes=max_probes(len(points), rechecks, start),
        probes=tuple(order),
        chosen=None if chosen is None else points[chosen],
        chosen_search=None if chosen is None else probes[chosen].search,
        warm_start=warm,
        rechecks=rechecks,
        gate=gate,
        start=None if start is None else points[start],
    )
