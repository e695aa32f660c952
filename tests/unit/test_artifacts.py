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


def _chain(root: Path, data: bytes, payloads: tuple[bytes, ...]) -> str:
    """A data file under `root` and a chain of artifacts made from it (stage i reads stage i-1), each with its payload;
    the URI of the last."""
    root.mkdir(parents=True)
    (root / "rows.jsonl").write_bytes(data)
    upstream = str(root / "rows.jsonl")
    for i, payload in enumerate(payloads):
        out = str(root / f"step{i}")
        with artifacts.stage_output(out, f"s{i}", {"i": i}, {"data" if i == 0 else "up": upstream}) as staging:
            (staging / "payload.bin").write_bytes(payload)
        upstream = out
    return upstream


def _key_downstream(upstream: str) -> str:
    return artifacts.cache_key("next", {"p": 1}, artifacts.describe_inputs({"up": upstream}))


def test_a_chain_made_again_from_the_same_bytes_elsewhere_keys_downstream_the_same(tmp_path):
    first = _chain(tmp_path / "a", b"rows", (b"scores", b"logits"))
    again = _chain(tmp_path / "b" / "deeper", b"rows", (b"scores", b"logits"))
    assert artifacts.manifest_sha256(first) != artifacts.manifest_sha256(again)  # they name other input locations
    assert _key_downstream(first) == _key_downstream(again)
    out = str(tmp_path / "next")
    with artifacts.stage_output(out, "next", {"p": 1}, {"up": first}):
        pass
    assert artifacts.cached(out, "next", {"p": 1}, {"up": again}) is not None  # reused, not made again


@pytest.mark.parametrize("differs", [0, 1])
def test_an_artifact_made_again_with_other_bytes_keys_downstream_anew(tmp_path, differs):
    """A stage that is not deterministic (a search with threads) may make other bytes from the same parameters and
    inputs: the same cache key, but not the same content, so nothing downstream of it is reused."""
    payloads = [b"scores", b"logits"]
    first = _chain(tmp_path / "a", b"rows", tuple(payloads))
    payloads[differs] += b"!"
    again = _chain(tmp_path / "b", b"rows", tuple(payloads))
    assert artifacts.read_manifest(first).cache_key == artifacts.read_manifest(again).cache_key or differs == 0
    assert _key_downstream(first) != _key_downstream(again)
    out = str(tmp_path / "next")
    with artifacts.stage_output(out, "next", {"p": 1}, {"up": first}):
        pass
    assert artifacts.cached(out, "next", {"p": 1}, {"up": again}) is None


_NAME = st.text("abcdefghij0123456789_-", min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64), payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3), a=_NAME, b=_NAME)
def test_a_downstream_key_depends_on_content_never_on_where_the_chain_lies(tmp_path_factory, data, payloads, a, b):
    root = tmp_path_factory.mktemp("chain")
    first = _chain(root / "one" / a, data, tuple(payloads))
    again = _chain(root / "two" / b / "x", data, tuple(payloads))
    assert _key_downstream(first) == _key_downstream(again)
    other = _chain(root / "three", data + b"+", tuple(payloads))  # other data at the root of the chain
    assert _key_downstream(other) != _key_downstream(first)


def test_a_manifest_from_before_content_identities_is_read_and_its_reuse_makes_it_again(tmp_path, monkeypatch):
    """A downstream artifact whose manifest recorded its artifact input by manifest sha256 alone (as before content
    identities) reads as before and follows its lineage; its reuse key no longer matches, so it is made again, with
    no error."""
    from evoesap.store import identity, lineage

    src = _chain(tmp_path / "src", b"rows", (b"scores",))
    out = str(tmp_path / "old")
    before = identity.artifact_record
    monkeypatch.setattr(
        identity, "artifact_record", lambda data: {k: v for k, v in before(data).items() if k != "content_sha256"}
    )
    with artifacts.stage_output(out, "next", {"p": 1}, {"up": src}) as staging:
        (staging / "x").write_text("old")
    monkeypatch.setattr(identity, "artifact_record", before)
    old = artifacts.read_manifest(out)
    assert set(old.inputs["up"]) == {"uri", "kind", "manifest_sha256"}
    assert [node.uri for node in lineage.walk({"up": out}).nodes] == [out, src]
    assert lineage.identity_of(old.inputs["up"]) == {"kind": "artifact", "manifest_sha256": artifacts.manifest_sha256(src)}
    assert artifacts.cached(out, "next", {"p": 1}, {"up": src}) is None  # made again ...
    with artifacts.stage_output(out, "next", {"p": 1}, {"up": src}) as staging:
        (staging / "x").write_text("new")
    assert artifacts.cached(out, "next", {"p": 1}, {"up": src}) is not None  # ... and reused from then on
    assert "content_sha256" in artifacts.read_manifest(out).inputs["up"]


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
