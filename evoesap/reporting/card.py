"""The model card of a published pruned checkpoint: README.md in the Hub's format (YAML metadata, then Markdown).

Everything here works on records already read and checked by the publish stage (pruning.json, config.json,
metrics.json, allocation.json, the lineage walk), so every number the card shows is one an artifact holds
(or a difference of two of them); laying the page out is the template's (`templates/model_card.md.j2`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from evoesap.errors import ConfigError
from evoesap.records import AllocationRecord, Experts, MetricsRecord, PruningRecord, QuantizationRecord, TaskMetric
from evoesap.reporting import render
from evoesap.reporting import report as rp
from evoesap.reporting.report import Cell, Table
from evoesap.store import identity, lineage
from evoesap.store.lineage import Lineage

DENSITY_FILE = "density.png"
LICENSE_KEYS = ("license", "license_name", "license_link")  # what a derivative carries from its base's card
# a license as the Hub and SPDX name one (apache-2.0, MIT, llama3.1, cc-by-nc-4.0, GPL-3.0-or-later, LicenseRef-x, other)
_LICENSE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+-]{0,63}")


def check_license(value: str, given: str = "license", fix: str = "") -> str:
    """`value` when it is a license identifier; a ConfigError naming it otherwise (before any work)."""
    if not isinstance(value, str) or not _LICENSE_ID.fullmatch(value):
        raise ConfigError(
            f"{given} {value!r} is not a license identifier (letters, digits, '.', '-' and '+', as in apache-2.0, mit, "
            f"llama3.1): {fix or 'give the Hub or SPDX id of the base model license, or other'}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the card says, each part read from one artifact (or the base model's own card)."""

    pruning: PruningRecord  # pruning.json of the prune artifact
    config: Mapping[str, Any]  # config.json of the published checkpoint (the quantized one, when quantized)
    pruned_eval: MetricsRecord | None  # metrics.json of the pruned model's evaluation (required unless quantized)
    full_eval: MetricsRecord | None  # metrics.json of the base model's evaluation
    search: AllocationRecord | None  # allocation.json of the search the model was pruned by
    search_params: Mapping[str, Any] | None  # that search's parameters (its manifest)
    lineage: Lineage
    base_model: str | None  # hub name of the base model
    license: Mapping[str, str]  # LICENSE_KEYS found on the base model's card (or given)
    report_files: Sequence[str] = ()  # the report's files, under report/ in the published artifact
    quantization: QuantizationRecord | None = None  # quantization.json of the quantize artifact published instead
    quantized_eval: MetricsRecord | None = None  # metrics.json of the quantized model's evaluation
    base_model_verified: bool = True  # False: base_model could not be checked against the pruned model's config

    @property
    def published_eval(self) -> MetricsRecord:
        """The evaluation of the checkpoint the card describes."""
        published = self.quantized_eval if self.quantization is not None else self.pruned_eval
        assert published is not None, "the published checkpoint's evaluation is required (the publish stage checks it)"
        return published


def metadata(evidence: Evidence) -> dict[str, Any]:
    """The card's YAML header: the keys the Hub reads (base model and relation, license, datasets, library, pipeline,
    tags, and `model-index`: the published model's primary score per task, which the Hub shows as its evaluation
    results). The Hub knows four relations (adapter, merge, quantized, finetune): a quantized release says
    `quantized`; pruning is none of them, so a pruned-only release names its base without a relation."""
    from huggingface_hub import EvalResult, ModelCardData

    family = evidence.published_eval.experts.family
    tags = ["evoesap", "expert-pruning", "mixture-of-experts", family, evidence.pruning.criterion]
    if evidence.quantization is not None:
        tags += ["compressed-tensors", evidence.quantization.recipe]
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=row.task,
            dataset_name=row.task,
            metric_type=row.metric,
            metric_value=row.value,
        )
        for row in evidence.published_eval.records
        if row.primary
    ]
    data = ModelCardData(
        model_name=_name(evidence) if results else None,
        base_model=evidence.base_model,
        base_model_relation="quantized" if evidence.quantization is not None and evidence.base_model else None,
        datasets=datasets(evidence.lineage) or None,
        eval_results=results or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
        **dict(evidence.license),
    )
    return data.to_dict()


def datasets(walked: Lineage) -> list[str]:
    """The Hub datasets the model was calibrated, searched or quantized on (data sources named org/name)."""
    named = (identity.hub_model(s.uri) for s in walked.sources if s.name != "model" and not identity.is_uri(s.uri))
    return sorted({ref[0] for ref in named if ref is not None})


# a URI, or an absolute path where a value starts (text start, after a space, `=`, `:`, a bracket, a quote or a comma):
# `</think>` or `and/or` hold a slash but name no location
_LOCATION = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,;|`)]+|(?:^|(?<=[\s=:(\[{\"',]))/[^\s,;|`)]+")


