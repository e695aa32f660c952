"""Per-stage Kubernetes settings in the compiled spec (pipeline.cluster), display names, pipeline inputs, and the
settings an outer pipeline overrides or binds."""

# No `from __future__ import annotations`: kfp reads the real annotations of the pipelines below.

import re

import pytest
import yaml
from evoesap.components import DEFAULT_IMAGE
from evoesap.pipeline.cluster import StageSettings, merged
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import build_subpipeline, compile_pipeline
from remote_config import REMOTE_CONFIG

from evoesap.errors import ConfigError

BASE = dict(REMOTE_CONFIG)
RESOURCES = {
    "all": {
        "secrets": [
            {"name": "s3-credentials", "env": {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY"}}
        ],
        "image_pull_secrets": ["regcred"],
    },
    "search": {
        "cpu_request": "4",
        "cpu": "8",
        "memory_request": "32G",
        "memory": "64G",
        "accelerator_type": "nvidia.com/gpu",
        "accelerator_count": 1,
        "node_selector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"pvc": "hf-cache", "mount_path": "/cache"}],
        "secrets": [{"name": "hf", "env": {"token": "HF_TOKEN"}}],
        "shm_size": "16Gi",
        "scratch": {"size": "100Gi"},
        "retries": 0,
    },
    "prune": {"cpu_request": "2", "memory_request": "8G", "memory": "16G", "scratch": {"size": "200Gi", "storage_class": "fast"}},
    "evaluate": {"node_selector": {"pool": "eval"}},
}


def _compile(tmp_path, **overrides) -> tuple[dict, dict]:
    path = compile_pipeline(load_config({**BASE, **overrides}), tmp_path / "pipeline.yaml")
    spec, *platform = yaml.safe_load_all(path.read_text())
    executors = platform[0]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if platform else {}
    return spec, executors


def _executors_by_stage(spec: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, component in spec["components"].items():
        if "executorLabel" in component:
            out.setdefault(re.sub(r"^comp-|-\d+$", "", name), []).append(component["executorLabel"])
    return out


def _tasks(spec: dict) -> dict[str, dict]:
    tasks = dict(spec["root"]["dag"]["tasks"])
    for component in spec["components"].values():
        tasks.update(component.get("dag", {}).get("tasks", {}))
    return tasks


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("cluster"), resources=RESOURCES)


def test_every_setting_reaches_exactly_the_stages_configured(compiled):
    spec, platform = compiled
    stages = _executors_by_stage(spec)
    secret_names = lambda e: sorted(s["secretName"] for s in platform[e].get("secretAsEnv", []))  # noqa: E731
    for stage, executors in stages.items():
        if stage == "importer":
            continue
        for executor in executors:
            settings = platform[executor]
            # `all`: the storage secret and the pull secret on every stage
            assert [p["secretName"] for p in settings["imagePullSecret"]] == ["regcred"], executor
            expected = ["hf", "s3-credentials"] if stage == "search" else ["s3-credentials"]
            assert secret_names(executor) == expected, executor
            node = {"search": {"pool": "gpu"}, "evaluate": {"pool": "eval"}}.get(stage)
            assert settings.get("nodeSelector", {}).get("labels") == node, executor
            assert bool(settings.get("tolerations")) == (stage == "search"), executor
            assert bool(settings.get("pvcMount")) == (stage == "search"), executor
            assert bool(settings.get("emptyDirMounts")) == (stage == "search"), executor
            assert bool(settings.get("genericEphemeralVolume")) == (stage in ("search", "prune")), executor
    (search,) = stages["search"]
    s3 = next(s for s in platform[search]["secretAsEnv"] if s["secretName"] == "s3-credentials")
    assert {k["secretKey"]: k["envVar"] for k in s3["keyToEnv"]} == {
        "access_key": "AWS_ACCESS_KEY_ID",
        "secret_key": "AWS_SECRET_ACCESS_KEY",
    }
    assert platform[search]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert platform[search]["pvcMount"][0]["mountPath"] == "/cache"
    (shm,) = platform[search]["emptyDirMounts"]
    assert (shm["mountPath"], shm["medium"], shm["sizeLimit"]) == ("/dev/shm", "Memory", "16Gi")
    (scratch,) = platform[search]["genericEphemeralVolume"]
    assert scratch["size"] == "100Gi" and scratch["mountPath"] == "/scratch"
    assert all(platform[e]["genericEphemeralVolume"][0]["storageClassName"] == "fast" for e in stages["prune"])


def test_requests_limits_and_accelerators_reach_the_containers(compiled):
    spec, _ = compiled
    executors, stages = spec["deploymentSpec"]["executors"], _executors_by_stage(spec)
    (search,) = stages["search"]
    res = executors[search]["container"]["resources"]
    assert (res["resourceCpuRequest"], res["resourceCpuLimit"]) == ("4", "8")
    assert (res["resourceMemoryRequest"], res["resourceMemoryLimit"]) == ("32G", "64G")
    assert res["accelerator"]["resourceType"] == "nvidia.com/gpu" and res["accelerator"]["resourceCount"] == "1"
    assert {"name": "TMPDIR", "value": "/scratch"} in executors[search]["container"]["env"]
    for prune in stages["prune"]:  # searched and uniform
        res = executors[prune]["container"]["resources"]
        assert (res["resourceCpuRequest"], res["resourceMemoryRequest"], res["resourceMemoryLimit"]) == ("2", "8G", "16G")
        assert "accelerator" not in res and "resourceCpuLimit" not in res
    for stage in ("calibrate", "report"):
        assert not executors[stages[stage][0]]["container"].get("resources"), stage


def test_retries_per_stage_with_a_bounded_backoff(compiled):
    spec, _ = compiled
    tasks = _tasks(spec)
    search = next(t for t in tasks.values() if t["taskInfo"]["name"] == "search")
    assert "retryPolicy" not in search  # retries: 0 for this stage
    calibrate = next(t for t in tasks.values() if t["taskInfo"]["name"] == "calibrate")
    assert calibrate["retryPolicy"]["maxRetryCount"] == 2
    assert calibrate["retryPolicy"]["backoffMaxDuration"] == "600s"


def test_display_names_are_unique_and_say_what_each_task_does(compiled):
    spec, _ = compiled
    names = [t["taskInfo"]["name"] for t in _tasks(spec).values()]
    assert len(names) == len(set(names)), names
    assert {
        "evaluate full",
        "evaluate searched",
        "evaluate uniform",
        "prune searched",
        "prune uniform",
        "cache-logits search set",
        "calibrate",
        "search",
        "report",
    } <= set(names)


def test_held_out_data_is_a_pipeline_input_only_when_configured(tmp_path):
    spec, _ = _compile(tmp_path)
    assert "heldout_data" not in spec["root"]["inputDefinitions"]["parameters"]
    assert "heldout_data" not in spec["components"]["comp-evoesap-stages"]["inputDefinitions"]["parameters"]
    spec, _ = _compile(tmp_path, heldout_data="/data/heldout.jsonl")
    assert spec["root"]["inputDefinitions"]["parameters"]["heldout_data"]["defaultValue"] == "/data/heldout.jsonl"
    assert "cache-logits held-out set" in {t["taskInfo"]["name"] for t in _tasks(spec).values()}


def test_no_platform_section_without_cluster_settings(tmp_path):
    _, platform = _compile(tmp_path)
    assert not any(platform.values())


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"prune": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 1}}, "resources.prune: prune loads no model"),
        ({"report": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 1}}, "resources.report: report loads no model"),
        ({"all": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 1}}, "set accelerators per stage"),
        ({"search": {"accelerator_count": 1}}, "accelerator_type is not"),
        ({"search": {"tolerations": [{"operator": "Sometimes"}]}}, "operator"),
        ({"search": {"secrets": [{"name": "s3", "env": {}}]}}, "env"),
        ({"serch": {"cpu": "2"}}, "serch"),
        ({"search": {"shm": "1Gi"}}, "shm"),
    ],
)
def test_bad_cluster_settings_are_refused_with_the_key(resources, message):
    with pytest.raises(ConfigError, match=message):
        load_config({**BASE, "resources": resources})


