"""The report stage: evaluate runs and search histories -> report.md (+ report.html) with PNG plots."""

from __future__ import annotations

import dataclasses
import io
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from evoesap import records
from evoesap.errors import ArtifactError, ConfigError, DataError
from evoesap.params import StageParams, keyed, param
from evoesap.reporting import report as rp
from evoesap.reporting.frontier import figure as frontier_figure
from evoesap.scoring.importance import read_scores
from evoesap.store import artifacts

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
HTML_FILE = "report.html"
SCORES_FILE = "scores.parquet"


@dataclasses.dataclass(frozen=True)
class ReportParams(StageParams):
    """How the report looks; what it says comes from its inputs."""

    title: str = param("EvoESAP report", "Title of the report.")
    digits: int = param(3, "Decimals in the benchmark table (the paper uses 3).", ge=1, le=8)
    html: bool = param(True, "Also write report.html.")


def _history(search_uri: str) -> tuple[str, pd.DataFrame, Mapping[str, Any]]:
    manifest = artifacts.read_manifest(search_uri, "search")
    history = pd.read_parquet(io.BytesIO(artifacts.read_payload(search_uri, records.HISTORY_FILE, manifest)))
    label = " ".join(str(v) for v in (manifest.params.get("criterion"), _pct(manifest.params.get("sparsity"))) if v is not None)
    return label or search_uri, history, manifest.params | {"_inputs": manifest.inputs}


def _pct(value: Any) -> str | None:
    return None if value is None else f"{float(value):.0%}"


def _frequency_allocation(search: Mapping[str, Any], experts: records.Experts) -> tuple[int, ...] | None:
    """The global frequency heuristic for a search's budget, from the scores that search used (None if unknown)."""
    from evoesap.method import allocation

    scores_uri = search["_inputs"].get("scores", {}).get("uri")
    if scores_uri is None or search.get("sparsity") is None:
        return None
    scores = read_scores(scores_uri)
    frequency = [group.sort_values("expert")["frequency"].tolist() for _, group in scores.groupby("layer", sort=True)]
    n, k = experts.num_experts, experts.top_k
    granularity = int(search.get("granularity", 1))
    budget = allocation.budget(float(search["sparsity"]), n, k, granularity)
    return allocation.frequency_global(frequency, n, k, budget, granularity)


def run_allocations(
    runs: Sequence[records.MetricsRecord], searches: Sequence[Mapping[str, Any]]
) -> dict[tuple[float, str], dict[str, tuple[Sequence[int], Sequence[int]]]]:
    """Per (sparsity, criterion): method -> (r, n), with r read off each run's expert counts against the full model.
    `searches`: the searches' parameters, for the frequency heuristic of the same budget."""
    full = [m for m in runs if m.labels.method == "full"]
    if not full:
        return {}
    n = list(full[0].experts.num_experts)
    groups: dict[tuple[float, str], dict[str, tuple[Sequence[int], Sequence[int]]]] = {}
    for metrics in runs:
        labels = metrics.labels
        if labels.method in (None, "full") or labels.sparsity is None or metrics.quantization:
            continue  # a quantized model keeps the experts of the one it was quantized from
        kept = metrics.experts.num_experts
        if len(kept) != len(n):
            raise DataError(f"run {metrics.model} has {len(kept)} MoE layers, the full model {len(n)}")
        key = (float(labels.sparsity), str(labels.criterion or ""))
        groups.setdefault(key, {})[labels.method] = ([a - b for a, b in zip(n, kept)], n)
    for search in searches:
        key = (float(search.get("sparsity") or 0.0), str(search.get("criterion") or ""))
        if key in groups and "frequency" not in groups[key]:
            r = _frequency_allocation(search, full[0].experts)
            if r is not None:
                groups[key]["frequency"] = (list(r), n)
    order = {m: i for i, m in enumerate(rp.METHOD_ORDER)}
    return {
        key: dict(sorted(methods.items(), key=lambda kv: order.get(kv[0], len(order)))) for key, methods in sorted(groups.items())
    }


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _allocation(uri: str, search_params: Mapping[str, Any]) -> records.AllocationRecord:
    """allocation.json of a search, with its warnings (searches made before they were recorded get them rebuilt)."""
    record = records.read(uri, records.AllocationRecord)
    if record.warnings is not None:
        return record
    check = record.heldout
    if check is None or not check.samples or check.beats_uniform:
        return dataclasses.replace(record, warnings=())
    warning = check.warning(record.metric or "esap", bool(search_params.get("fallback_to_uniform")))
    return dataclasses.replace(record, warnings=(warning,))


def check_one_base(runs: Sequence[str], metrics: Sequence[records.MetricsRecord]) -> None:
    """Refuse runs labelled full that are not, by content, the model every pruned or quantized run was made from: the
    report measures each run against the full model, so a wrong one would misstate every drop. Runs whose manifest
    records no model (metrics made elsewhere) are not checked."""
    from evoesap.store import lineage

    models = {uri: artifacts.read_manifest(uri, "evaluate").inputs.get("model") for uri in runs}
    full = [(uri, models[uri]) for uri, m in zip(runs, metrics) if m.labels.method == "full" and models[uri]]
    if not full:
        return
    base_uri, base = full[0][0], lineage.identity_of(full[0][1])
    for uri, entry in full[1:]:
        if lineage.identity_of(entry) != base:
            raise ConfigError(
                f"runs {artifacts.redact(base_uri)} and {artifacts.redact(uri)} are both labelled full but evaluated "
                "different models: give the evaluation of one full model"
            )
    for uri, m in zip(runs, metrics):
        if m.labels.method == "full" or not models[uri]:
            continue
        origin = lineage.model_origin(models[uri])
        if origin.through and origin.identity != base:
            raise ConfigError(
                f"run {artifacts.redact(uri)} was made from {origin.describe()}, not from the full model that "
                f"{artifacts.redact(base_uri)} evaluated ({full[0][1]['uri']}): give runs of one base model"
            )


