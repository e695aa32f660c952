"""Artifacts: directories at fsspec URIs with a payload and a manifest.json published last.

Every stage writes its payload into a local staging directory; `stage_output` then publishes it to the
destination URI (rename for local paths, upload for object stores) and writes the manifest last, so a
directory without a manifest is never mistaken for a finished artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import fsspec
from fsspec.core import url_to_fs

from evoesap import __version__
from evoesap.errors import ArtifactError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._=+-]+$")


def split(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path inside it for a local path or any fsspec URI."""
    fs, path = url_to_fs(str(uri))
    return fs, path


def is_local(uri: str) -> bool:
    fs, _ = split(uri)
    return "file" in _protocols(fs)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def join(uri: str, *names: str) -> str:
    """`uri/name/...`, refusing names that could escape the artifact root (`..`, `/`, empty)."""
    for name in names:
        for part in str(name).split("/"):
            if part in ("", ".", "..") or not _SAFE_NAME.match(part):
                raise ArtifactError(
                    f"artifact name {name!r} is not allowed: use letters, digits and ._=+- "
                    "separated by '/', without '..' or empty parts"
                )
    return "/".join([str(uri).rstrip("/"), *[str(n) for n in names]])


def redact(uri: str) -> str:
    """The URI without any user:password@ part, for logs and manifests."""
    return re.sub(r"(^[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", str(uri))


def exists(uri: str) -> bool:
    fs, path = split(uri)
    return fs.exists(path)


