"""Tables and plots from evaluate runs and search histories, shaped like the paper's Table 2 and Figure 1.

Everything here works on records already read (`MetricsRecord`, `AllocationRecord`) and history tables; reading
artifacts is the stage's job, laying the page out is the templates' (`evoesap.reporting.render`). Tables are
`Table`s of text cells; figure builders return matplotlib Figures (Agg) so tests can inspect what they draw.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from evoesap.errors import DataError  # noqa: E402
from evoesap.records import AllocationRecord, HeldoutCheck, MetricsRecord  # noqa: E402

if TYPE_CHECKING:
    from evoesap.store.lineage import Node, Source

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


@dataclasses.dataclass(frozen=True)
class Cell:
    text: str
    style: str = ""  # "", "bold" or "code"


@dataclasses.dataclass(frozen=True)
class Table:
    """Header, lines of cells and each column's alignment; the templates turn it into Markdown (and so HTML)."""

    header: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    align: tuple[str, ...]  # "left" or "right" per column


def primary_stderrs(metrics: MetricsRecord) -> dict[str, float]:
    """task -> standard error of its primary metric in a metrics.json, where lm-eval gave one."""
    return {r.task: float(r.stderr) for r in metrics.primary() if r.stderr is not None}


def clear_differences(uniform: MetricsRecord, searched: MetricsRecord) -> tuple[tuple[str, float], ...] | None:
    """(task, searched - uniform) for each task whose difference exceeds two standard errors of the difference,
    sqrt(se_u^2 + se_s^2) (unpaired: conservative where the two runs' per-sample scores correlate); None when
    no task of both runs has standard errors."""
    values = [{t: v for (_, t), (_, v) in primary_values(m).items()} for m in (uniform, searched)]
    errors = [primary_stderrs(m) for m in (uniform, searched)]
    tasks = sorted(set(values[0]) & set(values[1]) & set(errors[0]) & set(errors[1]))
    if not tasks:
        return None
    diffs = {t: values[1][t] - values[0][t] for t in tasks}
    return tuple((t, d) for t, d in diffs.items() if abs(d) > 2 * math.hypot(errors[0][t], errors[1][t]))


def primary_values(metrics: MetricsRecord) -> dict[tuple[str, str], tuple[str, float]]:
    """(domain, task) -> (metric, value) of each task's primary metric in a metrics.json."""
    return {(r.domain, r.task): (r.metric, float(r.value)) for r in metrics.primary()}


def columns(runs: Sequence[MetricsRecord]) -> list[Column]:
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


def _method(metrics: MetricsRecord) -> str:
    """The run's method label; a quantized model's names its recipe too (`searched + w4a16-gptq`), so it gets a row
    of its own beside the model it was quantized from and never stands in for it."""
    method = str(metrics.labels.method or "run")
    quantized = metrics.quantization
    return f"{method} + {quantized.recipe or quantized.scheme}" if quantized else method


def build_rows(runs: Sequence[MetricsRecord], sources: Sequence[str], cols: Sequence[Column]) -> list[Row]:
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
                members = [
                    prim[(c.domain, c.task)][1] for c in cols if c.domain == col.domain and c.task and (c.domain, c.task) in prim
                ]
                task_count = sum(1 for c in cols if c.domain == col.domain and c.task)
                if members and len(members) == task_count:
                    values[col] = sum(members) / len(members)
        sparsity = metrics.labels.sparsity
        rows.append(
            Row(None if sparsity is None else float(sparsity), metrics.labels.criterion, _method(metrics), values, source)
        )
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


def benchmark_table(rows: Sequence[Row], cols: Sequence[Column], digits: int = 3) -> Table:
    """The paper's Table 2: a line per run (bold: the better of each uniform/searched pair) and Δ lines."""
    lines = [
        tuple(Cell(text) for text in label) + tuple(Cell(text, "bold" if bold else "") for text, bold in cells)
        for label, cells in table_cells(rows, cols, digits)
    ]
    return Table(
        ("Sparsity", "Criterion", "Method", *[c.header for c in cols]), tuple(lines), ("left",) * 3 + ("right",) * len(cols)
    )


