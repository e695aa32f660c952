"""Short demo-world training under CPU thread configurations, on idle cores and beside busy processes.

Each configuration trains the default demo profile for `--steps` steps in a fresh interpreter (so an
OpenMP environment variable such as OMP_WAIT_POLICY is read before torch starts) and prints wall and
CPU seconds and the sha256 of the trained weights. `--load N` starts N `yes > /dev/null` processes for
the loaded runs: with two of them on a 2-core machine, two spin-waiting torch threads took 47 minutes
for a training that needs 3 on idle cores (docs/results/speed.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_threads.py --steps 40 --load 2

With both conditions it ends with each configuration's loaded/idle wall-time ratio (the bar: at most 2 for
the world build beside two busy processes), e.g. `--steps 200 --configs "1 thread"`, the default world's
training as the build runs it, idle and then beside two `yes`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# name -> (environment added, intra-op threads)
CONFIGS: dict[str, tuple[dict[str, str], int]] = {
    "2 threads (torch default here)": ({}, 2),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "1 thread": ({}, 1),
}


def train_once(steps: int, threads: int) -> dict:
    """Train the default profile for `steps` steps with `threads` intra-op threads (runs in the child)."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from evoesap.demo import domains, tokenizer, train
    from evoesap.demo.profiles import get_profile
    from evoesap.demo.world import weights_hash

    profile = dataclasses.replace(get_profile("default"), steps=steps, warmup=min(10, steps), train_size=1000, threads=threads)
    sets = {
        d: [s.to_json()["messages"] for s in domains.generate_splits(d, 0, profile.train_size)["train"]]
        for d in sorted(domains.DOMAINS)
    }
    tok = tokenizer.build_tokenizer(model_max_length=profile.max_positions)
    model = train.make_model(profile, tok, seed=0)
    figures = train.train(model, tok, sets, profile, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        sha = weights_hash(Path(tmp))
    return {"wall_s": figures["train_seconds"], "cpu_s": figures["train_cpu_seconds"], "sha256": sha}


def run_config(name: str, steps: int, timeout: float) -> dict | None:
    """Figures of one configuration's training in a fresh interpreter; None when it ran past `timeout` seconds."""
    env, threads = CONFIGS[name]
    code = f"import json, bench_threads as b; print(json.dumps(b.train_once({steps}, {threads})))"
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, **env, PYTHONPATH=path),
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--load", type=int, default=2, help="busy `yes` processes for the loaded runs")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--conditions", nargs="*", default=["idle", "loaded"], choices=["idle", "loaded"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run is stopped and reported so")
    args = parser.parse_args()
    print(f"default profile, {args.steps} steps; load average at start {os.getloadavg()}")
    print("| configuration | condition | wall s | cpu s | s/step | weights sha256 |")
    print("|---|---|---|---|---|---|")
    wall: dict[tuple[str, bool], float] = {}
    for loaded in [c == "loaded" for c in args.conditions]:
        loaders = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.load if loaded else 0)]
        try:
            for name in args.configs:
                r = run_config(name, args.steps, args.timeout)
                cond = f"{args.load}x yes" if loaded else "no yes"
                if r is None:
                    print(f"| {name} | {cond} | > {args.timeout:.0f} (stopped) | | | |", flush=True)
                    continue
                wall[name, loaded] = r["wall_s"]
                print(
                    f"| {name} | {cond} (load avg {os.getloadavg()[0]:.1f}) | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
                    f"| {r['wall_s'] / args.steps:.2f} | {r['sha256'][:12]} |",
                    flush=True,
                )
        finally:
            for p in loaders:
                p.kill()
                p.wait()
    for name in args.configs:
        if (name, False) in wall and (name, True) in wall:
            print(f"{name}: wall beside {args.load}x yes / idle = {wall[name, True] / wall[name, False]:.2f}")


if __name__ == "__main__":
    main()
