"""Content identity of stage inputs (`evoesap.store.identity`): what must change for a stage to run again."""

import hashlib
import json
import shutil
import types
from pathlib import Path

import fsspec
import pytest
import torch

from evoesap.errors import ConfigError
from evoesap.params import keyed
from evoesap.store import artifacts, identity


def test_a_local_file_is_identified_by_size_and_sha256(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "a"}\n')
    record, digest = identity.identify(str(data))
    assert record == {"kind": "file", "size": 14, "sha256": hashlib.sha256(b'{"text": "a"}\n').hexdigest()}
    assert digest == identity.digest(record)


def test_an_artifact_is_identified_by_its_content_and_its_manifest(tmp_path):
    out = str(tmp_path / "art")
    with artifacts.stage_output(out, "demo", {}, {}) as staging:
        (staging / "x").write_text("1")
    manifest = artifacts.read_manifest(out)
    content = {"stage": "demo", "cache_key": manifest.cache_key, "files": {"x": hashlib.sha256(b"1").hexdigest()}}
    assert identity.identify(out)[0] == {
        "kind": "artifact",
        "content_sha256": hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest(),
        "manifest_sha256": artifacts.manifest_sha256(out),  # what lineage checks a manifest read later against
    }


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
    monkeypatch.setattr(identity, "resolve_revision", lambda name, repo_type, revision: revisions[name])
    record, digest = identity.identify("org/model")
    assert record == {"kind": "hub", "name": "org/model", "repo_type": "model", "revision": "a" * 40}
    revisions["org/model"] = "b" * 40  # a new commit pushed under the same name
    assert identity.identify("org/model")[1] != digest
    assert artifacts.cache_key("s", {}, artifacts.describe_inputs({"model": "org/model"})) != artifacts.cache_key(
        "s", {}, {"model": {"uri": "org/model", **record}}
    )


def test_a_checkpoint_moved_elsewhere_keeps_its_identity_and_its_weights_are_hashed_once(tiny_artifacts, tmp_path, monkeypatch):
    """The weights count as large here: hashed through the digest cache, once per file version, across processes
    (the in-process cache cleared); a byte-identical copy at a new path keys the same; a change in place does not."""
    from evoesap.store import digest_cache

    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(tmp_path / "digests.sqlite"))
    monkeypatch.setattr(identity, "SMALL_FILE_BYTES", 1 << 10)
    model = tmp_path / "run-1" / "model"
    shutil.copytree(tiny_artifacts["model"], model)
    read = []
    real = identity.stream_sha256
    monkeypatch.setattr(identity, "stream_sha256", lambda fs, path: read.append(Path(path).name) or real(fs, path))
    record, digest = identity.identify(str(model))
    weights = model / "model.safetensors"
    assert record["files"]["model.safetensors"] == {
        "size": weights.stat().st_size,
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    }
    assert read.count("model.safetensors") == 1
    identity._local_sha256.cache_clear()  # another process: the digest comes from the table
    assert identity.identify(str(model))[1] == digest and read.count("model.safetensors") == 1
    assert digest_cache.location() == tmp_path / "digests.sqlite"

    moved = tmp_path / "run-2" / "model"  # what a team's Output[Model] is in the next KFP run: other path, same bytes
    shutil.copytree(model, moved)
    assert identity.identify(str(moved))[1] == digest
    key = lambda path: artifacts.cache_key("calibrate", {}, artifacts.describe_inputs({"model": str(path)}))  # noqa: E731
    assert key(moved) == key(model)
    assert artifacts.describe_inputs({"model": str(moved)})["model"]["uri"] == str(moved)  # the manifest keeps where

    tensors = weights.read_bytes()
    flipped = tensors[:-1] + bytes([tensors[-1] ^ 1])  # same size, one bit of the last tensor
    weights.write_bytes(flipped)
    identity._local_sha256.cache_clear()
    assert identity.identify(str(model))[1] != digest and key(model) != key(moved)
    (model / "config.json").write_text((moved / "config.json").read_text() + " ")
    assert identity.identify(str(model))[1] != identity.identify(str(moved))[1]


