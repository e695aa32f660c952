"""A team's step after EvoESAP: each released model handed to a model registry (`evoesap.release.registry`), MLflow's
or the Kubeflow Model Registry.

It takes the (sub-)pipeline's `released_models` and skips the withheld entries of releases the gate refused, so it
runs whatever the verdict. The server and its token come from the task's environment (MLFLOW_TRACKING_URI and
MLFLOW_TRACKING_TOKEN, or EVOESAP_KF_REGISTRY_URL and EVOESAP_KF_REGISTRY_TOKEN, from a Kubernetes secret): set them on
the task this component makes.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable, List

from kfp import dsl
from kfp.dsl import Input, Model


def register_models(released: Input[List[Model]], name: str, registry: str = "mlflow") -> str:
    """Register each released model as a version of `name` in a model registry, its lineage as tags.

    Args:
        released: The EvoESAP (sub-)pipeline's released_models; withheld entries (a release the gate refused) are
            skipped.
        name: The registered model's name.
        registry: mlflow (MLflow's model registry) or kubeflow (the Kubeflow Model Registry; the image needs the
            evoesap[kubeflow-registry] extra).

    Returns:
        Output: The registered versions, as JSON: a list of {"version", "source"}.
    """
    import json

    from evoesap.components.kfp_artifacts import source

    from evoesap.release.registry import register

    done = []
    for model in released:
        if model.metadata.get("withheld"):
            print(f"skipped (withheld): {model.metadata.get('reason')}")
            continue
        entry = register(source(model), name, registry=registry)
        done.append({"version": entry.version, "source": entry.source})
    return json.dumps(done)


def make_registrar(image: str) -> Callable:
    """`register_models` in the stage image (nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(register_models)
