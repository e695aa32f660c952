"""The rows of bench_candidate_work's `--compare` as JSON lines, and the markdown tables made from one or more files of them.

A row is one search: world, criterion, seed, method, its work (FFE per candidate in the run and over a whole
default search, estimated), seconds per candidate, candidates, the final allocation and its full-set ESAP, and
the settings it ran with; newer rows also hold the FFE of each generation, how each generation's new candidates
ended (`endings_by_generation`: "full", or the racing level they stopped at) and how many distinct allocations were
ever elite (`elite_allocations`: scored on the full set by any search that takes this one's course). Rows are
appended one by one as searches finish, so a stopped run keeps what it did.
Reading several files, a later row replaces an earlier one of the same world, criterion, seed and method: a later
file of statistical rows alone (`--methods statistical`) replaces that column and keeps the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from evoesap.errors import DataError

METHODS = ("exact", "prefix", "racing", "statistical")
FIELDS = (
    "world",
    "criterion",
    "seed",
    "method",
    "candidates",
    "ffe_per_candidate",
    "ffe_per_candidate_whole_search",
    "seconds_per_candidate",
    "allocation",
    "esap",
    "settings",
)
# settings that every method of a world must share for its rows to be compared; the rest (statistical racing's
# own parameters, the code's commit) may differ between files and are listed under the tables
SHARED = ("samples", "max_length", "calibration_samples", "sparsity", "population", "elites", "generations", "batch_size")


def append(path: str | Path, row: dict) -> None:
    """Append one row as one line, flushed to disk before the next search starts; the file is checked again first
    (`check_writable`), so what replaced it since the run started is refused, not appended to."""
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ValueError(f"a work row lacks {missing}")
    line = json.dumps(row, sort_keys=True) + "\n"
    with open(check_writable(path), "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def check_writable(path: str | Path) -> Path:
    """The `--out` file, resolved (symlinks, `..`), refused before any model is built where it cannot be appended to
    or holds anything but work rows: a row is never appended to a file that is not ours."""
    path = Path(path).resolve()
    if path.is_dir():
        raise DataError(f"--out {str(path)!r} is a directory: give a file path such as {str(path / 'rows.jsonl')!r}")
    if not path.parent.is_dir():
        raise DataError(f"--out {str(path)!r}: its folder {str(path.parent)!r} does not exist; create it first")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise DataError(f"--out {str(path)!r} is not writable: choose a path you can write")
    if path.exists() and path.stat().st_size:
        try:
            read([path])
        except DataError as e:
            raise DataError(f"--out {str(path)!r} is not a file of work rows ({e}): choose a new path") from None
    return path


def read(paths: Sequence[str | Path]) -> list[dict]:
    """Rows of all files, later ones replacing earlier ones of the same (world, criterion, seed, method)."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(f"cannot read work rows {str(path)!r}: {e.strerror}; give a JSONL file that --out wrote") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(
                    f"{path}:{number} is not a JSON row ({line[:40]!r}...; a run stopped while writing it?): delete that line"
                ) from None
            missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
            if missing:
                raise DataError(f"{path}:{number} lacks {missing}: not a row of bench_candidate_work --out")
            if row["method"] not in METHODS:
                raise DataError(f"{path}:{number} has method {row['method']!r}, not one of {list(METHODS)}")
            rows[(row["world"], row["criterion"], row["seed"], row["method"])] = {**row, "source": str(path)}
    if not rows:
        raise DataError(f"no work rows in {[str(p) for p in paths]}: give the JSONL files that --out wrote")
    _check_shared(rows.values())
    return list(rows.values())


def _check_shared(rows: Iterable[dict]) -> None:
    seen: dict[str, dict] = {}
    for row in rows:
        first = seen.setdefault(row["world"], row)
        for key in SHARED:
            a, b = first["settings"].get(key), row["settings"].get(key)
            if a != b:
                raise DataError(
                    f"world {row['world']!r}: {key} is {a!r} in {first['source']} ({first['method']}) but {b!r} in "
                    f"{row['source']} ({row['method']}); rows compared in one table need the same settings: re-run "
                    "with the same ones or table the files apart"
                )


def pct(value: float) -> str:
    """A relative difference in percent; below 0.001% in two significant digits (the OLMoE shape's ESAP differences)."""
    if math.isnan(value):
        return "n/a"
    return f"{value:+.1e}%" if 0 < abs(value) < 1e-3 else f"{value:+.3f}%"


