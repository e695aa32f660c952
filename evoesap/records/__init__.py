"""The JSON records stages publish for each other: allocation.json (search), pruning.json (prune), metrics.json
(evaluate) and quantization.json (quantize). One home for their file names, their typed fields
(`evoesap.records.documents`), their writing and their verified reading, so a stage, the scorer, the report and
the orchestrator metadata all read a record the same way; scoring reads records from here, never from a stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from evoesap.errors import ArtifactError, ConfigError
from evoesap.method import allocation as alloc
from evoesap.records.documents import (
    ALLOCATION_FILE,
    GATE_FILE,
    METRICS_FILE,
    PRUNING_FILE,
    QUANTIZATION_FILE,
    TARGET_FILE,
    AllocationRecord,
    Candidate,
    Experts,
    GateCheck,
    GateRecord,
    HeldoutCheck,
    HeldoutEsap,
    Labels,
    Memory,
    MetricsRecord,
    Probe,
    PruningRecord,
    QuantizationRecord,
    Quantized,
    SearchWork,
    TargetRecord,
    TaskMetric,
)
from evoesap.records.typed import Record
from evoesap.store import artifacts, jsontext

__all__ = [
    "ALLOCATION_FILE",
    "GATE_FILE",
    "HISTORY_FILE",
    "METRICS_FILE",
    "PRUNING_FILE",
    "QUANTIZATION_FILE",
    "TARGET_FILE",
    "AllocationRecord",
    "Candidate",
    "Experts",
    "GateCheck",
    "GateRecord",
    "HeldoutCheck",
    "HeldoutEsap",
    "Labels",
    "Memory",
    "MetricsRecord",
    "Probe",
    "PruningRecord",
    "QuantizationRecord",
    "Quantized",
    "Record",
    "SearchWork",
    "TargetRecord",
    "TaskMetric",
    "allocation_counts",
    "read",
    "write",
]

HISTORY_FILE = "history.parquet"  # search: one row per generation

R = TypeVar("R", bound=Record)


def write(staging: Path, record: Record) -> None:
    """Write a record into a stage's staging directory as its file (sorted keys: the same record, the same bytes)."""
    assert record.FILE is not None, f"{type(record).__name__} is part of a record, not a file"
    (staging / record.FILE).write_text(jsontext.dumps(record.to_json(), record.FILE, indent=2, sort_keys=True))


def read(uri: str, kind: type[R]) -> R:
    """The record `kind` of the finished artifact at `uri`, checked against its manifest's sha256 and its fields'
    types (`Record.from_json`)."""
    name, stage = kind.FILE, kind.STAGE
    assert name is not None and stage is not None, f"{kind.__name__} is part of a record, not a file"
    manifest = artifacts.read_manifest(uri, stage)
    where = f"{artifacts.redact(uri)}/{name}"
    document = jsontext.loads(artifacts.read_payload(uri, name, manifest), where, ArtifactError, artifacts.rebuild_hint(stage))
    return kind.from_json(document, where)


def allocation_counts(
    record: AllocationRecord, uri: str, spec: Any, *, criterion: str | None = None, sparsity: float | None = None
) -> tuple[list[int], dict[int, list[int]]]:
    """(removal counts, pruned ids per MoE layer) of the allocation.json at `uri`, refused unless they fit `spec`
    (`evoesap.moe.MoESpec`) and meet the budget of its sparsity, every layer is present and the lists agree
    with the counts. `criterion` / `sparsity`, when given, must be the ones searched."""
    from evoesap import moe

    where = f"{artifacts.redact(uri)}/{ALLOCATION_FILE}"
    hint = artifacts.rebuild_hint("search")
    counts = list(record.removal_counts)
    pruned = {layer: list(ids) for layer, ids in record.pruned.items()}
    for key, asked in (("criterion", criterion), ("sparsity", sparsity)):
        if asked is not None and getattr(record, key) != asked:
            raise ConfigError(
                f"allocation at {artifacts.redact(uri)} was searched with {key}={getattr(record, key)!r}, "
                f"but prune was asked for {key}={asked!r}: pass the matching value"
            )
    space = moe.pruning_space(spec, record.granularity)
    if sorted(pruned) != list(range(len(spec.layers))):
        raise ArtifactError(
            f"{where} has pruned lists for MoE layers {sorted(pruned)}, the model has 0..{len(spec.layers) - 1}: {hint}"
        )
    try:
        budget = alloc.budget(record.sparsity, space.num_experts, space.min_kept, space.granularity)
        alloc.check(counts, space.num_experts, space.min_kept, budget, space.granularity)
        moe.check_pruned(spec, pruned)
    except ConfigError as exc:
        raise ArtifactError(f"{where} does not fit this model at sparsity {record.sparsity}: {exc}: {hint}") from None
    disagree = [layer for layer, ids in sorted(pruned.items()) if len(ids) != counts[layer]]
    if disagree:
        layer = disagree[0]
        raise ArtifactError(
            f"{where}: MoE layer {layer} lists {len(pruned[layer])} pruned experts but its removal "
            f"count is {counts[layer]}: {hint}"
        )
    return counts, pruned