def run_label(metrics: MetricsRecord) -> str:
    """ "Full" or "25% reap searched": how tables name a run."""
    if _method(metrics) == "full":
        return "Full"
    labels = metrics.labels
    return " ".join(str(v) for v in (_sparsity(labels.sparsity), labels.criterion, _method(metrics)) if v)


def memory_rows(runs: Sequence[MetricsRecord]) -> list[dict[str, Any]]:
    """Per run in table order: parameters, bytes, bf16 size, saving against the full run's bf16 size, held-out ESAP."""
    full = [m for m in runs if _method(m) == "full"]
    full_bf16 = full[0].memory.bf16_bytes if full else None
    full_stored = full[0].memory.checkpoint_bytes if full else None
    keyed = [(_row_key(Row(m.labels.sparsity, m.labels.criterion, _method(m), {}, "")), i) for i, m in enumerate(runs)]
    out = []
    for _, i in sorted(keyed):
        memory, esap = runs[i].memory, runs[i].heldout_esap
        stored = memory.checkpoint_bytes  # None: evaluated before it was recorded, or a hub model not cached
        out.append(
            {
                "run": run_label(runs[i]),
                "parameters": memory.parameters,
                "parameter_bytes": memory.parameter_bytes,
                "bf16_bytes": memory.bf16_bytes,
                "saving": None if not full_bf16 else 1 - memory.bf16_bytes / full_bf16,
                "checkpoint_bytes": stored,
                "checkpoint_saving": None if not full_stored or stored is None else 1 - stored / full_stored,
                "heldout_esap": None if esap is None else esap.esap,
            }
        )
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.3f} MiB"


def memory_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """Per run: parameters and bytes as loaded, the bf16 size and its saving, the checkpoint's stored bytes (what a
    quantized model shrinks) and their saving, held-out ESAP."""
    lines = []
    for r in rows:
        saving = "–" if r["saving"] is None else f"{r['saving']:.1%}"
        esap = "–" if r["heldout_esap"] is None else f"{r['heldout_esap']:.4f}"
        stored = "–" if r.get("checkpoint_bytes") is None else f"{r['checkpoint_bytes']:,}"
        stored_saving = "–" if r.get("checkpoint_saving") is None else f"{r['checkpoint_saving']:.1%}"
        cells = (r["run"], f"{r['parameters']:,}", f"{r['parameter_bytes']:,}", _gib(r["bf16_bytes"]), saving)
        lines.append(tuple(Cell(t) for t in (*cells, stored, stored_saving, esap)))
    header = (
        "Run",
        "Parameters",
        "Parameter bytes",
        "bf16 size",
        "Saving vs full",
        "Checkpoint bytes",
        "Checkpoint saving",
        "Held-out ESAP",
    )
    return Table(header, tuple(lines), ("left",) + ("right",) * 7)


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
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
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
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, history in histories.items():
        curve = search_curve(history)
        line = ax.plot(curve.index, curve["best"], label=f"{label} best")[0]
        ax.plot(curve.index, curve["mean"], linestyle="--", color=line.get_color(), label=f"{label} mean")
    ax.set_xlabel("Generation")
    ax.set_ylabel("Fitness")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes, never over a curve
    fig.tight_layout()
    return fig


