"""A `workers > 1` search on Kubeflow (evoesap.pipeline.trainjob): the compiled launcher task, and the launcher
against a recording Kubernetes API server on 127.0.0.1 standing in for a cluster with Kubeflow Trainer v2."""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from evoesap.pipeline import trainjob
from evoesap.pipeline.cluster import StageSettings
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline
from evoesap.pipeline.trainjob import job_template, launcher_settings, run_search_job
from recording_http import JsonHandler, serving
from remote_config import REMOTE_CONFIG
from tiny_world import make_tiny_inputs

from evoesap.errors import ConfigError, EvoESAPError
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.search import SearchParams, run_search
from evoesap.steps import output_uri, run_step
from evoesap.store import artifacts

BASE = {**REMOTE_CONFIG, "image": "registry.example.org/evoesap/stage:1"}
GPU_NODES = {
    "cpu": "16",
    "memory": "120Gi",
    "cpu_request": "12",
    "memory_request": "100Gi",
    "accelerator_type": "nvidia.com/gpu",
    "accelerator_count": 2,
    "env": {"NCCL_DEBUG": "WARN"},
    "secrets": [{"name": "s3-credentials", "env": {"access_key": "AWS_ACCESS_KEY_ID"}}],
}
JOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs"
SMALL = dict(criterion="reap", sparsity=0.5, population=4, elites=1, generations=1, batch_size=8)


# ------------------------------------------------------------------------------------------ the compiled pipeline


def _compile(tmp_path: Path, **overrides: Any) -> dict:
    path = compile_pipeline(load_config({**BASE, **overrides}), tmp_path / "pipeline.yaml")
    spec, *platform = yaml.safe_load_all(path.read_text())
    return {"spec": spec, "platform": platform[0]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if platform else {}}


def _tasks(spec: dict) -> dict[str, dict]:
    return {
        name: task
        for component in spec["components"].values()
        for name, task in component.get("dag", {}).get("tasks", {}).items()
    }


def test_a_two_worker_search_compiles_to_the_trainjob_launcher_with_the_job_it_creates(tmp_path):
    compiled = _compile(tmp_path, search={"workers": 2, "generations": 3}, resources={"search": GPU_NODES})
    spec = compiled["spec"]
    tasks = _tasks(spec)
    (launcher,) = [t for t in tasks.values() if t["componentRef"]["name"] == "comp-search-trainjob"]
    assert "comp-search" not in spec["components"]  # the plain search task is gone
    assert launcher["taskInfo"]["name"] == "search on 2 workers (TrainJob)"
    job = launcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"]
    assert job["runtime"] == "torch-distributed" and job["image"] == BASE["image"] and job["procs_per_node"] == 2
    assert job["resources"] == {
        "requests": {"cpu": "12", "memory": "100Gi"},
        "limits": {"cpu": "16", "memory": "120Gi", "nvidia.com/gpu": "2"},
    }
    assert {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": "access_key"}}} in job[
        "env"
    ]
    assert {"name": "OMP_NUM_THREADS", "value": "8"} in job["env"]  # 16 cores over 2 workers per node
    # the search's parameters reach the launcher unchanged, and without device_map: one worker per GPU
    search_params = spec["root"]["inputDefinitions"]["parameters"]["search_params"]["defaultValue"]
    assert search_params == {"workers": 2, "generations": 3}
    executor = spec["deploymentSpec"]["executors"]["exec-search-trainjob"]["container"]
    assert executor["image"] == BASE["image"] and "run_search_job" in executor["command"][-1]
    assert not executor.get("resources")  # the launcher's own pod asks for no GPU, CPU or memory
    assert [s["secretName"] for s in compiled["platform"]["exec-search-trainjob"]["secretAsEnv"]] == ["s3-credentials"]


def test_workers_that_are_gpu_groups_run_one_process_per_group_on_each_node(tmp_path):
    eight = {**GPU_NODES, "accelerator_count": 8}
    search = {"workers": 4, "gpus_per_worker": 4, "device_map": "auto"}
    spec = _compile(tmp_path, search=search, resources={"search": eight})["spec"]
    (launcher,) = [t for t in _tasks(spec).values() if t["componentRef"]["name"] == "comp-search-trainjob"]
    job = launcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"]
    assert job["procs_per_node"] == 2 and job["resources"]["limits"]["nvidia.com/gpu"] == "8"  # two groups of 4 a node
    assert {"name": "OMP_NUM_THREADS", "value": "8"} in job["env"]
    body = trainjob.trainjob(job, "evoesap-search-x", {"params": search}, workers=4)
    assert body["spec"]["trainer"]["numNodes"] == 2 and body["spec"]["trainer"]["numProcPerNode"] == 2