def _decision(record: records.TargetRecord, decisions: Sequence[records.TargetRecord]) -> str:
    """The word heading a criterion's decision: CHOSEN or UNMET, and when the target chose among the criteria (a
    challenger has a `start`), CHOSEN for the best one only and NOT CHOSEN for the others."""
    from evoesap.planning.target import best

    if any(d.start is not None for d in decisions):
        return "CHOSEN" if record is best(decisions) else "NOT CHOSEN"
    return "CHOSEN" if record.chosen is not None else "UNMET"


def run_report(
    runs: list[str],
    params: ReportParams,
    out_uri: str,
    *,
    searches: Sequence[str] = (),
    gates: Sequence[str] = (),
    targets: Sequence[str] = (),
) -> artifacts.Manifest:
    """Write report.md (and a self-contained report.html): the gate's verdicts and the target's decisions first, then
    summary, benchmark and memory tables, plots, lineage."""
    from evoesap.registry import NAMES
    from evoesap.reporting import render
    from evoesap.store import lineage

    if not runs:
        raise ConfigError("give at least one evaluate run (--runs)")
    inputs = {
        **{f"runs.{i}": u for i, u in enumerate(runs)},
        **{f"searches.{i}": u for i, u in enumerate(searches)},
        **{f"gates.{i}": u for i, u in enumerate(gates)},
        **{f"targets.{i}": u for i, u in enumerate(targets)},
    }
    seen = artifacts.preflight(out_uri, "report", inputs)
    metrics = [records.read(uri, records.MetricsRecord) for uri in runs]
    check_one_base(runs, metrics)
    verdicts = [records.read(uri, records.GateRecord) for uri in gates]
    chosen = [records.read(uri, records.TargetRecord) for uri in targets]
    histories = [_history(uri) for uri in searches]
    found = [_allocation(uri, h[2]) for uri, h in zip(searches, histories)]
    traced = lineage.walk(inputs)
    with artifacts.stage_output(out_uri, "report", keyed(params), inputs, seen) as staging:
        cols = rp.columns(metrics)
        rows = rp.build_rows(metrics, [artifacts.redact(u) for u in runs], cols)
        settings = rp.settings(metrics, found)
        images: list[tuple[str, str]] = []
        frontier = frontier_figure(metrics, verdicts, chosen)
        if frontier is not None:
            _save(frontier, staging / "frontier.png")
            images.append(("Quality against memory: held-out ESAP and checkpoint bytes", "frontier.png"))
        try:
            allocations = run_allocations(metrics, [h[2] for h in histories])
        except (ArtifactError, DataError, KeyError) as exc:  # a search without usable scores still gets its curve
            log.warning("frequency-heuristic allocation unavailable: %s", exc)
            allocations = run_allocations(metrics, [])
        for (sparsity, criterion), methods in allocations.items():
            name = f"density_{re.sub(r'[^A-Za-z0-9._+-]', '_', criterion or 'run')}_{round(sparsity * 100)}.png"
            _save(rp.density_figure(methods, f"{criterion} at {sparsity:.0%} sparsity"), staging / name)
            images.append((f"Expert density per layer: {criterion}, {sparsity:.0%}", name))
        if histories:
            _save(rp.search_curve_figure({label: h for label, h, _ in histories}), staging / "search_curves.png")
            images.append(("Search curves", "search_curves.png"))
        gives = {artifacts.redact(u): f"Benchmarks and Memory: {rp.run_label(m)}" for u, m in zip(runs, metrics)}
        gives |= {artifacts.redact(u): f"Summary and plots: {label}" for u, (label, _, _) in zip(searches, histories)}
        context = {
            "title": params.title,
            "verdicts": [(v.passed, v.line()) for v in verdicts],
            "targets": [(_decision(t, chosen), f"{t.criterion}: {t.line()}") for t in chosen],
            "notes": _notes(metrics),
            "headline": rp.headline(settings),
            "summary": rp.summary_table(settings, params.digits),
            "warnings": [(f"{s.criterion} {s.sparsity:.0%}", w) for s in settings for w in s.warnings],
            "benchmarks": rp.benchmark_table(rows, cols, params.digits),
            "memory": rp.memory_table(rp.memory_rows(metrics)),
            "images": images,
            "sources": rp.sources_table(traced.sources),
            "configuration": rp.configuration_table(
                [*lineage.configuration(traced.nodes, NAMES), ("report (this page)", _as_configuration(params))]
            ),
            "software": rp.software_table(lineage.software(traced.nodes)),
            "artifacts": rp.artifacts_table(traced.nodes, gives),
        }
        (staging / REPORT_FILE).write_text(render.markdown(context, image_src=lambda name: name))
        if params.html:
            embedded = render.markdown(context, image_src=lambda name: render.data_uri((staging / name).read_bytes()))
            (staging / HTML_FILE).write_text(render.html_page(embedded, params.title))
    return artifacts.read_manifest(out_uri)


def _as_configuration(params: ReportParams) -> dict[str, list[str]]:
    return {k: [str(v)] for k, v in dataclasses.asdict(params).items()}


def _notes(metrics: Sequence[records.MetricsRecord]) -> list[str]:
    limits = sorted({f"{float(m.limit):g}" for m in metrics if m.limit is not None})  # configs may turn 48 into 48.0
    if limits:
        return [f"Smoke run: at most {', '.join(limits)} examples per task; not comparable with full evaluations."]
    return []
