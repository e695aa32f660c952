"""The quality-memory frontier: held-out ESAP against checkpoint bytes for the searched and uniform models of every
evaluated sparsity, one line per method and criterion (each criterion orders experts its own way, uniform's too),
the full model at the top right, the target and the chosen sparsity marked, and each release candidate coloured by
the gate's verdict. The picture a release manager decides from."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from evoesap.records import GateRecord, MetricsRecord, TargetRecord

METHODS = ("searched", "uniform")


def _bytes(metrics: MetricsRecord) -> int:
    """The checkpoint's stored bytes, else its parameter bytes (evaluations made before stored bytes were recorded)."""
    return metrics.memory.checkpoint_bytes or metrics.memory.parameter_bytes


Series = tuple[str, str | None]  # (method, criterion)


def points(runs: Sequence[MetricsRecord]) -> dict[Series, list[tuple[int, float, float]]]:
    """(method, criterion) -> (bytes, held-out ESAP, sparsity) of each unquantized pruned run that has held-out ESAP,
    by bytes; series by criterion, then searched before uniform."""
    found: dict[Series, list[tuple[int, float, float]]] = {}
    for m in runs:
        method = m.labels.method
        if method in METHODS and m.heldout_esap is not None and m.labels.sparsity is not None and m.quantization is None:
            point = (_bytes(m), m.heldout_esap.esap, float(m.labels.sparsity))
            found.setdefault((method, m.labels.criterion), []).append(point)
    order = sorted(found, key=lambda k: (k[1] or "", METHODS.index(k[0])))
    return {key: sorted(found[key]) for key in order}


def figure(
    runs: Sequence[MetricsRecord], verdicts: Sequence[GateRecord] = (), targets: Sequence[TargetRecord] = ()
) -> Figure | None:
    """The frontier, or None when no pruned run has held-out ESAP (nothing to draw)."""
    series = points(runs)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(criterion for _, criterion in series))}
    for (method, criterion), values in series.items():
        xs, ys = [v[0] for v in values], [v[1] for v in values]
        style = "-" if method == "searched" else "--"
        label = method if criterion is None else f"{method} ({criterion})"
        ax.plot(xs, ys, marker="o", linestyle=style, color=colours[criterion], label=label)
        for x, y, sparsity in values:
            ax.annotate(f"{sparsity:.0%}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    full = [m for m in runs if m.labels.method == "full" and m.heldout_esap is not None]
    if full:
        ax.scatter([_bytes(full[0])], [full[0].heldout_esap.esap], marker="*", s=120, color="black", label="full")
    by_model = {m.model: m for m in runs}
    for verdict in verdicts:
        judged = by_model.get(verdict.candidate)
        if judged is not None and judged.heldout_esap is not None:
            colour, word = ("tab:green", "gate passed") if verdict.passed else ("tab:red", "gate failed")
            ax.scatter([_bytes(judged)], [judged.heldout_esap.esap], s=220, facecolors="none", edgecolors=colour,
                       linewidths=2, label=word)  # fmt: skip
        for check in verdict.checks:
            if check.name == "held-out ESAP":
                # dots over the target's dashes, labelled above at the left: both stay visible on the same value
                ax.axhline(check.limit, color="tab:red", linestyle=":", linewidth=1.5, zorder=3,
                           label="gate: least held-out ESAP")  # fmt: skip
                _line_label(ax, check.limit, f"gate {check.limit:g}", "tab:red", above=True)
    for target in targets:
        if target.threshold is not None:  # a gate target's goal is the gate's checks, drawn with the verdicts
            ax.axhline(target.threshold, color="tab:purple", linestyle="-.", linewidth=1, label=f"target ({target.criterion})")
            _line_label(ax, target.threshold, f"target {target.threshold:g} ({target.criterion})", "tab:purple", above=False)
        searched = series.get(("searched", target.criterion), [])
        chosen = [v for v in searched if target.chosen is not None and abs(v[2] - target.chosen) < 1e-9]
        if chosen:
            ax.scatter([chosen[0][0]], [chosen[0][1]], marker="D", s=90, color="tab:purple", label="chosen sparsity")
    ax.set_xlabel("Checkpoint size")
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))  # 10 MB, not 1e7
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))  # "1.02 MB"-wide labels: at most 6 fit the axis side by side
    ax.set_ylabel("Held-out ESAP")
    ax.set_title("Quality against memory")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per label
    ax.legend(unique.values(), unique.keys(), fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def _line_label(ax: plt.Axes, y: float, text: str, colour: str, *, above: bool) -> None:
    """Name a horizontal line on the plot: above it at the left, or below it at the right (two lines at one value
    keep both names apart)."""
    ax.annotate(
        text, (0.01 if above else 0.99, y), xycoords=("axes fraction", "data"), textcoords="offset points",
        xytext=(0, 3 if above else -3), ha="left" if above else "right", va="bottom" if above else "top",
        fontsize="x-small", color=colour,
    )  # fmt: skip