@pytest.mark.parametrize(
    "env", [{}, {"KFP_POD_NAME": "launcher"}, {"KFP_POD_UID": "0f1e2d3c"}, {"KFP_POD_NAME": " ", "KFP_POD_UID": "u"}]
)
def test_a_launcher_outside_a_kfp_pod_makes_a_job_without_an_owner(monkeypatch, env):
    for name in ("KFP_POD_NAME", "KFP_POD_UID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert trainjob.launcher_owner() is None  # a half-known owner would name another pod, or none Kubernetes accepts
    body = trainjob.trainjob(_template(), "evoesap-search-x", {"params": SMALL}, 4, trainjob.launcher_owner())
    assert "ownerReferences" not in body["metadata"]


def test_each_worker_of_a_node_spreads_its_replica_over_its_own_gpus(monkeypatch):
    from evoesap.method import distributed

    groups = []
    for rank in range(3):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        groups.append(SearchParams(**SMALL, workers=3, gpus_per_worker=2, device_map="auto").placement["gpus"])
    assert groups == [[0, 1], [2, 3], [4, 5]]
    monkeypatch.delenv("LOCAL_RANK")
    assert distributed.worker_gpus(4) == [0, 1, 2, 3]  # one process alone: the first group
    assert SearchParams(**SMALL, workers=2).placement["gpus"] is None  # one GPU a worker: its local rank's


def test_one_worker_keeps_the_plain_search_task(tmp_path):
    spec = _compile(tmp_path, search={"workers": 1}, resources={"search": GPU_NODES})["spec"]
    assert "comp-search" in spec["components"] and "comp-search-trainjob" not in spec["components"]
    resources = spec["deploymentSpec"]["executors"]["exec-search"]["container"]["resources"]
    assert resources["accelerator"]["resourceCount"] == "2"


@pytest.mark.parametrize(
    ("search", "resources", "message"),
    [
        (
            {"workers": 2},
            {"search": {"node_affinity": [{"match_expressions": [{"key": "pool", "operator": "Exists"}]}]}},
            "node_affinity cannot reach the pods of a multi-worker",
        ),
        ({"workers": 2}, {"all": {"scratch": {"size": "8Gi"}}}, "scratch .*ClusterTrainingRuntime 'torch-distributed'"),
        ({"workers": 1}, {"prune": {"suspend": True}}, "resources.prune.suspend: only the search runs as a multi-worker"),
        ({"workers": 3}, {"search": GPU_NODES}, "workers 3 is not a multiple of the 2 workers per node"),
        (
            {"workers": 2, "gpus_per_worker": 4, "device_map": "auto"},
            {"search": GPU_NODES},
            "accelerator_count 2 is not a multiple of search.gpus_per_worker 4",
        ),
        ({"workers": 2, "gpus_per_worker": 2}, {"search": GPU_NODES}, "gpus_per_worker=2 spreads .* set device_map: auto"),
        ({"workers": 2, "device_map": "auto"}, {"search": GPU_NODES}, "drop device_map 'auto', or set gpus_per_worker"),
        ({"workers": 1}, {"prune": {"training_runtime": "mine"}}, "only the search runs as a multi-worker job"),
    ],
)
def test_settings_a_trainjob_cannot_carry_are_refused_when_the_configuration_loads(search, resources, message):
    with pytest.raises(ConfigError, match=message):
        load_config({**BASE, "search": search, "resources": resources})


# ------------------------------------------------------------------------------------ a recording Kubernetes API


class KubeAPI(JsonHandler):
    """The TrainJob and pod calls of the launcher; each (method, path, body) recorded. `states`: what successive
    looks at the job answer (a condition type, "" for none yet, or an HTTP status); `on_complete` runs before the
    Complete answer (the job's rank 0 publishing); `existing`: a job of that name already there (409 on create)."""

    requests: list[tuple[str, str, Any]] = []
    states: list[Any] = []
    failure: dict[str, str] = {}
    pods: list[dict] = []
    existing: dict | None = None
    on_complete: Callable[[dict], None] | None = None
    patch_status: int | None = None  # the status a PATCH is refused with; None: applied

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null") if length else None

    def do_POST(self):  # noqa: N802
        body = self._body()
        self.requests.append(("POST", self.path, body))
        if KubeAPI.existing is not None:
            self._reply({"kind": "Status", "status": "Failure", "reason": "AlreadyExists", "code": 409}, 409)
            return
        KubeAPI.existing = body
        self._reply(body, 201)

    def do_GET(self):  # noqa: N802
        url = urllib.parse.urlparse(self.path)
        self.requests.append(("GET", url.path, urllib.parse.parse_qs(url.query)))
        if url.path == "/api/v1/namespaces/team-a/pods":
            self._reply({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": self.pods})
            return
        if KubeAPI.existing is None:
            self._reply({"kind": "Status", "code": 404}, 404)
            return
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(state, int):
            self._reply({"kind": "Status", "message": "etcdserver: request timed out", "code": state}, state)
            return
        conditions = []  # Trainer v2's condition types: Suspended, Complete, Failed (no Created)
        if state == "Complete" and KubeAPI.on_complete is not None:
            KubeAPI.on_complete(KubeAPI.existing)
            KubeAPI.on_complete = None
        if state in ("Complete", "Failed", "Suspended"):
            conditions.append({"type": state, "status": "True", **(self.failure if state == "Failed" else {})})
        jobs = [{"name": "node", "active": 2, "ready": 2, "succeeded": 0, "failed": 0}] if state == "" else []
        self._reply({**KubeAPI.existing, "status": {"conditions": conditions, "jobsStatus": jobs}})

    def do_PATCH(self):  # noqa: N802
        body = self._body()
        self.requests.append(("PATCH", self.path, body))
        if KubeAPI.patch_status is not None:
            self._reply(
                {"kind": "Status", "message": "trainjobs is forbidden", "code": KubeAPI.patch_status}, KubeAPI.patch_status
            )
            return
        KubeAPI.existing = {**KubeAPI.existing, "metadata": {**KubeAPI.existing["metadata"], **body["metadata"]}}
        self._reply(KubeAPI.existing)

    def do_DELETE(self):  # noqa: N802
        self.requests.append(("DELETE", self.path, self._body()))
        KubeAPI.existing = None
        self._reply({"kind": "Status", "status": "Success"})


@pytest.fixture
def kube(tmp_path, monkeypatch) -> Iterator[str]:
    """The API on 127.0.0.1, reached the way the launcher outside a cluster reaches one: a kubeconfig (namespace team-a)."""
    KubeAPI.requests, KubeAPI.states, KubeAPI.failure, KubeAPI.pods = [], [""], {}, []
    KubeAPI.existing, KubeAPI.on_complete, KubeAPI.patch_status = None, None, None
    with serving(KubeAPI) as url:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "team-a"}}],
        }
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield url


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainjob")
    files = make_tiny_inputs(root)
    inputs = {"model": files["model"], "scores": str(root / "scores"), "cache": str(root / "cache"), "heldout_cache": None}
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=8, max_length=128), inputs["scores"])
    run_cache_logits(
        files["model"], files["search"], CacheLogitsParams(samples=6, max_length=128, dtype="float32"), inputs["cache"]
    )
    return inputs


