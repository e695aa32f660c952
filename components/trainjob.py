"""The search stage's launcher component for `workers > 1`: the search runs as a Kubeflow Trainer TrainJob
(`evoesap.pipeline.trainjob`) and this task waits for it, then fills the same output artifact as the `search`
component, from the same content-addressed artifact a single-process search publishes."""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Any, Optional

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output


def search_trainjob(
    model: Input[Model],
    scores: Input[Dataset],
    cache: Input[Dataset],
    criterion: str,
    sparsity: float,
    storage_root: str,
    job: dict,
    allocation: Output[Artifact],
    heldout_cache: Optional[Input[Dataset]] = None,
    params: dict = {},
    image: str = "",
    cpu: str = "",
    memory: str = "",
    cpu_request: str = "",
    memory_request: str = "",
    accelerator_type: str = "",
    accelerator_count: str = "",
    node_selector: dict = {},
    tolerations: list = [],
    queue_name: str = "",
):
    """Search the per-layer expert allocation on several workers: a Kubeflow Trainer TrainJob, followed to its end.

    The settings after `params` place the job's worker pods at run time (the sub-pipeline's `search_<setting>`
    inputs); each replaces the compiled value of `resources.search`, and an empty one keeps it.

    Args:
        model: The full MoE model (as the search component's).
        scores: The calibrate stage's scores: the within-layer pruning order of `criterion`.
        cache: The teacher cache of the search samples.
        criterion: Importance criterion whose order the allocation applies: frequency, seer, ean or reap.
        sparsity: Global share of routed experts removed, in (0, 1).
        storage_root: Where EvoESAP keeps its content-addressed artifacts (a path reachable by the job's pods, s3://, gs://).
        job: The TrainJob's template (evoesap.pipeline.trainjob.job_template): runtime, image, workers per node, resources, env.
        heldout_cache: Teacher cache of other samples for the held-out check; without it a share of `cache` is held out.
        params: Parameters of the search stage, as in the pipeline configuration's `search` section; `workers` processes in all.
        image: The workers' image (fully qualified), and this launcher's.
        cpu: CPU limit of each node (pod), e.g. "16"; it also sets the workers' OMP_NUM_THREADS.
        memory: Memory limit of each node, e.g. "120Gi".
        cpu_request: CPU request of each node.
        memory_request: Memory request of each node.
        accelerator_type: The accelerator resource, e.g. "nvidia.com/gpu".
        accelerator_count: Accelerators per node, as digits, e.g. "8": a multiple of `gpus_per_worker`, and the workers a multiple of the workers per node.
        node_selector: Node labels the worker pods must run on, in place of the compiled ones.
        tolerations: Taints the worker pods tolerate (Kubernetes' form), in place of the compiled ones.
        queue_name: Kueue LocalQueue: the label kueue.x-k8s.io/queue-name on the TrainJob (not on its pods).

    Returns:
        allocation: The chosen allocation (allocation.json, search history); metadata: fitness, held-out check, cost.
    """
    from evoesap.components.kfp_artifacts import publish
    from evoesap.components.trainjob import shared
    from evoesap.pipeline.trainjob import run_search_job

    inputs = {"model": shared(model), "scores": shared(scores), "cache": shared(cache), "heldout_cache": shared(heldout_cache)}
    runtime = dict(
        image=image,
        cpu=cpu,
        memory=memory,
        cpu_request=cpu_request,
        memory_request=memory_request,
        accelerator_type=accelerator_type,
        accelerator_count=accelerator_count,
        node_selector=node_selector,
        tolerations=tolerations,
        queue_name=queue_name,
    )
    uri = run_search_job(job, storage_root, inputs, {**params, "criterion": criterion, "sparsity": sparsity}, runtime=runtime)
    publish(allocation, uri)


def shared(artifact: Any) -> Optional[str]:
    """The URI of an input artifact that every pod of the job reads alike: the one its metadata names
    (`kfp_artifacts.referenced`); anything else, the artifact's own URI (at its hub `revision`), never the copy
    KFP made inside this launcher's pod."""
    from evoesap.components.kfp_artifacts import referenced

    from evoesap.store.identity import pin

    if artifact is None:
        return None
    return referenced(artifact) or pin(artifact.uri, artifact.metadata.get("revision") or None)


def make_search_trainjob(image: str) -> dsl.component:
    """The launcher component bound to the stage image (it runs the Kubernetes client the image already has)."""
    return dsl.component(search_trainjob, base_image=image, install_kfp_package=False)
