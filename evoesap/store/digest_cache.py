"""The sha256 of a large local file, computed once per file version and remembered across processes.

A checkpoint's weights are identified by their content (so a byte-identical model at a new location, as a
team's `Output[Model]` is in every KFP run, keys the same stages), but hashing 60 GB again in every stage
process would cost as much as loading it. The digest is kept in a small SQLite table keyed by the file's
real path, size, mtime_ns, ctime_ns and inode: any write to the file changes one of them (ctime cannot be
set back by a user), so a stale digest is never returned. The table lives in `$EVOESAP_DIGEST_CACHE`, else
`$XDG_CACHE_HOME/evoesap/digests.sqlite` (`~/.cache/...`); where it cannot be written (a read-only home in a
pod) the file is hashed without remembering it. Concurrent processes share it (SQLite's own locking).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS digests (path TEXT, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, "
    "inode INTEGER, sha256 TEXT, PRIMARY KEY (path, size, mtime_ns, ctime_ns, inode))"
)


def location() -> Path:
    """Where the table is kept (see the module docstring)."""
    chosen = os.environ.get("EVOESAP_DIGEST_CACHE")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evoesap" / "digests.sqlite"


def _connect() -> sqlite3.Connection | None:
    where = location()
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(where, timeout=60)
        connection.execute(_SCHEMA)
        return connection
    except (OSError, sqlite3.Error) as exc:
        log.debug("digest cache %s unavailable (%s): hashing without it", where, exc)
        return None


def sha256(path: str, compute: Callable[[str], str]) -> str:
    """The sha256 of the local file `path`: remembered for this version of the file, else `compute(path)`."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    connection = _connect()
    if connection is None:
        return compute(real)
    with contextlib.closing(connection):
        row = connection.execute(
            "SELECT sha256 FROM digests WHERE path=? AND size=? AND mtime_ns=? AND ctime_ns=? AND inode=?", key
        ).fetchone()
        if row is not None:
            return str(row[0])
        digest = compute(real)
        if os.stat(real).st_mtime_ns == st.st_mtime_ns:  # not written while it was read
            try:
                with connection:
                    connection.execute("DELETE FROM digests WHERE path=?", (real,))  # older versions of the file
                    connection.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?)", (*key, digest))
            except sqlite3.Error as exc:
                log.debug("digest of %s not remembered (%s)", real, exc)
        return digest
