"""A multi-worker search on Kubeflow: a Kubeflow Trainer v2 `TrainJob` created, followed and reported by the KFP task.

With `search.workers > 1` the pipeline's search task is a launcher (`evoesap.components.trainjob`): it computes the
search's content-addressed output URI exactly as a single-process run would (`evoesap.steps.output_uri`; `workers`
is not part of the key), reuses a finished artifact there, else creates one TrainJob
(trainer.kubeflow.org/v1alpha1, `runtimeRef` to a torch ClusterTrainingRuntime, `torch-distributed` by default)
whose pods run `torchrun -m evoesap.stages.search_workers SPEC` with the runtime's PET_* rendezvous variables. Rank 0
runs the search and publishes the artifact at that URI, the other ranks score (`evoesap.method.distributed`), as with
`evoesap search --workers N` on one machine. The launcher waits for the job's Complete or Failed condition, raises
one line with the job's own reason (and the failed worker's termination message), and hands the URI back so the
KFP output artifact is filled from the same artifact a single-process run publishes.

Topology: one worker per group of `search.gpus_per_worker` GPUs (default one). `resources.search` describes one
node (pod): with `accelerator_count` G each node runs G / gpus_per_worker workers (numProcPerNode, numNodes the
rest of workers); without accelerators each node runs one worker.
The job's body: runtimeRef and trainer (image, command, args, env, numNodes, numProcPerNode, resourcesPerNode), which
every v1alpha1 release has, plus the worker pods' labels, annotations, node selector, tolerations and volumes
(PVCs, /dev/shm) through the field the cluster's Trainer release offers (`resources.search.trainer_version`):
`podSpecOverrides` in 2.0 (no pod metadata there: labels and annotations go to `spec.labels`/`spec.annotations`,
which reach the JobSet and Jobs), `podTemplateOverrides` in 2.1, `runtimePatches` from 2.2 on; each targets the
runtime's replicated job `node` and its container `node`. `suspend` creates the job suspended for a queue
(Kueue) to admit; `timeout` bounds the workers from admission, never the time queued: `activeDeadlineSeconds`
from 2.2 on (Trainer's deadline, made to follow a Kubernetes Job's, whose clock restarts when a suspended job
resumes); before 2.2 the launcher stops the job that long after it was admitted. A suspended job's launcher takes
no timeout of its own. `queue_name` labels the TrainJob only (kueue.x-k8s.io/queue-name, where Kueue's TrainJob
integration reads it), never its pods. Progress and the end are read from the conditions Trainer v2 sets
(Suspended, Complete, Failed) and its `jobsStatus` counts. Node affinity and scratch volumes are refused.

Run-time placement: the template compiled into the pipeline holds the search's settings (`settings`); the launcher
takes the values of `cluster.RUNTIME_SETTINGS` a run gives (`at_run_time`: the image, resources, node selector,
tolerations and queue), lays them over those settings, checks them as the configuration is checked and rebuilds the
template with `job_template` before it creates the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from evoesap import network
from evoesap.errors import ConfigError, EvoESAPError
from evoesap.params import keyed

from .cluster import QUEUE_LABEL, RUNTIME_SETTINGS, StageSettings, Toleration

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
DEFAULT_RUNTIME = "torch-distributed"
ENTRY = "evoesap.stages.search_workers"
POLL_SECONDS = 15.0
DEADLINE_ENV = "EVOESAP_K8S_DEADLINE_S"  # seconds one call to the Kubernetes API may take in all, however slowly it answers
DEFAULT_DEADLINE_S = 60.0
# pod placement a TrainJob's body sends (`pod_patch`), and what it cannot carry, so refused for workers
PLACEMENT = ("node_selector", "tolerations", "volumes", "shm_size")
REFUSED = ("node_affinity", "scratch")
TARGET = "node"  # the replicated job and the container of a torch runtime that run torchrun (torch-distributed's)
PATCH_MANAGER = "evoesap.io/search"  # the owner of the runtimePatches entry (2.2 on)
# what the worker pods ask for; the launcher pod asks for none of it
COMPUTE = ("cpu", "memory", "cpu_request", "memory_request", "accelerator_type", "accelerator_count")
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def check_workers(settings: StageSettings, workers: int, gpus_per_worker: int = 1) -> None:
    """Refuse, when the configuration loads, a multi-worker search whose settings its TrainJob cannot carry."""
    placed = [name for name in REFUSED if getattr(settings, name)]
    if placed:
        raise ConfigError(
            f"resources.search: {', '.join(placed)} cannot reach the pods of a multi-worker search (workers: {workers}) "
            f"through a TrainJob: set them in the ClusterTrainingRuntime {settings.training_runtime or DEFAULT_RUNTIME!r} "
            "(resources.search.training_runtime), or run with workers: 1"
        )
    if settings.accelerator_count and settings.accelerator_count % gpus_per_worker:
        raise ConfigError(
            f"resources.search.accelerator_count {settings.accelerator_count} is not a multiple of search.gpus_per_worker "
            f"{gpus_per_worker}: a node holds whole worker groups"
        )
    procs = procs_per_node(settings, gpus_per_worker)
    if workers % procs:
        raise ConfigError(
            f"search.workers {workers} is not a multiple of the {procs} workers per node "
            "(resources.search.accelerator_count / search.gpus_per_worker): each node runs whole worker groups"
        )


def launcher_settings(settings: StageSettings) -> StageSettings:
    """The launcher task's own pod: storage secrets, env, labels, retries and timeout, no compute and no placement.

    A suspended job waits in a queue (Kueue) before it runs, so the launcher then takes no timeout of its own: the
    timeout bounds the workers from admission (the job's activeDeadlineSeconds, or the launcher's clock before
    Trainer 2.2), never the time spent queueing."""
    dropped = {*COMPUTE, *PLACEMENT, *REFUSED, "training_runtime", "trainer_version", "suspend", "queue_name"}
    if settings.suspend:
        dropped.add("timeout")
    return StageSettings(**{k: v for k, v in settings.model_dump(exclude_unset=True).items() if k not in dropped})


def procs_per_node(settings: StageSettings, gpus_per_worker: int = 1) -> int:
    """Workers per node: one per group of `gpus_per_worker` GPUs, else one."""
    return max(1, (settings.accelerator_count or 0) // gpus_per_worker)


def job_template(settings: StageSettings, image: str, gpus_per_worker: int = 1) -> dict[str, Any]:
    """What the launcher needs to make the job (plain JSON, a task input), compiled into the pipeline and rebuilt at
    run time from its `settings` (`at_run_time`)."""
    requests = {k: v for k, v in (("cpu", settings.cpu_request), ("memory", settings.memory_request)) if v}
    limits = {k: v for k, v in (("cpu", settings.cpu), ("memory", settings.memory)) if v}
    if settings.accelerator_count:
        limits[settings.accelerator_type] = str(settings.accelerator_count)
    procs = procs_per_node(settings, gpus_per_worker)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in settings.env.items()]
    cpu = settings.cpu or settings.cpu_request
    if cpu and "OMP_NUM_THREADS" not in settings.env:  # the node's cores, not the host's, split over its workers
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        env.append({"name": "OMP_NUM_THREADS", "value": str(max(1, int(cores) // procs))})
    for secret in settings.secrets:
        env += [
            {"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key}}} for key, var in secret.env.items()
        ]
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return {
        "runtime": settings.training_runtime or DEFAULT_RUNTIME,
        "image": image,
        "procs_per_node": procs,
        "resources": resources,
        "env": env,
        "labels": dict(settings.labels),
        "annotations": dict(settings.annotations),
        "trainer_version": settings.trainer_version,
        "pod": _pod_fields(settings),
        "suspend": settings.suspend,
        **({"deadline": settings.timeout} if settings.timeout else {}),  # a KFP input holds no None
        **({"queue_name": settings.queue_name} if settings.queue_name else {}),
        "poll_seconds": POLL_SECONDS,
        "settings": settings.model_dump(mode="json", exclude_unset=True, exclude_none=True),  # what `at_run_time` starts from
    }


def at_run_time(template: Mapping[str, Any], values: Mapping[str, Any], workers: int, gpus_per_worker: int = 1) -> dict[str, Any]:
    """The job's template for this run: `values` (the launcher's inputs, named as `cluster.RUNTIME_SETTINGS`; an
    empty one: as compiled) over the compiled settings, validated as the configuration is (`StageSettings`,
    `check_workers` with this run's `workers` and `gpus_per_worker`), the template rebuilt by `job_template`.
    A bad value is one line naming its pipeline input (`search_<setting>`) and the fix."""
    given = {name: value for name, value in values.items() if value not in ("", None, {}, [])}
    unknown = sorted(given.keys() - RUNTIME_SETTINGS.keys())
    if unknown:
        raise ConfigError(
            f"run-time search settings {', '.join(unknown)}: not run-time settings; valid: {', '.join(RUNTIME_SETTINGS)}"
        )
    if "settings" not in template:  # a template made by hand, or compiled before the settings rode in it
        if given:
            raise ConfigError(
                f"the search's job template carries no settings to lay {_named(given)} over: compile the pipeline again"
            )
        return dict(template)
    compiled = dict(template["settings"])
    update = {name: _setting(name, value) for name, value in given.items() if name != "image"}
    try:
        settings = StageSettings(**{**compiled, **update})
    except ValidationError as exc:
        raise ConfigError("; ".join(_refusal(err, given) for err in exc.errors())) from None
    image = given.get("image") or template["image"]
    if "image" in given:
        from evoesap.components import qualified

        if not isinstance(image, str) or not qualified(image):
            raise ConfigError(
                f"the run-time input search_image {image!r} is not fully qualified: write registry/name:tag "
                "(e.g. registry.example.org/evoesap/stage:1)"
            )
    try:
        check_workers(settings, workers, gpus_per_worker)
    except ConfigError as exc:
        if not given:
            raise
        raise ConfigError(f"with the run-time inputs {_named(given)}: {exc}") from None
    return {**job_template(settings, image, gpus_per_worker), "poll_seconds": template.get("poll_seconds", POLL_SECONDS)}


def _setting(name: str, value: Any) -> Any:
    """A run-time value in `StageSettings`' form: the accelerator count a string of digits (as KFP's driver reads
    it), tolerations in Kubernetes' form."""
    if name == "accelerator_count":
        if not (isinstance(value, str) and value.strip().isdigit()):
            raise ConfigError(
                f"the run-time input search_accelerator_count {value!r} is not a whole number of accelerators per node: "
                "give digits, e.g. '8'"
            )
        return int(value)
    if name == "tolerations" and isinstance(value, list):
        return [Toleration.from_kubernetes(t) for t in value]
    return value