def tables(rows: Sequence[dict]) -> str:
    """Per world: a summary by criterion and method, then every search, as markdown."""
    by = {(r["world"], r["criterion"], r["seed"], r["method"]): r for r in rows}
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    lines: list[str] = []
    for world in worlds:
        mine = [r for r in rows if r["world"] == world]
        criteria = list(dict.fromkeys(r["criterion"] for r in mine))
        methods = [m for m in METHODS if any(r["method"] == m for r in mine)]

        def versus(r: dict, other: str) -> tuple[float, bool | None]:
            """(relative ESAP difference in %, same allocation) against `other`'s search of the same seed."""
            o = by.get((r["world"], r["criterion"], r["seed"], other))
            if o is None:
                return float("nan"), None
            return 100 * (r["esap"] - o["esap"]) / o["esap"], r["allocation"] == o["allocation"]

        def worse(r: dict, other: str) -> bool:
            diff, same = versus(r, other)
            return same is False and diff < 0

        lines += [f"#### {world}", ""]
        lines.append(
            "| criterion | method | searches | FFE / cand. | FFE / cand. whole search (est.) | s / cand. | full-set ESAP | "
            "vs exact: mean | worst | same allocation as exact | worse than exact | worse than racing |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for criterion in criteria:
            for method in methods:
                rs = sorted((r for r in mine if r["criterion"] == criterion and r["method"] == method), key=lambda r: r["seed"])
                if not rs:
                    continue
                diffs = [versus(r, "exact") for r in rs]
                known = [d for d, same in diffs if same is not None]
                racing = [versus(r, "racing") for r in rs]
                worst_racing = min((d for d, same in racing if same is False), default=0.0)
                n_racing = sum(same is not None for _, same in racing)
                lines.append(
                    f"| {criterion} | {method} | {len(rs)} | {_mean(r['ffe_per_candidate'] for r in rs):.3f} | "
                    f"{_mean(r['ffe_per_candidate_whole_search'] for r in rs):.3f} | "
                    f"{_mean(r['seconds_per_candidate'] for r in rs):.4f} | {_mean(r['esap'] for r in rs):.6f} | "
                    f"{pct(_mean(known))} | {pct(min(known, default=float('nan')))} | "
                    f"{sum(same is True for _, same in diffs)}/{len(known)} | {sum(worse(r, 'exact') for r in rs)}/{len(known)} | "
                    + ("-" if method == "racing" or not n_racing else f"{sum(worse(r, 'racing') for r in rs)}/{n_racing}")
                    + (f" (worst {pct(worst_racing)})" if method != "racing" and worst_racing < 0 else "")
                    + " |"
                )
        lines.append("")
        lines.append(
            "| criterion | seed | method | candidates | FFE / cand. | FFE / cand. whole search (est.) | s / cand. | "
            "final full-set ESAP | vs exact | same allocation as exact |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for criterion in criteria:
            seeds = sorted({r["seed"] for r in mine if r["criterion"] == criterion})
            for seed in seeds:
                for method in methods:
                    r = by.get((world, criterion, seed, method))
                    if r is None:
                        continue
                    diff, same = versus(r, "exact")
                    lines.append(
                        f"| {criterion} | {seed} | {method} | {r['candidates']} | {r['ffe_per_candidate']:.3f} | "
                        f"{r['ffe_per_candidate_whole_search']:.3f} | {r['seconds_per_candidate']:.4f} | {r['esap']:.6f} | "
                        f"{pct(diff)} | {'n/a' if same is None else 'yes' if same else 'no'} |"
                    )
        lines.append("")
        for method in methods:
            kinds = sorted({json.dumps(_own(r), sort_keys=True) for r in mine if r["method"] == method})
            lines.append(f"{method}: " + "; ".join(", ".join(f"{k} {v}" for k, v in json.loads(s).items()) for s in kinds))
        shared = mine[0]["settings"]
        lines.append("shared: " + ", ".join(f"{k} {shared.get(k)}" for k in SHARED))
        lines.append("")
    return "\n".join(lines)


def _own(row: dict) -> dict:
    """A row's settings beyond the shared ones (its method's parameters, the code's commit)."""
    return {k: v for k, v in row["settings"].items() if k not in SHARED}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