def _template(workers_per_node: int = 2) -> dict:
    config = load_config({**BASE, "search": {"workers": 4}, "resources": {"search": GPU_NODES}})
    template = job_template(config.settings("search"), config.stage_image("search"))
    assert template["procs_per_node"] == workers_per_node
    return {**template, "poll_seconds": 0}


def _rank_zero(job: dict) -> None:
    """What the job's rank 0 does, here in one process: the search into the URI the launcher gave it."""
    (spec,) = job["spec"]["trainer"]["args"]
    spec = json.loads(spec)
    run_search(**spec["inputs"], params=SearchParams(**{**spec["params"], "workers": 1}), out_uri=spec["out_uri"])


def _calls(method: str) -> list[tuple[str, Any]]:
    return [(path, body) for m, path, body in KubeAPI.requests if m == method]


def test_the_launcher_creates_the_trainjob_waits_for_it_and_returns_the_single_process_artifact(
    kube, world, tmp_path, monkeypatch
):
    root = str(tmp_path / "store")
    params = {**SMALL, "workers": 4}
    KubeAPI.states, KubeAPI.on_complete = ["", "", "Complete"], _rank_zero
    monkeypatch.setenv("KFP_POD_NAME", "tiny-run-search-trainjob-driver-123")  # KFP's downward API in the launcher pod
    monkeypatch.setenv("KFP_POD_UID", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    uri = run_search_job(_template(), root, world, params)
    ((path, job),) = _calls("POST")
    assert path == JOBS
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert re.fullmatch(r"evoesap-search-[0-9a-f]{12}", job["metadata"]["name"])
    # owned by the launcher pod: deleted with it (a deleted run leaves no workers), never blocking its deletion
    ((owner,),) = [job["metadata"]["ownerReferences"]]
    assert owner == {"apiVersion": "v1", "kind": "Pod", "name": "tiny-run-search-trainjob-driver-123",
                     "uid": "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "controller": False, "blockOwnerDeletion": False}  # fmt: skip
    assert job["spec"]["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)  # 4 workers, one per GPU, 2 GPUs a node
    assert trainer["image"] == BASE["image"]
    assert trainer["command"] == ["torchrun", "-m", "evoesap.stages.search_workers"]
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "16", "memory": "120Gi", "nvidia.com/gpu": "2"}
    assert trainer["resourcesPerNode"]["requests"] == {"cpu": "12", "memory": "100Gi"}
    env = {e["name"]: e for e in trainer["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3-credentials", "key": "access_key"}
    spec = json.loads(trainer["args"][0])
    assert spec["inputs"] == world and spec["params"]["workers"] == 4 and spec["out_uri"] == uri
    # the URI a one-process run computes, and a one-process run there reuses the job's artifact
    one = SearchParams(**SMALL)
    assert uri == output_uri("search", root, world, one)
    made = artifacts.read_manifest(uri, "search")
    assert run_step("search", root, world, dataclasses.asdict(one)) == uri
    assert artifacts.read_manifest(uri, "search") == made
    assert "workers" not in made.params
    assert not _calls("DELETE")  # a finished job is left to the cluster's TTL, as any job
    # the same search again: reused, no job created
    assert run_search_job(_template(), root, world, params) == uri and len(_calls("POST")) == 1


def test_a_failed_job_fails_the_task_with_the_job_s_reason_and_the_failed_worker_s_message(kube, world, tmp_path):
    KubeAPI.states = ["", "Failed"]
    KubeAPI.failure = {
        "reason": "JobSetFailed",
        "message": "jobset failed: replicated job node failed, backoffLimit reached\nmore",
    }
    terminated = lambda name, code, message: {  # noqa: E731
        "metadata": {"name": name},
        "status": {
            "containerStatuses": [
                {
                    "name": "node",
                    "ready": False,
                    "restartCount": 0,
                    "image": BASE["image"],
                    "imageID": "",
                    "state": {"terminated": {"exitCode": code, "message": message, "finishedAt": "2026-11-26T10:00:00Z"}},
                }
            ]
        },
    }
    KubeAPI.pods = [
        terminated("evoesap-search-x-node-0-0", 143, "search worker 0: SIGTERM"),
        terminated("evoesap-search-x-node-0-1", 1, "search worker 3: ModelError: CUDA out of memory\ntrace"),
    ]
    with pytest.raises(EvoESAPError) as caught:
        run_search_job(_template(), str(tmp_path / "store"), world, {**SMALL, "workers": 4})
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"search TrainJob team-a/evoesap-search-[0-9a-f]{12} failed \(JobSetFailed\): jobset failed: "
        r"replicated job node failed, backoffLimit reached; pod evoesap-search-x-node-0-1: "
        r"search worker 3: ModelError: CUDA out of memory",
        message,
    ), message
    ((_, query),) = [(p, q) for m, p, q in KubeAPI.requests if m == "GET" and p.endswith("/pods")]
    assert query["labelSelector"] == [f"jobset.sigs.k8s.io/jobset-name={message.split('/')[1].split()[0]}"]
    assert not _calls("DELETE")  # kept, with its pods' logs, for whoever looks into it


def test_a_launcher_that_stops_waiting_deletes_its_job(kube, world, tmp_path):
    KubeAPI.states = ["", 500]
    with pytest.raises(EvoESAPError, match=r"could not read TrainJob team-a/\S+ \(HTTP 500\): etcdserver: request timed out"):
        run_search_job(_template(), str(tmp_path / "store"), world, {**SMALL, "workers": 4})
    ((path, _),) = _calls("DELETE")
    assert re.fullmatch(re.escape(JOBS) + r"/evoesap-search-[0-9a-f]{12}\?propagationPolicy=Foreground", path), path


@pytest.mark.parametrize("trainer_version", ["2.1", "2.2"])
def test_a_queued_job_s_timeout_counts_from_admission_never_the_queue(kube, world, tmp_path, monkeypatch, trainer_version):
    """suspend + timeout: the launcher pod takes no timeout (Kueue's queue time would count against it); the
    workers get it from admission: the job's activeDeadlineSeconds from Trainer 2.2, the launcher's clock before."""
    resources = {"search": {**GPU_NODES, "suspend": True, "timeout": 25, "trainer_version": trainer_version}}
    config = load_config({**BASE, "search": {"workers": 4}, "resources": resources})
    settings = config.settings("search")
    assert launcher_settings(settings).timeout is None and settings.timeout == 25
    template = {**job_template(settings, config.stage_image("search")), "poll_seconds": 0}
    clock = iter(range(0, 10_000, 10))  # every reading of the launcher's clock is 10 s later
    monkeypatch.setattr(trainjob._TrainJob, "clock", staticmethod(lambda: next(clock)))
    KubeAPI.states = ["Suspended"] * 20 + [""] * 5 + ["Complete"]  # 200 s queued, then admitted
    KubeAPI.on_complete = _rank_zero
    if trainer_version == "2.2":
        run_search_job(template, str(tmp_path / "store"), world, {**SMALL, "workers": 4})
        ((_, job),) = _calls("POST")
        assert job["spec"]["activeDeadlineSeconds"] == 25 and job["spec"]["suspend"] is True
        assert not _calls("DELETE")
        return
    with pytest.raises(EvoESAPError, match=r"ran past resources.search.timeout \(25 s after it was admitted\)"):
        run_search_job(template, str(tmp_path / "store"), world, {**SMALL, "workers": 4})
    ((_, job),) = _calls("POST")
    assert "activeDeadlineSeconds" not in job["spec"]
    assert len(_calls("DELETE")) == 1  # stopped by the launcher: its workers do not run on
    reads = [p for m, p, _ in KubeAPI.requests if m == "GET" and not p.endswith("/pods")]
    assert len(reads) > 20  # not stopped while queued


def test_a_retried_launcher_follows_the_job_its_earlier_attempt_started(kube, world, tmp_path):
    root = str(tmp_path / "store")
    params = {**SMALL, "workers": 4}
    KubeAPI.existing = {
        "metadata": {"name": "earlier"},
        "spec": {
            "trainer": {
                "args": [
                    json.dumps(
                        {
                            "inputs": world,
                            "params": {**SMALL, "workers": 4},
                            "out_uri": output_uri("search", root, world, SearchParams(**SMALL)),
                        }
                    )
                ]
            }
        },
    }
    KubeAPI.states, KubeAPI.on_complete = ["", "Complete"], _rank_zero
    uri = run_search_job(_template(), root, world, params)
    assert len(_calls("POST")) == 1 and not _calls("DELETE")  # the 409, then only looks at the running job
    assert not _calls("PATCH")  # outside a pod there is no owner to add
    artifacts.read_manifest(uri, "search")


EARLIER_POD = {"apiVersion": "v1", "kind": "Pod", "name": "run-search-driver-1", "uid": "11111111-aaaa",
               "controller": False, "blockOwnerDeletion": False}  # fmt: skip


@pytest.mark.parametrize("refused", [None, 403])
def test_a_retried_launcher_adds_its_pod_to_the_adopted_job_s_owners(kube, world, tmp_path, monkeypatch, caplog, refused):
    """The earlier attempt's pod owns the job; deleted (Argo's pod GC, a drained node), it would take the job with it
    while the retry follows it. The retry adds its own pod, keeping the earlier one; refused that, it says so."""
    root = str(tmp_path / "store")
    params = {**SMALL, "workers": 4}
    args = {"inputs": world, "params": params, "out_uri": output_uri("search", root, world, SearchParams(**SMALL))}
    KubeAPI.existing = {"metadata": {"name": "earlier", "ownerReferences": [EARLIER_POD]},
                        "spec": {"trainer": {"args": [json.dumps(args)]}}}  # fmt: skip
    KubeAPI.states, KubeAPI.on_complete, KubeAPI.patch_status = ["", "Complete"], _rank_zero, refused
    monkeypatch.setenv("KFP_POD_NAME", "run-search-driver-2")
    monkeypatch.setenv("KFP_POD_UID", "22222222-bbbb")
    with caplog.at_level("INFO", logger="evoesap.pipeline.trainjob"):
        uri = run_search_job(_template(), root, world, params)
    ((path, patch),) = _calls("PATCH")
    assert path == f"{JOBS}/{KubeAPI.requests[0][2]['metadata']['name']}"
    assert [o["uid"] for o in patch["metadata"]["ownerReferences"]] == ["11111111-aaaa", "22222222-bbbb"]
    assert not _calls("DELETE")
    artifacts.read_manifest(uri, "search")  # followed to its end either way
    if refused:
        (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "stays owned by the earlier attempt's pod only (HTTP 403" in warning and "patch on trainjobs" in warning
    else:  # the job's owners now: both pods
        assert [o["uid"] for o in KubeAPI.existing["metadata"]["ownerReferences"]] == ["11111111-aaaa", "22222222-bbbb"]


def test_the_component_reads_the_job_s_inputs_where_every_pod_can_and_fills_its_artifact(kube, world, tmp_path):
    from evoesap.components.trainjob import search_trainjob
    from kfp import dsl

    model = dsl.Model(uri=world["model"], metadata={"revision": ""})
    ours = {
        name: dsl.Dataset(uri=f"minio://kfp/{name}", metadata={"uri": world[name], "stage": name}) for name in ("scores", "cache")
    }
    allocation = dsl.Artifact(uri=str(tmp_path / "kfp" / "allocation"), metadata={})
    KubeAPI.states, KubeAPI.on_complete = ["Complete"], _rank_zero
    search_trainjob(
        model=model,
        **ours,
        criterion="reap",
        sparsity=0.5,
        storage_root=str(tmp_path / "store"),
        job=_template(),
        allocation=allocation,
        params={k: v for k, v in SMALL.items() if k not in ("criterion", "sparsity")} | {"workers": 2},
    )
    ((_, job),) = _calls("POST")
    assert json.loads(job["spec"]["trainer"]["args"][0])["inputs"] == world
    assert job["spec"]["trainer"]["numNodes"] == 1  # 2 workers, 2 per node
    assert allocation.metadata["stage"] == "search" and Path(allocation.path, "allocation.json").is_file()


def test_a_worker_writes_its_one_line_error_where_the_pod_status_shows_it(tmp_path, monkeypatch):
    from evoesap.stages import search_workers

    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr(search_workers, "TERMINATION_LOG", str(log))
    monkeypatch.setenv("RANK", "3")
    spec = {"inputs": {}, "params": {"workers": 0}, "out_uri": str(tmp_path / "out"), "log_level": 30, "quiet": True}
    with pytest.raises(SystemExit):
        search_workers.main([json.dumps(spec)])  # the spec inline, as a job's pods get it
    assert log.read_text() == "search worker 3: ConfigError: workers must be >= 1, got 0"


def test_a_kubernetes_api_dripping_one_byte_at_a_time_ends_at_the_deadline_naming_it_and_the_knob(monkeypatch):
    import time

    from kubernetes import client
    from recording_http import dripping

    monkeypatch.setenv("EVOESAP_K8S_DEADLINE_S", "0.5")
    with dripping() as url:
        api = client.ApiClient(client.Configuration(host=url))
        job = trainjob._TrainJob(api, "team-a", {"metadata": {"name": "search-x"}}, poll_seconds=0)
        start = time.monotonic()
        with pytest.raises(EvoESAPError) as raised:
            job._get()
        elapsed = time.monotonic() - start
    assert elapsed < 3, elapsed
    assert str(raised.value) == (
        f"the Kubernetes API {url} asked to read TrainJob team-a/search-x did not finish within 0.5 s (the server is "
        "stalled or too slow): check it, or set EVOESAP_K8S_DEADLINE_S to allow longer"
    )


class NotTextKube(JsonHandler):
    def do_GET(self):  # noqa: N802
        data = b"\xff\xfe\x00\x81 not text"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_kubernetes_api_answering_bytes_that_are_not_utf8_is_one_clear_line():
    from kubernetes import client

    with serving(NotTextKube) as url:
        job = trainjob._TrainJob(client.ApiClient(client.Configuration(host=url)), "team-a", {"metadata": {"name": "s"}}, 0)
        with pytest.raises(EvoESAPError, match=f"the Kubernetes API {url} answered the request to read TrainJob team-a/s "
                                               "with bytes that are not UTF-8 text"):  # fmt: skip
            job._get()


# ------------------------------------------------------------------------- the worker pods placed at run time

NO_GPUS = {k: v for k, v in GPU_NODES.items() if not k.startswith("accelerator")}


@pytest.mark.parametrize(
    ("compiled", "values", "workers", "gpus_per_worker", "message"),
    [
        (GPU_NODES, {"cpu": "8 cores"}, 4, 1, r"the run-time input search_cpu: '8 cores' is not a CPU quantity: write e\.g\. 8"),
        (GPU_NODES, {"memory_request": "lots"}, 4, 1, r"search_memory_request: 'lots' is not a memory quantity: write a whole"),
        (
            GPU_NODES,
            {"accelerator_count": "3"},
            4,
            1,
            r"with the run-time inputs search_accelerator_count='3': search.workers 4 is not a multiple of the 3 workers "
            r"per node",
        ),
        (
            GPU_NODES,
            {"accelerator_count": "6"},
            2,
            4,
            r"search_accelerator_count='6': resources.search.accelerator_count 6 is not a multiple of search.gpus_per_worker 4",
        ),
        (GPU_NODES, {"accelerator_count": "two"}, 4, 1, r"search_accelerator_count 'two' is not a whole number .* give digits"),
        (
            NO_GPUS,
            {"accelerator_count": "2"},
            4,
            1,
            r"with the run-time inputs search_accelerator_count='2': accelerator_count is set but accelerator_type is not",
        ),
        (GPU_NODES, {"tolerations": [{"key": "a", "operator": "Sometimes"}]}, 4, 1, r"search_tolerations\[0\]\['operator'\]"),
        (GPU_NODES, {"node_selector": {"pool": 3}}, 4, 1, r"search_node_selector\['pool'\] 3: Input should be a valid string"),
        (GPU_NODES, {"queue_name": "Team A"}, 4, 1, r"search_queue_name: 'Team A' is not a Kueue LocalQueue name: write lower"),
        (GPU_NODES, {"image": "evoesap/stage:1"}, 4, 1, r"search_image 'evoesap/stage:1' is not fully qualified"),
    ],
)
def test_a_bad_run_time_placement_is_one_line_naming_the_pipeline_input(compiled, values, workers, gpus_per_worker, message):
    template = job_template(StageSettings(**compiled), BASE["image"])
    with pytest.raises(ConfigError, match=message) as refused:
        trainjob.at_run_time(template, values, workers, gpus_per_worker)
    assert "\n" not in str(refused.value)


def test_a_template_without_its_settings_takes_no_run_time_placement():
    template = {k: v for k, v in _template().items() if k != "settings"}
    assert trainjob.at_run_time(template, {"cpu": ""}, 4) == template  # nothing given: used as it is
    with pytest.raises(ConfigError, match=r"carries no settings to lay search_cpu='8' over: compile the pipeline again"):
        trainjob.at_run_time(template, {"cpu": "8"}, 4)


def test_a_bad_run_time_value_is_refused_before_the_cluster_or_the_store_is_touched(kube, world, tmp_path):
    root = tmp_path / "store"
    with pytest.raises(ConfigError, match="search_cpu"):
        run_search_job(_template(), str(root), world, {**SMALL, "workers": 4}, runtime={"cpu": "eight"})
    assert KubeAPI.requests == [] and not root.exists()


def test_the_launcher_places_the_worker_pods_and_queues_the_job_as_the_run_says(kube, world, tmp_path):
    from evoesap.components.trainjob import search_trainjob
    from kfp import dsl

    compiled = {**GPU_NODES, "node_selector": {"pool": "a100"}, "labels": {"team": "ml"}}
    config = load_config({**BASE, "search": {"workers": 2}, "resources": {"search": compiled}})
    template = {**job_template(config.settings("search"), config.stage_image("search")), "poll_seconds": 0}
    model = dsl.Model(uri=world["model"], metadata={"revision": ""})
    scores, cache = (dsl.Dataset(uri=world[name], metadata={}) for name in ("scores", "cache"))
    allocation = dsl.Artifact(uri=str(tmp_path / "kfp" / "allocation"), metadata={})
    KubeAPI.states, KubeAPI.on_complete = ["Complete"], _rank_zero
    toleration = {"key": "dedicated", "operator": "Equal", "value": "search", "effect": "NoSchedule"}
    search_trainjob(
        model=model,
        scores=scores,
        cache=cache,
        criterion="reap",
        sparsity=0.5,
        storage_root=str(tmp_path / "store"),
        job=template,
        allocation=allocation,
        params={k: v for k, v in SMALL.items() if k not in ("criterion", "sparsity")} | {"workers": 2},
        image="registry.example.org/evoesap/stage:2",
        cpu="6",
        accelerator_count="1",
        node_selector={"pool": "h200"},
        tolerations=[toleration],
        queue_name="team-a-gpus",
    )
    ((_, job),) = _calls("POST")
    trainer = job["spec"]["trainer"]
    assert trainer["image"] == "registry.example.org/evoesap/stage:2"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 1)  # one GPU a node now: two nodes of one worker
    assert trainer["resourcesPerNode"] == {
        "requests": {"cpu": "12", "memory": "100Gi"},  # not given: as compiled
        "limits": {"cpu": "6", "memory": "120Gi", "nvidia.com/gpu": "1"},
    }
    assert {"name": "OMP_NUM_THREADS", "value": "6"} in trainer["env"]  # 6 cores, one worker a node
    ((patch,),) = [job["spec"]["runtimePatches"]]  # Trainer 2.2, the default
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]
    assert pod["spec"] == {"nodeSelector": {"pool": "h200"}, "tolerations": [toleration]}
    assert pod["metadata"]["labels"] == {"team": "ml"}  # the queue is the job's, never its pods'
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert job["metadata"]["labels"]["team"] == "ml"
    assert allocation.metadata["stage"] == "search" and Path(allocation.path, "allocation.json").is_file()


def test_a_queue_for_every_stage_labels_their_pods_and_the_search_s_job_never_its_launcher(tmp_path):
    compiled = _compile(tmp_path, search={"workers": 2}, resources={"all": {"queue_name": "batch"}, "search": GPU_NODES})
    spec = compiled["spec"]
    (launcher,) = [t for t in _tasks(spec).values() if t["componentRef"]["name"] == "comp-search-trainjob"]
    job = launcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"]
    body = trainjob.trainjob(job, "evoesap-search-x", {}, 2)
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "batch"
    assert "kueue.x-k8s.io/queue-name" not in json.dumps(body["spec"])  # not on the worker pods
    executors = spec["deploymentSpec"]["executors"]
    for executor in executors:
        labels = compiled["platform"].get(executor, {}).get("podMetadata", {}).get("labels", {})
        queued = executor != "exec-search-trainjob"
        assert labels.get("kueue.x-k8s.io/queue-name") == ("batch" if queued else None), executor


def test_the_run_s_gpus_per_worker_sets_the_workers_per_node(kube, world, tmp_path):
    """`--set search_params.gpus_per_worker=2` at submit: the job is built for the workers the run starts, not for
    the compiled value (2 GPUs a node, one worker of 2 GPUs each: 4 nodes for 4 workers)."""
    KubeAPI.states, KubeAPI.failure = ["Failed"], {"reason": "Stopped"}
    params = {**SMALL, "workers": 4, "gpus_per_worker": 2, "device_map": "auto"}
    with pytest.raises(EvoESAPError, match=r"failed \(Stopped\)"):
        run_search_job(_template(), str(tmp_path / "store"), world, params)
    ((_, job),) = _calls("POST")
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 1)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "OMP_NUM_THREADS", "value": "16"} in trainer["env"]  # 16 cores, one worker a node
