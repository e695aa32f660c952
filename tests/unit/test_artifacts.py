import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evoesap.errors import ArtifactError
from evoesap.store import artifacts


def test_stage_output_publishes_payload_and_manifest_last(tmp_path):
    out = str(tmp_path / "art")
    with artifacts.stage_output(out, "demo", {"a": 1}, {}) as staging:
        (staging / "x.txt").write_text("hello")
    manifest = artifacts.read_manifest(out)
    assert manifest.stage == "demo"
    assert manifest.files["x.txt"] == artifacts.sha256_bytes(b"hello")


def test_failed_stage_leaves_no_artifact(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError), artifacts.stage_output(str(out), "demo", {}, {}) as staging:
        (staging / "x.txt").write_text("half")
        raise RuntimeError("boom")
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_failed_rerun_keeps_previous_artifact(tmp_path):
    out = str(tmp_path / "art")
    with artifacts.stage_output(out, "demo", {"v": 1}, {}) as staging:
        (staging / "x.txt").write_text("v1")
    with pytest.raises(RuntimeError), artifacts.stage_output(out, "demo", {"v": 2}, {}) as staging:
        raise RuntimeError("boom")
    assert (tmp_path / "art" / "x.txt").read_text() == "v1"


def test_unfinished_artifact_is_refused(tmp_path):
    (tmp_path / "art").mkdir()
    with pytest.raises(ArtifactError, match="not a finished artifact"):
        artifacts.read_manifest(str(tmp_path / "art"))


def test_cache_key_follows_params_and_input_manifests(tmp_path):
    src = str(tmp_path / "src")
    with artifacts.stage_output(src, "a", {}, {}) as staging:
        (staging / "f").write_text("1")
    out = str(tmp_path / "out")
    with artifacts.stage_output(out, "b", {"p": 1}, {"src": src}):
        pass
    assert artifacts.cached(out, "b", {"p": 1}, {"src": src}) is not None
    assert artifacts.cached(out, "b", {"p": 2}, {"src": src}) is None
    with artifacts.stage_output(src, "a", {}, {}) as staging:
        (staging / "f").write_text("2")
    assert artifacts.cached(out, "b", {"p": 1}, {"src": src}) is None


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_reuse_refuses_an_artifact_whose_payload_was_deleted_or_changed(tmp_path, damage):
    out = tmp_path / "out"
    with artifacts.stage_output(str(out), "b", {"p": 1}, {}) as staging:
        (staging / "weights.bin").write_bytes(b"w" * 1000)
        (staging / "config.json").write_text("{}")
    assert artifacts.cached(str(out), "b", {"p": 1}, {}) is not None
    if damage == "delete":
        (out / "weights.bin").unlink()
    else:
        (out / "weights.bin").write_bytes(b"w" * 10)
    assert (out / "manifest.json").exists()  # the manifest alone still claims a finished artifact
    assert artifacts.cached(str(out), "b", {"p": 1}, {}) is None


def test_memory_uri_round_trip():
    out = "memory://evoesap-test/art"
    with artifacts.stage_output(out, "demo", {}, {}) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "y.json").write_text(json.dumps({"k": 1}))
    assert artifacts.read_json(artifacts.join(out, "sub", "y.json")) == {"k": 1}
    with artifacts.local_copy(out) as local:
        assert json.loads((local / "sub" / "y.json").read_text()) == {"k": 1}


@pytest.mark.parametrize("name", ["..", "../x", "/abs", "a//b", "a/../b", "sp ace", ""])
def test_names_cannot_escape_the_root(name):
    with pytest.raises(ArtifactError):
        artifacts.join("memory://root", name)


def test_credentials_are_redacted():
    assert artifacts.redact("s3://key:secret@bucket/x") == "s3://bucket/x"


@pytest.fixture(scope="module")
def one_manifest(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sealed") / "art")
    with artifacts.stage_output(out, "demo", {"seed": 7, "lr": 0.5}, {}, run={"cost": {"candidates": 3}}) as staging:
        (staging / "x.txt").write_text("hello")
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_manifest_with_any_bit_changed_is_refused_as_malformed_never_read_as_other_lineage(one_manifest, position, bit):
    path = Path(one_manifest) / artifacts.MANIFEST
    sealed = path.read_bytes()
    assert artifacts.read_manifest(one_manifest).run == {"cost": {"candidates": 3}}
    data = bytearray(sealed)
    data[int(position * len(data))] ^= 1 << bit
    try:
        path.write_bytes(bytes(data))
        with pytest.raises(ArtifactError, match="is malformed .*rebuild it"):
            artifacts.read_manifest(one_manifest)
    finally:
        path.write_bytes(sealed)