def _refusal(err: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """One pydantic error of the run-time settings, at the pipeline input it came from."""
    message = str(err["msg"]).removeprefix("Value error, ")
    field, *rest = err["loc"] or ("",)
    if field in given:
        at = "".join(f"[{p!r}]" for p in rest if p != "[key]")
        value = "" if repr(err.get("input")) in message else f" {err.get('input')!r}"  # a message naming it says it once
        return f"the run-time input search_{field}{at}{value}: {message}"
    return f"with the run-time inputs {_named(given)}: {message}"


def _named(given: Mapping[str, Any]) -> str:
    return ", ".join(f"search_{name}={value!r}" for name, value in given.items())


def _pod_fields(settings: StageSettings) -> dict[str, Any]:
    """The worker pods' placement in Kubernetes' own form: nodeSelector, tolerations, volumes and their mounts."""
    from .cluster import SHM_MOUNT

    volumes = [{"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": v.pvc}} for i, v in enumerate(settings.volumes)]
    mounts = [
        {"name": f"pvc-{i}", "mountPath": v.mount_path, **({"subPath": v.sub_path} if v.sub_path else {})}
        for i, v in enumerate(settings.volumes)
    ]
    if settings.shm_size:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}})
        mounts.append({"name": "shm", "mountPath": SHM_MOUNT})
    tolerations = [t.kubernetes() for t in settings.tolerations]
    fields = {"nodeSelector": dict(settings.node_selector), "tolerations": tolerations, "volumes": volumes}
    return {k: v for k, v in fields.items() if v} | ({"volumeMounts": mounts} if mounts else {})


