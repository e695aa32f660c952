"""The full model handed to the stages as a small dsl.Model that names it, not as an import of its URI.

A cluster's importer accepts object-store (and oci://) URIs only (backend/src/v2/component/importer_launcher.go:
`objectstore.ParseProviderFromPath` refuses anything else), so a hub name or a path on a shared volume cannot be
imported there. `model_reference` writes a one-line JSON file at KFP's own URI and names the model in the
artifact's metadata `model`; every stage reads it from there (`kfp_artifacts.referenced`), as it reads a stage's
stored URI, and opens the model itself (a hub name at its `@REV`, an object-store URI, a path).
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable

from kfp import dsl
from kfp.dsl import Model, Output


def model_reference(model: str, reference: Output[Model]):
    """A dsl.Model that names the full model.

    Args:
        model: The full MoE model: a checkpoint path or URI, or a hub name (`org/name@REV` at a branch, tag or commit).
        reference: The artifact the stages take as their model; its metadata `model` names it.
    """
    import json
    import os

    os.makedirs(os.path.dirname(reference.path) or ".", exist_ok=True)
    with open(reference.path, "w") as f:
        json.dump({"model": model}, f)
    reference.metadata["model"] = model


def make_reference(image: str) -> Callable:
    """`model_reference` in the stage image (kfp is there; nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(model_reference)
