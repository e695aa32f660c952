"""What a finished artifact says about itself, for an orchestrator's metadata (KFP artifacts, ML Metadata).

Everything here is read from the artifact's manifest and payload, so the metadata a KFP user sees is the
lineage and the numbers our manifests record, never a second account of them.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from evoesap import records, registry
from evoesap.store import artifacts
from evoesap.store.lineage import changed

EXPORT_MAX_BYTES = 1 << 20  # files up to this size are copied into an orchestrator's artifact; weights never


def search_facts(uri: str) -> dict[str, Any]:
    doc = records.read(uri, records.AllocationRecord).to_json()
    keys = ("criterion", "sparsity", "metric", "fitness", "heldout", "removal_counts", "fallback_applied", "evaluations")
    return {**{k: doc[k] for k in keys}, "cost": artifacts.read_manifest(uri).run.get("cost")}


def search_headline(uri: str) -> str:
    """The search's result in one line: the searched allocation against uniform on the held-out samples (else on the
    search set), whether it beats uniform, and where allocation.json is."""
    record = records.read(uri, records.AllocationRecord)
    metric = record.metric or "fitness"
    where = f"{artifacts.redact(str(uri).rstrip('/'))}/{records.ALLOCATION_FILE}"
    if record.searched is None or record.uniform is None:  # an allocation written by hand
        return f"search: allocation {list(record.removal_counts)} (no comparison with uniform recorded); details: {where}"
    searched, uniform = list(record.searched.removal_counts), list(record.uniform.removal_counts)
    pair = f"searched {searched} vs uniform {uniform}" if searched != uniform else f"searched = uniform {uniform}"
    check = record.heldout
    if check is not None and check.samples and check.searched is not None and check.uniform is not None:
        spread = f", {check.difference / check.stderr:.1f} standard errors" if check.stderr else ""
        numbers = (
            f"held-out {metric} {check.searched:.5f} vs {check.uniform:.5f} "
            f"({check.difference:+.1e}{spread}, {check.samples} samples)"
        )
        verdict = "beats uniform" if check.beats_uniform else "does not beat uniform (see the warning above)"
    else:
        numbers = f"search-set {metric} {record.searched.fitness:.5f} vs {record.uniform.fitness:.5f} (no held-out samples)"
        verdict = "held-out check not run"
    fallback = "; fell back to uniform" if record.fallback_applied else ""
    return f"search: {pair}, {numbers}: {verdict}{fallback}; details: {where}"


def prune_facts(uri: str) -> dict[str, Any]:
    record = records.read(uri, records.PruningRecord)
    return {
        "method": record.method,
        "criterion": record.criterion,
        "sparsity": record.sparsity,
        "expert_counts": list(record.num_experts),
        "removal_counts": list(record.removal_counts),
        "parameter_bytes": record.parameter_bytes_pruned,
        "parameter_bytes_full": record.parameter_bytes_full,
    }


def evaluate_facts(uri: str) -> dict[str, Any]:
    labels = records.read(uri, records.MetricsRecord).labels.to_json()
    return {**{k: v for k, v in labels.items() if v is not None}, "scores": task_scores(uri)}


def quantize_facts(uri: str) -> dict[str, Any]:
    """The recipe and bytes, plus the method, criterion and sparsity of the prune artifact it quantized (they label
    the quantized model's evaluation, as a prune artifact's own do)."""
    doc = records.read(uri, records.QuantizationRecord).to_json()
    keys = ("recipe", "scheme", "num_experts_per_layer", "checkpoint_bytes_before", "checkpoint_bytes_after")
    source = artifacts.read_manifest(uri, "quantize").inputs["model"]
    return {**_point(source), **{k: doc[k] for k in keys}}


def publish_facts(uri: str) -> dict[str, Any]:
    """What was released: `withheld` false (a release the gate refused is an entry that says true and why), the method,
    criterion and sparsity of the prune artifact it released, where it was pushed, and the verdict it passed."""
    manifest = artifacts.read_manifest(uri, "publish")
    gate = manifest.inputs.get("gate")
    passed = {"gate": records.read(gate["uri"], records.GateRecord).line()} if gate and _recorded(gate, "gate") else {}
    pushed = {k: manifest.params[k] for k in ("to", "repo") if manifest.params.get(k)}
    return {"withheld": False, **_point(manifest.inputs.get("pruned", {})), **pushed, **passed}


def _recorded(entry: dict[str, Any], stage: str) -> bool:
    """Whether a manifest's input entry is still the `stage` artifact it read (none: a checkpoint of ours no longer
    where it was, changed since, or any other checkpoint)."""
    where = entry.get("uri")
    return (
        bool(where and entry.get("manifest_sha256"))
        and artifacts.exists(artifacts.join(where, artifacts.MANIFEST))
        and not changed(entry, artifacts.artifact_identity(where))  # by content: made again from the same bytes counts
        and artifacts.read_manifest(where).stage == stage
    )


def _point(entry: dict[str, Any]) -> dict[str, Any]:
    """The method, criterion and sparsity of the prune artifact an input entry names, when it is still there."""
    labels = ("method", "criterion", "sparsity")
    return {k: v for k, v in prune_facts(entry["uri"]).items() if k in labels} if _recorded(entry, "prune") else {}


def gate_facts(uri: str) -> dict[str, Any]:
    """The verdict, its one line and each check, so a KFP user reads the decision off the artifact's metadata."""
    record = records.read(uri, records.GateRecord)
    return {"passed": record.passed, "verdict": record.line(), "checks": [c.to_json() for c in record.checks]}


