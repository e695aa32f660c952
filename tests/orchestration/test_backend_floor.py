"""The lowest Kubeflow Pipelines backend a compiled spec needs (pipeline.backend_floor): every field of every
compiled spec is in the vendored table, and the floor stated is at least each used field's; the table's Kubernetes
floors agree with the backend's own protos (tests/data/kfp, an independent vendoring)."""

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from evoesap.pipeline.backend_floor import TABLE_FILE, floor_table, spec_floor, used_fields, version_key
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_config import REMOTE_CONFIG

from evoesap.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROTO_FIELDS = json.loads((ROOT / "tests" / "data" / "kfp" / "kubernetes_executor_config_fields.json").read_text())
EXECUTOR = "platforms.kubernetes.deploymentSpec.executors.*."
BASE_FLOOR = "2.14.0"  # dsl.Collected of artifacts, in every spec; the docs name it (test_kfp_backend)

NAME = st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True)
EFFECT = st.sampled_from(["NoExecute", "NoSchedule", "PreferNoSchedule"])
TOLERATION = st.one_of(
    st.fixed_dictionaries({"key": NAME, "operator": st.just("Equal"), "value": NAME}, optional={"effect": EFFECT}),
    st.fixed_dictionaries({"operator": st.just("Exists")}, optional={"key": NAME, "effect": EFFECT}),
    st.fixed_dictionaries(
        {"key": NAME, "effect": st.just("NoExecute"), "toleration_seconds": st.integers(0, 3600)},
        optional={"value": NAME},
    ),
)
REQUIREMENT = st.one_of(
    st.fixed_dictionaries(
        {"key": NAME, "operator": st.sampled_from(["In", "NotIn"]), "values": st.lists(NAME, min_size=1, max_size=2)}
    ),
    st.fixed_dictionaries({"key": NAME, "operator": st.sampled_from(["Exists", "DoesNotExist"])}),
)
AFFINITY = st.fixed_dictionaries(
    {"match_expressions": st.lists(REQUIREMENT, min_size=1, max_size=2)}, optional={"weight": st.integers(1, 100)}
)


def _settings(prefix: str, accelerator: bool = False) -> st.SearchStrategy[dict]:
    """One stage's (or `all`'s) Kubernetes settings; `prefix` keeps its mount paths and variables apart from the
    other entries', so that merging them never collides."""
    volume = st.fixed_dictionaries(
        {"pvc": NAME, "mount_path": st.just(f"/{prefix}")},
        optional={"sub_path": st.from_regex(r"[a-z]{1,4}(/[a-z]{1,4})?", fullmatch=True)},
    )
    secret = st.fixed_dictionaries(
        {"name": NAME, "env": st.dictionaries(NAME, st.just(f"S_{prefix.upper()}"), min_size=1, max_size=1)}
    )
    optional = {
        "cpu": st.sampled_from(["1", "500m"]),
        "memory": st.sampled_from(["1G", "64Gi"]),
        "cpu_request": st.just("1"),
        "memory_request": st.just("512M"),
        "secrets": st.lists(secret, min_size=1, max_size=1),
        "node_selector": st.dictionaries(st.sampled_from(["pool", "zone"]), NAME, min_size=1, max_size=2),
        "tolerations": st.lists(TOLERATION, min_size=1, max_size=2),
        "volumes": st.lists(volume, min_size=1, max_size=1),
        "shm_size": st.just("1Gi"),
        "scratch": st.fixed_dictionaries({"size": st.just("10Gi")}, optional={"storage_class": NAME}),
        "image_pull_secrets": st.lists(NAME, min_size=1, max_size=2),
        "retries": st.integers(0, 3),
        "env": st.just({f"E_{prefix.upper()}": "1"}),
        "timeout": st.integers(1, 10**5),
        "labels": st.dictionaries(NAME, NAME, min_size=1, max_size=2),
        "annotations": st.dictionaries(NAME, NAME, min_size=1, max_size=2),
        "node_affinity": st.lists(AFFINITY, min_size=1, max_size=2),
    }
    if accelerator:
        optional["accelerator_type"] = st.just("nvidia.com/gpu")
        optional["accelerator_count"] = st.integers(1, 2)
    return st.fixed_dictionaries({}, optional=optional).map(
        lambda s: (
            s if s.get("accelerator_type") or not s.get("accelerator_count") else {**s, "accelerator_type": "nvidia.com/gpu"}
        )
    )


CONFIGS = st.fixed_dictionaries(
    {
        "resources": st.fixed_dictionaries(
            {}, optional={"all": _settings("all"), "search": _settings("search", True), "prune": _settings("prune")}
        ),
        "retries": st.integers(0, 3),
        "parallelism": st.integers(0, 2),
    },
    optional={"sparsities": st.just([0.25, 0.5])},
)


def _settings_of(resources: dict) -> list[dict]:
    return list(resources.values())


def _compiled(config: dict, out: Path) -> tuple[Path, list]:
    path = compile_pipeline(load_config({**REMOTE_CONFIG, **config}), out)
    return path, list(yaml.safe_load_all(path.read_text()))


