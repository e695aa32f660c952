"""The digest cache is only a cache: a file at its location that is not one of ours is left byte-identical and
named in one warning, a lock held elsewhere holds a stage up for seconds at most, and the digest is always right."""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from pathlib import Path

import pytest

from evoesap.store import digest_cache

WARNING = "digest cache"


@pytest.fixture
def weights(tmp_path) -> list[Path]:
    """Three files standing for a checkpoint's weight files."""
    files = []
    for i in range(3):
        path = tmp_path / "model" / f"model-{i}.safetensors"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes([i]) * (1000 + i))
        files.append(path)
    return files


def _hashed(files: list[Path], calls: list[str]) -> list[str]:
    def compute(path: str) -> str:
        calls.append(path)
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    return [digest_cache.sha256(str(f), compute) for f in files]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and WARNING in r.getMessage()]


def _expected(files: list[Path]) -> list[str]:
    return [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]


def test_a_new_cache_is_created_and_remembers_each_digest_across_processes(weights, tmp_path, monkeypatch, caplog):
    where = tmp_path / "cache" / "digests.sqlite"
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(where))
    calls: list[str] = []
    assert _hashed(weights, calls) == _expected(weights) and len(calls) == 3
    assert _hashed(weights, calls) == _expected(weights) and len(calls) == 3  # read back, not computed
    assert where.read_bytes().startswith(b"SQLite format 3\x00") and not _warnings(caplog)
    assert [p.name for p in where.parent.iterdir()] == ["digests.sqlite"]  # no file left from building it


def test_a_cache_made_by_earlier_versions_with_the_same_schema_is_used(weights, tmp_path, monkeypatch, caplog):
    where = tmp_path / "digests.sqlite"
    with sqlite3.connect(where) as connection:
        connection.execute(digest_cache._SCHEMA.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS"))
    connection.close()
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(where))
    calls: list[str] = []
    _hashed(weights, calls)
    assert _hashed(weights, calls) == _expected(weights) and len(calls) == 3 and not _warnings(caplog)


def _other_schema(where: Path) -> None:
    with sqlite3.connect(where) as connection:
        connection.execute("CREATE TABLE digests (path TEXT PRIMARY KEY, sha256 TEXT)")  # an older or foreign layout
        connection.execute("INSERT INTO digests VALUES ('x', 'y')")
    connection.close()


def _foreign_database(where: Path) -> None:
    with sqlite3.connect(where) as connection:
        connection.execute(digest_cache._SCHEMA)  # our table, beside someone else's
        connection.execute("CREATE TABLE notes (text TEXT)")
    connection.close()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_other_schema, "another schema"),
        (_foreign_database, "holding the tables ['digests', 'notes']"),
        (lambda where: where.write_bytes(b""), "not a SQLite database"),
        (lambda where: where.write_text("my notes, not a cache\n" * 50), "not a SQLite database"),
        (lambda where: where.mkdir(), "not a regular file"),
    ],
    ids=["other-schema", "foreign-database", "empty-file", "text-file", "directory"],
)
def test_a_location_holding_anything_but_our_cache_is_left_untouched_with_one_warning(
    weights, tmp_path, monkeypatch, caplog, make, reason
):
    where = tmp_path / "digests.sqlite"
    make(where)
    before = where.read_bytes() if where.is_file() else None
    listing = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(where))
    calls: list[str] = []
    with caplog.at_level(logging.WARNING):
        assert _hashed(weights, calls) == _expected(weights)
        assert _hashed(weights, calls) == _expected(weights)
    assert len(calls) == 6  # every digest computed: nothing remembered, nothing wrong read
    (line,) = _warnings(caplog)  # one warning for the whole process
    assert str(where) in line and reason in line and "EVOESAP_DIGEST_CACHE" in line
    assert (where.read_bytes() if where.is_file() else None) == before  # byte-identical
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no journal or other file beside it
    if where.is_dir():
        assert not any(where.iterdir())


@pytest.mark.parametrize("lock", ["IMMEDIATE", "EXCLUSIVE"])
def test_a_cache_locked_by_another_writer_holds_hashing_up_for_seconds_at_most(weights, tmp_path, monkeypatch, caplog, lock):
    """Another connection holds a write transaction for as long as the test runs: hashing three files goes on
    without the cache after one short wait, with one warning, and the holder's transaction is untouched."""
    where = tmp_path / "digests.sqlite"
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(where))
    _hashed(weights[:1], [])  # the cache exists and holds one digest
    holder = sqlite3.connect(where, isolation_level=None)
    try:
        holder.execute(f"BEGIN {lock}")
        holder.execute("INSERT INTO digests VALUES ('held', 1, 1, 1, 1, ?)", ("0" * 64,))
        calls: list[str] = []
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            got = _hashed(weights, calls)
        took = time.monotonic() - started
        assert got == _expected(weights)
        assert took < digest_cache.BUSY_TIMEOUT_S + 2.0, f"hashing waited {took:.1f} s for the lock"
        (line,) = _warnings(caplog)
        assert "locked" in line and str(where) in line
        holder.execute("COMMIT")
    finally:
        holder.close()
    with sqlite3.connect(where) as reader:
        assert reader.execute("SELECT count(*) FROM digests WHERE path='held'").fetchone() == (1,)
    reader.close()
    assert digest_cache.BUSY_TIMEOUT_S <= 5


