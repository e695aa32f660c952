"""Per-stage Kubernetes settings of the compiled pipeline: what a stage's pods ask the cluster for.

The configuration's `resources` section holds one `StageSettings` per stage and an `all` entry merged
under each of them (lists add up, mappings merge, a stage's own value wins). `apply` puts them on a
task: requests, limits, accelerators and environment variables through the KFP DSL; secrets, node
selectors and affinity, tolerations, PVCs, an in-memory /dev/shm, scratch space, image pull secrets,
pod labels and annotations (the Kueue queue, `queue_name`, among them) and the timeout through kfp-kubernetes.
A stage's `image` is the base image its component is built with (`pipeline.dag`). KFP's spec has no
ephemeral-storage resource, so scratch space is a generic ephemeral volume with TMPDIR on it. `RUNTIME_SETTINGS`
are the settings that `pipeline.dag.build_subpipeline` can make inputs of the sub-pipeline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SHM_MOUNT = "/dev/shm"
SCRATCH_MOUNT = "/scratch"
# the quantities KFP's DSL accepts (kfp.dsl.PipelineTask.set_memory_limit, set_cpu_limit): refused when the
# configuration loads, not as an internal error halfway through compiling
_MEMORY = re.compile(r"[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?")
_CPU = re.compile(r"([0-9]*[.])?[0-9]+m?")
# a Kueue LocalQueue's name as the value of the label Kueue reads: a lower-case DNS-1123 name of at most 63 characters
_QUEUE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


# The settings a pipeline parameter can carry, with the parameter's type: those KFP 2.17 takes from a pipeline
# parameter, and `queue_name`, which only a multi-worker search takes at run time (its launcher puts it on the
# TrainJob; a pod label is a constant of the spec). Every other setting is a constant of the spec (set_env_variable,
# pod labels and annotations, timeout, volumes and secrets take no channel). Resources are strings, the accelerator
# count included: the driver reads the parameter's string value (kubeflow/pipelines
# backend/src/v2/driver/driver.go, resolvePodSpecInputRuntimeParameter), so an integer parameter would resolve to ""
# and the pod would get no accelerator.
RUNTIME_SETTINGS: dict[str, type] = {
    "image": str,
    "cpu": str,
    "memory": str,
    "cpu_request": str,
    "memory_request": str,
    "accelerator_type": str,
    "accelerator_count": str,
    "node_selector": dict,
    "tolerations": list,
    "queue_name": str,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Secret(_Strict):
    """A Kubernetes secret whose keys become environment variables (object storage keys, HF_TOKEN)."""

    name: str = Field(description="The secret's name in the pod's namespace.")
    env: dict[str, str] = Field(min_length=1, description="Secret key -> environment variable.")


class Toleration(_Strict):
    """A Kubernetes toleration: the pod may run on nodes with a matching taint."""

    key: str | None = Field(None, description="The taint's key; unset with operator Exists: every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: the taint's value is `value`; Exists: any.")
    value: str | None = Field(None, description="The taint's value (operator Equal).")
    effect: Literal["NoExecute", "NoSchedule", "PreferNoSchedule"] | None = Field(
        None, description="The taint effect tolerated; unset: every effect."
    )
    toleration_seconds: int | None = Field(
        None, strict=True, description="NoExecute only: how long the pod stays after the taint appears; unset: forever."
    )

    def kubernetes(self) -> dict[str, Any]:
        """This toleration in Kubernetes' JSON form (camelCase names, unset fields left out)."""
        return {KUBERNETES_NAMES.get(k, k): v for k, v in self.model_dump(exclude_none=True).items()}

    @classmethod
    def from_kubernetes(cls, value: Any) -> Any:
        """A toleration given in Kubernetes' JSON form, in this model's field names (anything else as given)."""
        if not isinstance(value, Mapping):
            return value
        return {_SNAKE_NAMES.get(k, k): v for k, v in value.items()}


KUBERNETES_NAMES = {"toleration_seconds": "tolerationSeconds"}  # a toleration's field -> its name in Kubernetes' JSON
_SNAKE_NAMES = {v: k for k, v in KUBERNETES_NAMES.items()}


class Volume(_Strict):
    """An existing PersistentVolumeClaim mounted into the pod (e.g. a shared model cache)."""

    pvc: str = Field(description="The PersistentVolumeClaim's name.")
    mount_path: str = Field(description="Where the volume appears in the pod.")
    sub_path: str = Field("", description="A folder of the volume to mount instead of its root.")


class Scratch(_Strict):
    """Temporary space of a given size for the stage (TMPDIR points at it)."""

    size: str = Field(description='Its size, e.g. "200Gi".')
    storage_class: str | None = Field(None, description="The storage class of its volume; unset: the cluster's default.")


