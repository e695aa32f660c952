"""Per-layer expert-removal allocations: the budget, feasibility, and the baseline allocations.

An allocation `r` has one integer per MoE layer in model order: `r[l]` experts are removed from layer
`l`. It is feasible for a budget `B` and a granularity `g` when

- `sum(r) == B`,
- `0 <= r[l] <= n_l - k_l` (at least `k_l` experts stay for top-k routing), and
- every `r[l]` is a multiple of `g`, so the upper bound is in effect the largest multiple of `g`
  that is at most `n_l - k_l`.

The granularity keeps pruned layers compatible with expert parallelism; the paper's "even-valued
transfers" are `g = 2`. In the search, a level-switch moves `Δ` experts between two layers with `Δ` a
multiple of `g` no larger than `max_transfer`: `Δ ∈ {g, 2g, ..., floor(max_transfer / g) * g}`, or
just `{g}` when `max_transfer < g`. Starting from a feasible allocation, such moves keep every count a
multiple of `g`. Internally counts are handled in units of `g` experts.

This module is pure Python + numpy, like `evoesap.method.search`; it never imports torch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from fractions import Fraction

from evoesap.errors import ConfigError

Allocation = tuple[int, ...]


def as_int(name: str, value: object) -> int:
    """`value` as an int (numpy integers too), refusing bools, floats and anything else."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def unit_caps(num_experts: Sequence[int], top_k: Sequence[int], granularity: int = 1) -> tuple[int, ...]:
    """Per-layer upper bounds in units of `granularity` experts, after validating the layers."""
    g = as_int("granularity", granularity)
    if g < 1:
        raise ConfigError(f"granularity must be >= 1, got {g}")
    n = [as_int(f"num_experts[{i}]", v) for i, v in enumerate(num_experts)]
    k = [as_int(f"top_k[{i}]", v) for i, v in enumerate(top_k)]
    if not n:
        raise ConfigError("num_experts is empty: an allocation needs at least one MoE layer")
    if len(n) != len(k):
        raise ConfigError(f"num_experts has {len(n)} layers but top_k has {len(k)}: give one per MoE layer")
    for layer, (n_l, k_l) in enumerate(zip(n, k)):
        if not 1 <= k_l <= n_l:
            raise ConfigError(f"layer {layer}: top_k {k_l} must be between 1 and num_experts {n_l}")
    return tuple((n_l - k_l) // g for n_l, k_l in zip(n, k))


def check_budget(num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> int:
    """Refuse a budget that no allocation can meet; return it as an int."""
    caps = unit_caps(num_experts, top_k, granularity)
    b = as_int("budget", budget)
    most = sum(n - k for n, k in zip(num_experts, top_k))
    if b < 0:
        raise ConfigError(f"budget {b} is negative")
    if b > most:
        raise ConfigError(
            f"budget {b} is above sum(n - k) = {most}, the most experts that can go while every layer "
            "keeps the experts it must (top-k; more under group-limited routing): lower the sparsity"
        )
    if b % granularity:
        raise ConfigError(f"budget {b} is not a multiple of the granularity {granularity}")
    if b > sum(caps) * granularity:
        raise ConfigError(
            f"budget {b} cannot be met in multiples of granularity {granularity}: at most "
            f"{sum(caps) * granularity} experts can go in such multiples; lower the sparsity or the granularity"
        )
    return b


def budget(sparsity: float, num_experts: Sequence[int], top_k: Sequence[int], granularity: int = 1) -> int:
    """The global number of experts to remove: `sparsity * sum(n_l)` rounded to the nearest multiple of
    `granularity`, halves up (the product is first rounded to 9 decimals so float noise such as
    `0.15 * 10 = 1.4999...` does not decide a half)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 < sparsity < 1.0:
        raise ConfigError(f"sparsity must be a number strictly between 0 and 1, got {sparsity!r}")
    unit_caps(num_experts, top_k, granularity)
    total = sum(num_experts)
    b = granularity * math.floor(round(sparsity * total / granularity, 9) + 0.5)
    if b == 0:
        raise ConfigError(
            f"sparsity {sparsity} of {total} experts rounds to a budget of 0 in multiples of {granularity}: raise the sparsity"
        )
    return check_budget(num_experts, top_k, b, granularity)


def check(r: Sequence[int], num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> Allocation:
    """Refuse an infeasible allocation, naming the offending value; return it as a tuple of ints."""
    unit_caps(num_experts, top_k, granularity)
    if len(r) != len(num_experts):
        raise ConfigError(f"allocation {tuple(r)} has {len(r)} entries for {len(num_experts)} MoE layers")
    out = tuple(as_int(f"r[{layer}]", v) for layer, v in enumerate(r))
    for layer, (r_l, n_l, k_l) in enumerate(zip(out, num_experts, top_k)):
        if not 0 <= r_l <= n_l - k_l:
            raise ConfigError(f"r[{layer}] = {r_l} is outside 0..{n_l - k_l} (layer {layer} has {n_l} experts and top_k {k_l})")
        if r_l % granularity:
            raise ConfigError(f"r[{layer}] = {r_l} is not a multiple of the granularity {granularity}")
    if sum(out) != budget:
        raise ConfigError(f"allocation {out} removes {sum(out)} experts, not the budget {budget}")
    return out


def is_feasible(r: Sequence[int], num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> bool:
    try:
        check(r, num_experts, top_k, budget, granularity)
    except ConfigError:
        return False
    return True


def uniform(num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1) -> Allocation:
    """The same count in every layer, as far as bounds and granularity allow.

    In units of `g` experts: every layer gets `min(cap_l, t)` for the largest level `t` that stays within
    the budget (layers whose bound is below the level keep their bound). The `rem` units left over, fewer
    than the layers still below their bound, go one each to `rem` of those layers evenly spaced in model
    order: the `i`-th (0-based) goes to eligible layer `floor((2i + 1) * m / (2 * rem))` of the `m`
    eligible ones, so a remainder of one lands in the middle and two land at one quarter and three
    quarters, never biased to the early or the late layers.
    """
    caps = unit_caps(num_experts, top_k, granularity)
    units = check_budget(num_experts, top_k, budget, granularity) // granularity
    level = 0
    while sum(min(c, level + 1) for c in caps) <= units and level < max(caps):
        level += 1
    x = [min(c, level) for c in caps]
    rem = units - sum(x)
    eligible = [layer for layer, c in enumerate(caps) if c > level]
    for i in range(rem):
        x[eligible[(2 * i + 1) * len(eligible) // (2 * rem)]] += 1
    return tuple(v * granularity for v in x)


def proportional(
    weights: Sequence[float], num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1
) -> Allocation:
    """The feasible allocation nearest to removing `λ * weights[l]` experts per layer.

    `λ` is chosen so that the targets `min(cap_l, λ w_l)` (in units, computed exactly with fractions)
    sum to the budget; each layer gets the floor of its target and the units left over go to the layers
    with the largest fractional parts, ties to the earlier layer. Used for the search's patterned seeds.
    """
    caps = unit_caps(num_experts, top_k, granularity)
    units = check_budget(num_experts, top_k, budget, granularity) // granularity
    if len(weights) != len(caps):
        raise ConfigError(f"weights has {len(weights)} entries for {len(caps)} MoE layers")
    w = [Fraction(v) for v in weights]
    if any(v <= 0 for v in w):
        raise ConfigError(f"weights must all be positive, got {tuple(weights)}")
    saturated: set[int] = set()
    while True:
        free = [layer for layer in range(len(caps)) if layer not in saturated]
        if not free:
            break
        lam = Fraction(units - sum(caps[layer] for layer in saturated)) / sum(w[layer] for layer in free)
        over = {layer for layer in free if lam * w[layer] > caps[layer]}
        if not over:
            break
        saturated |= over
    target = [Fraction(caps[layer]) if layer in saturated else lam * w[layer] for layer in range(len(caps))]
    x = [math.floor(t) for t in target]
    by_fraction = sorted(range(len(caps)), key=lambda layer: (-(target[layer] - x[layer]), layer))
    for layer in by_fraction[: units - sum(x)]:
        x[layer] += 1
    return tuple(v * granularity for v in x)


def frequency_global(
    frequency: Sequence[Sequence[float]],
    num_experts: Sequence[int],
    top_k: Sequence[int],
    budget: int,
    granularity: int = 1,
) -> Allocation:
    """The paper's (SEER-MoE's) global frequency heuristic: prune where the globally rarest experts are.

    All experts of all layers are ranked by routing frequency, ascending, ties broken by layer and then
    expert id (so earlier layers lose ties); `c_l` is how many of the first `B` fall in layer `l`. Each
    count is clipped to the layer's bound and rounded down to a multiple of `g`; the units still missing
    are then added one at a time (`g` experts each) to the layer whose next `g` experts, in its own
    ascending-frequency order, have the smallest summed frequency, ties to the earlier layer. With
    `g = 1` this is the same as walking down the global ranking and skipping layers already at their
    bound.
    """
    caps = unit_caps(num_experts, top_k, granularity)
    units = check_budget(num_experts, top_k, budget, granularity) // granularity
    if len(frequency) != len(caps):
        raise ConfigError(f"frequency has {len(frequency)} layers for {len(caps)} MoE layers")
    ranked: list[tuple[float, int, int]] = []
    for layer, (freqs, n_l) in enumerate(zip(frequency, num_experts)):
        if len(freqs) != n_l:
            raise ConfigError(f"frequency[{layer}] has {len(freqs)} experts but the layer has {n_l}")
        for expert, f in enumerate(freqs):
            if not math.isfinite(f):
                raise ConfigError(f"frequency[{layer}][{expert}] = {f} is not finite")
            ranked.append((float(f), layer, expert))
    ranked.sort()
    counts = [0] * len(caps)
    for _, layer, _ in ranked[:budget]:
        counts[layer] += 1
    x = [min(c // granularity, cap) for c, cap in zip(counts, caps)]
    ascending = [sorted(float(f) for f in freqs) for freqs in frequency]

    def next_cost(layer: int) -> float:
        start = x[layer] * granularity
        return sum(ascending[layer][start : start + granularity])

    for _ in range(units - sum(x)):
        layer = min((layer for layer in range(len(caps)) if x[layer] < caps[layer]), key=lambda i: (next_cost(i), i))
        x[layer] += 1
    return tuple(v * granularity for v in x)


def pruned_sets(r: Sequence[int], orders: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Expert ids removed per MoE layer: the first `r[l]` of layer `l`'s ascending-importance order, so the
    sets are nested as `r[l]` grows."""
    if len(r) != len(orders):
        raise ConfigError(f"allocation has {len(r)} entries for {len(orders)} pruning orders")
    out: dict[int, list[int]] = {}
    for layer, (r_l, order) in enumerate(zip(r, orders)):
        ids = [as_int(f"orders[{layer}]", e) for e in order]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"pruning order of layer {layer} repeats an expert id: {ids}")
        if not 0 <= r_l <= len(ids):
            raise ConfigError(f"r[{layer}] = {r_l} is outside 0..{len(ids)} (layer {layer} has {len(ids)} experts)")
        out[layer] = ids[:r_l]
    return out


