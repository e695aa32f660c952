"""The compiled specs against the backend releases the docs and `evoesap pipeline compile` name: the docs' lowest
backend is the floor of the smallest configuration, and every task's Kubernetes settings hold only fields the
backend's own proto of the spec's stated floor knows (its Argo compiler parses them strictly: an unknown field
refuses the run at creation). The proto field tables are vendored from kubeflow/pipelines (tests/data/kfp, with
their tag and commit), apart from the floor table the CLI reads (pipeline/backend_floors.yaml).
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from evoesap.pipeline.backend_floor import floor_table, spec_floor, version_key
from evoesap.pipeline.config import load_config
from evoesap.pipeline.dag import compile_pipeline
from remote_config import REMOTE_CONFIG

ROOT = Path(__file__).resolve().parents[2]
FIELDS = json.loads((ROOT / "tests" / "data" / "kfp" / "kubernetes_executor_config_fields.json").read_text())
KUBEFLOW_PAGE = ROOT / "docs" / "guides" / "kubeflow-submit.md"
# The pages that may hold a pipeline configuration example: the README and every documentation page.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _floor() -> str:
    """The lowest backend version the Kubeflow guide names: every configuration's floor."""
    found = re.search(r"Kubeflow Pipelines backend (\d+\.\d+\.\d+) or later", KUBEFLOW_PAGE.read_text())
    assert found, f"{KUBEFLOW_PAGE.relative_to(ROOT)} no longer names the lowest Kubeflow Pipelines backend"
    return found.group(1)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def unknown_fields(value: Any, message: str, version: str, where: str = "") -> list[str]:
    """Where `value` (protojson: lowerCamel or proto names) holds a field that `message` of `version` lacks."""
    table = FIELDS[version][message]
    names = {**{_camel(f): kind for f, kind in table.items()}, **table}
    if not isinstance(value, dict):
        return [f"{where or message}: not an object"]
    problems = []
    for key, item in value.items():
        kind, at = names.get(key), f"{where}.{key}" if where else key
        if kind is None:
            problems.append(at)
            continue
        repeated, inner = kind.endswith("[]"), kind.removesuffix("[]")
        if repeated and not isinstance(item, list):
            problems.append(f"{at}: not a list")
            continue
        if inner in FIELDS[version]:
            for i, element in enumerate(item if repeated else [item]):
                problems += unknown_fields(element, inner, version, f"{at}[{i}]" if repeated else at)
    return problems


def _executor_configs(spec_path: Path) -> dict[str, Any]:
    _, *platform = yaml.safe_load_all(spec_path.read_text())
    if not platform:
        return {}
    return platform[0]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _configs() -> list[tuple[str, dict]]:
    """Every example configuration; those with a publish section also with publish on (its token is a secret, as in
    the docs' cluster examples); and the configuration blocks of the README and the documentation pages."""
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        out.append((path.stem, data))
        if "publish" in data.get("resources", {}) and not data.get("publish_models"):
            one_point = {"criteria": data["criteria"][:1], "sparsities": data["sparsities"][:1]}  # one repo, one model
            out.append((f"{path.stem}+publish", {**data, **one_point, "publish_models": True}))
    for page in DOC_PAGES:
        blocks = re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S)
        out += [(f"{page.relative_to(ROOT)}-{i}", yaml.safe_load(b)) for i, b in enumerate(blocks) if "storage_root" in b]
    assert any(name.startswith("docs/guides/configure.md-") for name, _ in out), "configure.md lost its configuration example"
    return out


CONFIGS = _configs()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[dict[str, Any], str]]:
    """Each configuration's executors' Kubernetes settings and the floor its spec states."""
    root = tmp_path_factory.mktemp("specs")
    out = {}
    for name, data in CONFIGS:
        path = compile_pipeline(load_config(data), root / f"{name.replace('/', '_')}.yaml")
        out[name] = (_executor_configs(path), spec_floor(path).version)
    return out


def test_the_lowest_backend_the_docs_name_is_the_floor_of_the_smallest_configuration(tmp_path):
    floor = spec_floor(compile_pipeline(load_config(dict(REMOTE_CONFIG)), tmp_path / "pipeline.yaml"))
    assert floor.version == _floor(), floor.line()


@pytest.mark.parametrize("name", [name for name, _ in CONFIGS])
def test_every_compiled_kubernetes_setting_is_known_to_the_backend_the_spec_states(name, compiled):
    executors, floor = compiled[name]
    assert version_key(floor) >= version_key(_floor())
    vendored = max((v for v in FIELDS if not v.startswith("_")), key=version_key)
    against = floor if floor in FIELDS else vendored
    assert version_key(against) <= version_key(floor), f"vendor the {floor} field table into tests/data/kfp"
    prefix = "platforms.kubernetes.deploymentSpec.executors.*."
    above = {
        p.removeprefix(prefix)
        for p, v in floor_table().fields.items()
        if p.startswith(prefix) and version_key(v) > version_key(against)
    }
    for executor, config in executors.items():
        unknown = {re.sub(r"\[\d+\]", "", p) for p in unknown_fields(config, "kfp_kubernetes.KubernetesExecutorConfig", against)}
        assert unknown <= above, (executor, unknown)


def test_a_secret_is_what_a_2_14_backend_refuses_and_the_stated_floor_says_so(compiled):
    """kfp-kubernetes 2.17 writes secretAsEnv.optional, which 2.14's proto lacks: exactly the configurations with
    secrets state a floor above 2.14."""
    top = "kfp_kubernetes.KubernetesExecutorConfig"
    found = {
        name: [p for config in executors.values() for p in unknown_fields(config, top, "2.14.0")]
        for name, (executors, _) in compiled.items()
    }
    refused = {name: problems for name, problems in found.items() if problems}
    assert refused, "no configuration with secrets was compiled"
    assert {re.sub(r"\[\d+\]", "[i]", p) for problems in refused.values() for p in problems} == {"secretAsEnv[i].optional"}
    assert "olmoe-1b-7b-instruct+publish" in refused
    assert {name for name, (_, floor) in compiled.items() if version_key(floor) > version_key("2.14.0")} == set(refused)


def test_the_check_refuses_an_unknown_field_anywhere():
    config = {"secretAsEnv": [{"keyToEnv": [{"secretKey": "t", "envVar": "T", "extra": 1}], "secretName": "s"}]}
    assert unknown_fields(config, "kfp_kubernetes.KubernetesExecutorConfig", "2.15.0") == ["secretAsEnv[0].keyToEnv[0].extra"]
    assert unknown_fields({"podMetadata": {"labels": {"a": "b"}}}, "kfp_kubernetes.KubernetesExecutorConfig", "2.15.0") == []
