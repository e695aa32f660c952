"""The sha256 of a large local file, computed once per file version and remembered across processes.

A checkpoint's weights are identified by their content (so a byte-identical model at a new location, as a
team's `Output[Model]` is in every KFP run, keys the same stages), but hashing 60 GB again in every stage
process would cost as much as loading it. The digest is kept in a small SQLite table keyed by the file's
real path, size, mtime_ns, ctime_ns and inode: any write to the file changes one of them (ctime cannot be
set back by a user), so a stale digest is never returned. The table lives in `$EVOESAP_DIGEST_CACHE`, else
`$XDG_CACHE_HOME/evoesap/digests.sqlite` (`~/.cache/...`); where it cannot be written (a read-only home in a
pod) the file is hashed without remembering it. Concurrent processes share it (SQLite's own locking).

SQLite's locking is not to be trusted on a network filesystem (NFS and the like: sqlite.org/faq.html#q5), which is
what a volume shared by several pods usually is. `$EVOESAP_DIGEST_DIR` (it takes precedence) names a directory
instead, holding one small file per digest, named by the sha256 of its key and published by an atomic rename: a reader
sees a whole entry or none, concurrent writers of one entry write the same bytes, and no lock is taken. An entry is
used only when the key it records is the file's key now, so a file rewritten since gets a new entry.

It is only a cache, so it never stops a stage nor holds it up: a file it did not create is used only when it is
a SQLite database holding this table alone, with this schema (anything else, an empty file included, is left
byte-identical); a lock held by another process is waited for `BUSY_TIMEOUT_S` at most. A cache refused or
failing is named in one warning, then left alone for the rest of the process, and the file is hashed without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sqlite3
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 2.0  # the most a process waits, in all, for another's lock on the table; then it hashes without it
_TABLE = "digests"
_SCHEMA = (
    f"CREATE TABLE {_TABLE} (path TEXT, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, "
    "inode INTEGER, sha256 TEXT, PRIMARY KEY (path, size, mtime_ns, ctime_ns, inode))"
)
_SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
_SHA256 = re.compile(r"[0-9a-f]{64}")
_refused: set[str] = set()  # locations refused or failed in this process: not tried again


DIRECTORY_ENV = "EVOESAP_DIGEST_DIR"  # a directory of one file per digest: for a volume several pods share


def location() -> Path:
    """Where the table is kept (see the module docstring); `$EVOESAP_DIGEST_DIR`, when set, is used instead."""
    chosen = os.environ.get("EVOESAP_DIGEST_CACHE")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evoesap" / "digests.sqlite"


class _Unusable(Exception):
    """The cache cannot be used; the message says why."""


def _columns(execute: Callable[..., list[Any]]) -> list[tuple[Any, ...]]:
    """(name, type, not null, default, primary-key position) of each column of the table."""
    return [tuple(row[1:]) for row in execute(f"PRAGMA table_info({_TABLE})")]


def _expected_columns() -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(":memory:")) as connection:
        connection.execute(_SCHEMA)
        return _columns(lambda sql: connection.execute(sql).fetchall())


class _Cache:
    """A connection to the checked table whose lock waits, all together, last at most BUSY_TIMEOUT_S."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection
        self.wait_left = BUSY_TIMEOUT_S

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.connection.execute(f"PRAGMA busy_timeout = {max(int(self.wait_left * 1000), 0)}")
        started = time.monotonic()
        try:
            return self.connection.execute(sql, args).fetchall()
        finally:
            self.wait_left -= time.monotonic() - started


def _create(where: Path) -> None:
    """Make a new cache at `where`: built beside it under a private name, then linked into place only when nothing
    is there yet (a file someone made meanwhile is never replaced)."""
    building = where.with_name(f".{where.name}.{uuid.uuid4().hex}.building")
    try:
        with contextlib.closing(sqlite3.connect(building, isolation_level=None)) as connection:
            connection.execute(_SCHEMA)
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile: it is checked as any other
            os.link(building, where)
    finally:
        with contextlib.suppress(OSError):
            building.unlink()


def _open(where: Path) -> _Cache:
    """The existing cache at `where`, refused (`_Unusable`) unless it is a SQLite database holding our table alone,
    with our schema. SQLite is never let to create or write a file it did not check."""
    if not where.is_file():
        raise _Unusable("it is not a regular file")
    with open(where, "rb") as f:
        if f.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
            raise _Unusable("it is an existing file but not a SQLite database (an empty file included); it is left as it is")
    uri = "file:" + urllib.parse.quote(os.path.abspath(where)) + "?mode=rw"
    cache = _Cache(sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None))
    try:
        tables = sorted(row[0] for row in cache.execute("SELECT name FROM sqlite_master WHERE type='table'"))
        if tables != [_TABLE]:
            raise _Unusable(f"it is a SQLite database holding the tables {tables}, not an evoesap digest cache")
        if _columns(cache.execute) != _expected_columns():
            raise _Unusable(f"its {_TABLE!r} table has another schema (an older or foreign cache)")
    except BaseException:
        cache.connection.close()
        raise
    return cache


