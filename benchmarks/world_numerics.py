"""Whether the demo world's weights depend on the CPU: build a world with the pinned numerics and without,
each natively and with the host's instruction sets restricted (a stand-in for an older CPU), and print the
weights' sha256 of each.

Each build is `evoesap.demo.build_demo_world` in a fresh interpreter started with the condition's environment;
"unpinned" empties `evoesap.demo.numerics.PINNED_NUMERICS` there, so training sees the CPU as main before the pin
did. The pinned builds should share one digest, the unpinned ones should not.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/world_numerics.py --profile quick
    PYTHONPATH=$PWD .venv/bin/python benchmarks/world_numerics.py --profile default --steps 20 --train-size 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

# what an older CPU would choose by itself: AVX2 kernels in ATen, MKL and oneDNN (no AVX-512, no AMX)
AVX2_HOST = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# name -> (pinned, environment added to this process's)
CONDITIONS: dict[str, tuple[bool, dict[str, str]]] = {
    "pinned, native": (True, {}),
    "pinned, host restricted to AVX2": (True, AVX2_HOST),
    "pinned, MKL restricted to SSE4.2": (True, {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
    "unpinned, native": (False, {}),
    "unpinned, host restricted to AVX2": (False, AVX2_HOST),
}
CLEARED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")  # set only by a condition

CHILD = """
import dataclasses, json, sys
from evoesap.demo import numerics, profiles, world
pinned, profile, steps, train_size, out = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if not pinned:
    numerics.PINNED_NUMERICS.clear()
if steps:
    profiles.PROFILES[profile] = dataclasses.replace(profiles.PROFILES[profile], steps=steps)
if train_size:
    profiles.PROFILES[profile] = dataclasses.replace(profiles.PROFILES[profile], train_size=train_size)
built = world.build_demo_world(out, seed=0, profile=profile)
print(json.dumps({k: built.info[k] for k in ("weights_sha256", "cpu_capability", "train_cpu_seconds")}))
"""


def build(pinned: bool, env: dict[str, str], profile: str, steps: int, train_size: int) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(pinned), profile, str(steps), str(train_size), os.path.join(tmp, "world")],
            env={**base, **env},
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick", choices=["quick", "default"])
    parser.add_argument("--steps", type=int, default=0, help="train this many steps instead of the profile's (0: its own)")
    parser.add_argument("--train-size", type=int, default=0, help="training prompts per domain (0: the profile's)")
    parser.add_argument("--conditions", nargs="*", default=list(CONDITIONS), choices=list(CONDITIONS))
    args = parser.parse_args()
    with open("/proc/cpuinfo") as fh:
        model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), platform.processor())
    steps = f"{args.steps} steps" if args.steps else "its own steps"
    steps += f", {args.train_size} training prompts per domain" if args.train_size else ""
    print(f"{model}; profile {args.profile}, {steps}; {time.strftime('%Y-%m-%d')}")
    print("| condition | environment added | torch kernels | training CPU s | weights sha256 |")
    print("|---|---|---|---:|---|")
    for name in args.conditions:
        pinned, env = CONDITIONS[name]
        r = build(pinned, env, args.profile, args.steps, args.train_size)
        added = " ".join(f"{k}={v}" for k, v in env.items()) or "none"
        print(
            f"| {name} | {added} | {r['cpu_capability']} | {r['train_cpu_seconds']:.1f} | `{r['weights_sha256'][:16]}` |",
            flush=True,
        )


if __name__ == "__main__":
    main()
