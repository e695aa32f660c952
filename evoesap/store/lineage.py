"""Lineage behind a report: follow artifact manifests from its inputs to every artifact and outside source.

An artifact's manifest names its inputs; an input that is an artifact carries its content identity (what reuse keys
on, and what lineage checks the artifact read later against, so the same artifact made again with a new manifest is
still the one read) beside its manifest hash (all a record made before content identities holds, then checked
instead); one that is not (a model directory, a data file, a hub name) carries its content identity alone. Walking
those inputs from the report's runs and searches reaches every artifact a number depends on, and the
model and data sources at the roots, with the parameters and software that made each artifact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

from evoesap.errors import ArtifactError
from evoesap.store import artifacts
from evoesap.store.identity import keyed, same, summary

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Node:
    """One artifact reached from the report's inputs."""

    uri: str  # without credentials
    manifest: artifacts.Manifest | None  # None: it could not be read (moved or deleted since)
    content_sha256: str | None  # its content identity (identity.artifact_content): what keys and lineage checks use
    used_as: tuple[tuple[str, tuple[str, ...]], ...]  # ("<input name> of <stage>", settings of those artifacts) per edge


@dataclasses.dataclass(frozen=True)
class Source:
    """An input that is not an artifact: a model or a data set, named by URI and content identity."""

    name: str  # the input name its readers gave it (model, data)
    uri: str
    identity: str  # the content identity the manifest records, in one line (evoesap.store.identity.summary)
    read_by: tuple[str, ...]  # "<stage> (<how that artifact was used>)"


@dataclasses.dataclass(frozen=True)
class Lineage:
    nodes: list[Node]  # in the order reached: the report's inputs first
    sources: list[Source]


def _edge(name: str, stage: str) -> str:
    return f"{name.split('.')[0]} of {stage}"  # runs.3 -> runs: every run plays the same part


def _setting(params: Mapping[str, Any]) -> str:
    """ "25% reap searched": the grid point an artifact belongs to, from its parameters ('' when none)."""
    sparsity = params.get("sparsity")
    parts = [None if sparsity is None else f"{float(sparsity):.0%}", params.get("criterion"), params.get("method")]
    return " ".join(str(p) for p in parts if p)


def walk(roots: Mapping[str, str], root_stage: str = "report") -> Lineage:
    """Every artifact and outside source behind `roots` (input name -> artifact URI), breadth first."""
    queue = [(uri, _edge(name, root_stage), "") for name, uri in roots.items()]
    used_as: dict[str, dict[str, list[str]]] = {}  # uri -> edge -> settings of the artifacts that used it so
    order: list[str] = []
    manifests: dict[str, artifacts.Manifest | None] = {}
    sources: dict[tuple[str, str], tuple[str, list[str]]] = {}
    while queue:
        uri, edge, setting = queue.pop(0)
        seen = uri in used_as
        settings = used_as.setdefault(uri, {}).setdefault(edge, [])
        if setting and setting not in settings:
            settings.append(setting)
        if seen:
            continue
        manifests[uri] = manifest = _manifest(uri)
        order.append(uri)
        if manifest is None:
            continue
        reader = f"{manifest.stage} ({edge})"
        for name, entry in sorted(manifest.inputs.items()):
            if "manifest_sha256" in entry:
                queue.append((entry["uri"], _edge(name, manifest.stage), _setting(manifest.params)))
                continue
            record = {k: v for k, v in entry.items() if k != "uri"}
            identity, readers = sources.setdefault((name, entry["uri"]), (summary(record) if record else "", []))
            if reader not in readers:
                readers.append(reader)
    nodes = [
        Node(
            artifacts.redact(uri),
            manifests[uri],
            _content(uri) if manifests[uri] else None,
            tuple((edge, tuple(settings)) for edge, settings in used_as[uri].items()),
        )
        for uri in order
    ]
    return Lineage(nodes, [Source(name, uri, identity, tuple(readers)) for (name, uri), (identity, readers) in sources.items()])


def _manifest(uri: str) -> artifacts.Manifest | None:
    try:
        return artifacts.read_manifest(uri)
    except ArtifactError as exc:
        log.warning("lineage stops at %s: %s", artifacts.redact(uri), exc)
        return None


