"""The JSON records stages publish for each other: allocation.json (search), pruning.json (prune) and
metrics.json (evaluate). One home for their file names, their writing and their verified reading, so a
stage, the scorer, the report and the orchestrator metadata all read a record the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evoesap import allocation as alloc
from evoesap import artifacts
from evoesap.errors import ArtifactError, ConfigError

ALLOCATION_FILE = "allocation.json"  # search: the chosen removal counts, pruned expert ids, fitness, checks, cost
HISTORY_FILE = "history.parquet"  # search: one row per generation
PRUNING_FILE = "pruning.json"  # prune: method, counts and parameter bytes of the checkpoint
METRICS_FILE = "metrics.json"  # evaluate: every task metric, memory, expert counts, labels
QUANTIZATION_FILE = "quantization.json"  # quantize: recipe, scheme, checkpoint bytes before and after, tool versions

# which stage publishes each record (and so rebuilds it)
_WRITERS = {ALLOCATION_FILE: "search", PRUNING_FILE: "prune", METRICS_FILE: "evaluate", QUANTIZATION_FILE: "quantize"}


def write(staging: Path, name: str, document: dict[str, Any]) -> None:
    """Write a record into a stage's staging directory (sorted keys: the same document, the same bytes)."""
    (staging / name).write_text(json.dumps(document, indent=2, sort_keys=True))


def read(uri: str, name: str) -> dict[str, Any]:
    """The record `name` of the finished artifact at `uri`, checked against its manifest's sha256."""
    stage = _WRITERS[name]
    manifest = artifacts.read_manifest(uri, stage)
    try:
        document = json.loads(artifacts.read_payload(uri, name, manifest))
    except ValueError as exc:
        raise ArtifactError(f"{artifacts.redact(uri)}: {name} is not JSON ({exc}): {artifacts.rebuild_hint(stage)}") from None
    if not isinstance(document, dict):
        raise ArtifactError(f"{artifacts.redact(uri)}: {name} is not a JSON object: {artifacts.rebuild_hint(stage)}")
    return document


def allocation_counts(
    doc: dict[str, Any], uri: str, spec: Any, *, criterion: str | None = None, sparsity: float | None = None
) -> tuple[list[int], dict[int, list[int]]]:
    """(removal counts, pruned ids per MoE layer) of an allocation.json, refused unless they fit `spec`
    (`evoesap.moe.MoESpec`) and meet the budget of its sparsity, every layer is present and the lists agree
    with the counts. `criterion` / `sparsity`, when given, must be the ones searched."""
    from evoesap import moe

    where = f"{artifacts.redact(uri)}/{ALLOCATION_FILE}"
    hint = artifacts.rebuild_hint("search")
    try:
        counts = [alloc.as_int("removal_counts", c) for c in doc["removal_counts"]]
        pruned = {int(layer): [alloc.as_int("expert id", e) for e in ids] for layer, ids in doc["pruned"].items()}
        searched_sparsity, granularity = float(doc["sparsity"]), int(doc.get("granularity", 1))
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
        raise ArtifactError(f"{where} is malformed ({type(exc).__name__}: {exc}): {hint}") from None
    for key, asked in (("criterion", criterion), ("sparsity", sparsity)):
        if asked is not None and doc.get(key) != asked:
            raise ConfigError(
                f"allocation at {artifacts.redact(uri)} was searched with {key}={doc.get(key)!r}, "
                f"but prune was asked for {key}={asked!r}: pass the matching value"
            )
    space = moe.pruning_space(spec, granularity)
    if sorted(pruned) != list(range(len(spec.layers))):
        raise ArtifactError(
            f"{where} has pruned lists for MoE layers {sorted(pruned)}, the model has 0..{len(spec.layers) - 1}: {hint}"
        )
    try:
        budget = alloc.budget(searched_sparsity, space.num_experts, space.min_kept, space.granularity)
        alloc.check(counts, space.num_experts, space.min_kept, budget, space.granularity)
        moe.check_pruned(spec, pruned)
    except ConfigError as exc:
        raise ArtifactError(f"{where} does not fit this model at sparsity {searched_sparsity}: {exc}: {hint}") from None
    disagree = [layer for layer, ids in sorted(pruned.items()) if len(ids) != counts[layer]]
    if disagree:
        layer = disagree[0]
        raise ArtifactError(
            f"{where}: MoE layer {layer} lists {len(pruned[layer])} pruned experts but its removal "
            f"count is {counts[layer]}: {hint}"
        )
    return counts, pruned