class Requirement(_Strict):
    """One node label requirement of an affinity term (Kubernetes' NodeSelectorRequirement)."""

    key: str = Field(description="The node label.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="How the label's value is compared with `values`."
    )
    values: list[str] = Field([], description="The values compared (none for Exists and DoesNotExist).")


class Affinity(_Strict):
    """A node affinity term: required when `weight` is unset, else preferred with that weight."""

    match_expressions: list[Requirement] = Field(min_length=1, description="The requirements a node must meet, all of them.")
    weight: int | None = Field(None, ge=1, le=100, strict=True, description="Unset: required; else preferred with this weight.")


class StageSettings(_Strict):
    """What one stage's pods ask the cluster for; unset fields ask for nothing."""

    cpu: str | None = Field(None, description='CPU limit, e.g. "8".')
    memory: str | None = Field(None, description='Memory limit, e.g. "64G".')
    cpu_request: str | None = Field(None, description="CPU request (what the scheduler reserves).")
    memory_request: str | None = Field(None, description="Memory request (what the scheduler reserves).")
    accelerator_type: str | None = Field(None, description='The accelerator resource, e.g. "nvidia.com/gpu".')
    # strict: `true` or 1.5 is refused, not coerced
    accelerator_count: int = Field(0, ge=0, strict=True, description="Accelerators per pod (with accelerator_type).")
    secrets: list[Secret] = Field([], description="Kubernetes secrets whose keys become environment variables.")
    node_selector: dict[str, str] = Field({}, description="Node labels the pod must run on.")
    tolerations: list[Toleration] = Field([], description="Taints the pod tolerates.")
    volumes: list[Volume] = Field([], description="Existing PersistentVolumeClaims to mount (e.g. a shared model cache).")
    shm_size: str | None = Field(None, description="In-memory /dev/shm of this size (data loaders, NCCL).")
    scratch: Scratch | None = Field(None, description="Temporary space of a given size (TMPDIR points at it).")
    image_pull_secrets: list[str] = Field([], description="Secrets to pull the image with (a private registry).")
    retries: int | None = Field(
        None, ge=0, strict=True, description="Retries of this stage's tasks; unset: the configuration's `retries`."
    )
    env: dict[str, str] = Field({}, description="Plain environment variables, e.g. {HF_HOME: /cache}; secrets go in `secrets`.")
    image: str | None = Field(
        None, description="This stage's image (e.g. a slim CPU image for prune and report); unset: the configuration's `image`."
    )
    timeout: int | None = Field(None, gt=0, strict=True, description="Seconds a pod may run before Kubernetes stops it.")
    labels: dict[str, str] = Field({}, description="Pod labels (cost centre, team, policy selectors).")
    annotations: dict[str, str] = Field({}, description="Pod annotations.")
    node_affinity: list[Affinity] = Field(
        [], description="Beyond `node_selector`: In/NotIn/Exists... terms, required or preferred."
    )
    training_runtime: str | None = Field(
        None,
        description="Search with workers > 1 (a Kubeflow Trainer TrainJob, pipeline.trainjob): the "
        "ClusterTrainingRuntime it runs under; unset: torch-distributed.",
    )
    trainer_version: Literal["2.0", "2.1", "2.2"] = Field(
        "2.2", description="The cluster's Kubeflow Trainer: 2.0, 2.1, or 2.2 and later."
    )
    suspend: bool = Field(False, description="Create the TrainJob suspended, for a queue (Kueue) to admit.")
    queue_name: str | None = Field(
        None,
        description="Kueue LocalQueue: the label kueue.x-k8s.io/queue-name on the multi-worker search's TrainJob (never "
        "on its pods), or on a single-pod stage's pod.",
    )

    @field_validator("memory", "memory_request")
    @classmethod
    def _memory_quantity(cls, value: str | None) -> str | None:
        if value is not None and not _MEMORY.fullmatch(value):
            raise ValueError(f"{value!r} is not a memory quantity: write a whole number with an optional unit, e.g. 64Gi or 512M")
        return value

    @field_validator("cpu", "cpu_request")
    @classmethod
    def _cpu_quantity(cls, value: str | None) -> str | None:
        if value is not None and not _CPU.fullmatch(value):
            raise ValueError(f"{value!r} is not a CPU quantity: write e.g. 8, 0.5 or 500m")
        return value

    @field_validator("queue_name")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        if value is not None and not _QUEUE.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Kueue LocalQueue name: write lower-case letters, digits, '-' and '.', at most 63 "
                "characters, e.g. team-a-gpus"
            )
        return value

    @model_validator(mode="after")
    def _accelerator_pair(self) -> StageSettings:
        if self.accelerator_count and not self.accelerator_type:
            raise ValueError("accelerator_count is set but accelerator_type is not (e.g. nvidia.com/gpu)")
        return self

    @model_validator(mode="after")
    def _one_queue(self) -> StageSettings:
        if self.queue_name and QUEUE_LABEL in self.labels:
            raise ValueError(
                f"the queue is named twice, queue_name {self.queue_name!r} and labels.{QUEUE_LABEL} "
                f"{self.labels[QUEUE_LABEL]!r}: keep queue_name only"
            )
        return self


