"""model_workspace: the team's model artifact copied once into the run's KFP workspace, every task that takes the full
model reading the copy there (a reference: all its pod downloads) with KFP mounting the workspace, and the weights'
digests kept there, so no stage pod downloads or hashes the checkpoint again."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from evoesap.components.workspace import DIGEST_DIR, MODEL_DIR, copy_into, share_digests
from evoesap.pipeline.backend_floor import spec_floor, used_fields
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import build_subpipeline, compile_pipeline, workspace_config
from kfp import compiler, dsl
from kfp.dsl import Model, Output
from remote_config import REMOTE_CONFIG

from evoesap.errors import ConfigError
from evoesap.store import digest_cache, identity

WORKSPACE = {"size": "20Gi", "access_modes": ["ReadWriteMany"], "storage_class": "nfs"}
FULL_MODEL_STAGES = {"calibrate", "cache-logits", "evaluate", "search", "prune"}  # the tasks given the full model


def train(model: Output[Model]):
    """The team's step: its checkpoint."""


def _team_spec(tmp_path: Path, config: dict, **embed) -> list:
    """A team pipeline, train -> EvoESAP, compiled: its documents (pipeline spec, platform spec)."""
    loaded = load_config({**REMOTE_CONFIG, **config})
    evoesap = build_subpipeline(loaded, **embed)
    step = dsl.component(base_image=loaded.default_image, install_kfp_package=False)(train)

    chosen = workspace_config(loaded, embed.get("model_workspace"))
    mounted = {"workspace": dsl.WORKSPACE_PATH_PLACEHOLDER} if chosen else {}

    @dsl.pipeline(name="team", pipeline_config=chosen)
    def team(storage_root: str = "s3://bucket/runs"):
        trained = step().set_caching_options(enable_caching=False)
        evoesap(model=trained.outputs["model"], storage_root=storage_root, **mounted).set_caching_options(enable_caching=False)

    path = tmp_path / "team.yaml"
    compiler.Compiler().compile(team, str(path))
    return list(yaml.safe_load_all(path.read_text()))


def _tasks(spec: dict) -> dict[str, tuple[str, dict]]:
    """Every task of every DAG: name -> (its DAG's component, the task)."""
    dags = {"root": spec["root"], **spec["components"]}
    return {
        f"{component}/{name}": (component, task)
        for component, c in dags.items()
        if "dag" in c
        for name, task in c["dag"]["tasks"].items()
    }


def _origin(spec: dict, component: str, task: dict, name: str, kind: str = "artifacts") -> str:
    """Where an input comes from, followed up through the inputs of the loop and the sub-pipeline: `task.output`, or a
    parameter's constant; `input:NAME` for an input of the root pipeline."""
    where = task["inputs"][kind][name]
    given = "componentInputArtifact" if kind == "artifacts" else "componentInputParameter"
    while given in where:
        key = where[given]
        parents = [(c, t) for c, t in _tasks(spec).values() if t["componentRef"]["name"] == component]
        if not parents:
            return f"input:{key}"
        component, parent = parents[0]
        where = parent["inputs"][kind][key]
    if "runtimeValue" in where:
        return where["runtimeValue"]["constant"]
    out = where["taskOutputArtifact" if kind == "artifacts" else "taskOutputParameter"]
    return f"{out['producerTask']}.{out.get('outputArtifactKey') or out.get('outputParameterKey')}"


def _stage(task: dict) -> str:
    name = task["componentRef"]["name"].removeprefix("comp-")
    return name.rstrip("-0123456789") if name[-1].isdigit() else name


