"""Content identity of a stage input: what must change for a stage to run again.

One function, `identify(uri)`, gives a JSON-able record and its digest for any input a stage reads:

- one of our artifacts (a directory with manifest.json): its content (`artifact_content`: the stage, the
  cache key of what made it, which holds its parameters and its own inputs' content identities, and the sha256
  of every payload file), beside the sha256 of its manifest, which lineage checks against what it reads later;
- a local file: its size and sha256;
- a local directory (a checkpoint the user made): the size and sha256 of every file, the large ones (the
  weights) hashed once per file version and remembered across processes (`evoesap.store.digest_cache`), so a
  byte-identical checkpoint at a new path (a team's `Output[Model]` in each KFP run) has the same identity;
- an object-store file or directory (s3://, gs://, ...): per file its size and the store's own content
  identity (ETag, version id or generation); files without one are hashed when small;
- a hub name (`org/name`, or `org/name@revision` pinned to a branch, tag or commit): the commit it
  resolves to now.

Both the reuse key (`artifacts.cache_key`) and the manifest record these, so an input changed in place at
the same URI makes the stage run again; the key holds the identity alone (`keyed`: never the URI, nor an
artifact's manifest sha256, which names where its own inputs lay), so the same content at another URI reuses,
all the way down a chain of artifacts. A name that is neither an existing path nor of the form
`org/name` is refused here, so a mistyped path never goes to the hub.

`locate` is where every loader (from_pretrained, the shard reader, lm-eval's vLLM) learns what to ask the hub
for: the name and the commit its identity recorded, so the weights loaded are the ones identified.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from evoesap import network
from evoesap.errors import ConfigError, DataError
from evoesap.network import redact, refuse_credentials
from evoesap.store import digest_cache

MANIFEST = "manifest.json"
SMALL_FILE_BYTES = 16 << 20  # local files above this are hashed through the digest cache; remote ones: store metadata
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+-]*$")  # a branch, tag, commit or refs/pr/N
_STORE_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "crc32c")


def is_uri(text: str) -> bool:
    """True for an fsspec URI with a scheme (`s3://`, `file://`, `memory://`), as opposed to a local path or
    a hub name: the one test of the two spellings of a location."""
    return "://" in str(text)


def identify(uri: str, *, repo_type: str = "model") -> tuple[dict[str, Any], str]:
    """(record, digest) of the input at `uri`: a local path, an fsspec URI or a hub name.

    `repo_type` ("model" or "dataset") says which hub a hub name is resolved on. The record is
    JSON-able and never holds credentials; the digest is the sha256 of the record.
    """
    record = _record(str(uri), repo_type)
    return record, digest(record)


def digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def artifact_record(manifest: bytes) -> dict[str, Any]:
    """The identity of one of our artifacts from its manifest's bytes: its content (`artifact_content`) and the
    manifest's sha256. A manifest too malformed to hold a content identity is identified by its sha256 alone
    (whoever reads the artifact refuses it with the reason)."""
    record = {"kind": "artifact", "manifest_sha256": hashlib.sha256(manifest).hexdigest()}
    try:
        content = artifact_content(json.loads(manifest))
    except (ValueError, RecursionError):  # UnicodeDecodeError too
        content = None
    return record if content is None else {**record, "content_sha256": content}


def artifact_content(manifest: Any) -> str | None:
    """The content identity of an artifact from its manifest's fields: the sha256 of its stage, its cache key (its
    parameters and its inputs' content identities, recursively) and every payload file's sha256; None when the
    manifest lacks one of them. Neither where its inputs lay nor when or by what build it was made counts, so the
    same artifact made again elsewhere has the same content, and a stage that made other bytes (a search run with
    threads) does not."""
    if not isinstance(manifest, dict):
        return None
    stage, key, files = manifest.get("stage"), manifest.get("cache_key"), manifest.get("files")
    if not (isinstance(stage, str) and isinstance(key, str) and isinstance(files, dict)):
        return None
    return digest({"stage": stage, "cache_key": key, "files": files})


def keyed(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An input entry (a record, or a manifest's input with its `uri`) as reuse keys and lineage compare it: what the
    content is, not where. Without the URI; for an artifact with a content identity, without its manifest's sha256
    too (that changes with where the artifact's own inputs lay). An entry recorded before artifacts had a content
    identity keeps its manifest sha256: it still names exactly one artifact, only not the same content elsewhere."""
    drop = ("uri", "manifest_sha256") if "content_sha256" in entry else ("uri",)
    return {k: v for k, v in entry.items() if k not in drop}


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two identities (records, or manifests' input entries) name the same content: artifacts by content where
    both record it, else by the same manifest; anything else by its whole identity (`keyed`). So an artifact made
    again from the same bytes at another URI is the one a manifest recorded reading."""
    if a.get("kind") == b.get("kind") == "artifact":
        return any(key in a and a.get(key) == b.get(key) for key in ("content_sha256", "manifest_sha256"))
    return keyed(a) == keyed(b)


def summary(record: dict[str, Any]) -> str:
    """One short line naming the identity, for people (reports): kind, size or revision, digest prefix."""
    kind = record.get("kind")
    if kind == "hub":
        return f"hub revision {record.get('revision')}"
    if kind == "file" and "sha256" in record:
        return f"file, {record.get('size')} bytes, sha256 {record['sha256'][:12]}"
    if kind == "directory":
        return f"directory of {len(record.get('files', {}))} files, digest {digest(record)[:12]}"
    if kind == "artifact" and "content_sha256" in record:
        return f"artifact, content sha256 {record['content_sha256'][:12]}"
    if kind == "artifact":
        return f"artifact, manifest sha256 {record.get('manifest_sha256', '')[:12]}"
    return f"{kind or 'input'}, digest {digest(record)[:12]}"


def hub_model(name: str) -> tuple[str, str | None] | None:
    """(hub name, revision or None) of `org/name` or `org/name@revision`; None for a URI or an existing path."""
    text = str(name)
    if is_uri(text) or Path(text).exists():
        return None
    repo, pinned, revision = text.partition("@")
    if not _HUB_NAME.fullmatch(repo) or Path(repo).exists() or pinned and not _REVISION.fullmatch(revision):
        return None
    return repo, revision or None


def is_hub_name(name: str) -> bool:
    """True for `org/name` (or `org/name@revision`) that is not an existing local path (what a hub would be asked for)."""
    return hub_model(name) is not None


def pin(model: str, revision: str | None) -> str:
    """`model` pinned to a hub `revision` (branch, tag or commit) as `org/name@revision`; `model` itself without one.

    Only hub names have revisions: one given for a local path or another URI is refused, before any work.
    """
    if not revision:
        return model
    if not _REVISION.fullmatch(revision):
        raise ConfigError(f"revision {revision!r} is not a branch, tag or commit name: check the spelling")
    ref = hub_model(model)
    if ref is None:
        raise ConfigError(
            f"revision {revision!r} applies to hub models (org/name) only, but {redact(model)!r} is a local path or "
            "URI: drop the revision (or give the hub name)"
        )
    if ref[1] not in (None, revision):
        raise ConfigError(f"{model!r} already names revision {ref[1]!r}, and revision {revision!r} was given too: give one")
    return f"{ref[0]}@{revision}"


def locate(name: str, repo_type: str = "model") -> tuple[str, dict[str, str]]:
    """(what from_pretrained or snapshot_download opens, their keyword arguments) for a path or hub name.

    A hub name comes back with `revision`: the commit it resolves to (the one `identify` records, asked once
    per process), so what loads is what was identified; a path comes back as given. A missing path is
    refused here, never sent to the hub.
    """
    check_local_or_hub(name)
    ref = hub_model(name)
    if ref is None:
        return name, {}
    return ref[0], {"revision": resolve_revision(ref[0], repo_type, ref[1])}


def check_local_or_hub(name: str) -> None:
    """Refuse a name that must be a local path (it looks like one, or is not `org/name`) but does not exist."""
    if is_uri(name) or Path(name).exists() or hub_model(name):
        return
    raise ConfigError(
        f"{name!r} does not exist: check the path (hub names have the form org/name or org/name@revision and are "
        "not looked up for anything else)"
    )


_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(path: str | Path) -> str | None:
    """What a local path is (symlinks followed) when it is neither a regular file nor a directory, such as
    a FIFO (reading it waits for a writer) or /dev/zero (it never ends); None otherwise or when absent."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((what for test, what in _SPECIAL if test(mode)), None)


def refuse_special(path: str | Path, shown: str | None = None, fix: str = "replace it with a regular file") -> None:
    """Refuse, before reading a byte, a local path that is not a regular file or directory (`special_kind`)."""
    kind = special_kind(path)
    if kind is not None:
        through = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise DataError(f"{shown or path} is {kind}{through}, not a regular file, and is never read: {fix}")


def _record(uri: str, repo_type: str) -> dict[str, Any]:
    refuse_credentials(uri, "the input")
    if not is_uri(uri):
        check_local_or_hub(uri)
        ref = hub_model(uri)
        if ref is not None:
            commit = resolve_revision(ref[0], repo_type, ref[1])
            return {"kind": "hub", "name": ref[0], "repo_type": repo_type, "revision": commit}
    fs, path = url_to_fs(uri)
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
    if not fs.exists(path):
        raise ConfigError(f"{redact(uri)} does not exist: check the path or URI")
    if local:
        refuse_special(path, redact(uri))
    if fs.isfile(path):
        return {"kind": "file", **_file(fs, path, local, always_hash=True)}
    manifest = f"{path.rstrip('/')}/{MANIFEST}"
    if fs.isfile(manifest):  # a manifest.json that is not a file is refused by whoever reads the artifact
        with fs.open(manifest, "rb") as f:
            return artifact_record(f.read())
    root = path.rstrip("/")
    files = sorted(p for p in fs.find(root) if not Path(p).name.startswith("."))
    return {"kind": "directory", "files": {p[len(root) + 1 :]: _file(fs, p, local) for p in files}}


def _file(fs: Any, path: str, local: bool, always_hash: bool = False) -> dict[str, Any]:
    """Size plus the sha256 (local files, small remote ones, or `always_hash`), else the store's identity or the mtime."""
    if local:
        refuse_special(path)  # never hashed: it could block or never end
    info = fs.info(path)
    size = int(info.get("size") or 0)
    entry: dict[str, Any] = {"size": size}
    store = {k: str(info[k]) for k in _STORE_KEYS if info.get(k) is not None} if not local else {}
    if local and size > SMALL_FILE_BYTES:
        entry["sha256"] = digest_cache.sha256(path, _sha256_local_file)
    elif always_hash and (local or not store):
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
    return stream_sha256(fs, path)


@functools.lru_cache(maxsize=1024)
def _local_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """Hashed once per process and file version: a stage identifies its inputs several times."""
    del size, mtime_ns, inode  # part of the cache key only
    return stream_sha256(fsspec.filesystem("file"), path)


def _sha256_local_file(path: str) -> str:
    return _sha256(fsspec.filesystem("file"), path)


def stream_sha256(fs: Any, path: str) -> str:
    """The sha256 of a file on any filesystem, read in 1 MiB blocks (never the whole file in memory)."""
    digest_ = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest_.update(block)
    return digest_.hexdigest()


@functools.lru_cache(maxsize=64)
def _hub_revision(name: str, repo_type: str, revision: str | None = None) -> str:
    """The commit `name` (at `revision`, else its default branch) resolves to: asked of the hub, else the
    locally cached snapshot (offline)."""
    import huggingface_hub

    def ask(stop: Any) -> Any:
        return huggingface_hub.HfApi().repo_info(name, repo_type=repo_type, revision=revision)

    try:
        seconds = network.deadline_s(network.HUB_DEADLINE_ENV, network.HUB_DEADLINE_S)
        info = network.call(ask, seconds=seconds, what=f"resolving the hub {repo_type} {name}", knob=network.HUB_DEADLINE_ENV)
        return str(info.sha)
    except Exception as online:  # noqa: BLE001 - any failure: try the local cache before giving up
        try:
            snapshot = huggingface_hub.snapshot_download(name, repo_type=repo_type, revision=revision, local_files_only=True)
            return Path(snapshot).name
        except Exception:  # noqa: BLE001
            at = f" at revision {revision!r}" if revision else ""
            raise ConfigError(
                f"cannot resolve the hub {repo_type} {name!r}{at} to a commit ({type(online).__name__}: "
                f"{network.reply_line(online, limit=200)}): check the "
                "name, the revision and the network, or give a local path"
            ) from online


# (name, repo_type, revision or None) -> commit; replaced in tests (no network there)
resolve_revision: Callable[[str, str, str | None], str] = _hub_revision
