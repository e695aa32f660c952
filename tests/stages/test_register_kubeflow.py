"""The hand-off to the Kubeflow Model Registry through its Python client (model_registry), against an in-memory
registry that serves the client's REST calls and parses each body with the API's generated models
(tests/fake_model_registry.py; the real server is a Go service no test here can start): the registry holds the
release's version with its lineage as custom properties and its model artifact, read back from the server's store; a
re-run adds no version; refusals (a 4xx with the server's message, an unreachable server, bad settings) are one line
without the token, the settings' refused before any request."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from evoesap.components.register import register_models
from fake_model_registry import FakeModelRegistry
from kfp import dsl
from recording_http import dripping, serving

from evoesap import records
from evoesap.cli import main
from evoesap.errors import ConfigError, ReleaseError
from evoesap.records import facts
from evoesap.release import kubeflow_registry, lineage, registry
from evoesap.store import artifacts

TOKEN = "kf-registry-token-for-tests-0123456789"


@pytest.fixture
def fake_registry(monkeypatch):
    """The in-memory registry, empty, and the environment pointing at it with a token."""
    FakeModelRegistry.reset()
    with serving(FakeModelRegistry) as url:
        monkeypatch.setenv("EVOESAP_KF_REGISTRY_URL", url)
        monkeypatch.setenv("EVOESAP_KF_REGISTRY_TOKEN", TOKEN)
        yield url


def _properties(version: dict) -> dict[str, str]:
    """A version's custom properties as the server stores them (MetadataStringValue), as plain strings."""
    out = {}
    for key, value in version.get("customProperties", {}).items():
        assert value["metadataType"] == "MetadataStringValue", (key, value)
        out[key] = value["string_value"]
    return out


def test_a_release_is_registered_with_its_lineage_its_uri_and_format_and_a_rerun_adds_no_version(released, fake_registry, capsys):
    assert main(["register", "--registry", "kubeflow", "--published", released["published"], "--name", "tiny-olmoe"]) == 0
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err and "registered: tiny-olmoe version 1" in printed.out
    assert {auth for _, _, auth in FakeModelRegistry.requests} == {f"Bearer {TOKEN}"}  # each request carried the token

    [version] = FakeModelRegistry.versions("tiny-olmoe")
    assert (version["name"], version["author"]) == ("1", kubeflow_registry.AUTHOR)
    properties = _properties(version)
    # the lineage, each against the artifacts themselves
    pruning = records.read(released["pruned"], records.PruningRecord)
    assert properties["evoesap.publish_manifest_sha256"] == artifacts.manifest_sha256(released["published"])
    assert (properties["evoesap.criterion"], float(properties["evoesap.sparsity"])) == (pruning.criterion, pruning.sparsity)
    assert properties["evoesap.experts_per_layer"] == ",".join(map(str, pruning.num_experts))
    assert properties["evoesap.allocation_sha256"] == artifacts.manifest_sha256(released["search_out"])
    assert properties["evoesap.gate"] == records.read(released["gate"], records.GateRecord).line()
    assert (properties["evoesap.model_format"], properties["evoesap.model_format_version"]) == ("safetensors", "1")
    assert any(k.startswith("evoesap.metric.") for k in properties)
    # the same fields as MLflow's tags: every lineage tag, nothing else
    assert properties == lineage.read(released["published"]).tags
    [artifact] = FakeModelRegistry.artifacts(version["id"])
    assert (artifact["uri"], artifact["name"]) == (released["to"], "tiny-olmoe")  # where publish pushed it
    assert (artifact["modelFormatName"], artifact["modelFormatVersion"]) == ("safetensors", "1")

    # the same release again, one property changed on the server and one of someone else's added: the version it has,
    # its properties set again and the other one kept, no second version nor artifact
    stored = FakeModelRegistry.objects["model_versions"][version["id"]]["customProperties"]
    stored["evoesap.gate"]["string_value"] = "tampered"
    stored["team.owner"] = {"string_value": "ml-platform", "metadataType": "MetadataStringValue"}
    again = registry.register(released["published"], "tiny-olmoe", registry="kubeflow")
    assert (again.version, again.created, again.source) == ("1", False, released["to"])
    [version] = FakeModelRegistry.versions("tiny-olmoe")
    assert _properties(version) == {**properties, "team.owner": "ml-platform"}
    assert len(FakeModelRegistry.artifacts(version["id"])) == 1