def _content(uri: str) -> str | None:
    """The artifact's content identity, not its manifest's sha256: a report reused after an upstream artifact was made
    again from the same bytes (a new manifest) still names what is there."""
    try:
        return artifacts.artifact_identity(uri).get("content_sha256")
    except ArtifactError:
        return None


def configuration(nodes: list[Node], stages: tuple[str, ...]) -> list[tuple[str, dict[str, list[str]]]]:
    """Per stage (in `stages` order, then any other): parameter -> its distinct values over that stage's artifacts."""
    by_stage: dict[str, dict[str, list[str]]] = {}
    for node in nodes:
        if node.manifest is None:
            continue
        params = by_stage.setdefault(node.manifest.stage, {})
        for key, value in node.manifest.params.items():
            text = _value(value)
            if text not in params.setdefault(key, []):
                params[key].append(text)
    rank = {stage: i for i, stage in enumerate(stages)}
    return sorted(
        ((s, {k: sorted(v) for k, v in p.items()}) for s, p in by_stage.items()),
        key=lambda sp: (rank.get(sp[0], len(rank)), sp[0]),
    )


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def software(nodes: list[Node]) -> list[tuple[str, str | None, list[str]]]:
    """(package version, git commit, stages) for each distinct build that made an artifact."""
    builds: dict[tuple[str, str | None], list[str]] = {}
    for node in nodes:
        if node.manifest is not None:
            stages = builds.setdefault((node.manifest.version, node.manifest.git_commit), [])
            if node.manifest.stage not in stages:
                stages.append(node.manifest.stage)
    return [(version, commit, stages) for (version, commit), stages in builds.items()]


DERIVING_STAGES = ("prune", "quantize")  # stages whose output is a model made from their `model` input


@dataclasses.dataclass(frozen=True)
class Origin:
    """The model an artifact was made from, found by following `model` inputs through prune and quantize artifacts."""

    uri: str  # as its reader's manifest recorded it (credentials redacted)
    identity: dict[str, Any]  # its content identity (evoesap.store.identity), without the URI
    through: tuple[str, ...]  # the deriving stages passed, nearest first; empty: the model itself was given

    def describe(self) -> str:
        return f"{self.uri} ({summary(self.identity)})"


def identity_of(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An input entry of a manifest as content (`identity.keyed`: without its URI, and an artifact without its manifest
    sha256 where its content identity is recorded): what two entries must share to name the same content."""
    return keyed(entry)


def changed(entry: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """How the artifact an input `entry` recorded differs from `current` (`artifacts.artifact_identity` of what its URI
    holds now), in words; "" when it is the content its reader read. Compared by content where the entry records it
    (the same artifact made again, with a new manifest, is unchanged), else by manifest (an entry recorded before
    artifacts had a content identity)."""
    if same(entry, current):
        return ""
    key = "content_sha256" if "content_sha256" in entry else "manifest_sha256"
    return f"{key.replace('_', ' ')} {str(current.get(key) or 'none')[:12]}, recorded {str(entry.get(key))[:12]}"


def model_origin(entry: Mapping[str, Any]) -> Origin:
    """The model behind a manifest's `model` input `entry`: back through every prune and quantize artifact, each checked
    by content (`changed`: what its reader recorded), to the first model that is neither."""
    through: list[str] = []
    while "manifest_sha256" in entry:
        uri = entry["uri"]
        try:
            manifest, current = artifacts.read_manifest(uri), artifacts.artifact_identity(uri)
        except ArtifactError as exc:
            raise ArtifactError(f"cannot follow the model's lineage at {uri}: {exc}") from None
        if difference := changed(entry, current):
            raise ArtifactError(
                f"{uri} changed since it was read ({difference}), "
                "so its lineage no longer describes what was evaluated: re-run the stages from there"
            )
        if manifest.stage not in DERIVING_STAGES or "model" not in manifest.inputs:
            break
        through.append(manifest.stage)
        entry = manifest.inputs["model"]
    return Origin(str(entry["uri"]), identity_of(entry), tuple(through))
