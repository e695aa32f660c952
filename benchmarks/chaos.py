"""Chaos run: the pipeline's stages with one fault at a random moment, then re-run undisturbed.

Each run starts from an empty storage root, runs the whole stage sequence of the DAG (one criterion x one
sparsity: calibrate, both teacher caches, evaluate full, search on two workers, prune searched and uniform,
their evaluations, quantize the searched model and evaluate it, report, publish with a push to a second
place; `steps.run_step` under one storage root, as the KFP components call it) in a child process, and
injects one fault at a random moment of a stage drawn at random: kill -9 or SIGTERM of that process, an S3
outage (moto, stopped for a random interval), a full disk (the storage root a tmpfs of random size, in a
private mount namespace), a truncated or bit-flipped file of a finished artifact; or, aimed at one stage,
kill -9 of one search worker, SIGTERM of the search's launcher while its workers run, an outage of the
object store publish pushes to while it pushes. Then the sequence runs again undisturbed. It must end with
every artifact (the pushed copy included) equal to an undisturbed run's (payload files and their sha256s;
artifacts matched by lineage, since manifests carry times) or, for corrupted storage, one `error:` line
naming the damaged artifact; user files beside and above the storage root must be unchanged.

The quantize stage runs llm-compressor in its own environment: EVOESAP_QUANTIZE_PYTHON, else this
checkout's .venv-quantize (`make quantize-venv`).

    python benchmarks/chaos.py --faults 100 --seed 0             # the quick demo world
    python benchmarks/chaos.py --faults 12 --seed 1 --world tiny  # the CI variant's world (tests/system/test_chaos.py)
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's evoesap; tests' tiny world

from evoesap.registry import STAGES
from evoesap.store import identity

KINDS = ("kill9", "sigterm", "s3_outage", "disk_full", "corrupt", "kill9_worker", "sigterm_launcher", "push_outage")
AIMED = {"kill9_worker": "search", "sigterm_launcher": "search", "push_outage": "publish"}  # kind -> its stage
S3_KINDS = ("s3_outage", "push_outage")
BUCKET = "chaos"
RELEASE_BUCKET = "chaos-release"  # where publish pushes its copy (`to`), when the harness runs an S3 endpoint
QUANTIZE_PYTHON = "EVOESAP_QUANTIZE_PYTHON"
CRITERION = "reap"

# Stage parameters per world: the demo's stages, shrunk so one pipeline takes seconds on 2 CPU cores.
PARAMS: dict[str, dict[str, Any]] = {
    "quick": {
        "sparsity": 0.25,  # the quick world (2 layers x 4 experts) admits one allocation at 50%
        "calibrate": {"samples": 32, "max_length": 256, "batch_size": 16},
        "cache-logits": {"samples": 32, "max_length": 256, "batch_size": 16, "dtype": "float32"},
        "search": {"population": 8, "elites": 2, "generations": 4, "batch_size": 16, "resume": True, "workers": 2},
        "prune": {},
        "evaluate": {"limit": 8, "batch_size": 8},
        "quantize": {"recipe": "fp8-dynamic", "device": "cpu"},
        "report": {"title": "chaos"},
        "publish": {},
    },
    "tiny": {  # tests/tiny_artifacts.py's sizes; one search process and no quantize, which take a minute a run
        "sparsity": 0.5,
        "calibrate": {"samples": 8, "max_length": 128},
        "cache-logits": {"samples": 6, "max_length": 128, "dtype": "float32"},
        "search": {"population": 4, "elites": 1, "generations": 2, "batch_size": 8, "resume": True},
        "prune": {},
        "evaluate": {"limit": 2, "batch_size": 2, "device": "cpu", "max_length": 128},
        "report": {"title": "chaos"},
        "publish": {},
    },
}


# ----------------------------------------------------------------------------- the pipeline (child process)


def run_pipeline(files: dict[str, str], params: dict[str, Any], root: str, to: str, marks: str) -> str:
    """The DAG's stages for one criterion x sparsity, in its order, under `root` (publish pushing to `to`); returns
    the publish artifact's URI. Each stage's start is appended to `marks` (its name and the monotonic clock)."""
    from evoesap import steps

    def run_step(stage: str, *args: Any) -> str:
        with open(marks, "a") as f:
            f.write(f"{stage} {time.monotonic()}\n")
        return steps.run_step(stage, *args)

    model, point = files["model"], {"criterion": CRITERION, "sparsity": params["sparsity"]}
    evaluate = {**params["evaluate"], "tasks": [files["tasks"]]}
    scores = run_step("calibrate", root, {"model": model, "data": files["calibration"]}, params["calibrate"])
    cache = run_step("cache-logits", root, {"model": model, "data": files["search"]}, params["cache-logits"])
    heldout = run_step("cache-logits", root, {"model": model, "data": files["heldout"]}, params["cache-logits"])
    full = run_step("evaluate", root, {"model": model, "teacher_cache": heldout}, {**evaluate, "method": "full"})
    searched = run_step(
        "search",
        root,
        {"model": model, "scores": scores, "cache": cache, "heldout_cache": heldout},
        {**params["search"], **point},
    )
    runs, pruned = {}, {}
    for method, allocation in (("uniform", None), ("searched", searched)):
        pruned[method] = run_step(
            "prune", root, {"model": model, "scores": scores, "allocation": allocation}, {**params["prune"], **point}
        )
        runs[method] = run_step(
            "evaluate", root, {"model": pruned[method], "teacher_cache": heldout}, {**evaluate, "method": method, **point}
        )
    quantized = None
    if "quantize" in params:  # the world's pipeline quantizes the searched model and evaluates that too
        quantized = run_step("quantize", root, {"model": pruned["searched"]}, params["quantize"])
        runs["quantized"] = run_step(
            "evaluate", root, {"model": quantized, "teacher_cache": heldout}, {**evaluate, "method": "searched", **point}
        )
    report = run_step("report", root, {"runs": [full, *runs.values()], "searches": [searched]}, params["report"])
    return run_step(
        "publish",
        root,
        {
            "pruned": pruned["searched"],
            "evaluations": [full, runs["searched"], *([runs["quantized"]] if quantized else [])],
            "search": searched,
            "report": report,
            "quantized": quantized,
        },
        {**params["publish"], "to": to},
    )


def child(spec_path: str) -> int:
    """Run the pipeline as a stage process would: exit 0, or 1 with one `error:` line (the CLI's rule)."""
    from evoesap.errors import EvoESAPError
    from evoesap.store.artifacts import redact

    spec = json.loads(Path(spec_path).read_text())
    try:
        Path(spec["result"]).write_text(run_pipeline(spec["files"], spec["params"], spec["root"], spec["to"], spec["marks"]))
    except EvoESAPError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - anything else is a finding: traceback, then the CLI's line
        traceback.print_exc()
        print(f"internal error ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 1
    return 0


def disk_full_child(spec_path: str, size: int) -> int:
    """In a private mount namespace: the storage root a tmpfs of `size` bytes for one pipeline run, then its
    contents moved back onto the real disk (the disk 'grown'), as the next run would find them."""
    root = Path(json.loads(Path(spec_path).read_text())["root"])
    spill = root.with_name(root.name + ".spill")
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)], check=True)
    try:
        return child(spec_path)
    finally:
        held = _held_under(root)
        shutil.copytree(root, spill, symlinks=True)
        subprocess.run(["umount", "--lazy", str(root)], check=True)  # lazy: a file still held (reported below) keeps it busy
        shutil.copytree(spill, root, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(spill)  # restored first, so the next fault run starts clean even after a finding
        if held:
            raise RuntimeError(f"the stage process still holds files under the storage root: {held[:5]}")


CLONE_NEWNS = 0x00020000


def _held_under(root: Path) -> list[str]:
    """Files under `root` this process still has open or mapped (a leak: the stage has failed and returned)."""
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")]
    maps = [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines() if len(line.split()) == 6]
    return sorted({f"{'fd' if i < len(fds) else 'mmap'} {p}" for i, p in enumerate(fds + maps) if p.startswith(f"{root}/")})


# ----------------------------------------------------------------------------- what a run leaves


def storage_fs(root: str):
    from evoesap.store import artifacts

    return artifacts.split(root)


def snapshot(root: str, report: str | None = None) -> dict[str, dict[str, str]]:
    """Every finished artifact under `root` (with `report`: those behind that report, the ones a run used;
    others are what earlier runs made from inputs since rebuilt) as {lineage label: {payload file: sha256}}.

    Artifacts are matched by lineage (stage, parameters, inputs; artifact inputs by their own lineage),
    since content-addressed locations and manifest hashes carry the manifests' times. An artifact input is followed
    as the pipeline's lineage follows it (`store.lineage.changed`): by the content identity its reader recorded, so an
    artifact made again from the same bytes (a new manifest) after its readers were made is still theirs; by manifest
    sha256 where no content identity is recorded. For the same reason a payload's bytes are hashed after each
    artifact location (or its last part, as a public model card names it) and manifest sha256 in them (an
    evaluation's model URI) is replaced by its lineage label; nothing else is changed.
    """
    fs, base = storage_fs(root)
    manifests, hashes, by_content = {}, {}, {}
    for path in fs.find(base):
        directory = path.rsplit("/", 1)[0]
        if path.endswith("/manifest.json") and not fs.exists(f"{directory}/publishing.json"):
            raw = fs.cat_file(path)
            manifests[directory], hashes[directory] = json.loads(raw), hashlib.sha256(raw).hexdigest()
            by_content[identity.artifact_record(raw).get("content_sha256")] = directory
    by_hash = {digest: directory for directory, digest in hashes.items()}
    by_content.pop(None, None)
    labels: dict[str, str] = {}

    def label(directory: str) -> str:
        if directory not in labels:
            manifest = manifests[directory]
            inputs = {
                name: label(read)
                if (read := _read_from(record, by_content, by_hash))
                else {k: v for k, v in record.items() if k != "uri"}
                if record.get("kind") == "artifact"
                else record
                for name, record in manifest["inputs"].items()
            }
            text = json.dumps({"stage": manifest["stage"], "params": manifest["params"], "inputs": inputs}, sort_keys=True)
            labels[directory] = f"{manifest['stage']}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        return labels[directory]

    scheme = root.split("://", 1)[0] + "://" if "://" in root else ""
    swaps = sorted(
        # a public model card names an artifact by the last part of its location only (its content-addressed key)
        (
            (s.encode(), f"<{label(d)}>".encode())
            for d in manifests
            for s in (scheme + d, d, d.rsplit("/", 1)[-1], hashes[d], hashes[d][:12])
        ),
        key=lambda pair: -len(pair[0]),
    )
    if report is not None:
        manifests = {d: m for d, m in manifests.items() if d in _behind(split_path(report), manifests, by_content, by_hash)}
    found: dict[str, dict[str, str]] = {}
    for directory, manifest in manifests.items():
        files = {}
        for rel in manifest["files"]:
            data = fs.cat_file(f"{directory}/{rel}") if fs.exists(f"{directory}/{rel}") else b"<missing>"
            for text, replacement in swaps:
                data = data.replace(text, replacement)
            files[rel] = hashlib.sha256(data).hexdigest()
        if found.setdefault(label(directory), files) != files:  # two artifacts of one lineage must agree
            found[label(directory) + ":conflict"] = files
    return found


def split_path(uri: str) -> str:
    return storage_fs(uri)[1].rstrip("/")


def _read_from(record: dict[str, Any], by_content: dict[str, str], by_hash: dict[str, str]) -> str | None:
    """The artifact (directory) a manifest's input record names: by its recorded content identity, else by manifest."""
    if record.get("kind") != "artifact":
        return None
    if "content_sha256" in record:
        return by_content.get(record["content_sha256"])
    return by_hash.get(record.get("manifest_sha256"))


def _behind(top: str, manifests: dict[str, Any], by_content: dict[str, str], by_hash: dict[str, str]) -> set[str]:
    """`top` and every artifact it was made from, through the manifests' input records (`_read_from`)."""
    seen, todo = set(), [top]
    while todo:
        directory = todo.pop()
        if directory in seen or directory not in manifests:
            continue
        seen.add(directory)
        todo += [d for r in manifests[directory]["inputs"].values() if (d := _read_from(r, by_content, by_hash))]
    return seen


def leftovers(roots: list[str], tmpdir: Path) -> list[str]:
    """What interrupted runs left (under the storage root and the place publish pushes to, and in TMPDIR) that the
    undisturbed re-run should have removed."""
    names = []
    for root in roots:
        fs, base = storage_fs(root)
        if fs.exists(base):
            names += [p for p in fs.find(base, withdirs=True) if "/." in p[len(base) :] or p.endswith("/publishing.json")]
    return sorted(
        {n.split(".partial-")[0] + ".partial" if ".partial-" in n else n for n in names}
        | {p.name for pattern in ("evoesap-*", "torchelastic_*") for p in tmpdir.glob(pattern)}
    )


def pushed_copy_differs(published: str, to: str) -> str:
    """Where the copy publish pushed to `to` differs from the artifact it published (manifest and every file,
    byte for byte); "" when identical."""
    fs, base = storage_fs(published)
    to_fs, to_base = storage_fs(to)
    listed = sorted(json.loads(fs.cat_file(f"{base}/manifest.json"))["files"]) + ["manifest.json"]
    for rel in listed:
        if not to_fs.exists(f"{to_base}/{rel}") or to_fs.cat_file(f"{to_base}/{rel}") != fs.cat_file(f"{base}/{rel}"):
            return f"pushed copy: {rel}"
    extra = {p[len(to_base) + 1 :] for p in to_fs.find(to_base)} - set(listed)
    return f"pushed copy holds more: {sorted(extra)[:3]}" if extra else ""


def user_files(ws: Workspace) -> dict[str, bytes]:
    """The user's files by content: those beside the storage root (inside its parent), those next to that
    parent, and the pipeline's inputs (model, data, tasks)."""
    places = [ws.runs, ws.top / "user", ws.top / "world"]
    skip = (ws.runs / "artifacts", ws.runs / "artifacts.spill")
    return {
        str(p.relative_to(ws.top)): p.read_bytes()
        for place in places
        for p in sorted(place.rglob("*"))
        if p.is_file() and not any(s == p or s in p.parents for s in skip)
    }


# ----------------------------------------------------------------------------- one fault run


@dataclasses.dataclass
class Outcome:
    kind: str
    moment: float  # seconds after start (kill, outage, corruption), or the tmpfs size in bytes
    stage: str  # the stage the fault was aimed at ("" for disk_full, which hits whichever stage fills the disk)
    hit: str  # the stage running when it struck (disk_full: the last one started); "" when the run ended first
    first_rc: int
    rerun_rc: int
    result: str  # "identical", "clear error", or what went wrong
    detail: str = ""
    user_bytes_lost: int = 0
    leftovers: tuple[str, ...] = ()
    first_error: str = ""  # the faulted run's last stderr line when it failed ("internal error" is a finding)


@dataclasses.dataclass
class Workspace:
    """Fixed paths, so every run's artifacts name the same inputs and storage (payloads may embed paths)."""

    top: Path
    files: dict[str, str]
    params: dict[str, Any]
    s3: bool = False  # an S3 endpoint runs: publish pushes to its bucket, else to a local folder

    @property
    def runs(self) -> Path:
        return self.top / "runs"  # the storage root's parent, holding user files too

    @property
    def result(self) -> Path:
        return self.top / "report-uri.txt"  # the report a pipeline run made

    @property
    def tmp(self) -> Path:
        return self.top / "tmp"

    @property
    def marks(self) -> Path:
        return self.top / "marks.txt"  # each stage's start in the current pipeline run

    def root(self, kind: str) -> str:
        return f"s3://{BUCKET}/runs/artifacts" if kind == "s3_outage" else str(self.runs / "artifacts")

    def to(self, kind: str) -> str:
        """Where publish pushes its copy: an S3 bucket of its own when there is an endpoint, else a local folder."""
        return f"s3://{RELEASE_BUCKET}/{storage(kind)}" if self.s3 else str(self.top / "release")

    def spec(self, kind: str) -> Path:
        path = self.top / f"spec-{storage(kind)}.json"
        path.write_text(
            json.dumps(
                {
                    "files": self.files,
                    "params": self.params,
                    "root": self.root(kind),
                    "to": self.to(kind),
                    "marks": str(self.marks),
                    "result": str(self.result),
                }
            )
        )
        return path

    def plant_user_files(self) -> None:
        (self.runs / "sub").mkdir(parents=True, exist_ok=True)
        (self.runs / "notes.txt").write_text("precious notes beside the storage root\n")
        (self.runs / "sub" / "data.csv").write_text("1,2\n3,4\n")
        (self.top / "user").mkdir(exist_ok=True)
        (self.top / "user" / "thesis.md").write_text("next to the storage root's parent\n")


class S3:
    """moto's threaded S3 server on loopback; its data lives in this process, so an outage (the listening
    socket closed for a while, then served again on the same port) keeps it."""

    def __init__(self) -> None:
        import logging

        import fsspec

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._serve()
        for key, value in {
            "AWS_ACCESS_KEY_ID": "chaos",
            "AWS_SECRET_ACCESS_KEY": "chaos",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",  # fsspec's configuration in the search workers
        }.items():
            os.environ[key] = value
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = f"http://127.0.0.1:{self.port}"
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True)
        self.fs.mkdir(BUCKET)
        self.fs.mkdir(RELEASE_BUCKET)

    def _serve(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def outage(self, seconds: float) -> None:
        self.stop()
        time.sleep(seconds)
        self._serve()

    def forget_socket(self) -> None:
        """In a forked stage process: close its copy of the listening socket, so an outage refuses connections."""
        self.server._server.socket.close()

    def wipe(self, bucket: str) -> None:
        self.fs.invalidate_cache()
        if self.fs.find(bucket):
            self.fs.rm(self.fs.find(bucket))
        self.fs.invalidate_cache()

    def stop(self) -> None:
        self.server.stop()
        self.server._server.server_close()  # moto's stop leaves the port bound: clients would hang, not fail


@dataclasses.dataclass(frozen=True)
class Child:
    pid: int
    stderr: Path

    def wait(self, seconds: float) -> bool:
        """True when the process ended within `seconds` (it is then reaped: call `finish` for its status)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._poll() is not None:
                return True
            time.sleep(0.05)
        return False

    def finish(self, timeout: float = 900) -> tuple[int, str]:
        """Exit code (negative: the signal that ended it) and stderr, once it ended."""
        if not self.wait(timeout):
            os.kill(self.pid, signal.SIGKILL)
            raise RuntimeError(f"a pipeline run (pid {self.pid}) did not end within {timeout} s")
        return self._poll(), self.stderr.read_text(errors="replace")

    def _poll(self) -> int | None:
        if self.pid in _REAPED:
            return _REAPED[self.pid]
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return None
        _REAPED[self.pid] = os.waitstatus_to_exitcode(status)
        return _REAPED[self.pid]


_REAPED: dict[int, int] = {}


def storage(kind: str) -> str:
    """The storage a fault kind runs on: the S3 root for an S3 outage, else the local one."""
    return "s3" if kind == "s3_outage" else "local"


def read_marks(path: Path) -> list[tuple[str, float]]:
    """(stage, monotonic start) of each stage a pipeline run started, in order."""
    text = path.read_text() if path.exists() else ""
    return [(stage, float(at)) for stage, at in (line.split() for line in text.splitlines() if line.count(" ") == 1)]


def stage_at(marks: list[tuple[str, float]], moment: float) -> str:
    """The stage running at monotonic `moment` (the last one started before it)."""
    started = [stage for stage, at in marks if at <= moment]
    return started[-1] if started else ""


def workers_of(pid: int) -> list[int]:
    """The search workers process `pid` launched (its children with a torch.distributed RANK)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if any(v.startswith(b"RANK=") for v in environ):
            found.append(int(stat.parent.name))
    return sorted(found)


class Harness:
    """Reference runs (one per storage kind), then fault runs drawn from one seeded generator."""

    def __init__(self, ws: Workspace, kinds: tuple[str, ...], seed: int, log: Callable[[str], None] = print) -> None:
        self.ws, self.kinds, self.log = ws, kinds, log
        self.rng = np.random.default_rng(seed)
        self.s3 = S3() if any(k in S3_KINDS for k in kinds) else None
        # the search's workers are fresh interpreters: they import this checkout's evoesap too
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ws.s3 = self.s3 is not None
        self.reference: dict[str, dict[str, dict[str, str]]] = {}
        self.duration: dict[str, float] = {}
        self.windows: dict[str, dict[str, tuple[float, float]]] = {}  # storage -> stage -> (start, length) seconds
        self.stored_bytes = 0
        for stage in STAGES:  # imported once here, so each forked stage process starts warm
            stage.function()
        import lm_eval.evaluator  # noqa: F401 - the evaluate stage's heaviest import

        from evoesap.store import artifacts

        artifacts._checkout_head()  # read once, before the forks: the code every stage process runs is this

    def close(self) -> None:
        if self.s3:
            self.s3.stop()

    def _clear(self, kind: str) -> None:
        shutil.rmtree(self.ws.runs / "artifacts", ignore_errors=True)
        shutil.rmtree(self.ws.top / "release", ignore_errors=True)
        self.ws.result.unlink(missing_ok=True)
        shutil.rmtree(self.ws.tmp, ignore_errors=True)
        self.ws.tmp.mkdir(parents=True)
        if self.s3:
            self.s3.wipe(RELEASE_BUCKET)
            if kind == "s3_outage":
                self.s3.wipe(BUCKET)

    def _start(self, kind: str, disk: int | None = None) -> Child:
        """A stage process: forked from this one (its imports already done, as a warm node's would be), in
        its own session, with TMPDIR and stderr of its own; a fresh process's start time, so it cleans up
        after runs killed before it (`artifacts.clean_orphans`)."""
        spec, err = str(self.ws.spec(kind)), self.ws.top / "stderr.txt"
        self.ws.marks.unlink(missing_ok=True)
        pid = os.fork()
        if pid:
            return Child(pid, err)
        code = 70
        try:
            os.setsid()
            if self.s3:
                self.s3.forget_socket()
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.chdir(self.ws.top)  # lm-eval records the working directory's git commit: not a checkout that moves
            os.environ["TMPDIR"] = str(self.ws.tmp)
            tempfile.tempdir = None
            from evoesap.store import artifacts

            artifacts._STARTED = time.time()
            code = disk_full_child(spec, disk) if disk else child(spec)
        except BaseException:  # noqa: BLE001 - a harness failure inside the child: shown, never raised past fork
            traceback.print_exc()
        finally:
            os._exit(code)

    def _snapshot(self, kind: str) -> dict[str, dict[str, str]]:
        """The artifacts behind the published one, and whether publish's pushed copy equals it."""
        published = self.ws.result.read_text()
        found = snapshot(self.ws.root(kind), published)
        differs = pushed_copy_differs(published, self.ws.to(kind))
        return {**found, "pushed copy": {"differs": differs} if differs else {}}

    def prepare(self) -> None:
        """Undisturbed reference runs; their artifacts are what every fault run must end with, their stages'
        times where faults aimed at a stage strike."""
        self.ws.plant_user_files()
        for kind in sorted({"s3_outage" if k == "s3_outage" else "kill9" for k in self.kinds}):
            self._clear(kind)
            started = time.monotonic()
            code, err = self._start(kind).finish()
            if code != 0:
                raise RuntimeError(f"the undisturbed reference run failed: {err.strip()[-2000:]}")
            ended = time.monotonic()
            self.duration[storage(kind)] = ended - started
            marks = read_marks(self.ws.marks) + [("", ended)]
            windows: dict[str, tuple[float, float]] = {}
            for (stage, at), (_, after) in zip(marks, marks[1:]):
                windows.setdefault(stage, (at - started, after - at))  # a stage's first run (evaluate runs four)
            self.windows[storage(kind)] = windows
            self.reference[storage(kind)] = self._snapshot(kind)
            if kind == "kill9":
                self.stored_bytes = sum(p.stat().st_size for p in (self.ws.runs / "artifacts").rglob("*") if p.is_file())
            times = ", ".join(f"{stage} {length:.1f}" for stage, (_, length) in windows.items())
            self.log(
                f"reference ({storage(kind)}): {len(self.reference[storage(kind)]) - 1} artifacts in "
                f"{self.duration[storage(kind)]:.1f} s ({times})"
            )

    def fault(self, kind: str) -> Outcome:
        place = storage(kind)
        self._clear(kind)
        users = user_files(self.ws)
        windows = self.windows[place]
        stage = AIMED.get(kind) or ("" if kind == "disk_full" else str(self.rng.choice(sorted(windows))))
        corrupted, hit = None, ""
        if kind == "disk_full":
            moment: float = int(self.rng.integers(16 << 10, max(self.stored_bytes, 32 << 10)))
            first, first_err = self._start(kind, disk=moment).finish()
            hit = (read_marks(self.ws.marks)[-1:] or [("", 0.0)])[0][0]
        else:
            _, length = windows[stage]
            proc, began = self._start(kind), time.monotonic()
            struck = self._strike(proc, kind, stage, float(self.rng.uniform(0.0, 1.0)) * length)
            moment = round(struck - began, 2) if struck else -1.0
            if struck and kind == "corrupt":
                corrupted = self._corrupt()
            hit = stage_at(read_marks(self.ws.marks), struck) if struck else ""
            first, first_err = proc.finish()
        rerun, err = self._start(kind).finish()
        failed = first_err.strip().splitlines()[-1:] if first > 0 else []
        internal = bool(failed) and ("Traceback" in first_err or not failed[0].startswith("error: "))
        outcome = Outcome(
            kind,
            round(moment, 2),
            stage,
            hit,
            first,
            rerun,
            "",
            user_bytes_lost=self._lost(users),
            leftovers=tuple(leftovers([self.ws.root(kind), self.ws.to(kind)], self.ws.tmp)),
            first_error=("internal: " if internal else "") + "".join(failed)[:300],
        )
        lines = err.strip().splitlines() or [""]
        if rerun == 0:
            now = self._snapshot(kind)
            differ = sorted(k for k in set(now) | set(self.reference[place]) if now.get(k) != self.reference[place].get(k))
            outcome.result = "identical" if not differ else "different"
            outcome.detail = ", ".join(differ[:4])
        elif corrupted and "Traceback" not in err and lines[-1].startswith("error: ") and corrupted[0] in lines[-1]:
            outcome.result, outcome.detail = "clear error", lines[-1][:300]
        else:
            outcome.result, outcome.detail = "re-run failed", err.strip()[-1500:]
        if corrupted:
            outcome.detail = f"{corrupted[1]}; {outcome.detail}"
        return outcome

    def _strike(self, proc: Child, kind: str, stage: str, delay: float) -> float | None:
        """Inject `kind` `delay` seconds after this run starts `stage` (timed from the stage's own start, so a run
        slower or faster than the reference still meets the stage), or for a search worker or the search's
        launcher, once that stage's workers run. Returns the monotonic moment it struck; None when the run ended
        (or left the stage) first."""
        while stage not in {s for s, _ in read_marks(self.ws.marks)}:
            if proc.wait(0.05):
                return None
        if proc.wait(delay):
            return None
        if kind in ("kill9_worker", "sigterm_launcher"):
            while not (workers := workers_of(proc.pid)):  # not started yet, or the search is over
                if proc.wait(0.05) or read_marks(self.ws.marks)[-1][0] != stage:
                    return None
            victim = workers[int(self.rng.integers(len(workers)))] if kind == "kill9_worker" else proc.pid
            os.kill(victim, signal.SIGKILL if kind == "kill9_worker" else signal.SIGTERM)
        elif kind in ("kill9", "sigterm"):
            os.kill(proc.pid, signal.SIGKILL if kind == "kill9" else signal.SIGTERM)
        elif kind in S3_KINDS:
            began = time.monotonic()
            self.s3.outage(float(self.rng.uniform(0.5, 5.0)))
            return began
        return time.monotonic()

    def _corrupt(self) -> tuple[str, str] | None:
        """Truncate or flip one bit of a random file of a finished artifact (manifest included); returns
        (the artifact's directory, what was done). Files still being staged are not chosen: bytes changed
        before they are hashed cannot be told from the stage's own output."""
        root = self.ws.runs / "artifacts"
        candidates = []
        for manifest_path in sorted(root.glob("*/*/manifest.json")):
            try:
                listed = json.loads(manifest_path.read_text())["files"]
            except (OSError, ValueError, KeyError):
                continue
            candidates += [manifest_path] + [manifest_path.parent / rel for rel in sorted(listed)]
        candidates = [c for c in candidates if c.is_file() and c.stat().st_size > 0]
        if not candidates:
            return None
        target = candidates[int(self.rng.integers(len(candidates)))]
        data = bytearray(target.read_bytes())
        if self.rng.random() < 0.5:
            cut = int(self.rng.integers(len(data)))
            target.write_bytes(bytes(data[:cut]))
            what = f"truncated {target.relative_to(root)} to {cut} of {len(data)} bytes"
        else:
            bit = int(self.rng.integers(len(data) * 8))
            data[bit // 8] ^= 1 << (bit % 8)
            target.write_bytes(bytes(data))
            what = f"flipped bit {bit} of {target.relative_to(root)}"
        return str(target.parent if target.name == "manifest.json" else _artifact_dir(target, root)), what

    def _lost(self, before: dict[str, bytes]) -> int:
        after = user_files(self.ws)
        return sum(len(data) for name, data in before.items() if after.get(name) != data)


def _artifact_dir(path: Path, root: Path) -> Path:
    return root / path.relative_to(root).parts[0] / path.relative_to(root).parts[1]


def disk_full_available() -> bool:
    """Whether this process may mount a tmpfs in a private mount namespace (needs root: CAP_SYS_ADMIN)."""
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d && rmdir $d"
    try:
        return (
            os.geteuid() == 0
            and subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def build_world(world: str, top: Path) -> dict[str, str]:
    """The inputs: the quick demo world (`evoesap demo build --profile quick`), or tests' tiny random OLMoE."""
    if world == "tiny":
        from tiny_world import make_tiny_inputs

        (top / "world").mkdir(parents=True, exist_ok=True)
        return make_tiny_inputs(top / "world")
    from evoesap.demo.world import build_demo_world

    built = build_demo_world(top / "world", seed=0, profile="quick")
    return {
        "model": str(built.model_dir),
        "calibration": str(built.data_file("code", "calibration")),
        "search": str(built.data_file("math", "search")),
        "heldout": str(built.data_file("math", "search_heldout")),
        "tasks": str(built.tasks_dir),
    }


def world_files(world: str, top: Path) -> dict[str, str]:
    """`build_world` in a process of its own: the harness forks stage processes, so it never runs torch itself
    (a thread pool started before fork would hang the children)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--build-world", world, "--workdir", str(top)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the {world} world failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kinds_for(world: str) -> tuple[str, ...]:
    """The fault kinds a world's pipeline has a target for: a search worker and its launcher need workers."""
    workers = PARAMS[world]["search"].get("workers", 1) > 1
    return tuple(k for k in KINDS if workers or k not in ("kill9_worker", "sigterm_launcher"))


def draw_kinds(rng: random.Random, kinds: tuple[str, ...], n: int) -> Iterator[str]:
    """Every kind in turn (so each appears), in an order shuffled per round."""
    while n > 0:
        batch = list(kinds)
        rng.shuffle(batch)
        yield from batch[:n]
        n -= len(batch)


def table(outcomes: list[Outcome], seconds: float) -> str:
    by_kind = collections.Counter(o.kind for o in outcomes)
    by_hit = collections.Counter(o.hit for o in outcomes)
    rows = [
        ("runs", len(outcomes)),
        ("faults by kind", ", ".join(f"{k} {by_kind[k]}" for k in KINDS if by_kind[k])),
        (
            "faults by the stage running when they struck",
            ", ".join(f"{s or 'none (run over first)'} {n}" for s, n in by_hit.most_common()),
        ),
        ("identical outcomes", sum(o.result == "identical" for o in outcomes)),
        ("clear errors", sum(o.result == "clear error" for o in outcomes)),
        ("failures", sum(o.result not in ("identical", "clear error") for o in outcomes)),
        ("bytes of user data lost", sum(o.user_bytes_lost for o in outcomes)),
        ("runs leaving debris", sum(bool(o.leftovers) for o in outcomes)),
        ("faulted runs ending in an internal error", sum(o.first_error.startswith("internal: ") for o in outcomes)),
        ("wall time", f"{seconds / 60:.1f} min ({seconds / max(len(outcomes), 1):.1f} s per fault run)"),
    ]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def run_chaos(
    top: Path,
    world: str,
    faults: int,
    seed: int,
    kinds: tuple[str, ...],
    log: Callable[[str], None] = print,
    record: Path | None = None,
) -> list[Outcome]:
    """`faults` fault runs after the reference runs; every outcome, in order (also written to `record` after
    each run, so a long run stopped early keeps what it found)."""
    top = top.resolve()
    ws = Workspace(top, world_files(world, top), PARAMS[world])
    harness = Harness(ws, kinds, seed, log)
    outcomes = []
    try:
        harness.prepare()
        for i, kind in enumerate(draw_kinds(random.Random(seed), kinds, faults)):
            outcome = harness.fault(kind)
            outcomes.append(outcome)
            if record:
                record.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
            log(
                f"{i + 1:4d} {kind:16s} {outcome.stage or '-':12s} hit {outcome.hit or '-':12s} at {outcome.moment:>9} "
                f"rc {outcome.first_rc:>3}/{outcome.rerun_rc}: {outcome.result}"
                f"{' (' + outcome.detail[:200] + ')' if outcome.result != 'identical' or outcome.kind == 'corrupt' else ''}"
                f"{' debris ' + ','.join(outcome.leftovers) if outcome.leftovers else ''}"
                f"{' [faulted run: ' + outcome.first_error[:160] + ']' if outcome.first_error else ''}"
            )
    finally:
        harness.close()
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world", choices=sorted(PARAMS), default="quick")
    parser.add_argument("--kinds", help="comma-separated fault kinds (default: every kind the world has a target for)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".cache" / "chaos")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--build-world", choices=sorted(PARAMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_world:
        print(json.dumps(build_world(args.build_world, args.workdir)))
        return 0
    kinds = tuple(k for k in (args.kinds or ",".join(kinds_for(args.world))).split(",") if k)
    unknown = sorted(set(kinds) - set(kinds_for(args.world)))
    if unknown:
        parser.error(
            f"fault kind(s) {', '.join(unknown)} not for the {args.world} world; its kinds are {', '.join(kinds_for(args.world))}"
        )
    if "disk_full" in kinds and not disk_full_available():
        parser.error("disk_full mounts a tmpfs in a private mount namespace, which needs root; drop it from --kinds")
    quantize_python = os.environ.get(QUANTIZE_PYTHON) or str(REPO / ".venv-quantize" / "bin" / "python")
    if "quantize" in PARAMS[args.world] and not os.access(quantize_python, os.X_OK):
        parser.error(f"the pipeline quantizes: set {QUANTIZE_PYTHON} to llm-compressor's python (or `make quantize-venv`)")
    os.environ[QUANTIZE_PYTHON] = quantize_python
    shutil.rmtree(args.workdir, ignore_errors=True)
    started = time.monotonic()
    outcomes = run_chaos(
        args.workdir, args.world, args.faults, args.seed, kinds, log=lambda line: print(line, flush=True), record=args.json
    )
    print(table(outcomes, time.monotonic() - started))
    return 0 if all(o.result in ("identical", "clear error") and not o.user_bytes_lost for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