def test_a_new_release_takes_the_next_number_or_its_given_name_and_a_taken_name_is_refused(released, fake_registry):
    # version 1: an earlier release; version 3: a model someone else registered
    assert registry.register(released["published"], "olmoe", registry="kubeflow").version == "1"
    [earlier] = FakeModelRegistry.versions("olmoe")
    earlier["customProperties"]["evoesap.publish_manifest_sha256"]["string_value"] = "an-earlier-release"
    FakeModelRegistry.objects["model_versions"]["99"] = {**earlier, "id": "99", "name": "3", "customProperties": {}}

    with pytest.raises(ReleaseError) as refused:
        registry.register(released["published"], "olmoe", registry="kubeflow", version="3")
    line = str(refused.value)
    assert "\n" not in line and "version '3' of 'olmoe'" in line and "holds another release" in line and "--version" in line

    named = registry.register(released["published"], "olmoe", registry="kubeflow", version="v2-pruned")
    assert (named.version, named.created) == ("v2-pruned", True)
    assert sorted(v["name"] for v in FakeModelRegistry.versions("olmoe")) == ["1", "3", "v2-pruned"]
    # the same release under another --version: the version it has
    assert registry.register(released["published"], "olmoe", registry="kubeflow", version="4").version == "v2-pruned"

    FakeModelRegistry.objects["model_versions"] = {
        k: v for k, v in FakeModelRegistry.objects["model_versions"].items() if v["name"] != "v2-pruned"
    }
    assert registry.register(released["published"], "olmoe", registry="kubeflow").version == "4"  # after 3


def test_a_registration_cut_off_before_its_artifact_is_completed_by_the_rerun(released, fake_registry):
    registry.register(released["published"], "cut", registry="kubeflow")
    [version] = FakeModelRegistry.versions("cut")
    FakeModelRegistry.objects["model_artifacts"].clear()  # as if the deadline passed between version and artifact
    again = registry.register(released["published"], "cut", registry="kubeflow", source="s3://releases/cut")
    assert (again.version, again.created) == ("1", False)
    [artifact] = FakeModelRegistry.artifacts(version["id"])
    assert (artifact["uri"], artifact["modelFormatName"]) == ("s3://releases/cut", "safetensors")
    # a later --source moves the artifact's uri
    registry.register(released["published"], "cut", registry="kubeflow", source="hf://org/cut")
    assert [a["uri"] for a in FakeModelRegistry.artifacts(version["id"])] == ["hf://org/cut"]


def test_a_quantized_release_is_registered_as_compressed_tensors_at_the_version_that_wrote_it():
    quantized = records.QuantizationRecord(
        recipe="fp8-dynamic", scheme="FP8_DYNAMIC", algorithm="rtn", calibration_samples=0, architectures=None,
        num_experts_per_layer=None, checkpoint_bytes_before=2, checkpoint_bytes_after=1,
        versions={"llmcompressor": "0.9.0", "compressed-tensors": "0.19.1"},
    )  # fmt: skip
    assert lineage.format_of(quantized) == ("compressed-tensors", "0.19.1")
    assert lineage.format_of(None) == ("safetensors", "1")


def test_the_component_registers_released_models_in_the_kubeflow_registry(released, fake_registry):
    published = dsl.Model(name="published", uri=released["published"], metadata=facts.facts(released["published"]))
    withheld = dsl.Model(name="published", uri="/kfp/withheld", metadata={"withheld": True, "reason": "release gate failed"})
    done = json.loads(register_models(released=[withheld, published], name="from-a-pipeline", registry="kubeflow"))
    assert done == [{"version": "1", "source": released["to"]}]
    [version] = FakeModelRegistry.versions("from-a-pipeline")
    assert [a["uri"] for a in FakeModelRegistry.artifacts(version["id"])] == [released["to"]]


