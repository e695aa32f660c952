"""Artifacts: directories at fsspec URIs with a payload and a manifest.json published last.

Every stage checks its output location first (`preflight`: absent, empty, or an artifact of the same
stage; never an input, `.`, `/` or a path through a file), writes its payload into a staging directory
(beside a local output, in TMPDIR for an object store), and `stage_output` publishes it (one rename
locally, an upload marked by publishing.json remotely) with the manifest last, so a directory without a
manifest is never mistaken for a finished artifact. Concurrent publishes of one output take turns: the check
of what is there and the swap happen under a lock (flock on `.NAME.lock` beside a local output; on an object
store publishing.json itself, created only where absent), so an identical run's artifact is kept and a
different one is refused, never silently replaced. A look at a local output (`occupant`) holds the same lock,
so it never sees a swap half done; on an object store a look reads again what changed under it. Readers check
the manifest's stage and the sha256 of every payload file (`verify`, `read_payload`). Staging directories are
locked by their process, so the next run of a stage removes what a killed one left (`clean_orphans`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import fsspec
from fsspec.core import url_to_fs

from evoesap import __version__
from evoesap.errors import ArtifactError, ConfigError
from evoesap.network import redact, refuse_credentials, reply_line  # artifacts.redact: the one redaction, used everywhere
from evoesap.store import identity, jsontext

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._=+-]+$")


def split(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path inside it for a local path or any fsspec URI. Credentials written into a URI
    are refused (they would end up in manifests, specs and error messages: `network.refuse_credentials`)."""
    refuse_credentials(uri)
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
            if part in ("", ".", "..") or not _SAFE_NAME.fullmatch(part):
                raise ArtifactError(
                    f"artifact name {name!r} is not allowed: use letters, digits and ._=+- "
                    "separated by '/', without '..' or empty parts"
                )
    return "/".join([str(uri).rstrip("/"), *[str(n) for n in names]])


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
    """The JSON document at `uri`; an ArtifactError naming it when it is not JSON (or nests too deeply to read)."""
    return jsontext.loads(read_bytes(uri), redact(uri))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return identity.stream_sha256(fsspec.filesystem("file"), str(path))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Lineage of one artifact: what made it, from what, with which parameters, and its files.

    Written with a `checksum` of its own content (`seal`), so a changed bit anywhere in it is refused on
    read, not taken for other lineage: the payload files are checked against `files`, the manifest
    against itself."""

    stage: str
    params: dict[str, Any]
    inputs: dict[str, dict[str, Any]]  # name -> {"uri", "kind", and its identity: `evoesap.store.identity`}
    files: dict[str, str]  # relative path -> sha256
    cache_key: str
    version: str = __version__
    git_commit: str | None = None
    started: str = ""
    ended: str = ""
    run: dict[str, Any] = dataclasses.field(default_factory=dict)  # what this run measured of itself (the
    # search's cost): like the times, it may differ between runs that make the same payload

    def to_json(self) -> str:
        return seal(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check the shape and the checksum; raises ValueError naming the first problem."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("its JSON nests too deeply to read (more than about a thousand levels)") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        checksum = data.pop(CHECKSUM, None)
        if checksum != _checksum(data):
            raise ValueError(
                f"its {CHECKSUM!r} field is missing"
                if checksum is None
                else f"it does not match its {CHECKSUM!r} (a changed byte: damaged or edited by hand)"
            )
        for name, kind in (("stage", str), ("params", dict), ("inputs", dict), ("files", dict), ("cache_key", str)):
            if not isinstance(data.get(name), kind):
                raise ValueError(f"field {name!r} is missing or not a {kind.__name__}")
        bad = [k for k, v in data["files"].items() if not isinstance(v, str) or not _SHA256.fullmatch(v)]
        if bad:
            raise ValueError(f"files entry {bad[0]!r} has no sha256")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


CHECKSUM = "checksum"


def seal(data: Mapping[str, Any]) -> str:
    """manifest.json's text for `data` (its fields), with the checksum `Manifest.from_json` verifies."""
    fields = {k: v for k, v in data.items() if k != CHECKSUM}
    return jsontext.dumps({**fields, CHECKSUM: _checksum(fields)}, MANIFEST, indent=2, sort_keys=True)


