"""Tables and plots from evaluate runs and search histories, shaped like the paper's Table 2 and Figure 1.

Everything here works on plain data (metrics dicts, allocations, history tables); reading artifacts is
the stage's job. Figure builders return matplotlib Figures (Agg) so tests can inspect what they draw.
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from evoesap.errors import DataError  # noqa: E402

METHOD_ORDER = ("full", "uniform", "frequency", "searched")
PAIR = ("uniform", "searched")  # bolded against each other; deltas are searched - uniform


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column: a task's primary metric, or the average of a domain's tasks."""

    domain: str
    task: str | None  # None: the domain average
    metric: str | None = None

    @property
    def header(self) -> str:
        return f"{self.domain} Avg" if self.task is None else f"{self.task} ({self.metric})"


@dataclasses.dataclass(frozen=True)
class Row:
    """One run in the table."""

    sparsity: float | None
    criterion: str | None
    method: str
    values: dict[Column, float]
    source: str  # the run's URI, so a reader can trace a number to its metrics.json
    bold: frozenset[Column] = frozenset()


def primary_values(metrics: Mapping[str, Any]) -> dict[tuple[str, str], tuple[str, float]]:
    """(domain, task) -> (metric, value) of each task's primary metric in a metrics.json."""
    out = {}
    for record in metrics["records"]:
        if record.get("primary"):
            out[(record["domain"], record["task"])] = (record["metric"], float(record["value"]))
    return out


def columns(runs: Sequence[Mapping[str, Any]]) -> list[Column]:
    """Task columns grouped by domain in first-seen order, each domain followed by its average when it has 2+ tasks."""
    by_domain: dict[str, dict[str, str]] = {}
    for metrics in runs:
        for (domain, task), (metric, _) in primary_values(metrics).items():
            by_domain.setdefault(domain, {}).setdefault(task, metric)
    cols: list[Column] = []
    for domain, tasks in by_domain.items():
        cols += [Column(domain, task, metric) for task, metric in tasks.items()]
        if len(tasks) > 1:
            cols.append(Column(domain, None))
    return cols


def _method(metrics: Mapping[str, Any]) -> str:
    return str(metrics.get("labels", {}).get("method") or "run")


def build_rows(runs: Sequence[Mapping[str, Any]], sources: Sequence[str], cols: Sequence[Column]) -> list[Row]:
    """Rows in table order (full first, then by sparsity and criterion, uniform before searched), with bold marks."""
    rows = []
    for metrics, source in zip(runs, sources):
        prim = primary_values(metrics)
        values: dict[Column, float] = {}
        for col in cols:
            if col.task is not None:
                if (col.domain, col.task) in prim:
                    values[col] = prim[(col.domain, col.task)][1]
            else:
                members = [prim[(c.domain, c.task)][1] for c in cols if c.domain == col.domain and c.task and (c.domain, c.task) in prim]
                task_count = sum(1 for c in cols if c.domain == col.domain and c.task)
                if members and len(members) == task_count:
                    values[col] = sum(members) / len(members)
        labels = metrics.get("labels", {})
        sparsity = labels.get("sparsity")
        rows.append(Row(None if sparsity is None else float(sparsity), labels.get("criterion"), _method(metrics), values, source))
    rows.sort(key=_row_key)
    return _mark_better(rows, cols)


def _row_key(row: Row) -> tuple:
    method_rank = METHOD_ORDER.index(row.method) if row.method in METHOD_ORDER else len(METHOD_ORDER)
    return (row.method != "full", row.sparsity or 0.0, row.criterion or "", method_rank, row.method)


