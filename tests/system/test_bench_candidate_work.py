"""benchmarks/bench_candidate_work.py --compare --out / --table: rows written as searches finish, tables from several
files (a later file's rows replacing the same searches of an earlier one), and bad inputs refused before any work."""

from __future__ import annotations

import json

import pytest
from scripts import load_script

from evoesap.errors import DataError

TINY = ["--compare", "--worlds", "tiny", "--samples", "16", "--calibration-samples", "4", "--max-length", "32"]
TINY += ["--population", "6", "--elites", "2", "--generations", "1", "--criteria", "reap", "--seeds", "0"]


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_candidate_work.py")


@pytest.fixture(scope="module")
def rows():
    return load_script("benchmarks/work_rows.py")


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_search_is_on_disk_before_the_next_starts(bench, tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    real, calls = bench.run_search, []

    def run_search(*args, **kwargs):
        calls.append(kwargs["race"])
        if len(calls) == 3:  # the third search dies: the two before it must be on disk already
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_search", run_search)
    commits = iter(["1111111", "2222222", "3333333"])  # HEAD moving while the run goes on
    monkeypatch.setattr(bench, "_commit", lambda: next(commits))
    with pytest.raises(KeyboardInterrupt):
        bench.main([*TINY, "--methods", "exact", "prefix", "racing", "--out", str(out)])
    written = read_lines(out)
    assert [r["method"] for r in written] == ["exact", "prefix"]
    for r in written:
        assert (r["world"], r["criterion"], r["seed"]) == ("tiny", "reap", 0)
        assert r["settings"]["samples"] == 16 and r["settings"]["generations"] == 1
        assert r["settings"]["commit"] == "1111111"  # the code that was imported, read when the run started
        assert sum(r["allocation"]) == sum(written[0]["allocation"])  # both meet the same budget
        assert 0 < r["esap"] <= 1 and 0 < r["ffe_per_candidate"] <= 1
    # prefix reuse does not change which allocation wins, nor its full-set score
    assert written[0]["allocation"] == written[1]["allocation"] and written[0]["esap"] == written[1]["esap"]
    assert written[1]["ffe_per_candidate"] < written[0]["ffe_per_candidate"]


def test_a_method_run_alone_is_judged_as_beside_exact(bench, tmp_path):
    """The statistical column can be re-run by itself: its final allocation gets the same full-set ESAP as when
    exact search ran in the same process."""
    together, alone = tmp_path / "together.jsonl", tmp_path / "alone.jsonl"
    bench.main([*TINY, "--methods", "exact", "statistical", "--out", str(together)])
    bench.main([*TINY, "--methods", "statistical", "--out", str(alone)])
    first, second = read_lines(together), read_lines(alone)
    assert [r["method"] for r in first] == ["exact", "statistical"] and [r["method"] for r in second] == ["statistical"]
    assert second[0]["allocation"] == first[1]["allocation"] and second[0]["esap"] == first[1]["esap"]
    assert second[0]["settings"]["racing_delta"] == 0.05 and "racing_schedule" not in second[0]["settings"]
    assert second[0]["settings"]["racing_tolerance"] == 0.0
    for r in first:  # where the work went: per generation, its FFE and how its new candidates ended
        assert len(r["ffe_by_generation"]) == len(r["endings_by_generation"]) == 2
        assert sum(r["ffe_by_generation"]) == pytest.approx(r["ffe_per_candidate"] * r["candidates"])
        assert sum(sum(ends.values()) for ends in r["endings_by_generation"]) == r["candidates"]
    assert set().union(*first[0]["endings_by_generation"]) == {"full"}  # exact search scores every one in full
    assert 2 <= first[0]["elite_allocations"] <= sum(first[0]["endings_by_generation"][0].values())


def row(method, seed, esap, allocation, ffe=0.5, criterion="reap", **settings):
    return {
        "world": "demo",
        "criterion": criterion,
        "seed": seed,
        "method": method,
        "candidates": 100,
        "ffe_per_candidate": ffe,
        "ffe_per_candidate_whole_search": ffe / 2,
        "seconds_per_candidate": 0.01,
        "seconds": 1.0,
        "allocation": allocation,
        "esap": esap,
        "settings": {"samples": 64, "max_length": 128, "generations": 6, **settings},
    }


def write(path, rows_):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def summary_line(text, criterion, method):
    (line,) = [x for x in text.splitlines() if x.startswith(f"| {criterion} | {method} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_counts_matches_and_losses_and_a_later_file_replaces_its_rows(rows, tmp_path):
    old = write(
        tmp_path / "old.jsonl",
        [
            row("exact", 0, 0.90, [2, 2]),
            row("racing", 0, 0.90, [2, 2]),
            row("statistical", 0, 0.80, [1, 3], ffe=0.4),  # worse than exact and racing
            row("exact", 1, 0.90, [2, 2]),
            row("racing", 1, 0.85, [3, 1]),
            row("statistical", 1, 0.90, [2, 2], ffe=0.2),
        ],
    )
    text = rows.tables(rows.read([old]))
    stat = summary_line(text, "reap", "statistical")
    # criterion, method, searches, FFE, whole, s, ESAP, vs exact mean, worst, same as exact, worse than exact, than racing
    assert stat[2] == "2" and stat[3] == "0.300" and stat[6] == "0.850000"
    assert stat[8] == f"{100 * (0.80 - 0.90) / 0.90:+.3f}%" and stat[9:11] == ["1/2", "1/2"]
    assert stat[11] == f"1/2 (worst {100 * (0.80 - 0.90) / 0.90:+.3f}%)"
    assert summary_line(text, "reap", "racing")[9:12] == ["1/2", "1/2", "-"]

    new = write(tmp_path / "new.jsonl", [row("statistical", 0, 0.90, [2, 2], ffe=0.1, racing_waves=8)])
    text = rows.tables(rows.read([old, new]))
    stat = summary_line(text, "reap", "statistical")
    assert stat[3] == "0.150" and stat[6] == "0.900000" and stat[9:12] == ["2/2", "0/2", "0/2"]
    assert "| reap | 0 | statistical | 100 | 0.100 |" in text and "| reap | 0 | statistical | 100 | 0.400 |" not in text
    assert "racing_waves 8" in text  # the statistical rows' own settings are listed


def test_table_refuses_a_torn_line_and_rows_of_other_settings(rows, tmp_path):
    good = json.dumps(row("exact", 0, 0.9, [2, 2])) + "\n"
    torn = tmp_path / "torn.jsonl"
    torn.write_text(good + good[:30])
    with pytest.raises(DataError, match=r"torn.jsonl:2 is not a JSON row .*delete that line"):
        rows.read([torn])
    other = write(tmp_path / "other.jsonl", [row("statistical", 0, 0.9, [2, 2], samples=16)])
    with pytest.raises(DataError, match=r"samples is 64 in .*torn2.jsonl \(exact\) but 16 in .*other.jsonl"):
        rows.read([write(tmp_path / "torn2.jsonl", [row("exact", 0, 0.9, [2, 2])]), other])
    with pytest.raises(DataError, match=r"lacks \['esap'\]"):
        rows.read([write(tmp_path / "partial.jsonl", [{k: v for k, v in row("exact", 0, 0.9, [2]).items() if k != "esap"}])])
    with pytest.raises(DataError, match="cannot read work rows"):
        rows.read([tmp_path / "missing.jsonl"])


def test_bad_options_stop_before_any_model_is_built(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "world", lambda *a: pytest.fail("a world was built"))
    for argv, code, message in (
        ([*TINY, "--out", str(tmp_path / "no" / "rows.jsonl")], 1, "its folder"),
        ([*TINY, "--out", str(tmp_path)], 1, "is a directory"),
        (["--out", str(tmp_path / "rows.jsonl")], 2, "add --compare"),
        ([*TINY, "--table", str(tmp_path / "rows.jsonl")], 2, "--table only reads rows"),
        (["--compare", "--worlds", "demo"], 2, "--worlds demo needs --model"),
    ):
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == code
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()[-1]) > 20
    assert not (tmp_path / "rows.jsonl").exists()


def test_out_refuses_a_file_that_is_not_work_rows_and_leaves_it_byte_identical(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "world", lambda *a: pytest.fail("a world was built"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(notes)  # the file it points at is judged, not the name
    for given in (notes, link):
        with pytest.raises(SystemExit) as stop:
            bench.main([*TINY, "--out", str(given)])
        assert stop.value.code == 1
        assert "is not a file of work rows" in capsys.readouterr().err
        assert notes.read_text() == "my notes\n"