def test_stage_settings_add_to_the_shared_ones():
    shared = StageSettings(image_pull_secrets=["a"], node_selector={"zone": "x", "pool": "cpu"}, cpu="2", retries=3)
    own = StageSettings(image_pull_secrets=["b"], node_selector={"pool": "gpu"}, cpu="8")
    both = merged(shared, own)
    assert both.image_pull_secrets == ["a", "b"]
    assert both.node_selector == {"zone": "x", "pool": "gpu"}
    assert (both.cpu, both.retries) == ("8", 3)
    assert merged(None, own) == own and merged(shared, None) == shared


CPU_IMAGE, GPU_IMAGE = "registry.example.org/evoesap/stage-cpu:0.1.0", "registry.example.org/evoesap/stage-cuda:0.1.0"
POD = {
    "all": {"env": {"HF_HOME": "/cache", "TOKENIZERS_PARALLELISM": "false"}, "labels": {"team": "ml"}},
    "search": {
        "env": {"HF_HOME": "/fast-cache"},
        "timeout": 7200,
        "annotations": {"cost-centre": "gpu"},
        "labels": {"tier": "gpu"},
        "node_affinity": [
            {"match_expressions": [{"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]},
            {"match_expressions": [{"key": "zone", "operator": "Exists"}], "weight": 50},
        ],
    },
    "prune": {"image": CPU_IMAGE, "timeout": 3600},
    "report": {"image": CPU_IMAGE},
}


@pytest.fixture(scope="module")
def pod_settings(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("pod"), resources=POD, image=GPU_IMAGE)


def test_env_labels_annotations_timeout_and_affinity_reach_exactly_their_stages(pod_settings):
    spec, platform = pod_settings
    executors = spec["deploymentSpec"]["executors"]
    for stage, names in _executors_by_stage(spec).items():
        if stage == "importer":
            continue
        for executor in names:
            env = {e["name"]: e["value"] for e in executors[executor]["container"].get("env", [])}
            assert env == {"HF_HOME": "/fast-cache" if stage == "search" else "/cache", "TOKENIZERS_PARALLELISM": "false"}
            settings = platform[executor]
            labels = {"team": "ml", **({"tier": "gpu"} if stage == "search" else {})}
            assert settings["podMetadata"]["labels"] == labels, executor
            assert settings["podMetadata"].get("annotations") == ({"cost-centre": "gpu"} if stage == "search" else None)
            assert settings.get("activeDeadlineSeconds") == {"search": "7200", "prune": "3600"}.get(stage), executor
            assert bool(settings.get("nodeAffinity")) == (stage == "search"), executor
    (search,) = _executors_by_stage(spec)["search"]
    required, preferred = platform[search]["nodeAffinity"]
    assert required["matchExpressions"] == [{"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]
    assert "weight" not in required and preferred["weight"] == 50
    assert preferred["matchExpressions"] == [{"key": "zone", "operator": "Exists"}]


def test_a_stage_s_own_image_and_the_config_s_image_for_the_rest(pod_settings):
    spec, _ = pod_settings
    executors = spec["deploymentSpec"]["executors"]
    for stage, names in _executors_by_stage(spec).items():
        if stage != "importer":
            expected = CPU_IMAGE if stage in ("prune", "report") else GPU_IMAGE
            assert {executors[e]["container"]["image"] for e in names} == {expected}, stage


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"all": {"image": CPU_IMAGE}}, "resources.all.image: set the image of every stage with the top-level"),
        ({"search": {"timeout": 0}}, "timeout"),
        ({"search": {"node_affinity": [{"match_expressions": [{"key": "gpu", "operator": "Near"}]}]}}, "operator"),
        ({"search": {"node_affinity": [{"match_expressions": [{"key": "gpu", "operator": "Exists"}], "weight": 101}]}}, "weight"),
        ({"search": {"env": {"HF_HOME": 3}}}, "env"),
        ({"prune": {"queue_name": "Team_A"}}, r"resources.prune.queue_name: .*'Team_A' is not a Kueue LocalQueue name"),
        (
            {"all": {"labels": {"kueue.x-k8s.io/queue-name": "a"}}, "search": {"queue_name": "b"}},
            r"resources.search with resources.all under it: the queue is named twice, queue_name 'b' and labels.kueue.x-k8s.io/queue-name 'a'",
        ),
    ],
)
def test_bad_pod_settings_are_refused_with_the_key(resources, message):
    with pytest.raises(ConfigError, match=message):
        load_config({**BASE, "resources": resources})


# ------------------------------------------------------------------ settings the outer pipeline of build_subpipeline sets


def _team_spec(tmp_path, config, bind: dict | None = None, **build) -> tuple[dict, dict]:
    """A team's pipeline with the DAG as its sub-pipeline (`build_subpipeline(config, **build)`), compiled."""
    from kfp import compiler, dsl

    stages = build_subpipeline(config, **build)

    @dsl.pipeline(name="team")
    def team():
        trained = dsl.importer(artifact_uri="s3://bucket/trained", artifact_class=dsl.Model)
        stages(model=trained.output, **(bind or {}))

    compiler.Compiler().compile(team, str(tmp_path / "team.yaml"))
    spec, *platform = yaml.safe_load_all((tmp_path / "team.yaml").read_text())
    return spec, platform[0] if platform else {}


def _differences(a, b, path=()) -> list[tuple]:
    """The paths at which two parsed YAML documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(a.keys() | b.keys()) for d in _differences(a.get(key), b.get(key), (*path, key))]
    return [] if a == b else [path]


def test_an_override_changes_exactly_that_stage_s_tasks_and_nothing_else(tmp_path):
    config = load_config({**BASE, "resources": RESOURCES})
    before = _team_spec(tmp_path, config)
    override = {"prune": {"memory": "99G", "env": {"SHARD": "1"}, "node_selector": {"pool": "big"}, "labels": {"run": "x"}}}
    after = _team_spec(tmp_path, config, overrides=override)
    prune = set(_executors_by_stage(before[0])["prune"])
    assert len(prune) == 2  # searched and uniform
    changed = _differences(before[0], after[0]) + _differences(before[1], after[1])
    assert changed and {p[:3] for p in changed} <= {("deploymentSpec", "executors", e) for e in prune} | {
        ("platforms", "kubernetes", "deploymentSpec")
    }
    assert {p[4] for p in changed if p[0] == "platforms"} <= prune  # platforms/kubernetes/deploymentSpec/executors/<e>
    for executor in prune:  # the override merged over the configured prune settings and `all`
        container = after[0]["deploymentSpec"]["executors"][executor]["container"]
        assert container["resources"]["resourceMemoryLimit"] == "99G" and {"name": "SHARD", "value": "1"} in container["env"]
        assert container["resources"]["resourceMemoryRequest"] == "8G"  # configured, kept
        settings = after[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"][executor]
        assert settings["nodeSelector"]["labels"] == {"pool": "big"} and settings["podMetadata"]["labels"] == {"run": "x"}
        assert [s["secretName"] for s in settings["secretAsEnv"]] == ["s3-credentials"]  # `all` still under it


@pytest.mark.parametrize(
    ("build", "message"),
    [
        ({"overrides": {"serch": {"memory": "1G"}}}, r"invalid overrides: serch: Input should be 'all', 'calibrate', "),
        (
            {"overrides": {"search": {"memroy": "1G"}}},
            r"search.memroy: Extra inputs are not permitted \(valid: accelerator_count, ",
        ),
        ({"overrides": {"prune": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 1}}}, "prune loads no model"),
        ({"settings_inputs": ["serch.memory"]}, r"unknown stage 'serch'; write <stage>.<setting> with a stage of calibrate, "),
        ({"settings_inputs": ["search.env"]}, r"'env' is not a setting KFP takes at run time; valid: image, cpu, memory, "),
        ({"settings_inputs": ["search"]}, r"'' is not a setting KFP takes at run time; valid: image"),
        ({"settings_inputs": "search.memory"}, r"give a list of <stage>.<setting> names"),
        ({"settings_inputs": ["prune.accelerator_count"]}, "prune loads no model; stages that can use an accelerator: "),
        ({"settings_inputs": ["quantize.image"]}, "no quantize task to set, since the quantize section names no recipe"),
        ({"settings_inputs": ["report.memory"]}, r"needs a configured value to start from: set resources.report.memory "),
        ({"settings_inputs": ["evaluate.accelerator_count"]}, "set resources.evaluate.accelerator_count and accelerator_type"),
        ({"settings_inputs": ["prune.queue_name"]}, r"KFP takes a pod label from no pipeline input, so only a multi-worker"),
        ({"settings_inputs": ["search.queue_name"]}, r"set resources.search.queue_name when building \(`overrides`\)"),
    ],
)
def test_an_unknown_or_unusable_override_or_settings_input_is_refused_in_one_line(build, message):
    config = load_config({**BASE, "resources": RESOURCES})
    with pytest.raises(ConfigError, match=message) as refused:
        build_subpipeline(config, **build)
    assert "\n" not in str(refused.value)


def test_settings_inputs_are_sub_pipeline_parameters_the_outer_pipeline_binds_at_run_time(tmp_path):
    config = load_config({**BASE, "resources": RESOURCES})
    names = ["search.accelerator_count", "search.image", "search.node_selector", "search.tolerations", "prune.memory"]
    bind = {"search_accelerator_count": "4", "prune_memory": "48G"}
    spec, platform = _team_spec(tmp_path, config, bind, settings_inputs=names)
    inputs = spec["components"]["comp-evoesap-stages"]["inputDefinitions"]["parameters"]
    defaults = {name: (inputs[name]["parameterType"], inputs[name]["defaultValue"]) for name in inputs}
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {k: defaults[k] for k in inputs.keys() - build_subpipeline(config).component_spec.inputs.keys()} == {
        "search_accelerator_count": ("STRING", "1"),  # a string: KFP's driver reads the parameter's string value
        "search_image": ("STRING", DEFAULT_IMAGE),
        "search_node_selector": ("STRUCT", {"pool": "gpu"}),
        "search_tolerations": ("LIST", tolerations),
        "prune_memory": ("STRING", "16G"),
    }
    assert inputs["search_params"]["defaultValue"]["device_map"] == "auto"  # the GPU count may be more than one
    (call,) = [t for t in spec["root"]["dag"]["tasks"].values() if t["componentRef"]["name"] == "comp-evoesap-stages"]
    assert {k: v["runtimeValue"]["constant"] for k, v in call["inputs"]["parameters"].items()} == bind
    executors, stages = spec["deploymentSpec"]["executors"], _executors_by_stage(spec)
    (search,) = stages["search"]
    container = executors[search]["container"]
    assert (
        container["resources"]["accelerator"]["resourceCount"]
        == "{{$.inputs.parameters['pipelinechannel--search_accelerator_count']}}"
    )
    assert container["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"  # configured, fixed
    assert container["image"] == "{{$.inputs.parameters['pipelinechannel--search_image']}}"
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert k8s[search]["nodeSelector"] == {
        "nodeSelectorJson": {"componentInputParameter": "pipelinechannel--search_node_selector"}
    }
    assert k8s[search]["tolerations"] == [{"tolerationJson": {"componentInputParameter": "pipelinechannel--search_tolerations"}}]
    for prune in stages["prune"]:
        assert executors[prune]["container"]["resources"]["resourceMemoryLimit"] == (
            "{{$.inputs.parameters['pipelinechannel--prune_memory']}}"
        )
        assert executors[prune]["container"]["image"] == DEFAULT_IMAGE
    for evaluate in stages["evaluate"]:  # a stage not named keeps its fixed settings
        assert executors[evaluate]["container"].get("resources") is None
        assert k8s[evaluate]["nodeSelector"] == {"labels": {"pool": "eval"}}


def test_a_single_pod_stage_s_queue_is_its_pod_label(tmp_path):
    spec, platform = _compile(tmp_path, resources={"all": {"labels": {"team": "ml"}}, "prune": {"queue_name": "cpu-batch"}})
    stages = _executors_by_stage(spec)
    for stage, executors in stages.items():
        for executor in executors:
            queued = {"kueue.x-k8s.io/queue-name": "cpu-batch"} if stage == "prune" else {}
            assert platform[executor]["podMetadata"]["labels"] == {"team": "ml", **queued}, executor
    assert len(stages["prune"]) == 2


WORKER_NODES = {
    "cpu": "16",
    "memory": "120Gi",
    "accelerator_type": "nvidia.com/gpu",
    "accelerator_count": 2,
    "node_selector": {"pool": "a100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "labels": {"team": "ml"},
}


def test_a_multi_worker_search_takes_its_placement_and_queue_as_launcher_inputs(tmp_path):
    config = load_config({**BASE, "search": {"workers": 2}, "resources": {"search": WORKER_NODES}})
    names = ["search.accelerator_count", "search.node_selector", "search.tolerations", "search.queue_name", "search.image"]
    bind = {"search_accelerator_count": "4", "search_queue_name": "team-a-gpus"}
    spec, platform = _team_spec(tmp_path, config, bind, settings_inputs=names)
    inputs = spec["components"]["comp-evoesap-stages"]["inputDefinitions"]["parameters"]
    added = inputs.keys() - build_subpipeline(config).component_spec.inputs.keys()
    assert {k: (inputs[k]["parameterType"], inputs[k]["defaultValue"]) for k in added} == {
        "search_accelerator_count": ("STRING", "2"),
        "search_node_selector": ("STRUCT", {"pool": "a100"}),
        "search_tolerations": ("LIST", [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
        "search_queue_name": ("STRING", ""),  # unset: the launcher keeps the compiled (no) queue
        "search_image": ("STRING", DEFAULT_IMAGE),
    }
    (launcher,) = [t for t in _tasks(spec).values() if t["componentRef"]["name"] == "comp-search-trainjob"]
    given = {k: v.get("componentInputParameter") for k, v in launcher["inputs"]["parameters"].items()}
    for setting in ("accelerator_count", "node_selector", "tolerations", "queue_name", "image"):
        assert given[setting] == f"pipelinechannel--search_{setting}"
    assert not {"cpu", "memory", "cpu_request"} & given.keys()  # not made inputs: the launcher's defaults (as compiled)
    job = launcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"]
    assert job["settings"] == WORKER_NODES  # what the launcher rebuilds the job from
    (executor,) = _executors_by_stage(spec)["search-trainjob"]
    assert "search" not in _executors_by_stage(spec)
    container = spec["deploymentSpec"]["executors"][executor]["container"]
    assert not container.get("resources")  # the launcher asks for none
    assert container["image"] == "{{$.inputs.parameters['pipelinechannel--search_image']}}"  # the same code as its workers
    own = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].get(executor, {})
    assert not {"nodeSelector", "tolerations"} & own.keys()
    assert own["podMetadata"]["labels"] == {"team": "ml"}  # no queue: the launcher pod is not queued with its job


def echo(text: str) -> str:
    return text


def test_a_task_whose_settings_are_pipeline_inputs_runs_under_kfp_local(tmp_path):
    """kfp.local has no pods: the settings inputs (placeholders the compiler adds to the task) must not break a run."""
    from evoesap.pipeline.cluster import apply
    from kfp import dsl, local

    step = dsl.component(base_image="python:3.11", install_kfp_package=False)(echo)
    gpu = StageSettings(accelerator_type="nvidia.com/gpu", tolerations=[{"key": "gpu", "operator": "Exists"}])

    @dsl.pipeline
    def inner(text: str, memory: str = "1G", image: str = DEFAULT_IMAGE, gpus: str = "1", pool: dict = {"a": "b"}) -> str:  # noqa: B006 - a KFP default
        task = step(text=text)
        apply(task, gpu, 0, {"memory": memory, "image": image, "accelerator_count": gpus, "node_selector": pool})
        return task.output

    @dsl.pipeline
    def outer(text: str = "hi") -> str:
        return inner(text=text, memory="2G", gpus="2").output

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    assert outer().output == "hi"