def merged(shared: StageSettings | None, own: StageSettings | None) -> StageSettings:
    """`own` over `shared`: lists add up, mappings merge, other values from `own` where it sets them."""
    if shared is None or own is None:
        return own or shared or StageSettings()
    values: dict[str, Any] = shared.model_dump(exclude_unset=True)
    for name, value in own.model_dump(exclude_unset=True).items():
        base = values.get(name)
        if isinstance(value, list) and isinstance(base, list):
            values[name] = base + value
        elif isinstance(value, dict) and isinstance(base, dict):
            values[name] = {**base, **value}
        else:
            values[name] = value
    return StageSettings(**values)


def runtime_default(settings: StageSettings, name: str) -> Any:
    """The configured value of a `RUNTIME_SETTINGS` entry in the form its pipeline parameter takes (None: unset).
    `image` is not here: a stage's image defaults to the configuration's (`PipelineConfig.stage_image`)."""
    value = getattr(settings, name)
    if name == "accelerator_count":
        return str(value) if settings.accelerator_type else None
    if name == "tolerations":  # Kubernetes' Toleration JSON, as kfp-kubernetes' add_toleration_json takes it
        return [t.kubernetes() for t in value]
    return value


def apply(task: Any, settings: StageSettings, retries: int, inputs: dict[str, Any] | None = None) -> Any:
    """Put one stage's settings on a task; `retries` is the configuration-wide default. `inputs` maps names of
    `RUNTIME_SETTINGS` to pipeline parameters that replace the configured values."""
    from kfp import kubernetes

    inputs = inputs or {}
    count = settings.retries if settings.retries is not None else retries
    if count:
        task.set_retry(num_retries=count, backoff_duration="30s", backoff_factor=2.0, backoff_max_duration="10m")
    if "image" in inputs:
        task.set_container_image(inputs["image"])
    for setter, name in (
        (task.set_cpu_limit, "cpu"),
        (task.set_memory_limit, "memory"),
        (task.set_cpu_request, "cpu_request"),
        (task.set_memory_request, "memory_request"),
    ):
        value = inputs.get(name, getattr(settings, name))
        if value:
            setter(value)
    accelerators = inputs.get("accelerator_count", settings.accelerator_count)
    if accelerators:
        task.set_accelerator_type(inputs.get("accelerator_type", settings.accelerator_type))
        task.set_accelerator_limit(accelerators)
    for secret in settings.secrets:
        kubernetes.use_secret_as_env(task, secret_name=secret.name, secret_key_to_env=dict(secret.env))
    if "node_selector" in inputs:  # the driver puts the parameter's mapping in place of any fixed labels
        kubernetes.add_node_selector_json(task, inputs["node_selector"])
    else:
        for key, value in settings.node_selector.items():
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
    if "tolerations" in inputs:  # its default holds the configured tolerations
        kubernetes.add_toleration_json(task, inputs["tolerations"])
    else:
        for toleration in settings.tolerations:
            kubernetes.add_toleration(task, **toleration.model_dump())
    for volume in settings.volumes:
        kubernetes.mount_pvc(task, pvc_name=volume.pvc, mount_path=volume.mount_path, sub_path=volume.sub_path)
    if settings.shm_size:
        kubernetes.empty_dir_mount(task, volume_name="shm", mount_path=SHM_MOUNT, medium="Memory", size_limit=settings.shm_size)
    if settings.scratch:
        kubernetes.add_ephemeral_volume(
            task,
            volume_name="scratch",
            mount_path=SCRATCH_MOUNT,
            access_modes=["ReadWriteOnce"],
            size=settings.scratch.size,
            storage_class_name=settings.scratch.storage_class,
        )
        task.set_env_variable("TMPDIR", SCRATCH_MOUNT)
    if settings.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(settings.image_pull_secrets))
    for name, value in settings.env.items():
        task.set_env_variable(name, value)
    for key, value in settings.labels.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    if settings.queue_name:  # a multi-worker search's launcher has none (`trainjob.launcher_settings`): its job does
        kubernetes.add_pod_label(task, label_key=QUEUE_LABEL, label_value=settings.queue_name)
    for key, value in settings.annotations.items():
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    if settings.timeout:
        kubernetes.set_timeout(task, settings.timeout)
    for term in settings.node_affinity:
        kubernetes.add_node_affinity(task, match_expressions=[r.model_dump() for r in term.match_expressions], weight=term.weight)
    return task
