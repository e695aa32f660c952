"""Between KFP artifacts and EvoESAP's storage: where an input artifact's content is, and how an output
artifact describes the stage's result.

A stage's result lives at its content-addressed URI under `storage_root` (reused across runs, with its
manifest). The KFP output artifact is a small, faithful view of it at KFP's own URI: the manifest and the
small payload files (no weights), with `metadata["uri"]` pointing at the full artifact and the stage's
headline numbers (`evoesap.facts`) beside it. See docs/ARCHITECTURE.md, "KFP artifacts and the storage root".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evoesap import facts


def source(artifact: Any) -> str | None:
    """The URI a stage reads for an input artifact (None when an optional input was not given).

    One of ours: the storage URI in its metadata. Anything else (a team's model, an imported URI or hub
    name): the local copy KFP made when there is one, else the artifact's URI itself; a hub name whose
    metadata names a `revision` (branch, tag or commit) is read at that revision (`org/name@revision`),
    and a revision on anything else is refused.
    """
    from evoesap.identity import pin

    if artifact is None:
        return None
    if artifact.metadata.get("uri") and artifact.metadata.get("stage"):
        return artifact.metadata["uri"]
    path = artifact.path
    return pin(path if path and os.path.exists(path) else artifact.uri, artifact.metadata.get("revision") or None)


def publish(artifact: Any, uri: str) -> None:
    """Fill the KFP output `artifact` from the finished EvoESAP artifact at `uri`."""
    artifact.metadata.update(facts.facts(uri))
    facts.export_small_files(uri, Path(artifact.path))


def publish_metrics(metrics: Any, uri: str) -> None:
    """One scalar per task (its primary metric) on a KFP Metrics artifact, for KFP's run comparison."""
    for name, value in facts.task_scores(uri).items():
        metrics.log_metric(name, value)


def publish_report(markdown: Any, page: Any, uri: str) -> None:
    """The report as KFP Markdown and HTML artifacts, rendered by the KFP UI."""
    from evoesap import artifacts

    for artifact in (markdown, page):
        artifact.metadata.update(facts.facts(uri))
    Path(markdown.path).write_bytes(artifacts.read_bytes(artifacts.join(uri, "report.md")))
    Path(page.path).write_text(facts.standalone_html(uri))
