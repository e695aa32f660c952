"""Lineage checks an artifact it reads again against what its reader recorded: by content where the reader recorded
it (the same artifact made again with a new manifest is what was read), by manifest in a record made before."""

import shutil

import pytest

from evoesap.errors import ArtifactError
from evoesap.records import facts
from evoesap.release import lineage as release_lineage
from evoesap.store import artifacts, lineage

PRUNE = {"criterion": "reap", "sparsity": 0.5}


def _model(tmp_path):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return str(model)


def _prune(tmp_path, data_dir: str, payload: bytes = b"weights") -> str:
    """The prune artifact at one URI, made from a data file under `data_dir`: another place, another manifest (it names
    where its inputs lay), the same content (key and payload) when the bytes are the same."""
    rows = tmp_path / data_dir / "rows.jsonl"
    rows.parent.mkdir(exist_ok=True)
    rows.write_bytes(b"rows")
    out = tmp_path / "prune"
    shutil.rmtree(out, ignore_errors=True)
    with artifacts.stage_output(str(out), "prune", PRUNE, {"model": _model(tmp_path), "scores": str(rows)}) as staging:
        (staging / "model.safetensors").write_bytes(payload)
    return str(out)


def _read_then_made_again(tmp_path, payload: bytes):
    """The prune artifact, the manifest of a publish that read it, and what that manifest recorded of it; then the
    prune artifact made again at its URI."""
    pruned = _prune(tmp_path, "a")
    reader = str(tmp_path / "publish")
    with artifacts.stage_output(reader, "publish", {}, {"pruned": pruned}) as staging:
        (staging / "release.txt").write_text("released")
    before = artifacts.manifest_sha256(pruned)
    _prune(tmp_path, "b", payload)
    assert artifacts.manifest_sha256(pruned) != before  # a new manifest in every case
    published = artifacts.read_manifest(reader)
    return pruned, published, published.inputs["pruned"]


def test_model_origin_follows_a_checkpoint_made_again_from_the_same_bytes(tmp_path):
    _, _, read = _read_then_made_again(tmp_path, b"weights")
    origin = lineage.model_origin(read)
    assert origin.through == ("prune",) and origin.uri == _model(tmp_path)


def test_model_origin_refuses_a_checkpoint_made_again_with_other_bytes_in_one_line(tmp_path):
    pruned, _, read = _read_then_made_again(tmp_path, b"other weights")
    now = artifacts.artifact_identity(pruned)["content_sha256"]
    with pytest.raises(ArtifactError) as caught:
        lineage.model_origin(read)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{pruned} changed since it was read (content sha256 {now[:12]}, recorded {read['content_sha256'][:12]})" in message
    assert "re-run the stages from there" in message


def test_a_record_from_before_content_identities_is_checked_by_its_manifest(tmp_path):
    """No content identity recorded: only the very manifest read is accepted, even for the same bytes made again."""
    pruned = _prune(tmp_path, "a")
    read = {"uri": pruned, "kind": "artifact", "manifest_sha256": artifacts.manifest_sha256(pruned)}
    assert lineage.model_origin(read).through == ("prune",)
    assert facts._recorded(read, "prune")
    _prune(tmp_path, "b")
    with pytest.raises(ArtifactError, match=r"changed since it was read \(manifest sha256 \w{12}, recorded \w{12}\)"):
        lineage.model_origin(read)
    assert not facts._recorded(read, "prune")


@pytest.mark.parametrize("payload, kept", [(b"weights", True), (b"other weights", False)])
def test_facts_and_the_release_read_a_checkpoint_made_again_by_content(tmp_path, payload, kept):
    """The published point's facts and the release's check of what it released, as the lineage walk: a checkpoint made
    again from the same bytes is still the one recorded; made with other bytes, it is not."""
    pruned, published, read = _read_then_made_again(tmp_path, payload)
    assert facts._recorded(read, "prune") is kept
    if kept:
        assert release_lineage._input(published, "pruned", "prune", "pub") == pruned
    else:
        with pytest.raises(ArtifactError, match="changed since"):
            release_lineage._input(published, "pruned", "prune", "pub")


def test_the_walk_names_an_artifact_by_content_so_a_reused_report_stays_true(tmp_path):
    """The artifacts a report lists carry their content identity, not their manifest's sha256: a report reused after an
    upstream artifact was made again from the same bytes still names what is there; other bytes show."""
    pruned = _prune(tmp_path, "a")
    reader = str(tmp_path / "publish")
    with artifacts.stage_output(reader, "publish", {}, {"pruned": pruned}) as staging:
        (staging / "release.txt").write_text("released")

    def listed():
        return {node.uri: node.content_sha256 for node in lineage.walk({"runs": reader}).nodes}

    before = listed()
    assert set(before) == {reader, pruned} and all(before.values())
    _prune(tmp_path, "b")  # a new manifest, the same content
    assert listed() == before
    _prune(tmp_path, "c", b"other weights")
    assert listed()[pruned] != before[pruned] and listed()[reader] == before[reader]