def test_with_model_workspace_the_model_is_copied_once_and_every_full_model_task_reads_the_copy(tmp_path):
    spec, platform = _team_spec(tmp_path, {"sparsities": [0.25, 0.5], "model_workspace": WORKSPACE})
    workspace = platform["platforms"]["kubernetes"]["pipelineConfig"]["workspace"]
    assert workspace == {
        "size": "20Gi",
        "kubernetes": {"pvcSpecPatch": {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs"}},
    }
    tasks = _tasks(spec)
    # the team's model goes to one task of the sub-pipeline, which copies it into the workspace
    takers = [
        (c, t)
        for c, t in tasks.values()
        if c != "root" and any(_origin(spec, c, t, a) == "train.model" for a in t.get("inputs", {}).get("artifacts", {}))
    ]
    assert [t["componentRef"]["name"] for _, t in takers] == ["comp-model-to-workspace"]
    (copier,) = takers
    assert _origin(spec, *copier, "workspace", "parameters") == dsl.WORKSPACE_PATH_PLACEHOLDER
    full = {
        key: (c, t)
        for key, (c, t) in tasks.items()
        if _stage(t) in FULL_MODEL_STAGES
        and "model" in t.get("inputs", {}).get("artifacts", {})
        and _origin(spec, c, t, "model") == "model-to-workspace.reference"
    }
    stages = sorted(_stage(t) for _, t in full.values())
    assert stages == ["cache-logits", "calibrate", "evaluate", "prune", "prune", "search"], stages
    for key, (c, t) in full.items():  # each mounts the workspace (KFP mounts it for a task given the placeholder)
        assert _origin(spec, c, t, "workspace", "parameters") == dsl.WORKSPACE_PATH_PLACEHOLDER, key
    others = [t for c, t in tasks.values() if "model" in t.get("inputs", {}).get("artifacts", {}) and (c, t) not in full.values()]
    assert {_origin(spec, c, t, "model").split(".")[1] for c, t in tasks.values() if t in others} == {"pruned", "model"}
    used, unknown = used_fields([spec, platform])
    assert unknown == {}
    floor = spec_floor(tmp_path / "team.yaml")
    assert floor.version == "2.15.0" and floor.because == ("platforms.kubernetes.pipelineConfig.workspace",)


def test_without_model_workspace_no_workspace_is_declared_and_the_stages_take_the_model_itself(tmp_path):
    spec, *platform = _team_spec(tmp_path, {})
    assert not [d for d in platform if "pipelineConfig" in json.dumps(d)]
    tasks = _tasks(spec)
    assert "model-to-workspace" not in {t["taskInfo"]["name"] for _, t in tasks.values()}
    assert dsl.WORKSPACE_PATH_PLACEHOLDER not in json.dumps(spec)
    calibrate = next((c, t) for c, t in tasks.values() if _stage(t) == "calibrate")
    assert _origin(spec, *calibrate, "model") == "train.model"
    assert spec_floor(tmp_path / "team.yaml").version == "2.14.0"


def test_the_embed_argument_sets_the_workspace_and_a_bad_one_is_refused_in_one_line(tmp_path):
    config = load_config(REMOTE_CONFIG)
    assert workspace_config(config) is None
    chosen = workspace_config(config, {"size": "5Gi"})
    assert chosen.workspace.size == "5Gi"
    spec, platform = _team_spec(tmp_path, {}, model_workspace={"size": "5Gi"})
    assert platform["platforms"]["kubernetes"]["pipelineConfig"]["workspace"]["size"] == "5Gi"
    with pytest.raises(ConfigError) as refused:
        build_subpipeline(config, model_workspace={"size": "lots"})
    assert "'lots'" in str(refused.value) and "200Gi" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="model_workspace.size"):
        load_config({**REMOTE_CONFIG, "model_workspace": {"size": "-"}})
    # the backend's Argo compiler takes accessModes and storageClassName alone in a workspace's PVC patch
    with pytest.raises(ConfigError, match="model_workspace.pvc_spec_patch: Extra inputs"):
        load_config({**REMOTE_CONFIG, "model_workspace": {"size": "1Gi", "pvc_spec_patch": {"volumeMode": "Block"}}})


def test_a_team_pipeline_that_forgets_the_workspace_or_its_path_is_refused_when_defined(tmp_path):
    """Not left for a cluster, where a task given the workspace path would wait for a volume the run never made."""
    loaded = load_config({**REMOTE_CONFIG, "model_workspace": WORKSPACE})
    evoesap = build_subpipeline(loaded)
    step = dsl.component(base_image=loaded.default_image, install_kfp_package=False)(train)
    with pytest.raises(ValueError, match="PipelineConfig.workspace.size is not set"):

        @dsl.pipeline
        def without_workspace():
            evoesap(model=step().outputs["model"], workspace=dsl.WORKSPACE_PATH_PLACEHOLDER)

    with pytest.raises(TypeError, match="workspace"):

        @dsl.pipeline(pipeline_config=workspace_config(loaded))
        def without_its_path():
            evoesap(model=step().outputs["model"])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "standalone pipeline names its model"),
        ({"search": {"workers": 2}}, "TrainJob pods"),
    ],
    ids=["standalone", "multi-worker-search"],
)
def test_a_workspace_no_stage_could_read_is_refused_before_compiling(tmp_path, config, message):
    loaded = load_config({**REMOTE_CONFIG, **config, "model_workspace": WORKSPACE})
    out = tmp_path / "pipeline.yaml"
    with pytest.raises(ConfigError, match=message) as refused:
        compile_pipeline(loaded, out) if not config else build_subpipeline(loaded)
    assert "model_workspace" in str(refused.value) and not out.exists()


