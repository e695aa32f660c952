"""How much of the decoder prefix reuse can skip, by depth: a bound from the search's own candidates.

Runs the level-switch search (defaults: population 32, elites 4, 50 generations, 50% sparsity) on a
cheap separable fitness at a family's depth and expert count, and for every new candidate, in the
order the search evaluates them, finds the earlier candidate whose per-layer counts agree with it on the
longest run of leading MoE layers. Prefix reuse can start no later than that layer, so the share of
layers still to run is a lower bound on its cost (every earlier candidate's states kept, which the
evaluator's bounded cache does not promise); the evaluator's FFE adds its own savings on top (the first
changed layer's attention, the last layer at scored positions only), worth more on shallow models.

Example:
    .venv/bin/python benchmarks/prefix_depth.py
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

import numpy as np

from evoesap.method import allocation as alloc
from evoesap.method import search

DEPTHS = {
    "demo (4 x 16, top-2)": (4, 16, 2),
    "olmoe-1b-7b (16 x 64, top-8)": (16, 64, 8),
    "qwen3-30b-a3b (48 x 128, top-8)": (48, 128, 8),
}


def layers_to_run(layers: int, experts: int, top_k: int, sparsity: float, seed: int, generations: int) -> list[float]:
    """Per evaluated candidate, in order: the share of MoE layers from its first layer unshared with any earlier one."""
    n, k = [experts] * layers, [top_k] * layers
    weights = np.random.default_rng(seed).uniform(0.5, 2.0, size=layers)
    evaluated: list[tuple[int, ...]] = []

    def fitness(r: tuple[int, ...]) -> float:  # concave in each layer, with ripples so ties are rare
        evaluated.append(tuple(r))
        return float(sum(w * math.log(experts - x + 1) + 0.01 * math.sin(7 * x + i) for i, (w, x) in enumerate(zip(weights, r))))

    search.level_switch_search(fitness, n, k, alloc.budget(sparsity, n, k), generations=generations, seed=seed)
    shares = []
    for i, r in enumerate(evaluated):
        shared = max((next((layer for layer in range(layers) if r[layer] != c[layer]), layers) for c in evaluated[:i]), default=0)
        shares.append((layers - shared) / layers)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--generations", type=int, default=50)
    args = parser.parse_args()
    print(
        "| model shape | candidates per search | layers to run per candidate (bound), whole search | generation 0 | later generations |"
    )
    print("|---|---|---|---|---|")
    for name, (layers, experts, top_k) in DEPTHS.items():
        runs = [layers_to_run(layers, experts, top_k, args.sparsity, seed, args.generations) for seed in range(args.seeds)]
        whole = [np.mean(r) for r in runs]
        first = [np.mean(r[:32]) for r in runs]
        later = [np.mean(r[32:]) for r in runs]
        print(
            f"| {name} | {np.mean([len(r) for r in runs]):.0f} | {np.mean(whole):.3f} ({min(whole):.3f}-{max(whole):.3f}) | "
            f"{np.mean(first):.3f} | {np.mean(later):.3f} |"
        )
    print("\ncommand: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