def search_curve(history: pd.DataFrame) -> pd.DataFrame:
    """Per generation: the best fitness seen so far and the mean fitness of that generation's candidates."""
    missing = {"generation", "fitness"} - set(history.columns)
    if missing:
        raise DataError(f"search history lacks column(s) {', '.join(sorted(missing))}; has {', '.join(history.columns)}")
    per_gen = history.groupby("generation")["fitness"]
    return pd.DataFrame({"best": per_gen.max().cummax(), "mean": per_gen.mean()})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One criterion x sparsity: what a release manager decides on, searched against uniform."""

    sparsity: float
    criterion: str
    metric: str | None  # fitness of the held-out check (esap unless the search used another)
    heldout: HeldoutCheck | None  # the search's held-out check
    fallback_applied: bool | None  # None: no search artifact given for this setting
    task_delta: float | None  # mean over tasks of searched - uniform (primary metrics)
    clear_tasks: tuple[tuple[str, float], ...] | None  # (task, searched - uniform) beyond 2 SE; None: no SEs to judge
    memory_saved: float | None  # share of the full model's bf16 size the pruned model saves
    memory_saved_bytes: int | None
    warnings: tuple[str, ...]


def settings(runs: Sequence[MetricsRecord], searches: Sequence[AllocationRecord]) -> list[Setting]:
    """Every criterion x sparsity that has a search or a uniform/searched run pair."""
    by_key: dict[tuple[float, str], dict[str, MetricsRecord]] = {}
    for metrics in runs:
        labels = metrics.labels
        if labels.sparsity is not None and _method(metrics) in PAIR:
            by_key.setdefault((float(labels.sparsity), str(labels.criterion or "")), {})[_method(metrics)] = metrics
    found = {(float(s.sparsity), s.criterion): s for s in searches}
    full = [m for m in runs if _method(m) == "full"]
    out = []
    for key in sorted(set(by_key) | set(found)):
        pair, search = by_key.get(key, {}), found.get(key)
        prims = [{t: v for t, (_, v) in primary_values(pair[m]).items()} for m in PAIR if m in pair]
        shared = sorted(set(prims[0]) & set(prims[1])) if len(prims) == 2 else []
        pruned = pair.get("searched") or pair.get("uniform")
        saved = full[0].memory.bf16_bytes - pruned.memory.bf16_bytes if full and pruned else None
        out.append(
            Setting(
                sparsity=key[0],
                criterion=key[1],
                metric=search.metric if search else None,
                heldout=search.heldout if search else None,
                fallback_applied=bool(search.fallback_applied) if search else None,
                task_delta=sum(prims[1][t] - prims[0][t] for t in shared) / len(shared) if shared else None,
                clear_tasks=clear_differences(pair["uniform"], pair["searched"]) if len(prims) == 2 else None,
                memory_saved=None if saved is None else saved / full[0].memory.bf16_bytes,
                memory_saved_bytes=saved,
                warnings=tuple(search.warnings or ()) if search else (),
            )
        )
    return out


def _signed(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _fine(value: float | None, sign: str = "") -> str:
    """4 decimals, or 2 significant digits when smaller than that shows (a held-out ESAP gap can be 1e-6)."""
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:{sign}.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:{sign}.1e}"


def summary_table(rows: Sequence[Setting], digits: int = 3) -> Table:
    """Per setting: held-out fitness of searched and uniform, their paired difference and standard error, whether
    the difference clears two standard errors, whether the search fell back to uniform, the task-average Δ, memory saved."""
    lines = []
    for s in rows:
        check = s.heldout
        passed = None if check is None else check.beats_uniform
        searched, uniform, difference, stderr = (
            (None,) * 4 if check is None else (check.searched, check.uniform, check.difference, check.stderr)
        )
        lines.append(
            (
                Cell(_sparsity(s.sparsity)),
                Cell(s.criterion or "–"),
                Cell(s.metric or "–"),
                Cell(_fmt(searched, 4)),
                Cell(_fmt(uniform, 4)),
                Cell(_fine(difference, "+")),
                Cell(_fine(stderr)),
                Cell("–" if check is None else str(check.samples)),
                Cell("–" if passed is None else "passed" if passed else "failed", "" if passed is not False else "bold"),
                Cell(
                    "–" if s.fallback_applied is None else "applied" if s.fallback_applied else "no",
                    "bold" if s.fallback_applied else "",
                ),
                Cell(_signed(s.task_delta, digits)),
                Cell(_clear(s.clear_tasks, digits)),
                Cell("–" if s.memory_saved is None else f"{s.memory_saved:.1%} ({_gib(s.memory_saved_bytes)})"),
            )
        )
    header = (
        "Sparsity",
        "Criterion",
        "Held-out metric",
        "Searched",
        "Uniform",
        "Difference",
        "Std. error",
        "Samples",
        "Check (diff > 2 SE)",
        "Fallback to uniform",
        "Task avg Δ",
        "Tasks Δ > 2 SE",
        "Memory saved vs full",
    )
    return Table(header, tuple(lines), ("left",) * 3 + ("right",) * 5 + ("left",) * 2 + ("right", "left", "right"))


def _clear(tasks: tuple[tuple[str, float], ...] | None, digits: int) -> str:
    """`math +0.312, facts −0.250`, `none`, or `–` when the runs carry no standard errors."""
    if tasks is None:
        return "–"
    return ", ".join(f"{t} {d:+.{digits}f}" for t, d in tasks) or "none"


def headline(rows: Sequence[Setting]) -> str:
    """One sentence: in how many settings the search beat uniform on held-out data and on the tasks."""
    checked = [s.heldout for s in rows if s.heldout is not None]
    beat = sum(check.beats_uniform for check in checked)
    deltas = [s.task_delta for s in rows if s.task_delta is not None]
    parts = []
    if checked:
        parts.append(f"the searched allocation beats uniform on held-out data in {beat} of {len(checked)} settings")
    if deltas:
        parts.append(f"it raises the task average in {sum(d > 0 for d in deltas)} of {len(deltas)}")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] + "." if text else ""


def sources_table(sources: Sequence[Source]) -> Table:
    """The model and data sets at the roots of the lineage, by URI and content identity."""
    lines = [(Cell(s.name), Cell(s.uri, "code"), Cell(s.identity or "– (URI only)"), Cell("; ".join(s.read_by))) for s in sources]
    return Table(("Input", "URI", "Content identity", "Read by"), tuple(lines), ("left",) * 4)


def configuration_table(stages: Sequence[tuple[str, Mapping[str, Sequence[str]]]]) -> Table:
    """Each stage's parameters; a parameter that differs between its artifacts lists every value."""
    lines = []
    for stage, params in stages:
        text = ", ".join(f"{k}={v[0]}" if len(v) == 1 else f"{k} in {{{', '.join(v)}}}" for k, v in params.items())
        lines.append((Cell(stage), Cell(text)))
    return Table(("Stage", "Parameters"), tuple(lines), ("left", "left"))


