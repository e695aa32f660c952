"""The memory target against the checkpoints prune really writes: at each budget, does `target: {bytes: B}` choose the
least grid sparsity whose written checkpoint fits, and is the floor it names the smallest checkpoint prune writes?

For every grid point, seven allocations (the uniform one, the removal packed into the first layers and into the last,
four drawn from the feasible set) are pruned with `moe.prune_checkpoint`, the files summed on disk; the point's size
is the largest (safetensors headers differ with the experts' renumbered names, and a non-uniform checkpoint carries
its modeling file). Budgets: ten, from one byte under the full checkpoint to the smallest searchable point, each on
or one byte under a written size. Correct: every written checkpoint of the chosen point fits, and one of the point
below it (or the full model) does not.
The floor: every layer at its fewest experts, written, against the size the refusal names.

Example (the demo world, built by `evoesap demo build --out /work/demo-world`):
    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_target_check.py --model /work/demo-world/model
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path


def _written(model: str, counts: list[int], root: Path) -> int:
    """Bytes on disk of the checkpoint prune writes with `counts` experts removed per MoE layer."""
    from evoesap import moe

    out = root / "-".join(map(str, counts))
    if not out.exists():
        moe.prune_checkpoint(model, {layer: list(range(c)) for layer, c in enumerate(counts) if c}, out)
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _allocations(n: list[int], k: list[int], budget: int, draws: int, seed: int) -> list[list[int]]:
    """Allocations at `budget` whose checkpoints span the point's sizes: the uniform one, the removal packed into the
    first layers and into the last (the most uneven), and `draws` drawn from the feasible set."""
    import random

    from evoesap.method import allocation as alloc

    caps = [a - b for a, b in zip(n, k)]

    def packed(order: list[int]) -> list[int]:
        counts, left = [0] * len(n), budget
        for layer in order:
            counts[layer] = min(caps[layer], left)
            left -= counts[layer]
        return counts

    space, rng = alloc.FeasibleSet(n, k, budget, 1), random.Random(seed)
    drawn = [list(space.unrank(rng.randrange(space.size))) for _ in range(draws)]
    return [list(alloc.uniform(n, k, budget, 1)), packed(list(range(len(n)))), packed(list(range(len(n)))[::-1]), *drawn]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder (the demo world's model)")
    args = parser.parse_args()

    from evoesap.pipeline.target import fitting_sparsity, searchable

    from evoesap import moe
    from evoesap.errors import ConfigError
    from evoesap.machine import runtime
    from evoesap.method import allocation as alloc

    started = time.perf_counter()
    space, points = searchable(args.model, 1)
    n, k = space.num_experts, space.min_kept
    least = moe.pruning_space(runtime.inspect_checkpoint(args.model), 1).min_kept
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = _written(args.model, [0] * len(n), root)
        floor = _written(args.model, [a - b for a, b in zip(n, least)], root)
        sizes = []
        for i, sparsity in enumerate(points):
            budget = alloc.budget(sparsity, n, k, 1)
            sizes.append(max(_written(args.model, counts, root) for counts in _allocations(n, k, budget, 4, i)))
    picks = [0, len(points) // 4, len(points) // 2, 3 * len(points) // 4, len(points) - 1]
    budgets = [full - 1] + [sizes[i] for i in picks] + [sizes[i] - 1 for i in picks[:-1]]
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"grid: {len(points)} points; full checkpoint {full:,} bytes; floor (written) {floor:,} bytes")
    print("| budget (bytes) | chose | its written size | the point below (or full) | correct |")
    print("|---:|---:|---:|---:|---|")
    right = 0
    for budget in budgets:
        chosen = points.index(fitting_sparsity(args.model, budget, 1, "auto"))
        below = full if chosen == 0 else sizes[chosen - 1]
        ok = sizes[chosen] <= budget < below
        right += ok
        print(f"| {budget:,} | {points[chosen]:.4f} | {sizes[chosen]:,} | {below:,} | {'yes' if ok else '**no**'} |")
    named = None
    try:
        fitting_sparsity(args.model, floor - 1, 1, "auto")
    except ConfigError as refused:
        found = re.search(r"smallest checkpoint: ([\d,]+) bytes", str(refused))
        named = int(found.group(1).replace(",", "")) if found else None
    print(f"budgets correct: {right} of {len(budgets)}; the floor the refusal names: {named:,} bytes, written: {floor:,}")
    print(f"seconds: {time.perf_counter() - started:.0f}")
    return 0 if right == len(budgets) and named == floor else 1


if __name__ == "__main__":
    sys.exit(main())