def pod_patch(template: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainJob spec fields that carry the worker pods' metadata and placement, for the template's Trainer release
    (see the module docstring); empty when there is nothing to send."""
    pod = dict(template.get("pod") or {})
    mounts = pod.pop("volumeMounts", None)
    spec = {**pod, **({"containers": [{"name": TARGET, "volumeMounts": mounts}]} if mounts else {})}
    metadata = {k: dict(template[k]) for k in ("labels", "annotations") if template.get(k)}
    version = template.get("trainer_version", "2.2")
    if version == "2.0":
        out: dict[str, Any] = {k: v for k, v in metadata.items()}  # spec.labels/annotations: the JobSet and its Jobs
        if spec:
            out["podSpecOverrides"] = [{"targetJobs": [{"name": TARGET}], **spec}]
        return out
    if not spec and not metadata:
        return {}
    pod_template = {**({"metadata": metadata} if metadata else {}), **({"spec": spec} if spec else {})}
    if version == "2.1":
        return {"podTemplateOverrides": [{"targetJobs": [{"name": TARGET}], **pod_template}]}
    job = {"name": TARGET, "template": {"spec": {"template": pod_template}}}
    return {
        "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}]
    }


def job_name(out_uri: str) -> str:
    """One name per output: a retried launcher finds the job its earlier attempt started."""
    return f"evoesap-search-{out_uri.rstrip('/').rsplit('/', 1)[-1][:12]}"


# the launcher pod's name and uid, which KFP gives every task's container through the downward API
POD_NAME_ENV, POD_UID_ENV = "KFP_POD_NAME", "KFP_POD_UID"


def launcher_owner() -> dict[str, Any] | None:
    """The owner reference to the launcher's own pod (from KFP's downward-API env), so Kubernetes' garbage collector
    deletes the TrainJob with the pod that launched it (a deleted run leaves no workers behind); None outside a pod
    that has both. Not blocking, not a controller: deleting the pod needs no permission on trainjobs."""
    name, uid = os.environ.get(POD_NAME_ENV, "").strip(), os.environ.get(POD_UID_ENV, "").strip()
    if not (name and uid):
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": False, "blockOwnerDeletion": False}


def trainjob(
    template: Mapping[str, Any], name: str, spec: Mapping[str, Any], workers: int, owner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The TrainJob resource for a worker `spec` (`evoesap.method.distributed.worker_spec`) on `workers` processes;
    `owner`: its owner reference (`launcher_owner`), in the launcher pod's namespace."""
    procs = int(template["procs_per_node"])
    if workers % procs:
        raise ConfigError(
            f"search.workers {workers} is not a multiple of the {procs} workers per node "
            "(resources.search.accelerator_count / search.gpus_per_worker)"
        )
    trainer: dict[str, Any] = {
        "image": template["image"],
        "command": ["torchrun", "-m", ENTRY],
        "args": [json.dumps(spec, sort_keys=True)],
        "numNodes": workers // procs,
        "numProcPerNode": procs,
    }
    if template["env"]:
        trainer["env"] = list(template["env"])
    if template["resources"]:
        trainer["resourcesPerNode"] = dict(template["resources"])
    labels = {"app.kubernetes.io/name": "evoesap", "app.kubernetes.io/component": "search", **template["labels"]}
    if template.get("queue_name"):  # the job's own label, where Kueue reads it; not the pods' (`pod_patch`)
        labels[QUEUE_LABEL] = template["queue_name"]
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if template["annotations"]:
        metadata["annotations"] = dict(template["annotations"])
    if owner is not None:
        metadata["ownerReferences"] = [dict(owner)]
    spec: dict[str, Any] = {
        "runtimeRef": {"name": template["runtime"], "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
        "trainer": trainer,
        **pod_patch(template),
    }
    if template.get("suspend"):
        spec["suspend"] = True
    if template.get("deadline") and template.get("trainer_version", "2.2") not in ("2.0", "2.1"):
        spec["activeDeadlineSeconds"] = int(template["deadline"])
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": metadata, "spec": spec}


def run_search_job(
    template: Mapping[str, Any],
    storage_root: str,
    inputs: Mapping[str, Any],
    params: Mapping[str, Any],
    api_client: Any = None,
    namespace: str | None = None,
    runtime: Mapping[str, Any] | None = None,
) -> str:
    """Run the search stage as a TrainJob (see the module docstring); return its artifact's URI. `runtime`: this run's
    values of `cluster.RUNTIME_SETTINGS` (the launcher's inputs; an empty one: as compiled), checked before anything
    else (`at_run_time`)."""
    from evoesap.method import distributed
    from evoesap.steps import make_params, output_uri
    from evoesap.store import artifacts

    parsed = make_params("search", params)
    template = at_run_time(template, runtime or {}, parsed.workers, parsed.gpus_per_worker)
    out = output_uri("search", storage_root, inputs, parsed)
    artifacts.preflight(out, "search", dict(inputs))
    if artifacts.cached(out, "search", keyed(parsed), dict(inputs)) is not None:
        log.info("search: reusing the finished artifact at %s", artifacts.redact(out))
        return out
    api_client = api_client or _api_client()
    namespace = namespace or _namespace()
    spec = distributed.worker_spec(inputs, parsed, out)
    body = trainjob(template, job_name(out), spec, parsed.workers, launcher_owner())
    # Trainer before 2.2 has no activeDeadlineSeconds: the launcher stops the job itself, counting from admission
    deadline = template.get("deadline") if template.get("trainer_version", "2.2") in ("2.0", "2.1") else None
    with _stop_on_sigterm():
        _TrainJob(api_client, namespace, body, float(template.get("poll_seconds", POLL_SECONDS)), deadline).run()
    try:
        artifacts.read_manifest(out, "search")
    except EvoESAPError as exc:
        raise EvoESAPError(
            f"TrainJob {namespace}/{body['metadata']['name']} completed but published no search "
            f"artifact at {artifacts.redact(out)}: {exc}"
        ) from None
    return out


class _TrainJob:
    """One TrainJob through the Kubernetes API: created (or adopted), followed to its end, deleted when abandoned."""

    clock = staticmethod(time.monotonic)  # what the admission deadline is measured with

    def __init__(
        self, api_client: Any, namespace: str, body: dict[str, Any], poll_seconds: float, deadline: float | None = None
    ) -> None:
        from kubernetes import client

        self.objects, self.core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
        self.namespace, self.body, self.poll = namespace, body, poll_seconds
        self.deadline = deadline  # seconds the job may run once admitted, where the launcher enforces it
        self.name = body["metadata"]["name"]
        self.where = f"TrainJob {namespace}/{self.name}"

    def run(self) -> None:
        """Create the job and follow it; its Failed condition is raised as one line (the job kept for inspection)."""
        self._create()
        ended = None
        try:
            ended = self._wait()
        finally:
            if ended is None:  # cancelled (SIGTERM) or the launcher failed: its workers must not run on unseen
                self._delete()
        if ended["type"] == "Failed":
            raise EvoESAPError(self._failure(ended))
        log.info("%s completed", self.where)

    def _create(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._call(
                "create", lambda: self.objects.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.body)
            )
            log.info(
                "created %s (%d nodes x %d workers)",
                self.where,
                self.body["spec"]["trainer"]["numNodes"],
                self.body["spec"]["trainer"]["numProcPerNode"],
            )
            return
        except ApiException as exc:
            if exc.status != 409:
                raise self._refused("create", exc) from None
        existing = self._get()
        if _condition(existing, ("Complete", "Failed")) is None:
            log.info("%s is already running (an earlier attempt of this task): following it", self.where)
            self._own(existing)
            return
        log.info("%s ended in an earlier attempt without a usable artifact: replacing it", self.where)
        self._delete()
        while self._get(missing_ok=True) is not None:
            time.sleep(self.poll)
        try:
            self._call(
                "create", lambda: self.objects.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.body)
            )
        except ApiException as exc:
            raise self._refused("create", exc) from None

    def _own(self, existing: dict[str, Any]) -> None:
        """Add this launcher's pod to the owners of the job an earlier attempt started: the earlier pod, once deleted,
        must not take the job with it (the garbage collector deletes a dependent only when all its owners are gone).
        Without patch on trainjobs this is said, and the job followed all the same."""
        from kubernetes.client.exceptions import ApiException

        theirs = existing.get("metadata", {}).get("ownerReferences") or []
        known = {owner.get("uid") for owner in theirs}
        ours = [owner for owner in self.body["metadata"].get("ownerReferences") or [] if owner["uid"] not in known]
        if not ours:
            return
        patch = {"metadata": {"ownerReferences": [*theirs, *ours]}}  # a merge patch replaces the list: keep theirs
        try:
            self._call("patch", lambda: self.objects.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, patch
            ))  # fmt: skip
            log.info("%s is owned by this launcher's pod too", self.where)
        except ApiException as exc:
            detail = _first_line(network.scrub(_api_message(exc.body) or network.decode(exc.reason)))
            log.warning(
                "%s stays owned by the earlier attempt's pod only (HTTP %s: %s): deleting that pod deletes the job; give "
                "the pipeline's service account patch on trainjobs.%s",
                self.where, exc.status, detail, GROUP,
            )  # fmt: skip

    def _wait(self) -> dict[str, Any]:
        """Follow the job until it ends: its Complete or Failed condition (or past `deadline` after admission)."""
        seen, admitted = None, None
        while True:
            job = self._get()
            ended = _condition(job, ("Complete", "Failed"))
            if ended is not None:
                return ended
            if admitted is None and _condition(job, ("Suspended",)) is None:
                admitted = self.clock()  # queue time (suspended, waiting for Kueue) never counts
            if self.deadline is not None and admitted is not None and self.clock() - admitted > self.deadline:
                raise EvoESAPError(
                    f"search {self.where} ran past resources.search.timeout ({self.deadline:g} s after it was "
                    "admitted) and was stopped: raise the timeout, or give the search fewer generations"
                )
            state = _progress(job)
            if state != seen:
                log.info("%s: %s", self.where, state)
                seen = state
            time.sleep(self.poll)

    def _failure(self, condition: Mapping[str, Any]) -> str:
        reason = condition.get("reason") or "Failed"
        message = _first_line(condition.get("message") or "")
        worker = self._worker_message()
        text = f"search {self.where} failed ({reason})" + (f": {message}" if message else "")
        return text + (f"; {worker}" if worker and worker not in text else "")

    def _worker_message(self) -> str:
        """The termination message of the worker that failed first (`search_workers` writes its one-line error there)."""
        from kubernetes.client.exceptions import ApiException

        try:
            selector = f"jobset.sigs.k8s.io/jobset-name={self.name}"
            pods = self._call("list the pods of", lambda: self.core.list_namespaced_pod(self.namespace, label_selector=selector))
        except (ApiException, EvoESAPError):
            return ""  # no right to list pods: the job's own reason stands alone
        ended = []
        for pod in pods.items:
            for status in pod.status.container_statuses or []:
                done = status.state.terminated if status.state else None
                if done is not None and done.exit_code and (done.message or "").strip():
                    ended.append((done.exit_code in (137, 143), done.finished_at or 0, pod.metadata.name, done.message))
        if not ended:
            return ""
        _, _, pod, message = min(ended, key=lambda e: (e[0], str(e[1]), e[2]))  # not a SIGTERMed bystander first
        return f"pod {pod}: {_first_line(message)}"

    def _get(self, missing_ok: bool = False) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call(
                "read", lambda: self.objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
            )
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise self._refused("read", exc) from None

    def _delete(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._call("delete", lambda: self.objects.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name, propagation_policy="Foreground"
            ))  # fmt: skip
            log.info("deleted %s", self.where)
        except ApiException:
            pass
        except EvoESAPError as exc:  # not answered in time: said, as the job may be left running
            log.warning("%s", exc)

    def _call(self, verb: str, request: Any) -> Any:
        """`request()` within $EVOESAP_K8S_DEADLINE_S in all; a reply that is not UTF-8 text is one line."""
        seconds = network.deadline_s(DEADLINE_ENV, DEFAULT_DEADLINE_S)
        configuration = getattr(getattr(self.objects, "api_client", None), "configuration", None)
        host = network.redact(getattr(configuration, "host", "") or "")
        try:
            return network.call(lambda stop: request(), seconds=seconds, knob=DEADLINE_ENV, error=EvoESAPError,
                                what=f"the Kubernetes API {host} asked to {verb} {self.where}".replace("  ", " "))  # fmt: skip
        except UnicodeDecodeError:
            raise EvoESAPError(
                f"the Kubernetes API {host} answered the request to {verb} {self.where} with bytes that are not UTF-8 "
                "text: check the cluster's API endpoint (KUBECONFIG) and any proxy in front of it"
            ) from None

    def _refused(self, verb: str, exc: Any) -> EvoESAPError:
        detail = _first_line(network.scrub(_api_message(exc.body) or network.decode(exc.reason)))
        if exc.status == 404 and verb == "create":
            return EvoESAPError(
                f"the cluster has no {KIND} API ({GROUP}/{VERSION}) in namespace {self.namespace}: "
                f"install Kubeflow Trainer v2, or run the search with workers: 1 ({detail})"
            )
        if exc.status in (401, 403):
            return EvoESAPError(
                f"the Kubernetes API refused to {verb} {self.where} (HTTP {exc.status}): give the "
                f"pipeline's service account create, get and delete on trainjobs.{GROUP} and list on "
                f"pods in {self.namespace} ({detail})"
            )
        return EvoESAPError(f"the Kubernetes API could not {verb} {self.where} (HTTP {exc.status}): {detail}")


