"""Run a stage inside the built CPU image and compare it with the same stage run outside (`make image`).

Builds (or reuses) the quick-profile demo world outside, runs `evoesap --help` and `evoesap calibrate`
in a container of the image (buildah, chroot isolation, as the image's own non-root user) and the same
calibrate with this checkout's package outside, then compares the two scores.parquet files value by
value and the manifests' parameters and commit. Prints a markdown summary; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[1]
CALIBRATE = ["--quiet", "calibrate", "--samples", "16", "--max-length", "128"]


@contextlib.contextmanager
def container(image: str) -> Iterator[str]:
    name = subprocess.run(["buildah", "from", "--quiet", image], check=True, capture_output=True, text=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def run_inside(ctr: str, mounts: dict[Path, str], *command: str) -> subprocess.CompletedProcess:
    volumes = [arg for host, target in mounts.items() for arg in ("--volume", f"{host}:{target}")]
    return subprocess.run(
        ["buildah", "run", "--isolation", "chroot", *volumes, ctr, "--", *command], capture_output=True, text=True
    )


def image_size(image: str) -> str:
    return subprocess.run(
        ["buildah", "images", "--format", "{{.Size}}", image], check=True, capture_output=True, text=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image", default="localhost/evoesap/stage:cpu")
    # under the temporary directory: the image's uid 10001 must be able to read what is mounted (here /work is
    # readable by root alone)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "evoesap-image-check"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    world, inside_out, outside_out = work / "world", work / "inside", work / "outside"
    for d in (inside_out, outside_out):
        subprocess.run(["rm", "-rf", str(d)], check=True)
        d.mkdir(parents=True)
    inside_out.chmod(0o777)  # the image runs as uid 10001
    subprocess.run(
        [sys.executable, "-m", "evoesap", "demo", "build", "--out", str(world), "--profile", "quick"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["chmod", "-R", "a+rX", str(world)], check=True)  # built as root (0700 staging); read as 10001
    data = "data/code/calibration.jsonl"
    failures = []
    with container(args.image) as ctr:
        helped = run_inside(ctr, {}, "evoesap", "--help")
        if helped.returncode or "calibrate" not in helped.stdout:
            failures.append(f"`evoesap --help` in the image failed: {helped.stderr.strip()[-500:]}")
        user = run_inside(ctr, {}, "id", "-u").stdout.strip()
        t0 = time.perf_counter()
        inside = run_inside(
            ctr,
            {world: "/world", inside_out: "/out"},
            "evoesap",
            *CALIBRATE,
            "--model",
            "/world/model",
            "--data",
            f"/world/{data}",
            "--out",
            "/out/scores",
        )
        inside_s = time.perf_counter() - t0
    if inside.returncode:
        failures.append(f"calibrate in the image failed: {inside.stderr.strip()[-800:]}")
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "evoesap",
            *CALIBRATE,
            "--model",
            str(world / "model"),
            "--data",
            str(world / data),
            "--out",
            str(outside_out / "scores"),
        ],
        check=True,
        capture_output=True,
    )
    outside_s = time.perf_counter() - t0
    max_diff = float("nan")
    if not inside.returncode:
        a = pq.read_table(inside_out / "scores" / "scores.parquet").to_pandas()
        b = pq.read_table(outside_out / "scores" / "scores.parquet").to_pandas()
        if list(a.columns) != list(b.columns) or len(a) != len(b):
            failures.append(f"scores differ in shape: {a.shape} inside vs {b.shape} outside")
        else:
            numeric = a.select_dtypes("number").columns
            max_diff = float(np.max(np.abs(a[numeric].to_numpy(float) - b[numeric].to_numpy(float))))
            if max_diff > 1e-6:
                failures.append(f"scores differ by up to {max_diff:.3g}")
        mi, mo = (artifacts.read_manifest(str(d / "scores")) for d in (inside_out, outside_out))
        if mi.params != mo.params:
            failures.append("manifests record different parameters")
        if not mi.git_commit:
            failures.append("the image's manifest records no git commit")
    print("| image | size | user | calibrate inside | outside | max abs score difference | commit in manifest |")
    print("|---|---|---|---|---|---|---|")
    commit = mi.git_commit[:12] if not inside.returncode and mi.git_commit else "-"
    print(
        f"| {args.image} | {image_size(args.image)} | {user} | {inside_s:.1f} s | {outside_s:.1f} s | {max_diff:.3g} | {commit} |"
    )
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