def test_a_cache_in_a_place_that_cannot_be_written_is_skipped(weights, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(blocked / "digests.sqlite"))  # its parent is a file
    with caplog.at_level(logging.WARNING):
        assert _hashed(weights, []) == _expected(weights)
    (line,) = _warnings(caplog)
    assert "cannot be created" in line and blocked.read_bytes() == b""


def test_a_row_that_is_not_a_sha256_is_never_returned(weights, tmp_path, monkeypatch):
    where = tmp_path / "digests.sqlite"
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(where))
    _hashed(weights, [])
    with sqlite3.connect(where) as connection:
        connection.execute("UPDATE digests SET sha256 = sha256 || char(10) WHERE rowid % 2 = 0")  # a digest and a newline
        connection.execute("UPDATE digests SET sha256 = 'not a digest' WHERE rowid % 2 = 1")
    connection.close()
    calls: list[str] = []
    assert _hashed(weights, calls) == _expected(weights) and len(calls) == 3


# A directory of one file per digest (EVOESAP_DIGEST_DIR): for a volume several pods share, where SQLite's locks
# are not to be trusted.


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.iterdir())


def test_a_digest_directory_remembers_each_digest_in_a_file_of_its_own_across_processes(weights, tmp_path, monkeypatch):
    """Another process (a pod before this one) hashes the files into the directory; this one reads every digest back."""
    import subprocess
    import sys

    directory = tmp_path / "workspace" / "digests"
    monkeypatch.setenv("EVOESAP_DIGEST_DIR", str(directory))
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(tmp_path / "home-cache.sqlite"))  # not the one used
    script = (
        "import hashlib, sys; from pathlib import Path; from evoesap.store import digest_cache\n"
        "for f in sys.argv[1:]: digest_cache.sha256(f, lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest())"
    )
    subprocess.run([sys.executable, "-c", script, *map(str, weights)], check=True)
    assert len(_entries(directory)) == 3 and not (tmp_path / "home-cache.sqlite").exists()

    def never(path: str) -> str:
        raise AssertionError(f"{path} hashed again")

    assert [digest_cache.sha256(str(f), never) for f in weights] == _expected(weights)


def test_a_file_rewritten_in_place_is_hashed_again_even_with_its_old_size_and_mtime(weights, tmp_path, monkeypatch):
    import os

    directory = tmp_path / "digests"
    monkeypatch.setenv("EVOESAP_DIGEST_DIR", str(directory))
    calls: list[str] = []
    _hashed(weights, calls)
    target = weights[0]
    old = target.stat()
    target.write_bytes(b"\xff" * old.st_size)  # same size, other bytes
    os.utime(target, ns=(old.st_atime_ns, old.st_mtime_ns))  # mtime set back: only ctime tells
    assert _hashed(weights, calls) == _expected(weights)
    assert calls.count(os.path.realpath(target)) == 2 and len(calls) == 4
    assert len(_entries(directory)) == 4  # the old version's entry stays, never matched again


def test_a_damaged_or_foreign_entry_is_never_believed(weights, tmp_path, monkeypatch):
    """An entry that does not parse, or records another file's key under this key's name, is a miss: the digest is
    computed, right, and the entry rewritten whole."""
    import json

    directory = tmp_path / "digests"
    monkeypatch.setenv("EVOESAP_DIGEST_DIR", str(directory))
    _hashed(weights[:2], [])
    first, second = _entries(directory)
    first.write_text("{not json")
    second.write_text(json.dumps({"key": ["/elsewhere", 1, 2, 3, 4], "sha256": "0" * 64}))
    calls: list[str] = []
    assert _hashed(weights[:2], calls) == _expected(weights[:2]) and len(calls) == 2
    assert [json.loads(e.read_text())["sha256"] for e in (first, second)] != ["0" * 64] * 2
    assert sorted(json.loads(e.read_text())["sha256"] for e in _entries(directory)) == sorted(_expected(weights[:2]))


def test_writers_racing_on_one_entry_all_get_the_right_digest_and_leave_one_whole_entry(weights, tmp_path, monkeypatch):
    import threading

    directory = tmp_path / "digests"
    monkeypatch.setenv("EVOESAP_DIGEST_DIR", str(directory))
    start = threading.Barrier(8)
    got: list[str] = []

    def compute(path: str) -> str:
        start.wait()  # every writer has missed the entry: all of them publish it at once
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    threads = [threading.Thread(target=lambda: got.append(digest_cache.sha256(str(weights[0]), compute))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == _expected(weights[:1]) * 8
    (entry,) = _entries(directory)  # no partial file left behind
    assert entry.suffix == ".json" and hashlib.sha256(weights[0].read_bytes()).hexdigest() in entry.read_text()


def test_an_unwritable_digest_directory_is_named_in_one_warning_and_hashing_goes_on(weights, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the directory would be")
    monkeypatch.setenv("EVOESAP_DIGEST_DIR", str(blocked / "digests"))
    calls: list[str] = []
    with caplog.at_level(logging.WARNING):
        assert _hashed(weights, calls) == _expected(weights)
    assert len(calls) == 3
    (line,) = _warnings(caplog)
    assert str(blocked / "digests") in line and "EVOESAP_DIGEST_DIR" in line
    assert blocked.read_text() == "a file where the directory would be"