@pytest.mark.slow  # each example compiles a pipeline: about 1 s, several on a shared 2-core machine
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS)
def test_every_field_of_a_generated_configuration_s_spec_has_a_floor_and_the_floor_covers_them(config):
    table = floor_table()
    with tempfile.TemporaryDirectory() as tmp:
        path, documents = _compiled(config, Path(tmp) / "pipeline.yaml")
        used, unknown = used_fields(documents)
        floor = spec_floor(path)
    assert unknown == {}, f"add these fields' first backend release to pipeline/backend_floors.yaml: {unknown}"
    assert floor.unknown == ()
    stated = version_key(floor.version)
    assert all(stated >= version_key(table.fields[field]) for field in used)
    assert any(version_key(table.fields[field]) == stated for field in used)
    # what the configuration asks for, read from the configuration, not from the spec
    every = _settings_of(config["resources"])
    expected = BASE_FLOOR
    if any(s.get("node_affinity") for s in every):
        expected = max(expected, "2.14.0", key=version_key)
    if any(s.get("secrets") for s in every):
        expected = max(expected, "2.15.0", key=version_key)  # secretAsEnv.optional
    if any(v.get("sub_path") for s in every for v in s.get("volumes", [])):
        expected = max(expected, "2.16.0", key=version_key)  # pvcMount.subPath
    assert floor.version == expected, (floor.line(), config)


@pytest.fixture(scope="module")
def cli_floors(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """`evoesap pipeline compile` of a configuration with a volume's sub_path and of the same without it."""
    root = tmp_path_factory.mktemp("floors")
    volume = {"pvc": "hf-cache", "mount_path": "/cache"}
    out = {}
    for name, extra in (("sub_path", {"sub_path": "hub"}), ("plain", {})):
        config = root / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**REMOTE_CONFIG, "resources": {"search": {"volumes": [{**volume, **extra}]}}}))
        out[name] = (config, root / f"{name}-spec.yaml")
    return out


def test_compile_states_2_16_for_a_volume_s_sub_path_and_the_base_floor_without_it(cli_floors, capsys):
    lines = {}
    for name, (config, spec) in cli_floors.items():
        assert main(["pipeline", "compile", str(config), "-o", str(spec)]) == 0
        printed = capsys.readouterr()
        lines[name] = printed.out.splitlines()
        assert lines[name][0] == str(spec)
        assert "warning" not in printed.err
    assert lines["sub_path"][1].startswith(
        "the spec needs a Kubeflow Pipelines backend >= 2.16.0 (because of pvcMount.subPath in "
    )
    assert "executors.exec-search" in lines["sub_path"][1]
    assert lines["plain"][1].startswith(f"the spec needs a Kubeflow Pipelines backend >= {BASE_FLOOR} (because of isArtifactList")


def test_a_field_the_table_lacks_is_reported_not_guessed(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "pipelineInfo: {name: x}\nschemaVersion: 2.1.0\n---\n"
        "platforms:\n  kubernetes:\n    deploymentSpec:\n      executors:\n"
        "        exec-a: {pvcMount: [{constant: c, mountPath: /m, subPath: s, readOnly: true}]}\n"
    )
    floor = spec_floor(spec)
    assert floor.unknown == (f"{EXECUTOR}pvcMount.readOnly",)
    assert floor.version == "2.16.0" and floor.because == (
        "pvcMount.subPath in platforms.kubernetes.deploymentSpec.executors.exec-a",
    )


def _proto_knows(path: str, version: str) -> bool:
    """Whether KubernetesExecutorConfig of `version`'s proto (tests/data/kfp) has the field at `path` (lowerCamel)."""
    tables, message = PROTO_FIELDS[version], "kfp_kubernetes.KubernetesExecutorConfig"
    for part in path.split("."):
        fields = {"".join(w.title() if i else w for i, w in enumerate(f.split("_"))): kind for f, kind in tables[message].items()}
        if part not in fields:
            return False
        message = fields[part].removesuffix("[]")
        if message not in tables:
            return True  # a scalar, map or json value: nothing below it is a field
    return True


@pytest.mark.parametrize("version", [v for v in PROTO_FIELDS if not v.startswith("_")])
def test_the_table_s_kubernetes_floors_agree_with_that_release_s_proto(version):
    """A Kubernetes field at or below a release's floor is in that release's proto; one its proto lacks is above it."""
    table = floor_table()
    kubernetes = {p.removeprefix(EXECUTOR): v for p, v in table.fields.items() if p.startswith(EXECUTOR)}
    assert "pvcMount.subPath" in kubernetes and "secretAsEnv.optional" in kubernetes
    for field, floor in kubernetes.items():
        if version_key(floor) <= version_key(version):
            assert _proto_knows(field, version), (field, floor)
        if not _proto_knows(field, version):
            assert version_key(floor) > version_key(version), (field, floor)


def test_the_table_is_whole():
    """Each map and free path is itself a field, and every floor is a release the table's source names."""
    data = yaml.safe_load(TABLE_FILE.read_text())
    table = floor_table()
    assert set(table.free) <= set(table.fields)
    assert {m for m in table.maps if m} <= set(table.fields)
    assert {str(v) for v in table.fields.values()} <= {str(r) for r in data["releases"]}
    assert table.fields[f"{EXECUTOR}pvcMount.subPath"] == "2.16.0"
    assert table.fields[f"{EXECUTOR}secretAsEnv.optional"] == "2.15.0"