@pytest.fixture
def checkpoint(tmp_path, monkeypatch) -> Path:
    """A team's checkpoint: its weights above the size at which a file's digest is kept, its config below."""
    monkeypatch.setattr(identity, "SMALL_FILE_BYTES", 64)
    root = tmp_path / "pipeline-root" / "train" / "model"
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"num_experts": 4}')
    for i in range(2):
        (root / f"model-{i}.safetensors").write_bytes(bytes([i + 1]) * 4096)
    _unset_digest_env(monkeypatch)
    return root


def _unset_digest_env(monkeypatch) -> None:
    """No digest cache chosen; whatever the test or the code under test sets is undone after it (set first, so that
    monkeypatch records the variable's state even where it is absent)."""
    for name in (digest_cache.DIRECTORY_ENV, "EVOESAP_DIGEST_CACHE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_copy_has_the_original_s_identity_and_its_digests_spare_every_stage_the_hashing(checkpoint, tmp_path, monkeypatch):
    workspace = tmp_path / "kfp-workspace"
    workspace.mkdir()
    reference = SimpleNamespace(path=str(tmp_path / "out" / "reference"), metadata={})
    model = SimpleNamespace(path=str(checkpoint), uri=str(checkpoint), metadata={"base_model": "x"})
    copy_into(model, str(workspace), reference)
    copied = workspace / MODEL_DIR
    assert reference.metadata == {"model": str(copied)} and json.loads(Path(reference.path).read_text()) == reference.metadata
    assert len(list((workspace / DIGEST_DIR).iterdir())) == 2  # the two weight files' digests, computed by the copy
    # a stage pod: its home cache is its own, the workspace is shared
    monkeypatch.delenv(digest_cache.DIRECTORY_ENV)
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(tmp_path / "stage-home" / "digests.sqlite"))
    share_digests(str(workspace))

    def hashed_again(path: str) -> str:
        raise AssertionError(f"{path} hashed again in the stage")

    monkeypatch.setattr(identity, "_sha256_local_file", hashed_again)
    from evoesap.components.kfp_artifacts import source

    read = source(SimpleNamespace(path=reference.path, uri="", metadata=reference.metadata))
    assert read == str(copied)
    record, digest = identity.identify(read)
    monkeypatch.undo()
    assert (record, digest) == identity.identify(str(checkpoint))  # the same content: the same reuse keys as without it
    assert not (tmp_path / "stage-home").exists()


