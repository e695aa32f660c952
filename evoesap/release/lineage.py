"""What a publish artifact released, read from its manifest and its inputs: the facts a model registry records.

Every value comes from an artifact the publish read (the prune, search, gate and evaluate artifacts its manifest
names, each checked against the manifest sha256 the publish recorded), so a registry entry says what the card says.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from evoesap import network, records
from evoesap.errors import ArtifactError, ConfigError
from evoesap.store import artifacts
from evoesap.store.identity import is_uri, same
from evoesap.store.lineage import changed

PREFIX = "evoesap."  # every tag the hand-off writes; other tags on the same version are left alone
_KEY_UNSAFE = re.compile(r"[^\w./ :-]")  # what MLflow refuses in a tag key (letters, digits, _ - . / : and space)
VALUE_MAX = 5000  # MLflow's limit on a model version tag's value
# the checkpoint's format, as a registry names it: safetensors (its one format version), or the compressed-tensors
# layout of a quantized release at the version of compressed-tensors that wrote it
SAFETENSORS = ("safetensors", "1")
COMPRESSED_TENSORS = "compressed-tensors"


@dataclasses.dataclass(frozen=True)
class Release:
    """A released model: where it was published, its identity (the publish manifest's sha256) and its lineage tags."""

    uri: str  # the publish artifact (without credentials)
    source: str  # where the release lies for others: `to`, the Hub repository (hf://org/name), else `uri`
    manifest_sha256: str
    tags: dict[str, str]  # `PREFIX`-named keys: base model, criterion, sparsity, allocation, gate, metrics, format
    model_format: tuple[str, str] = SAFETENSORS  # (name, version) of the released checkpoint's format


def read(published: str, source: str | None = None) -> Release:
    """The release at `published` (a publish artifact) with its lineage; inputs moved or changed since are refused.
    `source`: where others read it, in place of where it was pushed."""
    manifest = artifacts.read_manifest(published, "publish")
    pruned_uri = _input(manifest, "pruned", "prune", published)
    pruned = records.read(pruned_uri, records.PruningRecord)
    prune_manifest = artifacts.read_manifest(pruned_uri, "prune")
    checkpoint = manifest.inputs.get("quantized") or manifest.inputs["pruned"]
    evaluation = _published_evaluation(manifest, checkpoint, published)
    allocation = prune_manifest.inputs.get("allocation", {}).get("manifest_sha256")
    tags = {
        "base_model": manifest.params.get("base_model") or _named(prune_manifest.inputs["model"]),
        "method": pruned.method,
        "criterion": pruned.criterion,
        "sparsity": f"{pruned.sparsity:g}",
        "experts_per_layer": ",".join(str(n) for n in pruned.num_experts),
        # the search artifact that chose the allocation, by its manifest sha256; a uniform prune has none
        "allocation_sha256": allocation or "uniform",
        "gate": _verdict(manifest, published),
        "publish_manifest_sha256": artifacts.manifest_sha256(published),
        "evoesap_version": manifest.version,
    }
    quantized = None
    if "quantized" in manifest.inputs:
        quantized = records.read(_input(manifest, "quantized", "quantize", published), records.QuantizationRecord)
        tags["quantization"] = quantized.recipe
    tags["model_format"], tags["model_format_version"] = model_format = format_of(quantized)
    metrics = records.read(evaluation, records.MetricsRecord)
    for row in metrics.primary():
        tags[f"metric.{row.task}/{row.metric}"] = f"{row.value:.6g}"
    if metrics.heldout_esap is not None:
        tags["metric.heldout_esap"] = f"{metrics.heldout_esap.esap:.6g}"
    return Release(
        uri=artifacts.redact(published),
        source=_source(manifest, published, source),
        manifest_sha256=tags["publish_manifest_sha256"],
        tags={_key(k): str(v)[:VALUE_MAX] for k, v in tags.items()},
        model_format=model_format,
    )


def format_of(quantized: records.QuantizationRecord | None) -> tuple[str, str]:
    """(name, version) of a released checkpoint's format: compressed-tensors at the version that wrote it when it was
    quantized, else safetensors."""
    if quantized is None:
        return SAFETENSORS
    return COMPRESSED_TENSORS, quantized.versions.get(COMPRESSED_TENSORS) or "unknown"


def _key(name: str) -> str:
    return PREFIX + _KEY_UNSAFE.sub("_", name)


def _input(manifest: artifacts.Manifest, name: str, stage: str, published: str) -> str:
    """The URI of the publish's input `name`, refused unless it is still the `stage` artifact the publish read."""
    entry = manifest.inputs.get(name) or {}
    uri = entry.get("uri")
    if not uri:
        raise ArtifactError(f"{artifacts.redact(published)} names no {name} input: give a publish artifact of evoesap publish")
    if "manifest_sha256" not in entry or changed(entry, artifacts.artifact_identity(uri)):
        raise ArtifactError(
            f"the {stage} artifact {artifacts.redact(uri)} that {artifacts.redact(published)} released changed since: "
            "re-run evoesap publish on the artifacts as they are"
        )
    return uri


def _published_evaluation(manifest: artifacts.Manifest, checkpoint: dict[str, Any], published: str) -> str:
    """The evaluation among the publish's inputs of the checkpoint it released (the quantized one, when quantized)."""
    for name in sorted(n for n in manifest.inputs if n.startswith("evaluations.")):
        uri = _input(manifest, name, "evaluate", published)
        if same(artifacts.read_manifest(uri, "evaluate").inputs["model"], checkpoint):  # by content, as publish matched it
            return uri
    raise ArtifactError(f"{artifacts.redact(published)} records no evaluation of the model it released: re-run evoesap publish")


def _verdict(manifest: artifacts.Manifest, published: str) -> str:
    """The release gate's one line; "none" when the publish took no verdict."""
    if "gate" not in manifest.inputs:
        return "none"
    return records.read(_input(manifest, "gate", "gate", published), records.GateRecord).line()


def _named(entry: Mapping[str, Any]) -> str:
    """The model an input entry names: a hub model at its revision, else its URI (without credentials)."""
    if entry.get("kind") == "hub":
        return f"{entry['name']}@{entry['revision']}"
    return artifacts.redact(entry.get("uri", ""))


def _source(manifest: artifacts.Manifest, published: str, given: str | None) -> str:
    """Where the release lies for others: `given`, else where it was pushed (a finished publish artifact means every
    push went through: its pushes run before it is published), else the artifact itself. A local path is refused: no
    one else can read it, and MLflow refuses a local model version source."""
    if given:
        network.refuse_credentials(given, "--source")
        where = given
    elif manifest.params.get("to"):
        where = manifest.params["to"]
    elif manifest.params.get("repo"):
        where = f"hf://{manifest.params['repo']}"
    else:
        where = artifacts.resolved(published)
    if not is_uri(where) or where.startswith("file://"):
        raise ConfigError(
            f"the source {artifacts.redact(where)} of the release {artifacts.redact(published)} is a local path, which a "
            "model registry cannot hand to anyone (MLflow refuses it): publish with --to an object-store URI or --repo, "
            "or give a --source other machines read (s3://..., hf://org/name)"
        )
    return artifacts.redact(where)
