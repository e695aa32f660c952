"""Content identity of stage inputs (`evoesap.identity`): what must change for a stage to run again."""

import hashlib
import shutil
from pathlib import Path

import fsspec
import pytest

from evoesap import artifacts, identity
from evoesap.errors import ConfigError


def test_a_local_file_is_identified_by_size_and_sha256(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "a"}\n')
    record, digest = identity.identify(str(data))
    assert record == {"kind": "file", "size": 14, "sha256": hashlib.sha256(b'{"text": "a"}\n').hexdigest()}
    assert digest == identity.digest(record)


def test_an_artifact_is_identified_by_its_manifest(tmp_path):
    out = str(tmp_path / "art")
    with artifacts.stage_output(out, "demo", {}, {}) as staging:
        (staging / "x").write_text("1")
    assert identity.identify(out)[0] == {"kind": "artifact", "manifest_sha256": artifacts.manifest_sha256(out)}


def test_an_object_without_a_store_identity_is_hashed():
    fs = fsspec.filesystem("memory")
    fs.pipe("/identity-test/data.jsonl", b"one")
    first = identity.identify("memory://identity-test/data.jsonl")[0]
    fs.pipe("/identity-test/data.jsonl", b"two")  # same size, other bytes
    assert identity.identify("memory://identity-test/data.jsonl")[0]["sha256"] != first["sha256"]


@pytest.mark.parametrize("name", ["no-such-model", "./models/x", "/abs/missing", "a/b/c", "~/model"])
def test_a_missing_path_is_refused_and_never_resolved_on_the_hub(name, monkeypatch):
    monkeypatch.setattr(identity, "resolve_revision", lambda *a: pytest.fail(f"{name} went to the hub"))
    with pytest.raises(ConfigError, match="does not exist"):
        identity.identify(name)


def test_a_hub_name_is_identified_by_its_resolved_revision(monkeypatch):
    revisions = {"org/model": "a" * 40}
    monkeypatch.setattr(identity, "resolve_revision", lambda name, repo_type: revisions[name])
    record, digest = identity.identify("org/model")
    assert record == {"kind": "hub", "name": "org/model", "repo_type": "model", "revision": "a" * 40}
    revisions["org/model"] = "b" * 40  # a new commit pushed under the same name
    assert identity.identify("org/model")[1] != digest
    assert artifacts.cache_key("s", {}, artifacts.describe_inputs({"model": "org/model"})) != artifacts.cache_key(
        "s", {}, {"model": {"uri": "org/model", **record}})


def test_a_checkpoint_is_identified_without_reading_its_weights(tiny_artifacts, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_artifacts["model"], model)
    monkeypatch.setattr(identity, "SMALL_FILE_BYTES", 1 << 10)  # the tiny weights count as large here
    read = []
    real_sha = identity._sha256
    monkeypatch.setattr(identity, "_sha256", lambda fs, path: read.append(Path(path).name) or real_sha(fs, path))
    record, digest = identity.identify(str(model))
    assert "model.safetensors" not in read and "config.json" in read
    weights = record["files"]["model.safetensors"]
    assert set(weights) == {"size", "mtime"} and weights["size"] == (model / "model.safetensors").stat().st_size
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    assert identity.identify(str(model))[1] != digest