def test_a_retried_copy_replaces_the_earlier_one_and_a_named_model_passes_through(checkpoint, tmp_path):
    workspace = tmp_path / "ws"
    (workspace / MODEL_DIR).mkdir(parents=True)
    (workspace / MODEL_DIR / "half-written.bin").write_bytes(b"x")  # an earlier attempt's copy
    (workspace / ".evoesap" / "model.0123.partial").mkdir()  # and one killed while copying
    reference = SimpleNamespace(path=str(tmp_path / "r1"), metadata={})
    copy_into(SimpleNamespace(path=str(checkpoint), uri="", metadata={}), str(workspace), reference)
    assert sorted(p.name for p in (workspace / MODEL_DIR).iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    assert [p.name for p in (workspace / ".evoesap").iterdir() if "partial" in p.name] == []
    named = SimpleNamespace(path=str(tmp_path / "ref"), uri="", metadata={"model": "org/name@abc123"})
    passed = SimpleNamespace(path=str(tmp_path / "r2"), metadata={})
    before = sorted(os.listdir(workspace / MODEL_DIR))
    copy_into(named, str(tmp_path / "other-ws"), passed)
    assert passed.metadata == {"model": "org/name@abc123"} and not (tmp_path / "other-ws").exists()
    assert sorted(os.listdir(workspace / MODEL_DIR)) == before


def test_a_stage_without_a_workspace_keeps_its_digest_cache_and_one_with_it_uses_the_workspace(monkeypatch, tmp_path):
    _unset_digest_env(monkeypatch)
    share_digests("")
    assert digest_cache.DIRECTORY_ENV not in os.environ
    share_digests(str(tmp_path))
    assert os.environ[digest_cache.DIRECTORY_ENV] == str(tmp_path / DIGEST_DIR)
    monkeypatch.setenv(digest_cache.DIRECTORY_ENV, "/chosen")
    share_digests(str(tmp_path))
    assert os.environ[digest_cache.DIRECTORY_ENV] == "/chosen"


def read_model(model: dsl.Input[Model], workspace: str) -> str:
    """A stage's view of its model: what it reads, and its identity, computed with the workspace's digests alone."""
    import os

    from evoesap.components.kfp_artifacts import source
    from evoesap.components.workspace import share_digests

    from evoesap.store import identity

    share_digests(workspace)

    def hashed_again(path: str) -> str:
        raise AssertionError(f"{path} hashed again in a stage")

    identity._sha256_local_file = hashed_again
    read = source(model)
    assert read.startswith(workspace) and os.environ["EVOESAP_DIGEST_DIR"].startswith(workspace), (read, workspace)
    return identity.identify(read)[1]


@pytest.mark.slow  # kfp.local: three tasks
def test_under_kfp_local_a_stage_reads_the_copy_with_the_digests_the_copy_made(tmp_path):
    from evoesap.pipeline.dag import _in_workspace
    from kfp import local

    checkpoint = tmp_path / "team" / "model"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text('{"num_experts": 4}')
    (checkpoint / "model.safetensors").write_bytes(b"\x01" * (identity.SMALL_FILE_BYTES + 1))  # kept in the digest cache
    config = load_config({**REMOTE_CONFIG, "model_workspace": {"size": "1Gi"}})
    step = dsl.component(base_image=config.default_image, install_kfp_package=False)

    def produce(model: Output[Model], source: str):
        import shutil

        shutil.copytree(source, model.path)

    made, reader = step(produce), step(read_model)

    @dsl.pipeline
    def stages(model: dsl.Input[Model], workspace: str) -> str:  # as build_subpipeline wires it
        return reader(model=_in_workspace(config, model, workspace), workspace=workspace).output

    @dsl.pipeline(pipeline_config=workspace_config(config))
    def team(source: str) -> str:
        trained = made(source=source)
        return stages(model=trained.outputs["model"], workspace=dsl.WORKSPACE_PATH_PLACEHOLDER).output

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    assert team(source=str(checkpoint)).output == identity.identify(str(checkpoint))[1]