def read_bytes(uri: str) -> bytes:
    fs, path = split(uri)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as exc:
        raise ArtifactError(f"{redact(uri)} does not exist") from exc


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri).decode("utf-8"))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Lineage of one artifact: what made it, from what, with which parameters, and its files."""

    stage: str
    params: dict[str, Any]
    inputs: dict[str, dict[str, str]]  # name -> {"uri", "manifest_sha256"}
    files: dict[str, str]  # relative path -> sha256
    cache_key: str
    version: str = __version__
    git_commit: str | None = None
    started: str = ""
    ended: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def read_manifest(uri: str) -> Manifest:
    """The manifest of a finished artifact; an unfinished or missing one is an error."""
    manifest_uri = join(uri, MANIFEST)
    if not exists(manifest_uri):
        raise ArtifactError(
            f"{redact(uri)} is not a finished artifact (no {MANIFEST}): run the stage that makes it, "
            "or re-run it if it was interrupted"
        )
    return Manifest.from_json(read_bytes(manifest_uri).decode("utf-8"))


def manifest_sha256(uri: str) -> str:
    read_manifest(uri)  # raises a clear error when unfinished
    return sha256_bytes(read_bytes(join(uri, MANIFEST)))


def describe_inputs(inputs: Mapping[str, str | None]) -> dict[str, dict[str, str]]:
    """Input URIs with their manifest hashes.

    A local directory that is not an artifact (a model the user made) gets a fingerprint of its file
    names, sizes and modification times instead, so that changing it invalidates the stage cache;
    hub names keep only the name.
    """
    described: dict[str, dict[str, str]] = {}
    for name, uri in sorted(inputs.items()):
        if uri is None:
            continue
        entry = {"uri": redact(uri)}
        if exists(join(uri, MANIFEST)):
            entry["manifest_sha256"] = manifest_sha256(uri)
        elif Path(uri).exists():
            entry["fingerprint"] = _fingerprint(Path(uri))
        described[name] = entry
    return described


def _fingerprint(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    listing = [(p.relative_to(path).as_posix() if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return sha256_bytes(json.dumps(listing).encode("utf-8"))


def cache_key(stage: str, params: Mapping[str, Any], inputs: Mapping[str, Mapping[str, str]]) -> str:
    """Hash of what determines a stage's output: its name, parameters and inputs' manifests."""
    payload = json.dumps(
        {"stage": stage, "params": dict(params), "inputs": {k: dict(v) for k, v in inputs.items()}},
        sort_keys=True,
        default=str,
    )
    return sha256_bytes(payload.encode("utf-8"))


def cached(out_uri: str, stage: str, params: Mapping[str, Any], inputs: Mapping[str, str | None]) -> Manifest | None:
    """The existing manifest at `out_uri` when it was made by the same stage, parameters and inputs."""
    if not exists(join(out_uri, MANIFEST)):
        return None
    manifest = read_manifest(out_uri)
    key = cache_key(stage, params, describe_inputs(inputs))
    if manifest.cache_key != key:
        return None
    fs, root = split(out_uri)
    for rel, expected in manifest.files.items():  # a deleted or changed payload file is made again, never reused
        path = f"{root.rstrip('/')}/{rel}"
        if not fs.exists(path) or _sha256_fs(fs, path) != expected:
            log.warning("%s: %s is missing or changed; making the artifact again", redact(out_uri), rel)
            return None
    return manifest


def _sha256_fs(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _git_commit() -> str | None:
    """The source commit: EVOESAP_GIT_COMMIT (set by the stage images at build time), else git's HEAD."""
    if os.environ.get("EVOESAP_GIT_COMMIT"):
        return os.environ["EVOESAP_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def stage_output(
    out_uri: str,
    stage: str,
    params: Mapping[str, Any],
    inputs: Mapping[str, str | None],
) -> Iterator[Path]:
    """Yield a local staging directory; on success publish it to `out_uri` with its manifest last.

    On an exception nothing is published and any earlier artifact at `out_uri` stays as it was.
    The published manifest is available afterwards through `read_manifest(out_uri)`.
    """
    started = _now()
    described = describe_inputs(inputs)
    key = cache_key(stage, params, described)
    staging = Path(tempfile.mkdtemp(prefix=f"evoesap-{stage}-"))
    try:
        yield staging
        files = {
            p.relative_to(staging).as_posix(): sha256_file(p)
            for p in sorted(staging.rglob("*"))
            if p.is_file()
        }
        manifest = Manifest(
            stage=stage,
            params=json.loads(json.dumps(dict(params), default=str)),
            inputs=described,
            files=files,
            cache_key=key,
            git_commit=_git_commit(),
            started=started,
            ended=_now(),
        )
        _publish(staging, out_uri, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, out_uri: str, manifest: Manifest) -> None:
    fs, path = split(out_uri)
    if "file" in _protocols(fs):
        _publish_local(staging, Path(path), manifest)
    else:
        _publish_remote(fs, staging, path, manifest)
    log.info("published %s artifact at %s", manifest.stage, redact(out_uri))


def _publish_local(staging: Path, dest: Path, manifest: Manifest) -> None:
    (staging / MANIFEST).write_text(manifest.to_json())
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    shutil.copytree(staging, partial)
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    if dest.exists():
        os.replace(dest, old)
    os.replace(partial, dest)
    shutil.rmtree(old, ignore_errors=True)


def _publish_remote(fs: fsspec.AbstractFileSystem, staging: Path, path: str, manifest: Manifest) -> None:
    manifest_path = f"{path.rstrip('/')}/{MANIFEST}"
    if fs.exists(manifest_path):
        fs.rm(manifest_path)  # the old artifact stops counting as finished before its payload changes
    for rel in manifest.files:
        fs.put_file(str(staging / rel), f"{path.rstrip('/')}/{rel}")
    with fs.open(manifest_path, "wb") as f:
        f.write(manifest.to_json().encode("utf-8"))


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[Path]:
    """A local directory holding the artifact at `uri`: the path itself when local, else a download."""
    fs, path = split(uri)
    if "file" in _protocols(fs):
        yield Path(path)
        return
    tmp = Path(tempfile.mkdtemp(prefix="evoesap-in-"))
    try:
        if not fs.exists(path):
            raise ArtifactError(f"{redact(uri)} does not exist")
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
