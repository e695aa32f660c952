"""Time what quantize on adds to the demo per point: the quantize stage and an evaluation of its output, in one process.

    python benchmarks/demo_quantize_step.py --pruned <a searched prune artifact of runs/demo> \
        --data runs/demo/world/data/code/calibration.jsonl --tasks runs/demo/world/tasks --out /tmp/demo-quantize

Needs EVOESAP_QUANTIZE_PYTHON (make quantize-venv). Prints one line per step with its wall seconds, and the
evaluations' primary metrics beside the unquantized model's (docs/results/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.quantize import QuantizeParams, run_quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pruned", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipes", nargs="+", default=["fp8-dynamic", "w4a16-gptq"])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    models = {"pruned": args.pruned}
    for recipe in args.recipes:
        started = time.perf_counter()
        models[recipe] = str(args.out / f"q-{recipe}")
        run_quantize(args.pruned, QuantizeParams(recipe=recipe, samples=64, max_length=256), models[recipe], data=args.data)
        print(f"quantize {recipe}: {time.perf_counter() - started:.1f} s")
    for name, model in models.items():
        started = time.perf_counter()
        out = args.out / f"eval-{name}"
        run_evaluate(model, EvaluateParams(tasks=(args.tasks,), limit=48, batch_size=16), str(out))
        metrics = json.loads((out / "metrics.json").read_text())
        scores = {r["task"]: round(r["value"], 3) for r in metrics["records"] if r.get("primary")}
        print(
            f"evaluate {name}: {time.perf_counter() - started:.1f} s, {metrics['memory']['checkpoint_bytes']:,} bytes, {scores}"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