def _checksum(fields: Mapping[str, Any]) -> str:
    return sha256_bytes(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8"))


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def rebuild_hint(stage: str | None) -> str:
    return f"rebuild it with `evoesap {stage}`" if stage else "rebuild it with the stage that made it"


def read_manifest(uri: str, stage: str | None = None) -> Manifest:
    """The manifest of a finished artifact (of `stage`, when given); unfinished, malformed or another
    stage's artifacts are refused with one line naming the artifact and the stage that rebuilds it."""
    manifest_uri = join(uri, MANIFEST)
    if not exists(manifest_uri):
        raise ArtifactError(
            f"{redact(uri)} is not a finished artifact (no {MANIFEST}): run `evoesap {stage or '<stage>'}` to make "
            "it, or re-run it if it was interrupted"
        )
    if exists(join(uri, PUBLISHING)):
        raise ArtifactError(
            f"{redact(uri)} is not a finished artifact (its publish is under way or was interrupted): re-run "
            f"`evoesap {stage or _publishing_record(uri).get('stage') or '<stage>'}` to finish it"
        )
    fs, path = split(manifest_uri)
    if not fs.isfile(path):  # a directory, a FIFO, /dev/zero: never read
        raise ArtifactError(f"{redact(manifest_uri)} is malformed (not a regular file): {rebuild_hint(stage)}")
    try:
        manifest = Manifest.from_json(read_bytes(manifest_uri).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{redact(manifest_uri)} is malformed ({exc}): {rebuild_hint(stage)}") from None
    if stage is not None and manifest.stage != stage:
        raise ArtifactError(
            f"{redact(uri)} is a {manifest.stage!r} artifact, not {stage!r}: give the output of `evoesap {stage}`"
        )
    return manifest


def verify(uri: str, stage: str, local: Path | None = None) -> Manifest:
    """The manifest of the `stage` artifact at `uri`, after checking every payload file against its sha256.

    `local`: a downloaded copy of the artifact to check instead of reading the URI again.
    """
    manifest = read_manifest(uri, stage)
    for rel, expected in sorted(manifest.files.items()):
        try:
            target = join(uri, rel)
        except ArtifactError:
            raise ArtifactError(f"{redact(uri)} lists a file outside itself ({rel!r}): {rebuild_hint(stage)}") from None
        if local is not None or is_local(uri):
            identity.refuse_special(local / rel if local is not None else split(target)[1], fix=rebuild_hint(stage))
        try:
            actual = sha256_file(local / rel) if local is not None else _sha256_uri(target)
        except (FileNotFoundError, IsADirectoryError):
            raise ArtifactError(f"{redact(uri)} is missing {rel}: {rebuild_hint(stage)}") from None
        if actual != expected:
            raise ArtifactError(
                f"{redact(uri)}: {rel} does not match the sha256 in its manifest (truncated or changed): {rebuild_hint(stage)}"
            )
    return manifest


def _sha256_uri(uri: str) -> str:
    return identity.stream_sha256(*split(uri))


def read_payload(uri: str, name: str, manifest: Manifest) -> bytes:
    """A payload file of an artifact, checked against the sha256 its manifest records."""
    data = read_bytes(join(uri, name))
    if manifest.files.get(name) != sha256_bytes(data):
        raise ArtifactError(
            f"{redact(uri)}: {name} does not match the sha256 in its manifest (truncated or changed): "
            f"{rebuild_hint(manifest.stage)}"
        )
    return data


def manifest_sha256(uri: str) -> str:
    read_manifest(uri)  # raises a clear error when unfinished
    return sha256_bytes(read_bytes(join(uri, MANIFEST)))


def artifact_identity(uri: str) -> dict[str, Any]:
    """The identity of the finished artifact at `uri` as a reader records it (`identity.artifact_record`: its content
    sha256 and its manifest's), to compare with what an earlier reader recorded (`identity.same`)."""
    read_manifest(uri)  # raises a clear error when unfinished
    return identity.artifact_record(read_bytes(join(uri, MANIFEST)))


def _repo_type(name: str) -> str:
    return "dataset" if name.split(".")[0].endswith("data") else "model"


def resolved(uri: str) -> str:
    """`uri` as it can be read from any working directory: a local path made absolute (from the working directory,
    as the system reads it: symlinks and `..` kept), a URI or hub name as given."""
    text = str(uri)
    if identity.is_uri(text) or identity.is_hub_name(text):
        return text
    return str(Path(text).absolute())


def describe_inputs(inputs: Mapping[str, str | None]) -> dict[str, dict[str, Any]]:
    """Input locations (`resolved`: a manifest read from another directory still leads to them) with their content
    identity (`evoesap.store.identity`): our artifacts by their content (stage, cache key, payload files' sha256) and
    their manifest's sha256 (for lineage), other files and checkpoints by content or store metadata, hub names by
    resolved revision. A missing input is refused here, before any work."""
    described: dict[str, dict[str, Any]] = {}
    for name, uri in sorted(inputs.items()):
        if uri is None:
            continue
        if not identity.is_hub_name(str(uri)) and exists(join(uri, PUBLISHING)):
            raise ArtifactError(
                f"the input {name} ({redact(uri)}) is not a finished artifact: its publish is under way or was "
                f"interrupted; re-run `evoesap {_publishing_record(uri).get('stage') or '<stage>'}` that makes it"
            )
        record, _ = identity.identify(uri, repo_type=_repo_type(name))
        described[name] = {"uri": redact(resolved(uri)), **record}
    return described


def cache_key(stage: str, params: Mapping[str, Any], inputs: Mapping[str, Mapping[str, Any]]) -> str:
    """Hash of what determines a stage's output: its name, parameters and inputs' identities (`identity.keyed`: content,
    not the URI they were read from nor an artifact's manifest, which names where its own inputs lay: a byte-identical
    model that KFP put at a new URI, or an upstream artifact made again elsewhere, reuses; the manifest keeps the URI)."""
    identities = {name: identity.keyed(described) for name, described in inputs.items()}
    payload = json.dumps(
        {"stage": stage, "params": dict(params), "inputs": identities},
        sort_keys=True,
        default=str,
    )
    return sha256_bytes(payload.encode("utf-8"))


def cached(out_uri: str, stage: str, params: Mapping[str, Any], inputs: Mapping[str, str | None]) -> Manifest | None:
    """The manifest at `out_uri` when it was made by the same stage, parameters and inputs and its payload
    is intact; None otherwise (a damaged artifact is made again, with a warning)."""
    if not exists(join(out_uri, MANIFEST)):
        return None
    try:
        manifest = read_manifest(out_uri, stage)
    except ArtifactError as exc:
        log.warning("%s; making it again", exc)
        return None
    if manifest.cache_key != cache_key(stage, params, describe_inputs(inputs)):
        return None
    try:
        return verify(out_uri, stage)
    except ArtifactError as exc:
        log.warning("%s; making it again", exc)
        return None


# ------------------------------------------------------------------------------- where outputs may go


def local_destination(path: str) -> Path:
    """The one physical path of a local output (symlinks and `..` resolved once, as the kernel would), used
    by the check and the publish alike: `L/../x` is never checked at one place and written at another."""
    return Path(os.path.realpath(path))


def preflight(out_uri: str, stage: str, inputs: Mapping[str, str | None]) -> str:
    """Refuse, before any work, an output that could destroy something or inputs that do not exist.

    `out_uri` must be absent, an empty directory or an artifact of the same `stage` holding nothing its
    manifest does not list (replaced on publish); never `""`, `.`, `/`, the working directory, a mount
    point, a read-only place, a path through a file, or a location equal to, inside or around any input.
    Returns what the output holds now (`occupant`), which the publish checks again before it swaps.
    """
    text = str(out_uri).strip()
    if text in ("", ".", "./", "/") or not text:
        raise ConfigError(f"--out {out_uri!r} is not allowed: give a new or empty directory (or an earlier {stage} output)")
    fs, path = split(out_uri)
    if "file" in _protocols(fs):
        _check_local_place(local_destination(path), redact(out_uri))
    _check_against_inputs(out_uri, inputs)
    describe_inputs(inputs)  # refuses a missing input now
    return occupant(out_uri, stage)


def _check_local_place(dest: Path, where: str) -> None:
    if dest == Path(dest.anchor) or dest == Path.cwd():
        raise ConfigError(f"--out {where} is the filesystem root or the working directory: give a new or empty directory")
    for parent in dest.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"--out {where} goes through the file {parent}: choose a path under a directory")
    if dest.is_dir() and os.path.ismount(dest):
        raise ConfigError(f"--out {where} is a mount point, which cannot be replaced: give a directory inside it")
    place = next(p for p in dest.parents if p.exists())  # staging and the swap happen in dest's parent
    if not os.access(place, os.W_OK) or os.statvfs(place).f_flag & os.ST_RDONLY:
        raise ConfigError(f"--out {where}: {place} is not writable (read-only or no permission): choose another --out")


class Occupied(ConfigError):
    """An output location holds something that is not ours to replace; `what` says what, in a few words."""

    def __init__(self, out_uri: str, what: str, fix: str) -> None:
        super().__init__(f"--out {redact(out_uri)} {what}: {fix}")
        self.what = what


def occupant(out_uri: str, stage: str, lease: str | None = None) -> str:
    """What the output location holds: "absent", "empty", "artifact:<manifest sha256>" or
    "publishing:<sha256>" (an interrupted remote publish of `stage`). Anything else (another stage's
    artifact, user files, files an earlier artifact's manifest does not list) is refused: it is not ours
    to replace. `lease`: the token of this process's own publishing.json, which does not count.

    A local location is looked at under its swap lock (`_swap_lock`), which every publish there holds from its
    check to its last rename: the look never sees a swap half done (the old artifact renamed aside, the new one
    not yet in) nor reads one artifact's manifest and the other's files. Not to be called with that lock held
    (the publish's own check calls `_look`)."""
    fs, path = split(out_uri)
    if "file" not in _protocols(fs):
        return _look(out_uri, stage, lease)
    dest = local_destination(path)
    try:
        fd = _lock(dest)
    except FileNotFoundError:
        return "absent"  # no parent directory; a publish creates it, and the first one there is one rename
    except OSError as exc:
        if exc.errno not in _CANNOT_LOCK:
            raise
        return _look(out_uri, stage, lease)  # no lock file can be made here: no publish can lock it either to swap
    try:
        return _look(out_uri, stage, lease)
    finally:
        _unlock(dest, fd)


_CANNOT_LOCK = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


def _look(out_uri: str, stage: str, lease: str | None) -> str:
    """`occupant` without the lock: read again while the location changes under the look, which only a writer that
    takes no lock does (an object store's publish, under its lease; a tool other than evoesap), until it settles."""
    deadline = time.monotonic() + _LOCK_WAIT
    attempt = 0
    while True:
        try:
            return _occupant_now(out_uri, stage, lease)
        except _Moving:
            if time.monotonic() > deadline:
                raise ArtifactError(
                    f"--out {redact(out_uri)} kept changing for over {_LOCK_WAIT:.0f} s while it was read: is another "
                    "run writing it? re-run when it is done"
                ) from None
            attempt += 1
            time.sleep(min(0.02 * attempt, 0.2))


class _Moving(Exception):
    """The location changed between two reads of one look at it (a concurrent swap): look again."""


def _read_settled(uri: str) -> bytes:
    """The bytes of a file that was just listed. Not finding it means the location moved since the listing, even
    when the file is back by the time anyone looks again: that is a new file, of the publish that moved it."""
    try:
        return read_bytes(uri)
    except (ArtifactError, FileNotFoundError):
        if _dangling(uri):
            return b""  # a link to nothing: there, unreadable, and not moving
        raise _Moving from None


def _dangling(uri: str) -> bool:
    """Whether a local `uri` is a symlink whose target is missing (it is listed, but reads as missing)."""
    fs, path = split(uri)
    return "file" in _protocols(fs) and os.path.islink(path) and not os.path.exists(path)


def _manifest_at(out_uri: str) -> Manifest | None:
    """The manifest at a listed location, None when malformed (a directory, a FIFO, bad JSON)."""
    return _listed_manifest(out_uri)[1]


def _listed_manifest(out_uri: str) -> tuple[bytes, Manifest | None]:
    """The bytes of the manifest at a listed location and what they parse to (None: malformed). One look at the
    kind of file (a file here, a directory there would straddle a swap); one read, which the caller hashes."""
    fs, path = split(join(out_uri, MANIFEST))
    try:
        kind = fs.info(path)["type"]
    except FileNotFoundError:
        if _dangling(join(out_uri, MANIFEST)):
            return b"", None
        raise _Moving from None
    if kind != "file":
        return b"", None
    data = _read_settled(join(out_uri, MANIFEST))
    try:
        return data, Manifest.from_json(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, TypeError):
        return data, None


def _occupant_now(out_uri: str, stage: str, lease: str | None) -> str:
    fs, path = split(out_uri)
    fs.invalidate_cache(path)  # other processes publish here: what this process listed before may be stale
    try:
        kind = fs.info(path)["type"]  # one look: exists-then-isdir could straddle another run's swap
    except FileNotFoundError:
        return "absent"
    if kind != "directory":
        raise Occupied(out_uri, "is an existing file", f"give a new or empty directory (or an earlier {stage} output)")
    try:
        names = sorted(Path(p.rstrip("/")).name for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        raise _Moving from None
    held = _read_settled(join(out_uri, PUBLISHING)) if PUBLISHING in names else None  # read once: judged and hashed
    record = _record(held)
    lease_there = _unchanged(out_uri, PUBLISHING, held)
    own = set()
    if lease is not None and record.get("token") == lease:
        names.remove(PUBLISHING)
        own = {PUBLISHING}
        if names and MANIFEST not in names:  # what an interrupted publish left, which our lease took over
            _refuse_unlisted(out_uri, stage, _ours_while_publishing(out_uri, stage, record), lease_there)
            return _TAKEN_OVER
    if not names:
        return "empty"
    if held is not None and not own and record.get("stage") == stage:
        _refuse_unlisted(out_uri, stage, _ours_while_publishing(out_uri, stage, record), lease_there)
        return f"publishing:{sha256_bytes(held)}"
    if MANIFEST in names:
        data, manifest = _listed_manifest(out_uri)
        if manifest is None or manifest.stage != stage:
            what = f"a {manifest.stage!r} artifact" if manifest else "a malformed manifest"
            raise Occupied(out_uri, f"holds {what}, not a {stage} output", "choose another --out (or delete it)")
        listed = set(manifest.files) | {MANIFEST} | own
        _refuse_unlisted(out_uri, stage, listed, _unchanged(out_uri, MANIFEST, data))
        return f"artifact:{sha256_bytes(data)}"
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise Occupied(
        out_uri,
        f"is a directory holding files that are not an evoesap artifact ({shown})",
        f"give a new or empty directory (or an earlier {stage} output); nothing was changed",
    )


def _files_under(out_uri: str) -> list[str]:
    """Every file under an output location, relative to it; symlinks are listed, never followed."""
    fs, path = split(out_uri)
    root = path.rstrip("/")
    if "file" in _protocols(fs):
        found = []
        for base, dirs, files in os.walk(root):
            rel = os.path.relpath(base, root)
            found += [n if rel == "." else f"{rel}/{n}" for n in files]
            found += [f"{rel}/{d}" if rel != "." else d for d in dirs if os.path.islink(os.path.join(base, d))]
        return [f.replace(os.sep, "/") for f in found]
    return [p[len(root) + 1 :] for p in fs.find(root)]


def _refuse_unlisted(out_uri: str, stage: str, listed: set[str], settled: Callable[[], bool]) -> None:
    """Refuse an output holding files that `listed` (read from its manifest or lease) does not name, unless `settled()`
    says that manifest or lease changed meanwhile: the files then belong to the publish that changed it (look again)."""
    unlisted = sorted(set(_files_under(out_uri)) - listed)
    if unlisted and not settled():
        raise _Moving
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (", ..." if len(unlisted) > 3 else "")
        raise Occupied(
            out_uri,
            f"holds files that are not part of the {stage} artifact there ({shown})",
            "move them out or choose another --out; nothing was changed",
        )


def _unchanged(out_uri: str, name: str, data: bytes | None) -> Callable[[], bool]:
    """Whether the file `name` at `out_uri` still holds `data` (a look's first read of it)."""

    def still() -> bool:
        try:
            return read_bytes(join(out_uri, name)) == data
        except ArtifactError:
            return False

    return still


def _location(uri: str) -> tuple[tuple[str, ...], str]:
    fs, path = split(uri)
    if "file" in _protocols(fs):
        return ("file",), os.path.realpath(path)
    return _protocols(fs), "/" + path.strip("/")


def overlap(uri: str, other: str) -> str | None:
    """How the location `uri` overlaps `other`: "is", "lies inside" or "holds"; None when apart."""
    (fs, path), (other_fs, other_path) = _location(uri), _location(other)
    if fs != other_fs:
        return None
    if path == other_path:
        return "is"
    if path.startswith(other_path.rstrip("/") + "/"):
        return "lies inside"
    return "holds" if other_path.startswith(path.rstrip("/") + "/") else None


def _check_against_inputs(out_uri: str, inputs: Mapping[str, str | None]) -> None:
    for name, uri in sorted(inputs.items()):
        if uri is None or (not identity.is_uri(str(uri)) and identity.is_hub_name(str(uri))):
            continue
        relation = overlap(out_uri, uri)
        if relation:
            raise ConfigError(
                f"--out {redact(out_uri)} {relation} the input {name} ({redact(uri)}): publishing would overwrite it; "
                "choose another --out"
            )


# ------------------------------------------------------------------------------- publishing

PUBLISHING = "publishing.json"  # marks a remote artifact whose upload is under way (or was interrupted)
_STARTED = time.time()  # orphans of killed runs are older than this process


def _publishing_record(uri: str) -> dict[str, Any]:
    """publishing.json: the stage being published and every file the publish may write or remove."""
    try:
        return _record(read_bytes(join(uri, PUBLISHING)))
    except ArtifactError:
        return {}


def _record(held: bytes | None) -> dict[str, Any]:
    """publishing.json's bytes, parsed; {} when there is none or it is malformed."""
    try:
        record = json.loads(held) if held is not None else {}
    except ValueError:  # UnicodeDecodeError too
        return {}
    return record if isinstance(record, dict) else {}


def _ours_while_publishing(uri: str, stage: str, record: Mapping[str, Any]) -> set[str]:
    """The files a publish under way (or interrupted) may have at `uri`: those its lease (`record`) names and, before it
    retired it, those of the earlier artifact of `stage` it replaces (a lease taken over an artifact does not list them)."""
    files = record.get("files")
    ours = {*(f for f in files if isinstance(f, str)), PUBLISHING, MANIFEST} if isinstance(files, list) else {PUBLISHING}
    fs, path = split(join(uri, MANIFEST))
    earlier = _manifest_at(uri) if fs.exists(path) else None
    return ours | set(earlier.files) if earlier is not None and earlier.stage == stage else ours


def _git_commit() -> str | None:
    """The source commit: EVOESAP_GIT_COMMIT (set by the stage images at build time), else git's HEAD."""
    return os.environ.get("EVOESAP_GIT_COMMIT") or _checkout_head()


@functools.lru_cache(maxsize=1)
def _checkout_head() -> str | None:
    """HEAD of the checkout this package runs from, read once per process: a process runs the code it
    imported, whatever HEAD moves to while it runs."""
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
def _owned_dir(parent: Path, name: str, published: bool = False) -> Iterator[Path]:
    """A new directory `parent/name-<random>` locked (flock) by this process while it lives; removed after.
    `published`: it becomes the output, so it gets the mode `mkdir` would give it (the umask's), not mkdtemp's 0700."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))
    if published:
        os.chmod(path, 0o777 & ~umask())
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it (`os.umask` sets it to read it, which races other threads)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def owned_tempdir(stage: str) -> contextlib.AbstractContextManager[Path]:
    """A scratch directory in TMPDIR for a run of `stage`, locked by this process while it lives: a concurrent
    run's `clean_orphans` takes `evoesap-<stage>-*` directories only once their owner is gone."""
    return _owned_dir(Path(tempfile.gettempdir()), f"evoesap-{stage}")


def _is_orphan(path: Path, locked: bool) -> bool:
    """Left by a killed run: older than this process and (when `locked`) no live process holds its lock."""
    try:
        if path.stat().st_ctime >= _STARTED:
            return False
        if not locked:
            return True
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def clean_orphans(out_uri: str, stage: str) -> list[Path]:
    """Remove what killed runs of `stage` left: `.NAME.partial-*` / `.NAME.old-*` beside a local output and
    `evoesap-<stage>-*` / `evoesap-in-*` staging directories in TMPDIR. Returns what was removed. A replaced
    artifact left aside (`.old-*`) loses only the files its manifest lists."""
    tmp = Path(tempfile.gettempdir())
    places = [(tmp, f"evoesap-{stage}-*", True), (tmp, "evoesap-in-*", True)]
    fs, path = split(out_uri)
    removed = []
    for parent, pattern, locked in places:
        removed += [c for c in sorted(parent.glob(pattern)) if c.is_dir() and _is_orphan(c, locked)]
    for candidate in removed:
        shutil.rmtree(candidate, ignore_errors=True)
    if "file" in _protocols(fs):
        dest = local_destination(path)
        staged = [c for c in sorted(dest.parent.glob(f".{dest.name}.partial-*")) if c.is_dir() and _is_orphan(c, True)]
        replaced = [c for c in sorted(dest.parent.glob(f".{dest.name}.old-*")) if c.is_dir() and _is_orphan(c, False)]
        for candidate in staged:
            shutil.rmtree(candidate, ignore_errors=True)
        for candidate in replaced:
            _discard_replaced(candidate, dest)
        removed += staged + replaced
    for candidate in removed:
        log.info("removed %s, left by an interrupted run", candidate)
    return removed


def _discard_replaced(old: Path, dest: Path) -> None:
    """Remove an artifact renamed aside by a publish: the files its manifest lists, then empty folders.
    Anything else (a user's file that arrived after every check) is kept, renamed where it can be seen."""
    try:
        listed = set(Manifest.from_json((old / MANIFEST).read_text()).files) | {MANIFEST}
    except (OSError, ValueError, TypeError):
        listed = set()
    for rel in listed:
        with contextlib.suppress(OSError):
            (old / rel).unlink()
    for base, _, _ in sorted(os.walk(old), key=lambda entry: -len(entry[0])):
        with contextlib.suppress(OSError):
            os.rmdir(base)
    if old.exists():
        kept = dest.parent / f"{dest.name}.kept-{uuid.uuid4().hex[:8]}"
        os.rename(old, kept)
        log.warning("files that were not part of the replaced artifact at %s are kept in %s", dest, kept)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def stage_output(
    out_uri: str,
    stage: str,
    params: Mapping[str, Any],
    inputs: Mapping[str, str | None],
    seen: str | None = None,
    before_publish: Callable[[Path, Manifest], None] | None = None,
    run: Mapping[str, Any] | None = None,
) -> Iterator[Path]:
    """Yield a staging directory; on success publish it to `out_uri` with its manifest last.

    A local output is staged beside it (`.NAME.partial-*`, published by one rename); a remote one in
    TMPDIR. On an exception nothing is published and any earlier artifact at `out_uri` stays as it was.
    `seen`: what the stage's own `preflight` found at `out_uri` before its work; the publish refuses to
    replace anything else (a user's file, another run's artifact) and keeps the new artifact aside.
    `before_publish(staging, manifest)` runs once the manifest is in the staging directory, before the
    publish (the publish stage pushes copies there): when it raises, nothing is published.
    `run`: what the run measured of itself, for the manifest (not the payload: runs that make the same
    payload may differ in it, as a resumed search does in its cost).
    The published manifest is available afterwards through `read_manifest(out_uri)`.
    """
    found = preflight(out_uri, stage, inputs)
    seen = seen or found
    clean_orphans(out_uri, stage)
    started = _now()
    described = describe_inputs(inputs)
    key = cache_key(stage, params, described)
    _refuse_foreign_upload(out_uri, stage, seen, key)
    parent, prefix = _staging_place(out_uri, stage)
    try:
        with _owned_dir(parent, prefix, published=True) as staging:
            yield staging
            files = {p.relative_to(staging).as_posix(): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()}
            manifest = Manifest(
                stage=stage,
                params=json.loads(json.dumps(dict(params), default=str)),
                inputs=described,
                files=files,
                cache_key=key,
                git_commit=_git_commit(),
                started=started,
                ended=_now(),
                run=json.loads(json.dumps(dict(run or {}), default=str)),
            )
            (staging / MANIFEST).write_text(manifest.to_json())
            if before_publish is not None:
                before_publish(staging, manifest)
            _publish(staging, out_uri, manifest, _Expected(out_uri, stage, seen, key, parent))
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise ArtifactError(
                f"no space left on the device for {redact(out_uri)} ({stage}): free space or choose another --out; "
                "nothing was published"
            ) from None
        raise


def _refuse_foreign_upload(out_uri: str, stage: str, seen: str, key: str) -> None:
    """Refuse, before the work, an unfinished upload at `out_uri` of other parameters or inputs: whether its run was
    stopped or is still uploading cannot be told from here, and taking over a live one would mix two artifacts. An
    identical run's upload is taken over at publish (both write the same bytes)."""
    if not seen.startswith("publishing:"):
        return
    record = _publishing_record(out_uri)
    if not record or record.get("key") == key:  # finished meanwhile: the publish's own check judges what is there now
        return
    raise ConfigError(
        f"--out {redact(out_uri)} holds an unfinished upload of another {stage} run (other parameters or inputs; "
        f"{PUBLISHING} marks it): wait for that run, or, if none is publishing there, delete {redact(join(out_uri, PUBLISHING))} "
        "and re-run; nothing was changed"
    )


def _staging_place(out_uri: str, stage: str) -> tuple[Path, str]:
    """(directory, name prefix) of the staging directory of an output: beside it locally (published by one
    rename), in TMPDIR for an object store."""
    fs, path = split(out_uri)
    if "file" in _protocols(fs):
        dest = local_destination(path)
        return dest.parent, f".{dest.name}.partial"
    return Path(tempfile.gettempdir()), f"evoesap-{stage}"


def publish_copy(staging: Path, uri: str, manifest: Manifest, seen: str, flag: str) -> None:
    """Publish a byte-identical copy of a staged artifact (its manifest included) at a second location `uri` (given
    by the option `flag`), under the rules of a stage's own output: `seen` is what `preflight(uri, ...)` found there
    before the work, the manifest goes last, and a failed copy is not a finished artifact there."""
    parent, prefix = _staging_place(uri, manifest.stage)
    with _owned_dir(parent, prefix, published=True) as copy:
        shutil.copytree(staging, copy, dirs_exist_ok=True)
        _publish(copy, uri, manifest, _Expected(uri, manifest.stage, seen, manifest.cache_key, parent, flag))


@dataclasses.dataclass(frozen=True)
class _Expected:
    """What a publish may replace: what preflight saw at the output, or an artifact of the same stage,
    parameters and inputs (an identical run that published first)."""

    out_uri: str
    stage: str
    seen: str
    key: str
    aside: Path  # where a refused publish keeps its staged artifact
    flag: str = "--out"  # the option that named the location, for the error

    def check(self, staging: Path, lease: str | None = None, taken_over: bool = False) -> bool:
        """Whether to swap the staged artifact in (True), or leave the identical one another run published
        meanwhile (False); anything else there is refused with the staged artifact kept aside. Called with the
        output's swap lock (local) or its lease (`lease`, remote) held, so no other publish moves it meanwhile.
        `taken_over`: the lease is the one of the interrupted publish preflight saw, so what is there (its files, the
        artifact it was replacing, or nothing but its lease) is what preflight saw, and is replaced."""
        try:
            now = _look(self.out_uri, self.stage, lease)  # occupant's look, under the lock (or lease) already held
        except Occupied as exc:
            self.refuse(staging, exc.what)
        except ConfigError as exc:  # the location became unreadable as an output in another way
            self.refuse(staging, str(exc))
        identical = (
            now != self.seen
            and now.startswith("artifact:")
            and getattr(_manifest_at(self.out_uri), "cache_key", None) == self.key
        )  # the manifest is read only when what is there changed since preflight, as before
        if now == self.seen or {now, self.seen} <= _NOTHING or (taken_over and not identical):
            return True
        if identical:
            log.info("an identical %s run published %s first: its artifact stays", self.stage, redact(self.out_uri))
            return False
        self.refuse(staging, f"another {self.stage} run published there")

    def refuse(self, staging: Path, problem: str) -> NoReturn:
        kept = self.aside / f"evoesap-unpublished-{self.stage}-{uuid.uuid4().hex[:8]}"
        os.rename(staging, kept)
        raise ArtifactError(
            f"{self.flag} {redact(self.out_uri)} changed while this run worked ({problem}): nothing there was replaced; "
            f"this run's {self.stage} artifact is kept at {kept}"
        )


_NOTHING = {"absent", "empty"}
_TAKEN_OVER = "taken-over"  # an interrupted publish's files under this publish's own lease


def _publish(staging: Path, out_uri: str, manifest: Manifest, expected: _Expected) -> None:
    fs, path = split(out_uri)
    if "file" in _protocols(fs):
        _publish_local(staging, local_destination(path), expected)
    else:
        try:
            _publish_remote(fs, staging, out_uri, manifest, expected)
        except ArtifactError:
            raise
        except Exception as exc:  # noqa: BLE001 - an object store fails in many ways; each means "not published"
            raise ArtifactError(
                f"publishing {redact(out_uri)} failed ({type(exc).__name__}: {reply_line(exc, limit=200)}): it is not a "
                f"finished artifact; re-run `evoesap {manifest.stage}` to publish it"
            ) from exc
    log.info("published %s artifact at %s", manifest.stage, redact(out_uri))


_LOCK_WAIT = 120.0  # seconds a publish waits for another publish of the same output to finish


@contextlib.contextmanager
def _swap_lock(dest: Path) -> Iterator[None]:
    """The right to check and swap a local output, exclusive among evoesap processes (flock on `.NAME.lock`
    beside it, removed on release): the check and the swap it allows are one step, so an artifact another run
    publishes meanwhile is always seen. A look at the output (`occupant`) holds it too, so it sees no swap half done."""
    fd = _lock(dest)
    try:
        yield
    finally:
        _unlock(dest, fd)


def _lock(dest: Path) -> int:
    """Take `dest`'s swap lock; returns the descriptor that holds it. A lock file its releasing holder removed under
    us is opened again."""
    lock = _lock_file(dest)
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ArtifactError(
                            f"another run has been publishing {dest} for over {_LOCK_WAIT:.0f} s: is it stuck? "
                            "re-run when it is done"
                        ) from None
                    time.sleep(0.01)
            if _same_file(fd, lock):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _unlock(dest: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lock_file(dest))
    os.close(fd)


def _lock_file(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _publish_local(staging: Path, dest: Path, expected: _Expected) -> None:
    """Swap the staged directory in under the output's lock: the old artifact is renamed aside, the new one
    renamed in, the old removed (only the files its manifest lists)."""
    with _swap_lock(dest):
        if not expected.check(staging):
            return
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(dest, old)
        except FileNotFoundError:
            old = None
        try:
            os.rename(staging, dest)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            expected.refuse(
                staging, "something was created there while it was swapped" + (f"; the old artifact is at {old}" if old else "")
            )
    if old is not None:
        _discard_replaced(old, dest)


def _publish_remote(fs: fsspec.AbstractFileSystem, staging: Path, uri: str, manifest: Manifest, expected: _Expected) -> None:
    """Take the output's lease (publishing.json, created only if absent), check it, retire the old manifest,
    replace the files, write the manifest, release the lease. Only files the replaced artifact listed are removed;
    the lease names every file the publish may write or remove, so an interrupted one is finished by the next run."""
    root = split(uri)[1].rstrip("/")
    token = uuid.uuid4().hex
    lease = {"stage": manifest.stage, "key": manifest.cache_key, "token": token, "files": sorted(manifest.files)}
    interrupted = _take_lease(fs, uri, lease, expected, staging)
    try:
        replace = expected.check(staging, token, taken_over=interrupted is not None)
    except BaseException:
        _release(fs, root, token)
        raise
    if not replace:
        _release(fs, root, token)
        return
    replaced = set(interrupted.get("files", [])) if interrupted is not None else set()
    if fs.exists(f"{root}/{MANIFEST}"):  # the artifact replaced (an interrupted publish may not have retired it yet)
        replaced |= set((_manifest_at(uri) or manifest).files)
    replaced -= {PUBLISHING, MANIFEST}
    lease["files"] = sorted(replaced | set(manifest.files))
    fs.pipe_file(f"{root}/{PUBLISHING}", json.dumps(lease).encode("utf-8"))  # ours: widened to what it may remove
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.rm(f"{root}/{MANIFEST}")  # the old artifact stops counting as finished before its payload changes
    stale = [p for p in fs.find(root) if p[len(root) + 1 :] in replaced - set(manifest.files)]
    if stale:
        fs.rm(stale)
    for rel in manifest.files:
        fs.put_file(str(staging / rel), f"{root}/{rel}")
    with fs.open(f"{root}/{MANIFEST}", "wb") as f:
        f.write(manifest.to_json().encode("utf-8"))
    _release(fs, root, token)


def _release(fs: fsspec.AbstractFileSystem, root: str, token: str) -> None:
    """Remove this publish's lease, only while it is still its own: an identical run that took it over holds it now."""
    fs.invalidate_cache(root)
    with contextlib.suppress(FileNotFoundError, ValueError):
        if json.loads(fs.cat_file(f"{root}/{PUBLISHING}")).get("token") == token:
            fs.rm(f"{root}/{PUBLISHING}")


_EXCLUSIVE_PUT = {"s3", "s3a", "memory"}  # stores whose fsspec pipe_file(mode="create") is one conditional put


def _create(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `path` only where it does not exist (FileExistsError otherwise): one conditional put on S3; on other
    stores a look, then the write, which leaves a moment in which two publishes could both take the lease."""
    if _EXCLUSIVE_PUT & set(_protocols(fs)):
        fs.pipe_file(path, data, mode="create")
        return
    if fs.exists(path):
        raise FileExistsError(path)
    fs.pipe_file(path, data)


def _take_lease(
    fs: fsspec.AbstractFileSystem, uri: str, lease: dict[str, Any], expected: _Expected, staging: Path
) -> dict[str, Any] | None:
    """Create publishing.json only where none exists (a conditional put where the store has one, as S3 does): one
    publish at a time holds an output. An interrupted publish that preflight saw is ours to finish (its record is
    returned); an identical publish under way is waited out (the check then finds its artifact); any other is refused."""
    path = join(uri, PUBLISHING)
    deadline = time.monotonic() + _LOCK_WAIT
    interrupted = None
    while True:
        try:
            _create(fs, split(path)[1], json.dumps(lease).encode("utf-8"))
            return interrupted
        except FileExistsError:
            pass
        fs.invalidate_cache(split(path)[1])  # another process wrote it: a listing cached here is stale
        try:
            held = fs.cat_file(split(path)[1])
        except FileNotFoundError:
            continue  # released in between: take it
        if expected.seen == f"publishing:{sha256_bytes(held)}":  # the interrupted publish preflight saw
            interrupted = json.loads(held)
            if interrupted.get("key") != lease["key"]:  # stopped, or still uploading: only an identical run's is ours
                expected.refuse(
                    staging,
                    f"it holds an unfinished upload of another {expected.stage} run; if none is publishing there, "
                    f"delete its {PUBLISHING} and re-run",
                )
            lease["files"] = sorted(set(lease["files"]) | set(interrupted.get("files", [])))
            with contextlib.suppress(FileNotFoundError):
                fs.rm(split(path)[1])
            continue
        try:
            other = json.loads(held)
        except ValueError:
            other = None
        if isinstance(other, dict) and other.get("token") == lease["token"]:
            return interrupted  # our own put, whose answer was lost and whose retry found it there
        if isinstance(other, dict) and other.get("key") != lease["key"]:
            expected.refuse(staging, f"another {expected.stage} run is publishing there")
        # an identical publish under way, or a lease read while its holder rewrote it (a store whose reads of an object
        # being overwritten are not atomic, as moto's): wait and read again
        if time.monotonic() > deadline:
            raise ArtifactError(
                f"another {expected.stage} run has been publishing {redact(uri)} for over {_LOCK_WAIT:.0f} s: "
                f"if it was stopped, re-run `evoesap {expected.stage}` to finish it"
            )
        time.sleep(0.2)


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[Path]:
    """A local directory holding the artifact at `uri`: the path itself when local, else a download."""
    fs, path = split(uri)
    if "file" in _protocols(fs):
        yield Path(path)
        return
    if not fs.exists(path):
        raise ArtifactError(f"{redact(uri)} does not exist")
    with _owned_dir(Path(tempfile.gettempdir()), "evoesap-in") as tmp:
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
        yield tmp