def facts(uri: str) -> dict[str, Any]:
    """The artifact's location, stage and manifest hash, plus the stage's own headline numbers (its registry
    entry's `facts`)."""
    manifest = artifacts.read_manifest(uri)
    common = {
        "uri": artifacts.redact(uri),
        "stage": manifest.stage,
        "manifest_sha256": artifacts.manifest_sha256(uri),
        "inputs": {name: entry.get("uri") for name, entry in manifest.inputs.items()},
        "evoesap_version": manifest.version,
    }
    stage = registry.get(manifest.stage) if manifest.stage in registry.NAMES else None
    return {**common, **(stage.facts_function()(uri) if stage is not None and stage.facts else {})}


def task_scores(uri: str) -> dict[str, float]:
    """`<task>/<metric>` -> value of each task's primary metric in an evaluate artifact."""
    metrics = records.read(uri, records.MetricsRecord)
    return {f"{r.task}/{r.metric}": float(r.value) for r in metrics.primary()}


def export_small_files(uri: str, dest: Path, max_bytes: int = EXPORT_MAX_BYTES) -> list[str]:
    """Copy the manifest and every payload file up to `max_bytes` into `dest`; return the copied names.

    Large files (weights, logits) stay only at `uri`, which the metadata records.
    """
    manifest = artifacts.read_manifest(uri)
    fs, root = artifacts.split(uri)
    names = [artifacts.MANIFEST, *sorted(manifest.files)]
    copied = []
    for name in names:
        path = f"{root.rstrip('/')}/{name}"
        if fs.size(path) > max_bytes:
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(path))
        copied.append(name)
    return copied


def standalone_html(uri: str) -> str:
    """A report artifact's HTML, one file with its plots inlined (the report stage embeds them), for the KFP
    UI's HTML view. A report made without HTML gets its Markdown in a <pre> block."""
    manifest = artifacts.read_manifest(uri, "report")
    if "report.html" not in manifest.files:
        text = artifacts.read_payload(uri, "report.md", manifest).decode("utf-8")
        return f"<!doctype html><meta charset='utf-8'><pre>{html.escape(text)}</pre>"
    return artifacts.read_payload(uri, "report.html", manifest).decode("utf-8")