def _pairs(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """Indices of (uniform, searched) rows that share sparsity and criterion."""
    pairs = []
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            if (a.method, b.method) == PAIR and (a.sparsity, a.criterion) == (b.sparsity, b.criterion):
                pairs.append((i, j))
    return pairs


def _mark_better(rows: list[Row], cols: Sequence[Column]) -> list[Row]:
    bold: dict[int, set[Column]] = {i: set() for i in range(len(rows))}
    for i, j in _pairs(rows):
        for col in cols:
            a, b = rows[i].values.get(col), rows[j].values.get(col)
            if a is None or b is None:
                continue
            if a >= b:
                bold[i].add(col)
            if b >= a:
                bold[j].add(col)
    return [dataclasses.replace(row, bold=frozenset(bold[i])) for i, row in enumerate(rows)]


def deltas(rows: Sequence[Row], cols: Sequence[Column]) -> dict[int, dict[Column, float]]:
    """Searched minus uniform per column, keyed by the searched row's index."""
    out = {}
    for i, j in _pairs(rows):
        out[j] = {c: rows[j].values[c] - rows[i].values[c] for c in cols if c in rows[i].values and c in rows[j].values}
    return out


def _fmt(value: float | None, digits: int) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _sparsity(value: float | None) -> str:
    return "–" if value is None else f"{float(value):.0%}"


def table_cells(rows: Sequence[Row], cols: Sequence[Column], digits: int) -> list[tuple[list[str], list[tuple[str, bool]]]]:
    """(label cells, [(value text, bold)]) per table line; a Δ line follows each searched row with a uniform partner."""
    diff = deltas(rows, cols)
    lines = []
    for i, row in enumerate(rows):
        label = ["Full", "", ""] if row.method == "full" else [_sparsity(row.sparsity), row.criterion or "–", row.method]
        lines.append((label, [(_fmt(row.values.get(c), digits), c in row.bold) for c in cols]))
        if i in diff:
            cells = [(f"{diff[i][c]:+.{digits}f}" if c in diff[i] else "–", False) for c in cols]
            lines.append(([_sparsity(row.sparsity), row.criterion or "–", "Δ vs uniform"], cells))
    return lines


def markdown_table(rows: Sequence[Row], cols: Sequence[Column], digits: int = 3) -> str:
    header = ["Sparsity", "Criterion", "Method", *[c.header for c in cols]]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, cells in table_cells(rows, cols, digits):
        values = [f"**{text}**" if bold else text for text, bold in cells]
        out.append("| " + " | ".join([*label, *values]) + " |")
    return "\n".join(out)


def html_table(rows: Sequence[Row], cols: Sequence[Column], digits: int = 3) -> str:
    header = "".join(f"<th>{html.escape(h)}</th>" for h in ["Sparsity", "Criterion", "Method", *[c.header for c in cols]])
    body = []
    for label, cells in table_cells(rows, cols, digits):
        tds = [f"<td>{html.escape(text)}</td>" for text in label]
        tds += [f"<td><b>{html.escape(text)}</b></td>" if bold else f"<td>{html.escape(text)}</td>" for text, bold in cells]
        body.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table>\n<tr>{header}</tr>\n" + "\n".join(body) + "\n</table>"


def _label(metrics: Mapping[str, Any]) -> str:
    labels = metrics.get("labels", {})
    if _method(metrics) == "full":
        return "Full"
    return " ".join(str(v) for v in (_sparsity(labels.get("sparsity")), labels.get("criterion"), _method(metrics)) if v)


def memory_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per run in table order: parameters, bytes, bf16 size, saving against the full run's bf16 size, held-out ESAP."""
    full = [m for m in runs if _method(m) == "full"]
    full_bf16 = full[0]["memory"]["bf16_bytes"] if full else None
    keyed = [(_row_key(Row(m.get("labels", {}).get("sparsity"), m.get("labels", {}).get("criterion"), _method(m), {}, "")), i) for i, m in enumerate(runs)]
    out = []
    for _, i in sorted(keyed):
        memory = runs[i]["memory"]
        out.append(
            {
                "run": _label(runs[i]),
                "parameters": memory["parameters"],
                "parameter_bytes": memory["parameter_bytes"],
                "bf16_bytes": memory["bf16_bytes"],
                "saving": None if not full_bf16 else 1 - memory["bf16_bytes"] / full_bf16,
                "heldout_esap": (runs[i].get("heldout_esap") or {}).get("esap"),
            }
        )
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.3f} MiB"


def memory_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    out = [
        "| Run | Parameters | Parameter bytes | bf16 size | Saving vs full | Held-out ESAP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        saving = "–" if r["saving"] is None else f"{r['saving']:.1%}"
        esap = "–" if r["heldout_esap"] is None else f"{r['heldout_esap']:.4f}"
        out.append(f"| {r['run']} | {r['parameters']:,} | {r['parameter_bytes']:,} | {_gib(r['bf16_bytes'])} | {saving} | {esap} |")
    return "\n".join(out)


def density_figure(allocations: Mapping[str, tuple[Sequence[int], Sequence[int]]], title: str = "") -> Figure:
    """The paper's Figure 1: one panel per allocation, one bar per MoE layer at density 1 - r_l / n_l."""
    if not allocations:
        raise DataError("no allocations to plot")
    fig, axes = plt.subplots(1, len(allocations), figsize=(4 * len(allocations), 3), sharey=True, squeeze=False)
    for ax, (label, (removed, experts)) in zip(axes[0], allocations.items()):
        if len(removed) != len(experts):
            raise DataError(f"allocation {label!r} has {len(removed)} layers but the model has {len(experts)} MoE layers")
        density = [1 - r / n for r, n in zip(removed, experts)]
        ax.bar(range(len(density)), density, color="tab:blue")
        ax.set_title(f"{label} (mean {sum(density) / len(density):.2f})")
        ax.set_xlabel("MoE layer")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("Expert density (1 - r/n)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def search_curve_figure(histories: Mapping[str, pd.DataFrame]) -> Figure:
    """Best-so-far and mean fitness per generation for each search."""
    if not histories:
        raise DataError("no search histories to plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, history in histories.items():
        curve = search_curve(history)
        line = ax.plot(curve.index, curve["best"], label=f"{label} best")[0]
        ax.plot(curve.index, curve["mean"], linestyle="--", color=line.get_color(), label=f"{label} mean")
    ax.set_xlabel("Generation")
    ax.set_ylabel("Fitness")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def search_curve(history: pd.DataFrame) -> pd.DataFrame:
    """Per generation: the best fitness seen so far and the mean fitness of that generation's candidates."""
    missing = {"generation", "fitness"} - set(history.columns)
    if missing:
        raise DataError(f"search history lacks column(s) {', '.join(sorted(missing))}; has {', '.join(history.columns)}")
    per_gen = history.groupby("generation")["fitness"]
    return pd.DataFrame({"best": per_gen.max().cummax(), "mean": per_gen.mean()})