def withheld(text: str) -> str:
    """`text` with every URI and absolute path cut to its last part, for a card meant for the public."""
    return _LOCATION.sub(lambda m: "…/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def _public(table: Table) -> Table:
    return dataclasses.replace(
        table, rows=tuple(tuple(dataclasses.replace(c, text=withheld(c.text)) for c in row) for row in table.rows)
    )


def write_density(pruning: PruningRecord, path: Path) -> None:
    """The per-layer expert density of the pruned model (the report's Figure 1 panel) as a PNG."""
    full = [k + r for k, r in zip(pruning.num_experts, pruning.removal_counts)]
    figure = rp.density_figure(
        {pruning.method: (pruning.removal_counts, full)}, f"{pruning.criterion} at {pruning.sparsity:.0%} sparsity"
    )
    figure.savefig(path, dpi=120)
    rp.plt.close(figure)


def _pm(value: float | None, stderr: float | None, digits: int) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" + ("" if stderr is None else f" ± {stderr:.{digits}f}")


def evaluation_table(
    pruned: Sequence[TaskMetric],
    full: Sequence[TaskMetric],
    digits: int,
    quantized: Sequence[TaskMetric] | None = None,
    recipe: str = "quantized",
) -> Table:
    """Per task of the published model (`quantized`, when given, else `pruned`; each a model's metrics.json records),
    its primary metric: full, pruned and quantized value ± standard error, the published model's difference from
    full, the samples."""
    keyed = [{(r.task, r.metric, r.filter): r for r in m} for m in ((full, pruned) if quantized is not None else (full,))]
    lines = []
    for row in (r for r in (quantized if quantized is not None else pruned) if r.primary):
        others = [by_key.get((row.task, row.metric, row.filter)) for by_key in keyed]
        base = others[0]
        delta = "–" if base is None else f"{row.value - base.value:+.{digits}f}"
        values = [_pm(o and o.value, o and o.stderr, digits) for o in others] + [_pm(row.value, row.stderr, digits)]
        samples = "–" if row.samples is None else str(row.samples)
        lines.append(tuple(Cell(t) for t in (row.task, row.metric, *values, delta, samples)))
    if quantized is None:
        header: tuple[str, ...] = ("Task", "Metric", "Full", "Pruned", "Δ (pruned − full)", "Samples")
    else:
        header = ("Task", "Metric", "Full", "Pruned", f"Pruned + {recipe}", "Δ (quantized − full)", "Samples")
    return Table(header, tuple(lines), ("left", "left") + ("right",) * (len(header) - 2))


def _records(metrics: MetricsRecord | None) -> tuple[TaskMetric, ...]:
    return metrics.records if metrics is not None else ()


def expert_table(pruning: PruningRecord, experts: Experts) -> Table:
    """Per MoE layer: its decoder layer, experts before and after, removed, and the router's top-k."""
    kept, removed = pruning.num_experts, pruning.removal_counts
    lines = [
        tuple(Cell(str(v)) for v in (i, experts.decoder_index[i], k + r, k, r, experts.top_k[i]))
        for i, (k, r) in enumerate(zip(kept, removed))
    ]
    header = ("MoE layer", "Decoder layer", "Experts (full)", "Experts kept", "Removed", "Top-k")
    return Table(header, tuple(lines), ("right",) * 6)


def memory_table(evidence: Evidence) -> Table:
    """Parameters and parameter bytes of the full and the pruned model (the evaluations' and pruning.json's)."""
    pruning, full = evidence.pruning, evidence.full_eval
    saving = 1 - pruning.parameter_bytes_pruned / pruning.parameter_bytes_full
    lines = [
        (
            Cell("Full"),
            Cell("–" if full is None else f"{full.memory.parameters:,}"),
            Cell(f"{pruning.parameter_bytes_full:,}"),
            Cell(""),
        ),
        (
            Cell("Pruned"),
            Cell("–" if evidence.pruned_eval is None else f"{evidence.pruned_eval.memory.parameters:,}"),
            Cell(f"{pruning.parameter_bytes_pruned:,}"),
            Cell(f"{saving:.1%}"),
        ),
    ]
    return Table(("Model", "Parameters", "Parameter bytes", "Saving"), tuple(lines), ("left",) + ("right",) * 3)


def _search(evidence: Evidence, digits: int) -> dict[str, Any] | None:
    doc = evidence.search
    if doc is None:
        return None
    check = doc.heldout
    return {
        "metric": doc.metric,
        "fitness": _pm(doc.fitness, None, digits + 3),
        "uniform": _pm(None if doc.uniform is None else doc.uniform.fitness, None, digits + 3),
        "evaluations": doc.evaluations,
        "generations": (evidence.search_params or {}).get("generations"),
        "fallback": bool(doc.fallback_applied),
        "heldout": None
        if check is None
        else {
            "samples": check.samples,
            "searched": f"{check.searched:.{digits + 3}f}",
            "uniform": f"{check.uniform:.{digits + 3}f}",
            "difference": f"{check.difference:.2e}",
            "stderr": "n/a" if check.stderr is None else f"{check.stderr:.2e}",
            "beats_uniform": check.beats_uniform,
        },
        "warnings": list(doc.warnings or []),
    }


def quantized(doc: QuantizationRecord | None) -> dict[str, Any] | None:
    """What quantization.json says of the published checkpoint: recipe, scheme, algorithm, calibration samples,
    tool versions and the stored bytes before and after; None when the checkpoint was not quantized by evoesap."""
    if doc is None:
        return None
    before, after = doc.checkpoint_bytes_before, doc.checkpoint_bytes_after
    bytes_table = Table(
        ("Checkpoint", "Safetensors bytes", "Saving"),
        (
            (Cell("Pruned"), Cell(f"{before:,}"), Cell("")),
            (Cell(f"Pruned + {doc.recipe}"), Cell(f"{after:,}"), Cell(f"{1 - after / before:.1%}")),
        ),
        ("left", "right", "right"),
    )
    return {
        "recipe": doc.recipe,
        "scheme": doc.scheme,
        "algorithm": doc.algorithm,
        "samples": doc.calibration_samples,
        "versions": ", ".join(f"{name} {version}" for name, version in sorted(doc.versions.items())),
        "bytes": bytes_table,
    }


def quantization(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's quantization recipe as config.json records it (compressed-tensors and transformers'
    quantizers write `quantization_config` there); None for unquantized weights."""
    recipe = config.get("quantization_config")
    return None if recipe is None else json.dumps(recipe, indent=2, sort_keys=True)


def _name(evidence: Evidence) -> str:
    base = evidence.base_model or "the base model"
    pruning = evidence.pruning
    title = f"{base}, {pruning.sparsity:.0%} of routed experts pruned ({pruning.criterion}, {pruning.method})"
    return title + (f", quantized ({evidence.quantization.recipe})" if evidence.quantization else "")


def render_card(evidence: Evidence, digits: int = 3, show_locations: bool = False) -> str:
    """README.md: the Hub's YAML metadata header, then the card's Markdown. Without `show_locations` the lineage
    tables name no path or bucket URI (each cut to its last part: `withheld`); hub names stay."""
    from evoesap.registry import NAMES

    pruning, experts = evidence.pruning, evidence.published_eval.experts
    evaluations = (evidence.pruned_eval, evidence.quantized_eval, evidence.full_eval)
    limits = sorted({f"{float(m.limit):g}" for m in evaluations if m is not None and m.limit})
    recipe = evidence.quantization.recipe if evidence.quantization else "quantized"
    context = {
        "title": _name(evidence),
        "base_model": evidence.base_model,
        "base_model_verified": evidence.base_model_verified,
        "method": pruning.method,
        "criterion": pruning.criterion,
        "sparsity": f"{pruning.sparsity:.0%}",
        "removed": sum(pruning.removal_counts),
        "total": sum(pruning.removal_counts) + sum(pruning.num_experts),
        "family": experts.family,
        "experts": expert_table(pruning, experts),
        "density": DENSITY_FILE,
        "evaluation": evaluation_table(
            _records(evidence.pruned_eval),
            _records(evidence.full_eval),
            digits,
            _records(evidence.quantized_eval) if evidence.quantization else None,
            recipe,
        ),
        "full_evaluated": evidence.full_eval is not None,
        "limits": limits,
        "memory": memory_table(evidence),
        "search": _search(evidence, digits),
        "remote_code": "auto_map" in evidence.config,
        "dtype": evidence.config.get("dtype") or evidence.config.get("torch_dtype"),
        "quantization": quantization(evidence.config),
        "quantized": quantized(evidence.quantization),
        "license": evidence.license.get("license"),
        "report": "report/report.html"
        if "report.html" in evidence.report_files
        else "report/report.md"
        if "report.md" in evidence.report_files
        else None,
        "sources": rp.sources_table(evidence.lineage.sources),
        "configuration": rp.configuration_table(lineage.configuration(evidence.lineage.nodes, NAMES)),
        "software": rp.software_table(lineage.software(evidence.lineage.nodes)),
        "artifacts": rp.artifacts_table(evidence.lineage.nodes, {}),
    }
    if not show_locations:
        context.update({k: _public(context[k]) for k in ("sources", "configuration", "artifacts")})
    header = yaml.safe_dump(metadata(evidence), sort_keys=False, allow_unicode=True)
    return f"---\n{header}---\n\n" + render.model_card(context)
