"""The memory target against the checkpoints prune really writes: at each budget, does `target: {bytes: B}` choose the
least grid sparsity whose written checkpoint fits, and is the floor it names the smallest checkpoint prune writes?

For every grid point, seven allocations (the uniform one, the removal packed into the first layers and into the last,
four drawn from the feasible set) are pruned with `moe.prune_checkpoint`, the files summed on disk; the point's size
is the largest (safetensors headers differ with the experts' renumbered names, and a non-uniform checkpoint carries
its modeling file). Budgets: ten, from one byte under the full checkpoint to the smallest searchable point, each on
or one byte under a written size. Correct: every written checkpoint of the chosen point fits, and one of the point
below it (or the full model) does not.
The floor: every layer at its fewest experts, written, against the size the refusal names.

With `--recipe` (fp8-dynamic or w4a16-gptq; the quantize environment, EVOESAP_QUANTIZE_PYTHON, must be there) every
checkpoint is also quantized by the quantize stage and the sizes are the quantized checkpoint's files (its
quantization.json and manifest.json aside); the three sized allocations per point (uniform, packed first, packed
last), and only the points the budgets need (each pick and its neighbours), since each one is a quantize run.

Example (the demo world, built by `evoesap demo build --out /work/demo-world`):
    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_target_check.py --model /work/demo-world/model
    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_target_check.py --model /work/demo-world/model --recipe fp8-dynamic
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


def _written(model: str, counts: list[int], root: Path, recipe: str | None = None) -> int:
    """Bytes on disk of the checkpoint prune writes with `counts` experts removed per MoE layer (with `recipe`, of the
    checkpoint the quantize stage writes from it, its own record and manifest aside)."""
    from evoesap import moe

    out = root / "-".join(map(str, counts))
    if not out.exists():
        moe.prune_checkpoint(model, {layer: list(range(c)) for layer, c in enumerate(counts) if c}, out)
    if recipe is not None:
        from evoesap.stages.quantize import QuantizeParams, run_quantize

        pruned, out = out, root / f"{recipe}-{out.name}"
        if not out.exists():
            run_quantize(str(pruned), QuantizeParams(recipe=recipe, samples=8, max_length=64), str(out), data=_data(root))
    skip = ("manifest.json", "quantization.json") if recipe else ()
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name not in skip)


def _data(root: Path) -> str:
    """A small calibration set for the calibrated recipes (the sizes do not depend on it)."""
    from evoesap.demo.domains import generate_splits, write_jsonl

    path = root / "calibration.jsonl"
    if not path.exists():
        write_jsonl(generate_splits("math", seed=0, train_size=4)["calibration"][:16], path)
    return str(path)


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
    parser.add_argument("--recipe", default=None, help="size the quantized checkpoint: fp8-dynamic or w4a16-gptq")
    args = parser.parse_args()
    recipe = args.recipe

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
        full = _written(args.model, [0] * len(n), root, recipe)
        floor = _written(args.model, [a - b for a, b in zip(n, least)], root, recipe)
        picks = [0, len(points) // 4, len(points) // 2, 3 * len(points) // 4, len(points) - 1]
        needed = (
            range(len(points))
            if recipe is None
            else sorted({j for i in picks for j in (i - 1, i, i + 1) if 0 <= j < len(points)})
        )
        sizes = {}
        for i in needed:
            budget = alloc.budget(points[i], n, k, 1)
            drawn = _allocations(n, k, budget, 0 if recipe else 4, i)
            sizes[i] = max(_written(args.model, counts, root, recipe) for counts in drawn)
    budgets = [full - 1] + [sizes[i] for i in picks] + [sizes[i] - 1 for i in picks[:-1]]
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(
        f"recipe: {recipe or 'none'}; grid: {len(points)} points; full checkpoint {full:,} bytes; floor (written) {floor:,} bytes"
    )
    print("| budget (bytes) | chose | its written size | the point below (or full) | correct |")
    print("|---:|---:|---:|---:|---|")
    right = 0
    for budget in budgets:
        chosen = points.index(fitting_sparsity(args.model, budget, 1, "auto", recipe))
        below = full if chosen == 0 else sizes.get(chosen - 1, -1)  # -1: a point no budget should reach (--recipe)
        ok = chosen in sizes and sizes[chosen] <= budget < below
        right += ok
        print(f"| {budget:,} | {points[chosen]:.4f} | {sizes.get(chosen, -1):,} | {below:,} | {'yes' if ok else '**no**'} |")
    named = None
    try:
        fitting_sparsity(args.model, floor - 1, 1, "auto", recipe)
    except ConfigError as refused:
        found = re.search(r"smallest checkpoint[\w\s-]*: ([\d,]+) bytes", str(refused))
        named = int(found.group(1).replace(",", "")) if found else None
    print(f"budgets correct: {right} of {len(budgets)}; the floor the refusal names: {named:,} bytes, written: {floor:,}")
    print(f"seconds: {time.perf_counter() - started:.0f}")
    return 0 if right == len(budgets) and named == floor else 1


if __name__ == "__main__":
    sys.exit(main())
