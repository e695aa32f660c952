"""The quality-memory frontier: held-out ESAP against checkpoint bytes for the searched and uniform models of every
evaluated sparsity, one line per method and criterion (each criterion orders experts its own way, uniform's too),
the full model at the top right, the target, its probes and the chosen sparsity marked, and each release candidate
coloured by the gate's verdict. The picture a release manager decides from."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
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
        label = method if criterion is None else f"{method} ({criterion})"
        # searched: filled dots; uniform: hollow squares around them, so a point where both coincide shows both
        marker = (
            dict(marker="o", markersize=6) if method == "searched" else dict(marker="s", markersize=10, markerfacecolor="none")
        )
        style = "-" if method == "searched" else "--"
        ax.plot(xs, ys, linestyle=style, color=colours[criterion], label=label, **marker)
    column: dict[tuple[int, float], float] = {}  # each size's sparsity named once, over its highest point: the searched
    for values in series.values():  # and uniform points of one sparsity share a size (a target run's, every criterion's)
        for x, y, sparsity in values:
            column[(x, sparsity)] = max(y, column.get((x, sparsity), y))
    for (x, sparsity), y in column.items():
        ax.annotate(_pct(sparsity), (x, y), textcoords="offset points", xytext=(5, 5), fontsize="x-small")
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
    thresholds: dict[float, list[str]] = {}  # one line and one name per threshold, however many criteria share it
    for target in targets:
        if target.threshold is not None:  # a gate target's goal is the gate's checks, drawn with the verdicts
            thresholds.setdefault(target.threshold, []).append(target.criterion)
    for threshold, criteria in thresholds.items():
        named = ", ".join(criteria)
        ax.axhline(threshold, color="tab:purple", linestyle="-.", linewidth=1, label=f"target ({named})")
        _line_label(ax, threshold, f"target {threshold:g} ({named})", "tab:purple", above=False)
    per_expert = _bytes_per_expert(runs)
    for target in targets:
        searched = series.get(("searched", target.criterion), [])
        chosen = [v for v in searched if target.chosen is not None and abs(v[2] - target.chosen) < 1e-9]
        if chosen:  # a ring around the evaluated point, which stays visible inside it
            ax.scatter([chosen[0][0]], [chosen[0][1]], marker="D", s=200, facecolors="none", edgecolors="tab:purple",
                       linewidths=2, zorder=4, label="chosen sparsity")  # fmt: skip
        if per_expert is not None and full:
            _probes(ax, target, _bytes(full[0]), per_expert, colours.get(target.criterion, "tab:purple"), searched)
    if any(target.probes for target in targets) and per_expert is not None and full:
        for marker, word in (("^", "meets"), ("v", "misses")):
            ax.add_line(Line2D([], [], marker=marker, linestyle="none", markerfacecolor="none", color="grey",
                               label=f"target probe: {word}"))  # fmt: skip
    ax.margins(x=0.1, y=0.08)  # room for the names beside the outermost points, inside the axes
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


def _bytes_per_expert(runs: Sequence[MetricsRecord]) -> float | None:
    """Checkpoint bytes one removed routed expert saves, from the full model's evaluation and the pruned ones' (the mean
    over the pruned runs); None when no run says (no full model, or no pruned run that removed experts)."""
    full = next((m for m in runs if m.labels.method == "full"), None)
    if full is None:
        return None
    experts = sum(full.experts.num_experts)
    saved = [
        (_bytes(full) - _bytes(m)) / (experts - sum(m.experts.num_experts))
        for m in runs
        if m.labels.method in METHODS and m.quantization is None and sum(m.experts.num_experts) < experts
    ]
    return sum(saved) / len(saved) if saved else None


def _probes(
    ax: plt.Axes, target: TargetRecord, full_bytes: int, per_expert: float, colour: str, searched: list[tuple[int, float, float]]
) -> None:
    """The target's probes at their held-out values: hollow triangles, up where a probe met the threshold, down where
    it missed; their size estimated from the experts each removed (its budget) at the evaluated runs' bytes per
    expert, since only the chosen sparsity is pruned and evaluated. A probe at an evaluated sparsity keeps its
    point's sparsity label; the others are named by theirs, and by their criterion when it has no evaluated point (a
    criterion the choice of criterion did not choose)."""
    evaluated = {round(v[2], 9) for v in searched}
    named = "" if searched else f"{target.criterion} "
    for probe in target.probes:
        if probe.heldout is None:
            continue
        x = full_bytes - probe.budget * per_expert
        ax.scatter([x], [probe.heldout], marker="^" if probe.meets else "v", s=60, facecolors="none", edgecolors=colour,
                   linewidths=1.5, zorder=3, gid=f"probe {'meets' if probe.meets else 'misses'}")  # fmt: skip
        if round(probe.sparsity, 9) not in evaluated:
            ax.annotate(named + _pct(probe.sparsity), (x, probe.heldout), textcoords="offset points", xytext=(7, 0),
                        va="center", fontsize="x-small", color=colour)  # fmt: skip


def _pct(sparsity: float) -> str:
    """25%, 37.5%: a grid sparsity as exact as one decimal of a percent shows it."""
    return f"{sparsity:.1%}".replace(".0%", "%")


def _line_label(ax: plt.Axes, y: float, text: str, colour: str, *, above: bool) -> None:
    """Name a horizontal line on the plot: above it at the left, or below it at the right (two lines at one value
    keep both names apart)."""
    ax.annotate(
        text, (0.01 if above else 0.99, y), xycoords=("axes fraction", "data"), textcoords="offset points",
        xytext=(0, 3 if above else -3), ha="left" if above else "right", va="bottom" if above else "top",
        fontsize="x-small", color=colour,
    )  # fmt: skip
