"""The model artifact brought into the run's KFP workspace once, for every stage to read there.

KFP's launcher downloads every input artifact of a task into its pod (backend/src/v2/component/launcher_v2.go
`downloadArtifacts`), so a team's `Output[Model]` handed to the DAG is downloaded again by each stage pod that takes
it. `model_to_workspace` takes it once (one download, into its own pod), copies it into the run's workspace volume
and hashes it there (the digests kept in the workspace: `store.digest_cache`), and hands on a reference naming the
copy (`components.reference`), a file of one line that is all each stage pod downloads. A task whose input holds
`dsl.WORKSPACE_PATH_PLACEHOLDER` gets the workspace mounted at /kfp-workspace (backend/src/v2/driver/driver.go
`needsWorkspaceMount`, backend 2.15.0), so each task that takes the full model is given the workspace path (the
sub-pipeline's `workspace` input, which the embedding pipeline binds to that placeholder) as its `workspace` input.

Not KFP's own `dsl.importer(download_to_workspace=True)`: its consumers skip the download only where they take its
output from the task itself; passed into a sub-DAG (the ParallelFor of the search and prune steps) the artifact is read
back from ML Metadata without the flag that says where it lies (driver/resolve.go `setWorkspaceFlag`, metadata/
converter.go drops `_kfp_workspace`), and those pods download it again. The importer also takes its URI from a pipeline
input only (component/importer_launcher.go), and from object stores only.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable

from kfp import dsl
from kfp.dsl import Input, Model, Output

MODEL_DIR = ".evoesap/model"  # the model's copy, under the workspace
DIGEST_DIR = ".evoesap/digests"  # the weights' digests, under the workspace (one file each: store.digest_cache)


def model_to_workspace(model: Input[Model], workspace: str, reference: Output[Model]):
    """Copy the model into the run's workspace once, hash it there, and name the copy for the stages.

    Args:
        model: The full model as a checkpoint artifact (a team's Output[Model]).
        workspace: The run's workspace path (dsl.WORKSPACE_PATH_PLACEHOLDER).

    Returns:
        reference: The artifact the stages take as their model; its metadata `model` names the copy in the workspace.
    """
    from evoesap.components.workspace import copy_into

    copy_into(model, workspace, reference)


def copy_into(model, workspace: str, reference) -> None:
    """`model_to_workspace`'s body: a model that names its model in its metadata (a reference, one of our artifacts) is
    read from there by every stage and passes through; a checkpoint is copied (under a private name, then renamed: a
    retry replaces a partial copy) and hashed into the workspace's digest directory."""
    import glob
    import logging
    import os
    import shutil
    import uuid

    from evoesap.components.kfp_artifacts import referenced
    from evoesap.components.reference import model_reference

    from evoesap.errors import ArtifactError
    from evoesap.store.identity import identify, summary

    log = logging.getLogger(__name__)
    named = referenced(model)
    if not named:
        if not os.path.isdir(model.path):
            raise ArtifactError(
                f"the model artifact at {model.path} is not a checkpoint directory: give an Output[Model] directory"
            )
        target = os.path.join(workspace, MODEL_DIR)
        for earlier in glob.glob(f"{glob.escape(target)}.*.partial"):  # an attempt killed while copying
            shutil.rmtree(earlier, ignore_errors=True)
        staged = f"{target}.{uuid.uuid4().hex}.partial"
        shutil.copytree(model.path, staged)
        shutil.rmtree(target, ignore_errors=True)  # a retry's earlier copy: no stage has started on it
        os.rename(staged, target)
        share_digests(workspace)
        log.info("model copied into the workspace at %s: %s", target, summary(identify(target)[0]))
        named = target
    model_reference(named, reference)


def make_model_to_workspace(image: str) -> Callable:
    """`model_to_workspace` in the stage image (kfp is there; nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(model_to_workspace)


def share_digests(workspace: str) -> None:
    """In a stage given the run's workspace (its `workspace` input), keep the weights' digests there, one file each, so
    that it reads those `model_to_workspace` computed instead of hashing the checkpoint again (over a digest cache in
    the pod's home, which no other pod sees). A digest directory chosen in the task's environment is kept."""
    import os

    from evoesap.store import digest_cache

    if workspace:
        os.environ.setdefault(digest_cache.DIRECTORY_ENV, os.path.join(workspace, DIGEST_DIR))
