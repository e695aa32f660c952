"""The hand-off to MLflow's model registry against a real `mlflow server` (SQLite backend, on a free port of 127.0.0.1,
started from .venv-mlflow and stopped after): the registry holds the release's version with its lineage tags, read
back through the REST API; a re-run adds no version; refusals (a 4xx, an unreachable server, a local source) are one
line without the token."""

from __future__ import annotations

import json
import socket
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from evoesap.components.register import register_models
from kfp import dsl
from recording_http import JsonHandler, serving

from evoesap import records
from evoesap.cli import main
from evoesap.errors import ConfigError, ReleaseError
from evoesap.records import facts
from evoesap.release import mlflow_registry
from evoesap.store import artifacts

TOKEN = "mlflow-token-for-tests-0123456789"


def _api(base: str, path: str, **query: str) -> dict:
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}", timeout=30) as answer:
        return json.loads(answer.read())


def test_a_release_is_registered_with_its_lineage_and_a_rerun_adds_no_version(released, mlflow_server, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)  # the server takes no auth; the client must send it and print none
    assert main(["register", "--published", released["published"], "--name", "tiny-olmoe-pruned"]) == 0
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err and "registered: tiny-olmoe-pruned version 1" in printed.out

    version = _api(mlflow_server, "model-versions/get", name="tiny-olmoe-pruned", version="1")["model_version"]
    assert version["source"] == released["to"]  # where publish pushed it
    tags = {t["key"]: t["value"] for t in version["tags"]}
    # each lineage tag against the artifacts themselves
    pruning = records.read(released["pruned"], records.PruningRecord)
    metrics = json.loads(Path(released["evaluated"], "metrics.json").read_text())
    primary = {f"evoesap.metric.{r['task']}/{r['metric']}": r["value"] for r in metrics["records"] if r["primary"]}
    assert primary and {k: float(tags[k]) for k in primary} == pytest.approx(primary, rel=1e-5)
    assert tags["evoesap.base_model"] == artifacts.redact(artifacts.read_manifest(released["pruned"]).inputs["model"]["uri"])
    assert (tags["evoesap.criterion"], float(tags["evoesap.sparsity"])) == (pruning.criterion, pruning.sparsity) == ("reap", 0.5)
    assert tags["evoesap.method"] == "searched"
    assert tags["evoesap.experts_per_layer"] == ",".join(map(str, pruning.num_experts))
    assert tags["evoesap.allocation_sha256"] == artifacts.manifest_sha256(released["search_out"])
    assert tags["evoesap.gate"] == records.read(released["gate"], records.GateRecord).line()
    assert tags["evoesap.gate"].startswith("release gate passed")
    assert tags["evoesap.publish_manifest_sha256"] == artifacts.manifest_sha256(released["published"])

    # the same release again: the version it has, its tags set again, no second version
    again = mlflow_registry.register(released["published"], "tiny-olmoe-pruned")
    assert (again.version, again.created) == ("1", False)
    found = _api(mlflow_server, "model-versions/search", filter="name='tiny-olmoe-pruned'")["model_versions"]
    assert [v["version"] for v in found] == ["1"]


def test_the_component_registers_released_models_and_skips_withheld_ones(released, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    published = dsl.Model(name="published", uri=released["published"], metadata=facts.facts(released["published"]))
    withheld = dsl.Model(name="published", uri="/kfp/withheld", metadata={"withheld": True, "reason": "release gate failed"})
    assert published.metadata["withheld"] is False
    done = json.loads(register_models(released=[withheld, published], name="from-a-pipeline"))
    assert done == [{"version": "1", "source": released["to"]}]
    found = _api(mlflow_server, "model-versions/search", filter="name='from-a-pipeline'")["model_versions"]
    assert [v["source"] for v in found] == [released["to"]]


def test_a_registry_s_4xx_is_one_line_without_the_token(released, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    with pytest.raises(ReleaseError) as refused:  # a Hub-style name: MLflow's names take no '/'
        mlflow_registry.register(released["published"], "my-org/olmoe-pruned")
    line = str(refused.value)
    assert "\n" not in line and TOKEN not in line
    assert "HTTP 400 INVALID_PARAMETER_VALUE" in line and "cannot contain '/'" in line and mlflow_server in line


def test_an_unreachable_registry_is_one_line_naming_it(released, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    with pytest.raises(
        ReleaseError, match=r"the model registry at http://127\.0\.0\.1:\d+ cannot be reached .*MLFLOW_TRACKING_URI"
    ):
        mlflow_registry.register(released["published"], "tiny")


class Echo(JsonHandler):
    """A registry that answers 403 and echoes the request's Authorization header back, recording each path."""

    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.paths.append(self.path)
        self._reply({"error_code": "PERMISSION_DENIED", "message": f"bad {self.headers.get('Authorization')}"}, 403)

    do_GET = do_POST  # noqa: N815


def test_what_a_registry_echoes_back_is_scrubbed_and_a_local_source_is_refused_before_any_request(released, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    with serving(Echo) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        with pytest.raises(ReleaseError) as refused:
            mlflow_registry.register(released["published"], "tiny")
        line = str(refused.value)
        assert TOKEN not in line and "HTTP 403 PERMISSION_DENIED" in line and "MLFLOW_TRACKING_TOKEN" in line
        Echo.paths.clear()
        with pytest.raises(ConfigError, match="is a local path, which a model registry cannot hand to anyone"):
            mlflow_registry.register(released["published"], "tiny", source=str(Path(released["published"]).resolve()))
        assert Echo.paths == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://user:secret@mlflow.example.org")
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI 'https://mlflow.example.org' has credentials"):
        mlflow_registry.register(released["published"], "tiny")