def test_without_a_writable_digest_cache_the_weights_are_still_identified(tiny_artifacts, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("EVOESAP_DIGEST_CACHE", str(blocked / "digests.sqlite"))  # its parent is a file
    monkeypatch.setattr(identity, "SMALL_FILE_BYTES", 1 << 10)
    record, _ = identity.identify(tiny_artifacts["model"])
    weights = Path(tiny_artifacts["model"]) / "model.safetensors"
    assert record["files"]["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------- hub revisions

EMBED = "model.embed_tokens.weight"


@pytest.fixture
def hub(tiny_artifacts, tmp_path, monkeypatch):
    """The hub model org/tiny at two commits (main and tag v1: the tiny model; v2: other embedding weights), in a
    hub cache read offline; the hub's API (monkeypatched) says which commit a revision is."""
    import huggingface_hub
    from huggingface_hub import constants
    from safetensors.torch import load_file, save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    commits = {"main": "1" * 40, "v1": "1" * 40, "v2": "2" * 40}
    for commit in set(commits.values()):
        shutil.copytree(tiny_artifacts["model"], repo / "snapshots" / commit)
    v2 = repo / "snapshots" / commits["v2"] / "model.safetensors"
    weights = load_file(v2)
    weights[EMBED] = weights[EMBED] + 1.0
    save_file(weights, v2, metadata={"format": "pt"})
    (repo / "refs").mkdir()
    for ref, commit in commits.items():
        (repo / "refs" / ref).write_text(commit)
    asked = []

    def repo_info(self, name, repo_type=None, revision=None, **kwargs):
        asked.append((name, revision))
        return types.SimpleNamespace(sha=commits[revision or "main"])

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the loaders read the cache; nothing goes out
    identity._hub_revision.cache_clear()  # each test is a fresh process as far as resolution goes
    yield types.SimpleNamespace(commits=commits, asked=asked, snapshots=repo / "snapshots")
    identity._hub_revision.cache_clear()


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("org/m", ("org/m", None)),
        ("org/m@v1.0", ("org/m", "v1.0")),
        ("org/m@refs/pr/3", ("org/m", "refs/pr/3")),
        ("org/m@", None),
        ("org/m@bad rev", None),
        ("s3://b/org/m@v1", None),
        ("a/b/c@v1", None),
    ],
)
def test_hub_model_references_parse_into_name_and_revision(name, parsed):
    assert identity.hub_model(name) == parsed


def test_a_revision_is_resolved_on_the_hub_to_its_commit(hub):
    assert identity.resolve_revision("org/tiny", "model", "v2") == hub.commits["v2"]
    assert identity.resolve_revision("org/tiny", "model", None) == hub.commits["main"]
    assert hub.asked == [("org/tiny", "v2"), ("org/tiny", None)]


def test_offline_a_revision_is_resolved_from_the_hub_cache(hub, monkeypatch):
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)
    assert identity.resolve_revision("org/tiny", "model", "v2") == hub.commits["v2"]
    with pytest.raises(ConfigError, match="cannot resolve the hub model 'org/tiny' at revision 'v9'"):
        identity.resolve_revision("org/tiny", "model", "v9")


def test_a_pinned_hub_model_loads_the_commit_its_revision_resolves_to(hub):
    from safetensors.torch import load_file

    from evoesap import moe
    from evoesap.machine import runtime

    for ref in ("v1", "v2"):
        stored = load_file(hub.snapshots / hub.commits[ref] / "model.safetensors")[EMBED]
        model = runtime.load_model(f"org/tiny@{ref}", device="cpu")
        assert torch.equal(model.state_dict()[EMBED], stored), ref
    assert torch.equal(
        runtime.load_model("org/tiny", device="cpu").state_dict()[EMBED],
        load_file(hub.snapshots / hub.commits["main"] / "model.safetensors")[EMBED],
    )
    assert moe.load_tokenizer("org/tiny@v2") is not None
    assert runtime.inspect_checkpoint("org/tiny@v2").layers
    assert {revision for _, revision in hub.asked} == {"v1", "v2", None}  # resolved once per revision, then reused


def test_reuse_keys_and_manifests_carry_the_commit_and_a_moved_branch_runs_again(hub, tiny_artifacts, tmp_path):
    from evoesap import steps
    from evoesap.stages.calibrate import CalibrateParams

    params = CalibrateParams(samples=4, max_length=64, device="cpu")
    inputs = {"model": "org/tiny@main", "data": tiny_artifacts["calibration"]}
    keys = {
        ref: steps.output_uri("calibrate", str(tmp_path), {**inputs, "model": f"org/tiny@{ref}"}, params) for ref in ("v1", "v2")
    }
    assert keys["v1"] != keys["v2"]
    out = str(tmp_path / "scores")
    manifest = steps.run_stage("calibrate", inputs, params, out)
    assert manifest.inputs["model"] == {
        "uri": "org/tiny@main",
        "kind": "hub",
        "name": "org/tiny",
        "repo_type": "model",
        "revision": hub.commits["main"],
    }
    assert json.loads(Path(out, "manifest.json").read_text())["inputs"]["model"]["revision"] == hub.commits["main"]
    assert artifacts.cached(out, "calibrate", keyed(params), inputs) is not None  # same commit: reused
    hub.commits["main"] = hub.commits["v2"]  # a push moves the branch
    identity._hub_revision.cache_clear()  # a later run, in its own process
    assert artifacts.cached(out, "calibrate", keyed(params), inputs) is None  # so it runs again


