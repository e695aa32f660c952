"""TrainJob bodies against the TrainJob CRD schema of each supported Kubeflow Trainer release (vendored from
kubeflow/trainer into tests/data/trainer, each file naming its tag, commit and path): every field the launcher sends
is one that release's API server keeps (an unknown field would be pruned, silently, or refused under strict field
validation), and the worker pods' metadata and placement take the path that release offers."""

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from evoesap.pipeline.cluster import RUNTIME_SETTINGS, StageSettings
from evoesap.pipeline.trainjob import _progress, at_run_time, job_template, trainjob

DATA = Path(__file__).resolve().parents[1] / "data" / "trainer"
RELEASES = {"v2.0.0": "2.0", "v2.1.0": "2.1", "v2.2.0": "2.2", "v2.3.0": "2.2", "head": "2.2"}  # file -> trainer_version
PLACED = dict(
    cpu="16",
    memory="120Gi",
    accelerator_type="nvidia.com/gpu",
    accelerator_count=2,
    env={"NCCL_DEBUG": "WARN"},
    secrets=[{"name": "s3-credentials", "env": {"access_key": "AWS_ACCESS_KEY_ID"}}],
    labels={"team": "ml", "kueue.x-k8s.io/queue-name": "gpus"},
    annotations={"cost-centre": "42"},
    node_selector={"pool": "h100"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "toleration_seconds": 60}],
    volumes=[{"pvc": "model-cache", "mount_path": "/cache", "sub_path": "hf"}],
    shm_size="16Gi",
    suspend=True,
    timeout=7200,
)