def _progress(job: Mapping[str, Any] | None) -> str:
    """What a running job is doing, as Trainer v2 reports it: suspended (waiting for admission), else its Jobs' pod
    counts (`status.jobsStatus`), else pending."""
    suspended = _condition(job, ("Suspended",))
    if suspended is not None:
        return f"suspended ({suspended.get('reason') or 'Suspended'}): waiting for admission"
    jobs = ((job or {}).get("status") or {}).get("jobsStatus") or []
    if not jobs:
        return "pending"
    counts = {k: sum(int(j.get(k) or 0) for j in jobs) for k in ("ready", "active", "succeeded", "failed")}
    return "running: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n) if any(counts.values()) else "pending"


def _condition(job: Mapping[str, Any] | None, types: tuple[str, ...]) -> dict[str, Any] | None:
    for condition in ((job or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") in types and condition.get("status") == "True":
            return condition
    return None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0][:500] if lines else ""


def _api_message(body: Any) -> str:
    try:
        return str(json.loads(network.decode(body)).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        return ""


def _api_client() -> Any:
    """The Kubernetes API: the pod's service account inside a cluster, else the kubeconfig (KUBECONFIG)."""
    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:  # the variable as it is now (the client reads it once, when imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except config.ConfigException as exc:
        raise EvoESAPError(
            f"no Kubernetes API to create the search's TrainJob in ({exc}): run the pipeline on a "
            "cluster, or point KUBECONFIG at one"
        ) from None
    return client.ApiClient()


def _namespace() -> str:
    """The launcher pod's own namespace (a KFP profile's), else the kubeconfig context's, else default."""
    if _NAMESPACE_FILE.is_file():
        return _NAMESPACE_FILE.read_text().strip()
    from kubernetes import config

    with contextlib.suppress(Exception):
        return config.list_kube_config_contexts(os.environ.get("KUBECONFIG"))[1]["context"].get("namespace") or "default"
    return "default"


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM (a cancelled KFP run) ends the wait as an exception, so the job is deleted on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