def test_the_streamed_prune_reads_the_shards_of_the_pinned_commit(hub, tiny_artifacts, tmp_path):
    from safetensors.torch import load_file

    from evoesap.stages.prune import PruneParams, run_prune

    out = tmp_path / "pruned"
    manifest = run_prune("org/tiny@v2", tiny_artifacts["scores"], PruneParams(criterion="reap", sparsity=0.5), str(out))
    written = load_file(out / "model.safetensors")[EMBED]
    assert torch.equal(written, load_file(hub.snapshots / hub.commits["v2"] / "model.safetensors")[EMBED])
    assert manifest.inputs["model"]["revision"] == hub.commits["v2"]


def test_lm_eval_vllm_is_given_the_commit_of_a_pinned_hub_model(hub, tiny_artifacts, monkeypatch):
    from evoesap.evaluation import lmeval, vllm_eval

    asked = []

    def simple_evaluate(python, model_args, *args, **kwargs):
        asked.append(model_args)
        raise StopIteration  # enough: the request is what this test reads

    monkeypatch.setattr(vllm_eval, "vllm_python", lambda: "python")
    monkeypatch.setattr(vllm_eval, "simple_evaluate", simple_evaluate)
    plan = lmeval.resolve_tasks((tiny_artifacts["tasks"],))
    with pytest.raises(StopIteration):
        lmeval.run_lm_eval("org/tiny@v2", None, plan, backend="vllm")
    commit = hub.commits["v2"]
    assert {k: asked[0][k] for k in ("pretrained", "revision", "tokenizer_revision")} == {
        "pretrained": "org/tiny",
        "revision": commit,
        "tokenizer_revision": commit,
    }


@pytest.mark.parametrize(
    ("model", "revision", "problem"),
    [
        ("local", "v1", "applies to hub models"),
        ("s3://bucket/model", "v1", "applies to hub models"),
        ("org/m@v1", "v2", "already names revision"),
        ("org/m", "two words", "not a branch, tag or commit"),
    ],
)
def test_a_revision_that_cannot_apply_is_refused_in_one_line(model, revision, problem, tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "resolve_revision", lambda *a: pytest.fail("went to the hub"))
    model = str(tmp_path) if model == "local" else model
    with pytest.raises(ConfigError, match=problem) as refused:
        identity.pin(model, revision)
    assert "\n" not in str(refused.value)
    assert identity.pin(model, None) == model  # no revision: the model as given


def test_the_cli_refuses_a_revision_for_a_local_model_before_any_work(tiny_artifacts, tmp_path, capsys):
    from evoesap.cli import main

    out = tmp_path / "scores"
    argv = [
        "calibrate",
        "--model",
        tiny_artifacts["model"],
        "--revision",
        "v1",
        "--data",
        tiny_artifacts["calibration"],
        "--out",
        str(out),
    ]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0 and not out.exists()


@pytest.mark.parametrize(
    ("stage", "args"),
    [
        ("calibrate", ["--data", "d.jsonl"]),
        ("cache-logits", ["--data", "d.jsonl"]),
        ("search", ["--scores", "s", "--cache", "c", "--criterion", "reap", "--sparsity", "0.5"]),
        ("prune", ["--scores", "s", "--criterion", "reap", "--sparsity", "0.5"]),
        ("evaluate", ["--tasks", "math"]),
    ],
)
def test_each_stage_command_pins_the_model_to_its_revision(stage, args, monkeypatch):
    from evoesap import steps
    from evoesap.cli import main

    seen = {}
    monkeypatch.setattr(steps, "run_stage", lambda name, inputs, params, out: seen.update(name=name, **inputs))
    # --quiet: the stage is stubbed, so there is no artifact for search's summary line to read
    assert main(["--quiet", stage, "--model", "org/m", "--revision", "v1.2", *args, "--out", "o"]) == 0
    assert seen["name"] == stage and seen["model"] == "org/m@v1.2"


@pytest.mark.parametrize("name", ["org/name\n", "org/name@main\n", "org\n/name"])
def test_a_name_with_a_trailing_newline_is_never_a_hub_name(name):
    assert identity.hub_model(name) is None  # `$` alone would match before the newline


def test_an_artifact_name_with_a_newline_is_refused():
    from evoesap.errors import ArtifactError
    from evoesap.store import artifacts

    with pytest.raises(ArtifactError, match="is not allowed"):
        artifacts.join("/store", "report.md\n")