def _closed(schema: Any) -> Any:
    """The CRD schema as the API server applies it to a body: an object's unlisted fields are not kept."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _validator(release: str) -> jsonschema.Draft7Validator:
    vendored = json.loads((DATA / f"trainjob-{release}.json").read_text())
    assert vendored["_provenance"]["path"] == "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"
    return jsonschema.Draft7Validator(_closed(vendored["schema"]))


def _body(version: str, **settings: Any) -> dict[str, Any]:
    template = job_template(StageSettings(**{**PLACED, **settings, "trainer_version": version}), "registry.example.org/e/s:1")
    return trainjob(template, "evoesap-search-0123456789ab", {"out": "s3://b/search/k"}, 4)


def _errors(release: str, body: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(release).iter_errors(body)]


@pytest.mark.parametrize("release", RELEASES)
def test_the_body_for_each_release_holds_only_fields_its_trainjob_schema_keeps(release):
    assert _errors(release, _body(RELEASES[release])) == []
    assert _errors(release, _body(RELEASES[release], suspend=False, timeout=None, labels={}, annotations={})) == []


@pytest.mark.parametrize(("release", "other"), [("v2.0.0", "2.1"), ("v2.1.0", "2.2"), ("v2.1.0", "2.0"), ("head", "2.1")])
def test_another_release_s_body_would_lose_the_pod_placement(release, other):
    """The check can fail: the placement field of one release is unknown to another."""
    assert _errors(release, _body(other))


def _pod_template(body: dict[str, Any], version: str) -> dict[str, Any]:
    spec = body["spec"]
    if version == "2.0":
        (override,) = spec["podSpecOverrides"]
        return {"metadata": {"labels": spec.get("labels"), "annotations": spec.get("annotations")}, "spec": override}
    if version == "2.1":
        (override,) = spec["podTemplateOverrides"]
        assert override["targetJobs"] == [{"name": "node"}]
        return override
    (patch,) = spec["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"
    return job["template"]["spec"]["template"]


@pytest.mark.parametrize("version", ["2.0", "2.1", "2.2"])
def test_worker_pods_get_their_labels_placement_and_volumes_and_the_job_its_queue_and_deadline(version):
    body = _body(version)
    pod = _pod_template(body, version)
    assert pod["metadata"]["labels"] == PLACED["labels"] and pod["metadata"]["annotations"] == PLACED["annotations"]
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"  # where Kueue reads it: the TrainJob
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "h100"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["pvc-0"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    (container,) = spec["containers"]
    assert container["name"] == "node"
    assert {m["mountPath"]: m.get("subPath") for m in container["volumeMounts"]} == {"/cache": "hf", "/dev/shm": None}
    assert body["spec"]["suspend"] is True
    assert body["spec"].get("activeDeadlineSeconds") == (7200 if version == "2.2" else None)  # 2.2 added the field


def test_progress_is_read_from_trainer_v2_s_conditions_and_job_counts():
    assert _progress({"status": {}}) == "pending"
    suspended = {"status": {"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}}
    assert _progress(suspended) == "suspended (Suspended): waiting for admission"
    running = {
        "status": {
            "conditions": [{"type": "Suspended", "status": "False", "reason": "Resumed"}],
            "jobsStatus": [{"name": "node", "active": 4, "ready": 3, "succeeded": 0, "failed": 0}],
        }
    }
    assert _progress(running) == "running: 3 ready, 4 active"


# what a run gives the launcher (its inputs, named as cluster.RUNTIME_SETTINGS), over PLACED compiled
RUN_TIME = dict(
    image="registry.example.org/e/s:2",
    cpu="32",
    memory="",  # empty: as compiled
    accelerator_count="8",
    node_selector={"pool": "h200"},
    tolerations=[{"key": "dedicated", "operator": "Equal", "value": "search", "effect": "NoExecute", "tolerationSeconds": 30}],
    queue_name="team-a-gpus",
)


@pytest.mark.parametrize("release", RELEASES)
def test_run_time_placement_rebuilds_a_body_each_release_keeps_with_the_queue_on_the_job_only(release):
    version = RELEASES[release]
    compiled = job_template(
        StageSettings(**{**PLACED, "labels": {"team": "ml"}, "trainer_version": version}), "registry.example.org/e/s:1"
    )
    assert compiled["procs_per_node"] == 2 and "queue_name" not in compiled
    template = at_run_time(compiled, RUN_TIME, workers=8, gpus_per_worker=2)
    body = trainjob(template, "evoesap-search-0123456789ab", {"out": "s3://b/search/k"}, 8)
    assert _errors(release, body) == []
    trainer = body["spec"]["trainer"]
    assert trainer["image"] == "registry.example.org/e/s:2"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)  # 8 GPUs a node, 2 a worker: 4 a node, 8 in all
    assert trainer["resourcesPerNode"] == {"limits": {"cpu": "32", "memory": "120Gi", "nvidia.com/gpu": "8"}}
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["OMP_NUM_THREADS"] == str(32 // 4) and env["NCCL_DEBUG"] == "WARN"  # the run's cores over its workers
    pod = _pod_template(body, version)
    assert pod["spec"]["nodeSelector"] == {"pool": "h200"}  # in place of the compiled pool, not merged with it
    assert pod["spec"]["tolerations"] == RUN_TIME["tolerations"]
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"pvc-0", "shm"}  # compile-time placement kept
    # Kueue reads the queue from the TrainJob; on the pods (or the 2.0 JobSet labels) it would queue them apart
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert pod["metadata"]["labels"] == {"team": "ml"}
    assert body["spec"].get("labels", {"team": "ml"}) == {"team": "ml"}
    assert body["spec"]["suspend"] is True


def test_empty_run_time_values_keep_the_compiled_job():
    settings = StageSettings(**{**PLACED, "labels": {"team": "ml"}, "queue_name": "compiled"})
    compiled = job_template(settings, "registry.example.org/e/s:1")
    empty = {name: kind() for name, kind in RUNTIME_SETTINGS.items()}  # "" {} []: what an unbound launcher input holds
    assert at_run_time(compiled, empty, workers=4) == compiled
    body = trainjob(compiled, "evoesap-search-0123456789ab", {}, 4)
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "compiled"
    assert "kueue.x-k8s.io/queue-name" not in _pod_template(body, "2.2")["metadata"]["labels"]