def test_a_refusal_is_one_line_with_the_server_s_message_and_no_token(released, fake_registry):
    FakeModelRegistry.refuse = (403, "forbidden: you sent {auth}")
    with pytest.raises(ReleaseError) as refused:
        registry.register(released["published"], "tiny", registry="kubeflow")
    line = str(refused.value)
    assert "\n" not in line and TOKEN not in line and fake_registry in line
    assert "HTTP 403" in line and "forbidden: you sent Bearer ***" in line and "EVOESAP_KF_REGISTRY_TOKEN" in line

    FakeModelRegistry.refuse = (400, "invalid name: names take no '/'")
    with pytest.raises(ReleaseError, match=r"refused a request \(HTTP 400\): invalid name: names take no '/': correct"):
        registry.register(released["published"], "my-org/tiny", registry="kubeflow")


def test_an_unreachable_or_stalled_registry_is_one_line_naming_it(released, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("EVOESAP_KF_REGISTRY_URL", closed)
    monkeypatch.setenv("EVOESAP_KF_REGISTRY_TOKEN", TOKEN)
    with pytest.raises(ReleaseError) as refused:
        registry.register(released["published"], "tiny", registry="kubeflow")
    line = str(refused.value)
    assert "\n" not in line and TOKEN not in line
    assert line.startswith(f"the Kubeflow Model Registry at {closed} cannot be reached (") and "EVOESAP_KF_REGISTRY_URL" in line

    monkeypatch.setenv("EVOESAP_REGISTRY_DEADLINE_S", "0.5")
    with dripping() as url:  # answers a byte at a time: only the overall deadline ends it
        monkeypatch.setenv("EVOESAP_KF_REGISTRY_URL", url)
        with pytest.raises(ReleaseError, match=r"registering tiny at http://127\.0\.0\.1:\d+ did not finish within 0\.5 s"):
            registry.register(released["published"], "tiny", registry="kubeflow")


@pytest.mark.parametrize(
    ("registry_name", "url", "extra", "message"),
    [
        ("kubeflow", None, {}, "no model registry: set EVOESAP_KF_REGISTRY_URL to the Kubeflow Model Registry's URL"),
        ("kubeflow", "ftp://registry.example.org", {}, "'ftp://registry.example.org' is not the http(s):// URL"),
        ("kubeflow", "https://user:pw@registry.example.org", {}, "EVOESAP_KF_REGISTRY_URL 'https://registry.example.org' has credentials"),
        ("kubeflow", "https://registry.example.org/api", {}, "has a path: the Kubeflow Model Registry's client takes scheme://host"),
        ("kubeflow", "https://registry.example.org", {"version": " "}, "--version is empty"),
        ("mlflow", "https://mlflow.example.org", {"version": "v1"}, "--version 'v1' cannot be given to mlflow: it numbers"),
        ("kubeflw", "https://registry.example.org", {}, "unknown model registry 'kubeflw': did you mean 'kubeflow'?"),
        ("kubeflow", "https://registry.example.org", {"source": "/local/path"}, "is a local path, which a model registry"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line_before_any_request(released, monkeypatch, registry_name, url, extra, message):
    for variable in ("EVOESAP_KF_REGISTRY_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(variable, raising=False)
        if url is not None:
            monkeypatch.setenv(variable, url)
    with pytest.raises(ConfigError) as refused:  # the URLs name no server that answers: any request would fail otherwise
        registry.register(released["published"], "tiny", registry=registry_name, **extra)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert "pw" not in str(refused.value)


def test_without_the_client_installed_the_line_says_how_to_install_it(released, fake_registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_registry", None)  # import model_registry raises ImportError
    with pytest.raises(
        ConfigError, match=r"Python client \(model-registry\) is not installed: pip install 'evoesap\[kubeflow-registry\]'"
    ):
        registry.register(released["published"], "tiny", registry="kubeflow")
    assert FakeModelRegistry.requests == []