class FeasibleSet:
    """Counts, ranks and unranks the feasible allocations (lexicographic order), so the search can draw
    its random seeds uniformly from all of them and without repeats. Counts are exact Python ints."""

    def __init__(self, num_experts: Sequence[int], top_k: Sequence[int], budget: int, granularity: int = 1):
        self.caps = unit_caps(num_experts, top_k, granularity)
        self.granularity = granularity
        self.units = check_budget(num_experts, top_k, budget, granularity) // granularity
        # ways[l][s]: allocations of layers l.. that remove s units.
        ways = [[0] * (self.units + 1) for _ in range(len(self.caps) + 1)]
        ways[-1][0] = 1
        for layer in range(len(self.caps) - 1, -1, -1):
            below, acc = ways[layer + 1], 0
            for s in range(self.units + 1):
                acc += below[s]
                if s - self.caps[layer] - 1 >= 0:
                    acc -= below[s - self.caps[layer] - 1]
                ways[layer][s] = acc
        self._ways = ways
        self.size = ways[0][self.units]

    def unrank(self, index: int) -> Allocation:
        if not 0 <= index < self.size:
            raise ConfigError(f"index {index} is outside 0..{self.size - 1}")
        out, left = [], self.units
        for layer, cap in enumerate(self.caps):
            for x in range(min(cap, left) + 1):
                n = self._ways[layer + 1][left - x]
                if index < n:
                    break
                index -= n
            out.append(x * self.granularity)
            left -= x
        return tuple(out)

    def rank(self, r: Sequence[int]) -> int:
        index, left = 0, self.units
        for layer, r_l in enumerate(r):
            x = r_l // self.granularity
            index += sum(self._ways[layer + 1][left - y] for y in range(x))
            left -= x
        return index