def _connect() -> _Cache | None:
    """The cache, checked; None where there is none to use (a new one cannot be made here, or it was refused)."""
    where = location()
    if os.path.abspath(where) in _refused:
        return None
    try:
        if not where.exists() and not where.is_symlink():
            try:
                where.parent.mkdir(parents=True, exist_ok=True)
                _create(where)
            except OSError as exc:  # a read-only home in a pod: expected, so worth a warning only where chosen
                if os.environ.get("EVOESAP_DIGEST_CACHE"):
                    raise _Unusable(f"it cannot be created: {exc}") from None
                log.debug("digest cache %s cannot be created (%s): hashing without it", where, exc)
                _refused.add(os.path.abspath(where))
                return None
        return _open(where)
    except (_Unusable, OSError, sqlite3.Error) as exc:
        _refuse(where, exc)
        return None


def _refuse(
    where: Path, exc: BaseException, fix: str = "point EVOESAP_DIGEST_CACHE at a new file, or delete this one if evoesap made it"
) -> None:
    """Warn once that the cache at `where` is not used, and leave it alone for the rest of the process."""
    if os.path.abspath(where) in _refused:
        return
    _refused.add(os.path.abspath(where))
    why = str(exc) if isinstance(exc, _Unusable) else f"{type(exc).__name__}: {exc}"
    log.warning("digest cache %s is not used (%s): weights are hashed without it in this process; %s", where, why, fix)


def sha256(path: str, compute: Callable[[str], str]) -> str:
    """The sha256 of the local file `path`: remembered for this version of the file, else `compute(path)`."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if os.environ.get(DIRECTORY_ENV):
        return _directory_sha256(Path(os.environ[DIRECTORY_ENV]), key, compute)
    where = location()
    cache = _connect()
    if cache is None:
        return compute(real)
    with contextlib.closing(cache.connection):
        try:
            rows = cache.execute(
                f"SELECT sha256 FROM {_TABLE} WHERE path=? AND size=? AND mtime_ns=? AND ctime_ns=? AND inode=?", key
            )
        except sqlite3.Error as exc:
            _refuse(where, exc)
            return compute(real)
        if rows and isinstance(rows[0][0], str) and _SHA256.fullmatch(rows[0][0]):
            return rows[0][0]
        digest = compute(real)
        if os.stat(real).st_mtime_ns == st.st_mtime_ns:  # not written while it was read
            try:
                cache.execute("BEGIN IMMEDIATE")
                try:
                    cache.execute(f"DELETE FROM {_TABLE} WHERE path=?", (real,))  # older versions of the file
                    cache.execute(f"INSERT OR REPLACE INTO {_TABLE} VALUES (?, ?, ?, ?, ?, ?)", (*key, digest))
                    cache.execute("COMMIT")
                except BaseException:
                    cache.connection.rollback()
                    raise
            except sqlite3.Error as exc:
                _refuse(where, exc)
        return digest


def _directory_sha256(directory: Path, key: tuple[Any, ...], compute: Callable[[str], str]) -> str:
    """`sha256` with the one-file-per-digest layout in `directory` (see the module docstring)."""
    real = key[0]
    if os.path.abspath(directory) in _refused:
        return compute(real)
    entry = directory / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()}.json"
    try:
        recorded = json.loads(entry.read_text())
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError) as exc:  # an entry being unreadable is a miss; it is written again below
        log.debug("digest cache entry %s unreadable (%s): hashing", entry, exc)
        recorded = None
    if isinstance(recorded, dict) and recorded.get("key") == list(key):
        found = recorded.get("sha256")
        if isinstance(found, str) and _SHA256.fullmatch(found):
            return found
    digest = compute(real)
    if os.stat(real).st_mtime_ns != key[2]:  # written while it was read: nothing to remember
        return digest
    staged = directory / f".{entry.name}.{uuid.uuid4().hex}.partial"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staged.write_text(json.dumps({"key": list(key), "sha256": digest}))
        os.replace(staged, entry)  # atomic: a reader in another pod sees the whole entry or none
    except OSError as exc:
        with contextlib.suppress(OSError):
            staged.unlink()
        _refuse(directory, _Unusable(f"an entry cannot be written: {exc}"), f"point {DIRECTORY_ENV} at a writable directory")
    return digest
