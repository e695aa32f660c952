"""Reuse keyed by content all the way down: an upstream artifact made again from the same bytes at another URI
leaves every downstream key unchanged, on real stage runs of a tiny OLMoE."""

import shutil

import pytest
from tiny_world import make_tiny_inputs

from evoesap import steps
from evoesap.stages import prune as prune_stage
from evoesap.store import artifacts, lineage

CALIBRATE = {"samples": 8, "max_length": 128}
PRUNE = {"criterion": "reap", "sparsity": 0.5}


def _artifacts_under(root):
    return sorted(str(p.parent) for p in root.rglob(artifacts.MANIFEST))


def test_calibrate_made_again_at_another_uri_reuses_the_prune_made_from_the_first(tmp_path, monkeypatch):
    files = make_tiny_inputs(tmp_path / "inputs")
    elsewhere = tmp_path / "copied" / "calibration.jsonl"  # the same data at another path: another calibrate manifest
    elsewhere.parent.mkdir()
    shutil.copyfile(files["calibration"], elsewhere)
    first = steps.run_step(
        "calibrate", str(tmp_path / "root-a"), {"model": files["model"], "data": files["calibration"]}, CALIBRATE
    )
    again = steps.run_step("calibrate", str(tmp_path / "root-b"), {"model": files["model"], "data": str(elsewhere)}, CALIBRATE)
    made_first, made_again = artifacts.read_manifest(first), artifacts.read_manifest(again)
    assert made_first.files == made_again.files  # the same scores, byte for byte ...
    assert artifacts.manifest_sha256(first) != artifacts.manifest_sha256(again)  # ... under manifests naming other inputs

    shared = tmp_path / "shared"
    pruned = steps.run_step("prune", str(shared), {"model": files["model"], "scores": first}, PRUNE)
    before = _artifacts_under(shared)
    calls = []
    real = prune_stage.run_prune
    monkeypatch.setattr(prune_stage, "run_prune", lambda **kw: calls.append(kw) or real(**kw))
    assert steps.run_step("prune", str(shared), {"model": files["model"], "scores": again}, PRUNE) == pruned
    assert calls == [] and _artifacts_under(shared) == before == [pruned]  # found finished: no new artifact

    recorded = artifacts.read_manifest(pruned).inputs["scores"]  # lineage still names, and checks, what it read
    assert recorded["uri"] == first and recorded["manifest_sha256"] == artifacts.manifest_sha256(first)
    assert lineage.identity_of(recorded) == lineage.identity_of(artifacts.describe_inputs({"scores": again})["scores"])


def _made(root, stage, payload, inputs=None):
    """A `stage` artifact under `root` from a data file there (so each place's manifest names another input)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "rows.jsonl").write_bytes(b"rows")
    out = str(root / stage)
    with artifacts.stage_output(out, stage, {}, {"data": str(root / "rows.jsonl"), **(inputs or {})}) as staging:
        (staging / "payload.bin").write_bytes(payload)
    return out


def test_the_search_cache_made_again_elsewhere_is_still_refused_as_a_held_out_cache(tmp_path):
    """A search reused from a cache at one URI optimised on the same samples as that cache made again at another:
    evaluating with it is not held out, and is refused as the cache itself is."""
    from evoesap.errors import ConfigError
    from evoesap.stages.evaluate import _check_heldout

    searched_on = _made(tmp_path / "a", "cache-logits", b"logits")
    again = _made(tmp_path / "b", "cache-logits", b"logits")
    search = _made(tmp_path / "search", "search", b"allocation", {"cache": searched_on})
    for teacher in (searched_on, again):
        with pytest.raises(ConfigError, match="is the cache the search .* optimised on"):
            _check_heldout(teacher, "org/model", search)
    _check_heldout(_made(tmp_path / "c", "cache-logits", b"other samples"), "org/model", search)  # held out: accepted


def test_publish_takes_a_search_made_again_elsewhere_as_the_one_the_prune_used(tmp_path):
    from evoesap.errors import ConfigError
    from evoesap.stages.publish import _check_search

    used = _made(tmp_path / "a", "search", b"allocation")
    pruned = _made(tmp_path / "prune", "prune", b"weights", {"allocation": used})
    manifest = artifacts.read_manifest(pruned)
    _check_search(used, manifest, pruned)
    _check_search(_made(tmp_path / "b", "search", b"allocation"), manifest, pruned)  # the same content elsewhere
    with pytest.raises(ConfigError, match="is not the search"):
        _check_search(_made(tmp_path / "c", "search", b"another allocation"), manifest, pruned)
