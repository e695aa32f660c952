"""Cost of verification on read: sha256 of every payload file against its manifest, per artifact.

For each finished artifact under --root (a pipeline's storage_root, e.g. the demo's runs/demo/artifacts)
it times `artifacts.verify` against a baseline measured in the same run: reading the same files without
hashing (what a stage reads anyway). Then it times sha256 against a plain read on a --payload-mib
synthetic file, to extrapolate to large payloads (a 60 GB checkpoint, a full-vocabulary teacher cache).

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_verify.py --root runs/demo/artifacts --payload-mib 1024
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from evoesap.store import artifacts


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _read_all(root: Path, names) -> None:
    for name in names:
        with open(root / name, "rb") as f:
            while f.read(1 << 20):
                pass


def per_artifact(root: Path, repeat: int) -> list[tuple[str, str, int, float, float]]:
    rows = []
    for manifest in sorted(root.rglob(artifacts.MANIFEST)):
        art = manifest.parent
        m = artifacts.read_manifest(str(art))
        size = sum((art / rel).stat().st_size for rel in m.files)
        t_read = _best(lambda art=art, m=m: _read_all(art, m.files), repeat)
        t_verify = _best(lambda art=art, m=m: artifacts.verify(str(art), m.stage), repeat)
        rows.append((m.stage, art.relative_to(root).as_posix(), size, t_read, t_verify))
    return rows


def throughput(mib: int, repeat: int) -> tuple[float, float]:
    """(plain read MiB/s, sha256 MiB/s) on a file of `mib` MiB (page cache warm: the hash, not the disk)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "payload.bin"
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        t_read = _best(lambda: _read_all(path.parent, [path.name]), repeat)
        t_hash = _best(lambda: artifacts.sha256_file(path), repeat)
    return mib / t_read, mib / t_hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="a storage_root holding finished artifacts")
    parser.add_argument("--payload-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = per_artifact(args.root, args.repeat)
    print("| stage | artifact | payload bytes | read (ms) | verify (ms) | verify / read |")
    print("|---|---|---:|---:|---:|---:|")
    for stage, name, size, t_read, t_verify in rows:
        print(f"| {stage} | {name} | {size:,} | {t_read * 1e3:.2f} | {t_verify * 1e3:.2f} | {t_verify / t_read:.1f} |")
    total_read, total_verify = sum(r[3] for r in rows), sum(r[4] for r in rows)
    print(
        f"| all | {len(rows)} artifacts | {sum(r[2] for r in rows):,} | {total_read * 1e3:.2f} | "
        f"{total_verify * 1e3:.2f} | {total_verify / total_read:.1f} |"
    )
    read_rate, hash_rate = throughput(args.payload_mib, max(1, args.repeat // 2))
    print(
        f"\n{args.payload_mib} MiB payload: plain read {read_rate:,.0f} MiB/s, sha256 {hash_rate:,.0f} MiB/s "
        f"(hashing is {read_rate / hash_rate:.1f}x a cached read; 60 GB would take {60e3 / hash_rate:.0f} s to verify)"
    )


if __name__ == "__main__":
    main()
