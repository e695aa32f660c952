"""Prefix reuse: hidden states entering MoE feed-forwards, kept for the fittest allocations under a byte budget.

The hidden state entering the feed-forward (MoE) half of MoE layer `a`'s decoder layer, after its
attention half, depends only on the pruned sets of MoE layers `0..a-1`. A search offspring differs from
its elite parent from some first changed layer on, so its forward can start at that layer's MoE block
from the parent's cached state and give the same values as a forward from scratch. Entries are keyed
by `(a, pruned sets of layers < a)`, so siblings and cousins share them and any cached allocation with
the longest common prefix serves, not only the parent; the entry at `a = 0` serves every candidate.

Memory: one boundary over the scored samples costs `boundary_bytes` (sum of tokens x hidden x dtype
size). The budget is split so that `keep + 1` allocations fit (the elites plus the candidate being
scored); when all boundaries do not fit, each allocation keeps evenly spaced ones. Eviction drops the
entries of the lowest-priority (least fit) allocations first, never those of the `keep` fittest, and a
state that does not fit is simply not kept: the budget is never exceeded.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

log = logging.getLogger(__name__)

Sets = tuple[tuple[int, ...], ...]  # per MoE ordinal: its pruned expert ids, sorted
EntryKey = tuple[int, Sets]  # (MoE ordinal a, pruned sets of MoE layers 0..a-1)


@dataclasses.dataclass
class _Entry:
    states: dict[int, torch.Tensor]  # sample index -> [T_i, H] hidden states entering MoE layer a
    bytes: int = 0
    priority: float = -math.inf  # best fitness among the allocations that wrote it; -inf while pending


def spread(candidates: list[int], slots: int) -> tuple[int, ...]:
    """`slots` evenly spaced picks of `candidates` (all of them when they fit)."""
    if slots >= len(candidates):
        return tuple(candidates)
    if slots <= 0:
        return ()
    return tuple(candidates[(i + 1) * len(candidates) // (slots + 1)] for i in range(slots))


class PrefixCache:
    """Per-sample hidden states at MoE-layer boundaries, reused by later allocations with the same prefix."""

    def __init__(self, budget_bytes: int, boundaries: list[int], boundary_bytes: int, keep: int = 4) -> None:
        """`boundaries`: MoE ordinals worth caching at; `keep`: allocations whose entries are never
        evicted (the search's elites)."""
        self.budget = int(budget_bytes)
        self.keep = max(1, int(keep))
        slots = self.budget // max(1, (self.keep + 1) * boundary_bytes)
        self.boundaries = spread(sorted(boundaries), slots)
        if boundaries and not self.boundaries:
            log.warning(
                "prefix cache budget %d bytes holds no layer boundary for %d allocations (%d bytes each): "
                "prefix reuse is off; raise prefix_cache_bytes to at least %d",
                self.budget,
                self.keep + 1,
                boundary_bytes,
                (self.keep + 1) * boundary_bytes,
            )
        elif len(self.boundaries) < len(boundaries):
            log.info(
                "prefix cache keeps MoE boundaries %s of %d (budget %d bytes)",
                list(self.boundaries),
                len(boundaries),
                self.budget,
            )
        self._entries: dict[EntryKey, _Entry] = {}
        self._fitness: dict[Sets, float] = {}  # committed allocations that own live entries
        self.bytes = 0
        self.peak_bytes = 0

    def start(self, sets: Sets, sample: int) -> tuple[int, torch.Tensor | None]:
        """The latest cached boundary for `sample` under `sets` -> (MoE ordinal, [T_i, H]), else (-1, None)."""
        for a in reversed(self.boundaries):
            entry = self._entries.get((a, sets[:a]))
            if entry is not None and sample in entry.states:
                return a, entry.states[sample]
        return -1, None

    def wants(self, sets: Sets, a: int, sample: int) -> bool:
        """Whether the state entering MoE layer `a` of `sample` under `sets` should be offered."""
        entry = self._entries.get((a, sets[:a]))
        return a in self.boundaries and (entry is None or sample not in entry.states)

    def put(self, sets: Sets, a: int, sample: int, state: torch.Tensor) -> None:
        """Keep `state` ([T_i, H], owned by the cache from now on) if it fits after evicting less fit entries."""
        size = state.numel() * state.element_size()
        if self.bytes + size > self.budget and not self._evict(self.bytes + size - self.budget):
            return
        entry = self._entries.setdefault((a, sets[:a]), _Entry({}))
        entry.states[sample] = state
        entry.bytes += size
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def commit(self, sets: Sets, fitness: float) -> None:
        """Record the fitness (higher is better) of the allocation whose states were just offered."""
        self._fitness[sets] = max(fitness, self._fitness.get(sets, -math.inf))
        for a in self.boundaries:
            entry = self._entries.get((a, sets[:a]))
            if entry is not None:
                entry.priority = max(entry.priority, fitness)

    def clear(self) -> None:
        self._entries.clear()
        self._fitness.clear()
        self.bytes = 0

    def _evict(self, need: int) -> bool:
        """Free at least `need` bytes from committed entries outside the fittest `keep` allocations."""
        elites = sorted(self._fitness, key=lambda s: -self._fitness[s])[: self.keep]
        protected = {(a, s[:a]) for s in elites for a in self.boundaries}
        victims = sorted(
            (key for key, e in self._entries.items() if key not in protected and e.priority > -math.inf),
            key=lambda key: self._entries[key].priority,
        )
        if sum(self._entries[key].bytes for key in victims) < need:
            return False
        freed = 0
        for key in victims:
            if freed >= need:
                break
            freed += self._entries.pop(key).bytes
        self.bytes -= freed
        self._fitness = {s: f for s, f in self._fitness.items() if any((a, s[:a]) in self._entries for a in self.boundaries)}
        return True
