"""Stress test of the publish protocol: many runs publishing one output at the same instant.

Each round starts `--publishers` publishes of one `--out` behind a barrier, as threads or as forked processes,
on a local directory or on S3 (moto's server on loopback). In an "identical" round every publisher stages the
same artifact (a KFP retry racing its first try); in a "mixed" round one of them stages a different one. What
must hold after every round, checked here:

- the output holds exactly one artifact, which verifies (every payload sha256 against its manifest);
- every publisher either succeeded, and the artifact there is its own (same parameters), or was refused with
  "changed while this run worked" and its own artifact kept, intact, where the message says;
- in an identical round, every publisher succeeded;
- nothing else is left beside the output (no lock, staging or replaced directory).

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/publish_race.py --rounds 200
The CI variant with the interleavings forced by hooks: tests/unit/test_publish_race.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from evoesap.store import artifacts
from evoesap.errors import ArtifactError

_FORK = multiprocessing.get_context("fork")


def _publish(out: str, payload: str, barrier: Any) -> tuple[str, str]:
    """One run: stage `payload`, wait for the others, publish. Returns (outcome, detail)."""
    try:
        with artifacts.stage_output(out, "race", {"payload": payload}, {}) as staging:
            (staging / "x.txt").write_text(payload * 1000)
            (staging / "sub").mkdir()
            (staging / "sub" / "y.bin").write_bytes(payload.encode() * 4096)
            barrier.wait(60)
        return "published", payload
    except ArtifactError as exc:
        text = str(exc)
        if "changed while this run worked" in text and "kept at " in text:
            return "refused", text.rsplit("kept at ", 1)[1]
        return "error", text


def _in_process(out: str, payload: str, barrier: Any, queue: Any, slot: int) -> None:
    queue.put((slot, *_publish(out, payload, barrier)))


def _round(out: str, payloads: list[str], processes: bool) -> list[tuple[str, str]]:
    if processes:
        barrier, queue = _FORK.Barrier(len(payloads)), _FORK.Queue()
        procs = [_FORK.Process(target=_in_process, args=(out, p, barrier, queue, i)) for i, p in enumerate(payloads)]
        for proc in procs:
            proc.start()
        got = dict((slot, (outcome, detail)) for slot, outcome, detail in (queue.get(timeout=300) for _ in procs))
        for proc in procs:
            proc.join(60)
        return [got[i] for i in range(len(payloads))]
    barrier, results = threading.Barrier(len(payloads)), [None] * len(payloads)

    def run(i: int) -> None:
        results[i] = _publish(out, payloads[i], barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def _problems(out: str, payloads: list[str], results: list[tuple[str, str]], parent: Path | None) -> list[str]:
    problems = []
    try:
        manifest = artifacts.verify(out, "race")
        there = manifest.params["payload"]
    except ArtifactError as exc:
        return [f"no intact artifact: {exc}"]
    for payload, (outcome, detail) in zip(payloads, results):
        if outcome == "published" and payload != there:
            problems.append(f"a {payload!r} run says it published, but {there!r} is there")
        elif outcome == "refused":
            kept = Path(detail)
            if (kept / "x.txt").read_text() != payload * 1000:
                problems.append(f"a refused {payload!r} run's artifact is not intact at {kept}")
            shutil.rmtree(kept, ignore_errors=True)
        elif outcome == "error":
            problems.append(f"a {payload!r} run failed: {detail}")
    if len(set(payloads)) == 1 and any(outcome != "published" for outcome, _ in results):
        problems.append(f"an identical run was refused: {[o for o, _ in results]}")
    if parent is not None:
        debris = sorted(p.name for p in parent.iterdir() if p.name != Path(out).name)
        if debris:
            problems.append(f"left beside the output: {debris}")
    return problems


@contextlib.contextmanager
def _moto() -> Any:
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[key] = "race"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    import fsspec

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = f"http://127.0.0.1:{port}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("race")
    try:
        yield "s3://race"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="rounds of each kind")
    parser.add_argument("--publishers", type=int, default=6)
    parser.add_argument("--stores", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)  # refusals are expected outcomes here, counted below
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    started = time.monotonic()
    with _moto() as bucket, tempfile.TemporaryDirectory(prefix="publish-race-") as tmp:
        for store in args.stores:
            for processes in (False, True):
                for kind in ("identical", "mixed"):
                    name = f"{store} {'processes' if processes else 'threads'} {kind}"
                    for r in range(args.rounds):
                        parent = Path(tmp) / f"{store}-{processes}-{kind}-{r}"
                        parent.mkdir()
                        out = str(parent / "out") if store == "local" else f"{bucket}/{parent.name}/out"
                        payloads = ["same"] * args.publishers
                        if kind == "mixed":
                            payloads[r % args.publishers] = "other"
                        results = _round(out, payloads, processes)
                        problems = _problems(out, payloads, results, parent if store == "local" else None)
                        counts[name]["rounds"] += 1
                        counts[name]["failed rounds"] += bool(problems)
                        for outcome, _ in results:
                            counts[name][outcome] += 1
                        failures += [f"{name} round {r}: {p}" for p in problems]
                        shutil.rmtree(parent, ignore_errors=True)
                    print(f"{name}: {dict(counts[name])}", flush=True)
    print("\n| setting | rounds | failed rounds | published | refused | errors |\n|---|---|---|---|---|---|")
    for name, c in counts.items():
        print(f"| {name} | {c['rounds']} | {c['failed rounds']} | {c['published']} | {c['refused']} | {c['error']} |")
    print(f"\n{len(failures)} problems in {time.monotonic() - started:.0f} s")
    for line in failures[:20]:
        print(line)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
