"""Between KFP artifacts and EvoESAP's storage: where an input artifact's content is, and what an output
artifact holds.

A stage's result lives at its content-addressed URI under `storage_root` (reused across runs, with its
manifest). The KFP output artifact becomes that artifact: its URI is set to the storage URI, so the
weights, logits and manifest are at the artifact's own `uri` / `path` for any consumer, stored once, with
the stage's headline numbers (`evoesap.records.facts`) in its metadata. Where KFP's launcher would refuse a changed
URI (an object-store storage root under a cluster's object-store pipeline root), the artifact stays at
KFP's URI and holds a view: the manifest and the small files, `metadata["uri"]` naming the full artifact.
With `EVOESAP_COPY_MODELS=1` in a task's environment (opt-in: `resources.<stage>.env`), a `Model` output
holds the whole checkpoint there instead, so a stock consumer that reads only `model.path` finds the weights;
the cost is a second copy of the weights per model, written by the pod and uploaded by KFP's launcher.
See docs/explanation/dag.md, "KFP artifacts and the storage root".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from evoesap.machine.env import flag
from evoesap.records import facts
from evoesap.store.identity import is_uri

log = logging.getLogger(__name__)

# The schemes KFP's launcher uploads an output artifact to (launcher_v2.go `LocalPathForURI`). It takes the
# URI a component wrote into executor_output.json, but one of these schemes must then lie under the run's own
# directory of the pipeline root (`Config.KeyFromURI`), or the task fails; a URI of any other kind (a path on
# a shared volume) it records as given and uploads nothing.
_LAUNCHER_SCHEMES = ("gs://", "s3://", "minio://", "oci://")
COPY_MODELS = "EVOESAP_COPY_MODELS"  # on (`machine.env.flag`): a Model output under an object-store pipeline root holds
# the whole checkpoint


def referenced(artifact: Any) -> str | None:
    """The URI an input artifact stands for, where its metadata names one: one of ours, its storage URI; a model
    reference (`components.reference`), the model it names. None for anything else."""
    if artifact.metadata.get("uri") and artifact.metadata.get("stage"):
        return artifact.metadata["uri"]
    return artifact.metadata.get("model") or None


def source(artifact: Any) -> str | None:
    """The URI a stage reads for an input artifact (None when an optional input was not given).

    One whose metadata names a URI (`referenced`): that URI. Anything else (a team's model, an imported URI or
    hub name): the local copy KFP made when there is one, else the artifact's URI itself; a hub name whose
    metadata names a `revision` (branch, tag or commit) is read at that revision (`org/name@revision`),
    and a revision on anything else is refused.
    """
    from evoesap.store.identity import pin

    if artifact is None:
        return None
    named = referenced(artifact)
    if named:
        return named
    path = artifact.path
    return pin(path if path and os.path.exists(path) else artifact.uri, artifact.metadata.get("revision") or None)


def target_uris(decisions: Any) -> list[str]:
    """The target artifacts the quality target's `decisions` (`components.target.find_sparsities`) names in its metadata
    `targets` (criterion -> URI), one per criterion: what the report reads to show each decision."""
    from evoesap.errors import ArtifactError
    from evoesap.store import artifacts

    named = decisions.metadata.get("targets")
    if not isinstance(named, Mapping) or not named:
        raise ArtifactError(
            f"artifact {artifacts.redact(decisions.uri)} names no target artifacts (metadata `targets`: {named!r}): give the target "
            "finder's `decisions` output"
        )
    return [str(uri) for uri in named.values()]


def artifact_uri(kfp_uri: str, uri: str) -> str | None:
    """The URI a KFP output artifact first given `kfp_uri` takes to be the stage's artifact at `uri`, or None
    where a cluster would refuse it: under an object-store pipeline root, always. The producer's launcher fails
    an object-store `uri` outside the run's directory, and every consumer's launcher fails on an input whose URI
    names no object store (a path on a shared volume, `file://`: launcher_v2.go `fetchNonDefaultBuckets`)."""
    if kfp_uri.startswith(_LAUNCHER_SCHEMES):
        return None
    if uri.startswith("file://"):
        return os.path.abspath(uri.removeprefix("file://"))
    return uri if is_uri(uri) else os.path.abspath(uri)


def publish(artifact: Any, uri: str) -> None:
    """Make the KFP output `artifact` the finished EvoESAP artifact at `uri` (its URI becomes `uri`), or,
    where KFP refuses that, a view of it at KFP's own URI; its metadata: the artifact's facts."""
    artifact.metadata.update(facts.facts(uri))
    own = artifact_uri(artifact.uri, uri)
    if own is not None:
        artifact.uri = own
        return
    if getattr(artifact, "schema_title", "") == "system.Model" and flag(COPY_MODELS):
        log.info("%s: copying the whole checkpoint %s to KFP's URI %s (%s)", artifact.name, uri, artifact.uri, COPY_MODELS)
        export_all(uri, Path(artifact.path))
        return
    log.warning(
        "%s stays at KFP's URI %s with the manifest and small files only: KFP's launcher keeps an object-store "
        "output only under the run's own directory; the full artifact is at metadata['uri'] %s (set %s=1 on the "
        "task for a Model holding the whole checkpoint)",
        artifact.name,
        artifact.uri,
        artifact.metadata["uri"],
        COPY_MODELS,
    )
    facts.export_small_files(uri, Path(artifact.path))


def withhold(artifact: Any, line: str) -> None:
    """A release the gate refused: the output holds no files, its metadata says it was withheld and why (the verdict's
    one line), so a consumer of the released models tells it from a release without reading storage."""
    artifact.metadata.update({"withheld": True, "reason": line})
    log.warning("%s withheld: %s", artifact.name, line)


def export_all(uri: str, dest: Path) -> None:
    """Copy the manifest and every payload file of the finished artifact at `uri` into `dest`, streamed, each
    checked against the sha256 its manifest records (a consumer of `dest` gets exactly the stored artifact)."""
    from evoesap.errors import ArtifactError
    from evoesap.store import artifacts
    from evoesap.store.identity import stream_sha256

    manifest = artifacts.read_manifest(uri)
    fs, root = artifacts.split(uri)
    local = artifacts.split(str(dest))[0]
    for name in [artifacts.MANIFEST, *sorted(manifest.files)]:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root.rstrip('/')}/{name}", str(target))
        if name in manifest.files and stream_sha256(local, str(target)) != manifest.files[name]:
            raise ArtifactError(f"{name} of {uri} changed while it was copied to {dest}: run the task again")


def publish_metrics(metrics: Any, uri: str) -> None:
    """One scalar per task (its primary metric) on a KFP Metrics artifact, for KFP's run comparison."""
    for name, value in facts.task_scores(uri).items():
        metrics.log_metric(name, value)


def publish_markdown(markdown: Any, uri: str) -> None:
    """The report's Markdown on a KFP Markdown artifact, rendered by the KFP UI."""
    from evoesap.store import artifacts

    markdown.metadata.update(facts.facts(uri))
    Path(markdown.path).write_bytes(artifacts.read_bytes(artifacts.join(uri, "report.md")))


def publish_page(page: Any, uri: str) -> None:
    """The report as one HTML page with its plots inlined on a KFP HTML artifact, rendered by the KFP UI."""
    page.metadata.update(facts.facts(uri))
    Path(page.path).write_text(facts.standalone_html(uri))


LABELS = ("method", "criterion", "sparsity")  # what names an evaluation's run in the report


def run_labels(arguments: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The evaluate component's params with its report labels: those of the model it evaluates (a pruned or quantized
    model's facts carry them) over the given ones; a model without them is the full model."""
    model = arguments["model"]
    return {"method": "full", **params, **{k: model.metadata[k] for k in LABELS if k in model.metadata}}
