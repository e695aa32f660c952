"""A stage's stored artifact handed on as a KFP artifact whose own URI is the stored one.

Where KFP's launcher keeps a stage's output at KFP's URI (an object-store pipeline root and storage root:
`kfp_artifacts.artifact_uri`), that output is a view, and a consumer's `model.path` would hold the manifest
and the small files only. `stored_uri` is a lookup task that reads the storage URI from the output's metadata;
`import_stored` imports that URI (`dsl.importer`), so the artifact handed on is the stored checkpoint, which the
consumer's launcher downloads into `model.path`. The importer sits in a pipeline of its own because KFP's
importer launcher resolves a runtime URI only from its DAG's own inputs (backend/src/v2/component/
importer_launcher.go, `ImportSpecToMLMDArtifact`: `GetComponentInputParameter`), never from a sibling task.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable

from kfp import dsl
from kfp.dsl import Artifact, Input, Model


def stored_uri(artifact: Input[Artifact]) -> str:
    """Where an EvoESAP stage's output is stored: its metadata `uri`, the content-addressed storage URI.

    Args:
        artifact: An output artifact of an EvoESAP stage.
    """
    uri = artifact.metadata.get("uri")
    if not uri or not artifact.metadata.get("stage"):
        raise ValueError(f"{artifact.uri} is not an EvoESAP stage's output (its metadata names no stored uri)")
    return uri


@dsl.pipeline(name="evoesap-stored-model", description="The stored model at `uri` as a dsl.Model of that URI")
def import_stored(uri: str) -> Model:
    # Metadata left empty: with reimport=False a cluster's importer then reuses an artifact of this pipeline that
    # already has the URI (on a shared-volume storage root, the stage's own output with its facts)
    imported = dsl.importer(artifact_uri=uri, artifact_class=Model, reimport=False)
    imported.set_display_name("import stored model").set_caching_options(enable_caching=False)
    return imported.output


def make_lookup(image: str) -> Callable:
    """The `stored_uri` component in the stage image (kfp is there; nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(stored_uri)
