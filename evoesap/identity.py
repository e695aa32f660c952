"""Content identity of a stage input: what must change for a stage to run again.

One function, `identify(uri)`, gives a JSON-able record and its digest for any input a stage reads:

- one of our artifacts (a directory with manifest.json): the sha256 of its manifest, which lists the
  sha256 of every payload file;
- a local file: its size and sha256;
- a local directory (a checkpoint the user made): the sha256 of every small file (config.json, the
  tokenizer files, the safetensors index) and the size and modification time of each large one (the
  weights: a 60 GB checkpoint is never read to identify it);
- an object-store file or directory (s3://, gs://, ...): per file its size and the store's own content
  identity (ETag, version id or generation); files without one are hashed when small;
- a hub name (`org/name`): the commit the name resolves to now.

Both the reuse key (`artifacts.cache_key`) and the manifest record these, so an input changed in place at
the same URI makes the stage run again. A name that is neither an existing path nor of the form
`org/name` is refused here, so a mistyped path never goes to the hub.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import fsspec
from fsspec.core import url_to_fs

from evoesap.errors import ConfigError

MANIFEST = "manifest.json"
SMALL_FILE_BYTES = 16 << 20  # files up to this size are hashed; larger ones (weights) are identified by metadata
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_STORE_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "crc32c")
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")


def redact(text: str) -> str:
    """`text` (a URI, or a message holding URIs) without any user:password@ part, for logs and records."""
    return _USERINFO.sub(r"\1", str(text))


def identify(uri: str, *, repo_type: str = "model") -> tuple[dict[str, Any], str]:
    """(record, digest) of the input at `uri`: a local path, an fsspec URI or a hub name.

    `repo_type` ("model" or "dataset") says which hub a hub name is resolved on. The record is
    JSON-able and never holds credentials; the digest is the sha256 of the record.
    """
    record = _record(str(uri), repo_type)
    return record, digest(record)


def digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def summary(record: dict[str, Any]) -> str:
    """One short line naming the identity, for people (reports): kind, size or revision, digest prefix."""
    kind = record.get("kind")
    if kind == "hub":
        return f"hub revision {record.get('revision')}"
    if kind == "file" and "sha256" in record:
        return f"file, {record.get('size')} bytes, sha256 {record['sha256'][:12]}"
    if kind == "directory":
        return f"directory of {len(record.get('files', {}))} files, digest {digest(record)[:12]}"
    if kind == "artifact":
        return f"artifact, manifest sha256 {record.get('manifest_sha256', '')[:12]}"
    return f"{kind or 'input'}, digest {digest(record)[:12]}"


def is_hub_name(name: str) -> bool:
    """True for `org/name` that is not an existing local path (what a hub would be asked for)."""
    return "://" not in name and not Path(name).exists() and bool(_HUB_NAME.match(name))


def check_local_or_hub(name: str) -> None:
    """Refuse a name that must be a local path (it looks like one, or is not `org/name`) but does not exist."""
    if "://" in name or Path(name).exists() or _HUB_NAME.match(name):
        return
    raise ConfigError(
        f"{name!r} does not exist: check the path (hub names have the form org/name and are not looked up "
        "for anything else)"
    )


def _record(uri: str, repo_type: str) -> dict[str, Any]:
    if "://" not in uri:
        check_local_or_hub(uri)
        if is_hub_name(uri):
            return {"kind": "hub", "name": uri, "repo_type": repo_type, "revision": resolve_revision(uri, repo_type)}
    fs, path = url_to_fs(uri)
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
    if not fs.exists(path):
        raise ConfigError(f"{redact(uri)} does not exist: check the path or URI")
    if fs.isfile(path):
        return {"kind": "file", **_file(fs, path, local, always_hash=True)}
    manifest = f"{path.rstrip('/')}/{MANIFEST}"
    if fs.exists(manifest):
        with fs.open(manifest, "rb") as f:
            return {"kind": "artifact", "manifest_sha256": hashlib.sha256(f.read()).hexdigest()}
    root = path.rstrip("/")
    files = sorted(p for p in fs.find(root) if not Path(p).name.startswith("."))
    return {"kind": "directory", "files": {p[len(root) + 1 :]: _file(fs, p, local) for p in files}}


def _file(fs: Any, path: str, local: bool, always_hash: bool = False) -> dict[str, Any]:
    """Size plus the sha256 (small files, or `always_hash`), else the store's identity or the mtime."""
    info = fs.info(path)
    size = int(info.get("size") or 0)
    entry: dict[str, Any] = {"size": size}
    store = {k: str(info[k]) for k in _STORE_KEYS if info.get(k) is not None} if not local else {}
    if always_hash and (local or not store):
        entry["sha256"] = _sha256(fs, path)
    elif store:
        entry.update(store)
    elif size <= SMALL_FILE_BYTES:
        entry["sha256"] = _sha256(fs, path)
    else:
        entry["mtime"] = str(info.get("mtime") or info.get("LastModified") or info.get("created"))
    return entry


def _sha256(fs: Any, path: str) -> str:
    if "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol):
        stat = os.stat(path)
        return _local_sha256(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    return _stream_sha256(fs, path)


@functools.lru_cache(maxsize=1024)
def _local_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """Hashed once per process and file version: a stage identifies its inputs several times."""
    del size, mtime_ns, inode  # part of the cache key only
    return _stream_sha256(fsspec.filesystem("file"), path)


def _stream_sha256(fs: Any, path: str) -> str:
    digest_ = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest_.update(block)
    return digest_.hexdigest()


@functools.lru_cache(maxsize=64)
def _hub_revision(name: str, repo_type: str) -> str:
    """The commit `name` resolves to: asked of the hub, else the locally cached snapshot (offline)."""
    import huggingface_hub

    try:
        info = huggingface_hub.HfApi().repo_info(name, repo_type=repo_type)
        return str(info.sha)
    except Exception as online:  # noqa: BLE001 - any failure: try the local cache before giving up
        try:
            snapshot = huggingface_hub.snapshot_download(name, repo_type=repo_type, local_files_only=True)
            return Path(snapshot).name
        except Exception:  # noqa: BLE001
            raise ConfigError(
                f"cannot resolve the hub {repo_type} {name!r} to a revision ({type(online).__name__}): check the "
                "name and the network, or give a local path"
            ) from online


resolve_revision: Callable[[str, str], str] = _hub_revision  # replaced in tests (no network there)