def software_table(builds: Sequence[tuple[str, str | None, Sequence[str]]]) -> Table:
    lines = [
        (Cell(version), Cell(commit or "unknown", "code" if commit else ""), Cell(", ".join(stages)))
        for version, commit, stages in builds
    ]
    return Table(("Package version", "Git commit", "Stages"), tuple(lines), ("left",) * 3)


def artifacts_table(nodes: Sequence[Node], gives: Mapping[str, str]) -> Table:
    """Every artifact behind the page: what it gives the report (or how the DAG used it) and its content identity (which
    stays true of a reused report when an upstream artifact is made again from the same bytes, as its manifest would not)."""
    lines = [
        (
            Cell(n.uri, "code"),
            Cell(n.manifest.stage if n.manifest else "unreadable"),
            Cell(gives.get(n.uri) or _used_as(n)),
            Cell(n.content_sha256 or "–", "code" if n.content_sha256 else ""),
        )
        for n in nodes
    ]
    return Table(("Artifact", "Stage", "Gives", "Content sha256"), tuple(lines), ("left",) * 4)


def _used_as(node: Node) -> str:
    """ "scores of search (25% frequency, 25% reap); scores of prune (...)"."""
    return "; ".join(f"{edge} ({', '.join(sorted(settings))})" if settings else edge for edge, settings in node.used_as)
