"""A quality target instead of a sparsity: the largest sparsity on the granularity grid whose searched allocation
still meets a held-out threshold, found by bisection over the grid.

The grid holds every budget the model can search (multiples of the granularity, each admitting two allocations or
more), as sparsities that give back exactly that budget. Held-out quality falls as sparsity rises, so bisection
needs at most `max_probes(len(grid))` searches where a sweep needs one per grid point. Each probe is an ordinary
search artifact (`steps.run_step`: reused by any later run with the same inputs and parameters), warm-started from
the nearest probe already made (its allocation rescaled to the new budget seeds generation 0 after uniform), and
the decision is recorded with every probe's evidence (`TargetRecord`).
"""

from __future__ import annotations

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


def max_probes(grid_size: int) -> int:
    """The most searches bisection over `grid_size` points makes: ceil(log2(grid_size)) + 1."""
    return math.ceil(math.log2(grid_size)) + 1 if grid_size > 0 else 0


def bracket(grid_size: int, meets: Callable[[int], bool]) -> tuple[int | None, list[int]]:
    """(the largest grid index that `meets`, assuming a monotone answer: every index below one that meets also
    meets; None when index 0 fails) and the indices probed, in order."""
    lo, hi, probed = -1, grid_size, []  # lo meets (sparsity 0 always does), hi fails (past the grid)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probed.append(mid)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return (lo if lo >= 0 else None), probed


def warm_start(
    neighbour: Sequence[int], num_experts: Sequence[int], min_kept: Sequence[int], budget: int, granularity: int
) -> tuple[int, ...]:
    """The neighbour probe's allocation rescaled to `budget`: removal in proportion to the neighbour's counts (plus
    half an expert per layer, so a layer the neighbour spared may still take some), feasible by construction."""
    return alloc.proportional([r + 0.5 for r in neighbour], num_experts, min_kept, budget, granularity)


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


def find(
    threshold: float,
    points: Sequence[float],
    search: Callable[[float, tuple[int, ...] | None], tuple[str, Any]],
    num_experts: Sequence[int],
    min_kept: Sequence[int],
    granularity: int,
    criterion: str,
) -> TargetRecord:
    """Bisect `points` for the largest sparsity whose search meets `threshold`. `search(sparsity, seed)` runs (or
    reuses) one search and returns (its URI, its `records.AllocationRecord`)."""
    from evoesap.store import artifacts

    probes: dict[int, Probe] = {}
    order: list[Probe] = []

    def meets(index: int) -> bool:
        sparsity = points[index]
        budget = alloc.budget(sparsity, num_experts, min_kept, granularity)
        near = min(probes, key=lambda i: abs(i - index), default=None)
        seed = None if near is None else warm_start(probes[near].removal_counts, num_experts, min_kept, budget, granularity)
        uri, record = search(sparsity, seed)
        check = record.heldout
        heldout = None if check is None else check.searched
        stderr = None if check is None else check.searched_stderr
        probe = Probe(
            sparsity=sparsity,
            budget=budget,
            search=artifacts.redact(uri),
            removal_counts=tuple(record.removal_counts),
            fitness=record.fitness,
            heldout=heldout,
            stderr=stderr,
            meets=heldout is not None and heldout >= threshold,
            warm_start=seed,
        )
        probes[index] = probe
        order.append(probe)
        return probe.meets

    chosen, _ = bracket(len(points), meets)
    return TargetRecord(
        criterion=criterion,
        metric="heldout_esap",
        threshold=threshold,
        grid=tuple(points),
        max_probes=max_probes(len(points)),
        probes=tuple(order),
        chosen=None if chosen is None else points[chosen],
        chosen_search=None if chosen is None else probes[chosen].search,
    )
