"""A KFP output artifact is the stage's artifact: the weights at its own URI, stored once, reused across runs."""

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import pytest
from evoesap.components.kfp_artifacts import artifact_uri, publish
from kfp import dsl

from evoesap.store import artifacts


def _artifact(uri: str, stage: str, files: dict[str, bytes]) -> str:
    with artifacts.stage_output(uri, stage, {}, {}) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
    return uri


WEIGHTS = {"config.json": b"{}", "model.safetensors": b"w" * (2 << 20)}  # more than facts.EXPORT_MAX_BYTES


def test_a_local_output_becomes_the_stored_artifact_and_nothing_is_written_at_kfps_path(tmp_path):
    uri = _artifact(str(tmp_path / "storage" / "calibrate" / "k"), "calibrate", WEIGHTS)
    out = dsl.Dataset(name="scores", uri=str(tmp_path / "kfp" / "task" / "scores"))
    publish(out, uri)
    assert out.uri == out.path == uri and out.metadata["uri"] == uri and out.metadata["stage"] == "calibrate"
    assert (Path(out.path) / "model.safetensors").read_bytes() == WEIGHTS["model.safetensors"]
    assert not (tmp_path / "kfp" / "task" / "scores").exists()  # no second copy, not even of the small files


def test_where_kfps_launcher_keeps_a_changed_output_uri():
    """launcher_v2 uploads gs/s3/minio/oci outputs and refuses one outside the run's directory; a consumer's launcher
    refuses an input URI that names no object store: under an object-store pipeline root, KFP's URI stays."""
    assert artifact_uri("/tmp/kfp/run/task/model", "s3://bucket/evoesap/prune/k") == "s3://bucket/evoesap/prune/k"
    assert artifact_uri("/tmp/kfp/run/task/model", "file:///data/prune/k") == "/data/prune/k"
    assert artifact_uri("/tmp/kfp/run/task/model", "relative/prune/k") == str(Path("relative/prune/k").resolve())
    # a shared volume under an object-store pipeline root: a consumer's launcher would fail on a path URI
    assert artifact_uri("s3://root/pipe/run/task/salt/model", "/mnt/evoesap/prune/k") is None
    assert artifact_uri("s3://root/pipe/run/task/salt/model", "s3://bucket/evoesap/prune/k") is None
    assert artifact_uri("minio://mlpipeline/v2/artifacts/p/r/t/model", "gs://bucket/evoesap/prune/k") is None


def test_an_object_store_artifact_is_the_output_locally_and_a_view_under_an_object_store_pipeline_root(tmp_path, s3):
    _, fs, bucket = s3
    uri = _artifact(f"s3://{bucket}/evoesap/cache-logits/k", "cache-logits", WEIGHTS)  # a teacher cache's shape
    local = dsl.Dataset(name="cache", uri=str(tmp_path / "kfp" / "cache"))  # kfp.local: a local pipeline root
    publish(local, uri)
    assert local.uri == uri and local.metadata["manifest_sha256"] == artifacts.manifest_sha256(uri)
    cluster = dsl.Dataset(name="cache", uri=f"s3://{bucket}/pipeline-root/p/run/cache-logits/cache")  # a cluster's launcher
    cluster.set_path(str(tmp_path / "pod" / "cache"))  # the pod's /s3/... directory, which the launcher uploads
    publish(cluster, uri)
    assert cluster.uri == f"s3://{bucket}/pipeline-root/p/run/cache-logits/cache" and cluster.metadata["uri"] == uri
    assert sorted(p.name for p in Path(cluster.path).iterdir()) == ["config.json", "manifest.json"]  # weights never copied
    assert fs.cat_file(f"{bucket}/evoesap/cache-logits/k/model.safetensors") == WEIGHTS["model.safetensors"]


def test_opted_in_a_model_under_an_object_store_pipeline_root_holds_the_whole_checkpoint_at_model_path(
    tmp_path, s3, tiny_artifacts, monkeypatch
):
    """A consumer that reads only `model.path` finds a view there by default (no weights); with
    EVOESAP_COPY_MODELS=1 the whole stored checkpoint, byte for byte, which loads as the same model."""
    import torch
    from evoesap.components.kfp_artifacts import COPY_MODELS

    from evoesap import moe

    _, fs, bucket = s3
    checkpoint = Path(tiny_artifacts["pruned"])  # a searched prune artifact, stored in the object store
    fs.put(str(checkpoint), f"{bucket}/evoesap/prune/k", recursive=True)
    uri = f"s3://{bucket}/evoesap/prune/k"
    stored = {str(p.relative_to(checkpoint)): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}

    def cluster_output(name: str) -> dsl.Model:
        model = dsl.Model(name="pruned", uri=f"s3://{bucket}/pipeline-root/p/{name}/prune/pruned")
        model.set_path(str(tmp_path / name / "pruned"))  # the pod's local directory, which the launcher uploads
        return model

    from evoesap.records import facts

    monkeypatch.setattr(facts.export_small_files, "__defaults__", (1024,))  # the tiny weights count as large here
    view = cluster_output("run-1")
    publish(view, uri)
    assert "model.safetensors" not in {p.name for p in Path(view.path).iterdir()}  # what a consumer would miss
    with pytest.raises(Exception):  # noqa: B017 - any failure: transformers' own, which varies by version
        moe.load_pruned(view.path)

    monkeypatch.setenv(COPY_MODELS, "1")
    whole = cluster_output("run-2")
    publish(whole, uri)
    assert whole.uri == f"s3://{bucket}/pipeline-root/p/run-2/prune/pruned" and whole.metadata["uri"] == uri
    copied = Path(whole.path)
    assert {str(p.relative_to(copied)): p.read_bytes() for p in copied.rglob("*") if p.is_file()} == stored
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = moe.load_pruned(whole.path, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(logits, moe.load_pruned(str(checkpoint), dtype=torch.float32)(input_ids=ids).logits)

    other = dsl.Dataset(name="cache", uri=f"s3://{bucket}/pipeline-root/p/run-2/cache-logits/cache")
    other.set_path(str(tmp_path / "run-2" / "cache"))
    publish(other, uri)  # the opt-in is for models: any other artifact stays a view
    assert "model.safetensors" not in {p.name for p in Path(other.path).iterdir()}


# ------------------------------------------------------------------ a kfp.local pipeline and a consumer that knows nothing of EvoESAP


def consume(model: dsl.Input[dsl.Model]) -> str:
    """A team's next step: loads the checkpoint at `model.path` with plain transformers and runs it."""
    import hashlib
    import json
    import os

    import torch
    from transformers import AutoModelForCausalLM

    network = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    logits = network(input_ids=torch.tensor([[5, 6, 7, 8]])).logits  # [1, 4, V] float32
    weights = sorted(name for name in os.listdir(model.path) if name.endswith(".safetensors"))
    return json.dumps(
        {
            "num_experts": network.config.num_experts,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in network.parameters()),
            "finite": bool(torch.isfinite(logits).all()),
            "weights": {n: hashlib.sha256(open(os.path.join(model.path, n), "rb").read()).hexdigest() for n in weights},
            "weight_bytes": sum(os.path.getsize(os.path.join(model.path, n)) for n in weights),
        }
    )


def _sha256_of_files(*roots: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for root in roots for p in root.rglob("*") if p.is_file()]


@pytest.mark.slow
def test_a_kfp_local_consumer_loads_the_pruned_model_from_model_path_stored_once(tmp_path):
    from evoesap.components import make_components
    from kfp import local
    from tiny_world import make_tiny_inputs

    from evoesap import moe

    files = make_tiny_inputs(tmp_path / "inputs")
    vocab = json.loads((Path(files["model"]) / "config.json").read_text())["vocab_size"]
    moe.tiny_model("olmoe", seed=3, vocab_size=vocab, hidden_size=128).save_pretrained(files["model"])  # > 1 MiB pruned
    storage, pipeline_root = tmp_path / "storage", tmp_path / "kfp"
    comps = make_components()
    consumer = dsl.component(base_image="python:3.11", install_kfp_package=False)(consume)
    Outputs = NamedTuple("Outputs", report=str, pruned=dsl.Model)  # noqa: UP014 - as KFP pipelines declare it

    @dsl.pipeline
    def release(model_uri: str, data: str, storage_root: str) -> Outputs:
        model = dsl.importer(artifact_uri=model_uri, artifact_class=dsl.Model, reimport=False)
        scores = comps.calibrate(
            model=model.output, data=data, storage_root=storage_root, params={"samples": 8, "max_length": 64}
        )
        pruned = comps.prune(model=model.output, scores=scores.outputs["scores"], criterion="frequency", sparsity=0.5,
                             storage_root=storage_root)  # fmt: skip
        for task in (scores, pruned):
            task.set_caching_options(enable_caching=False)
        consumed = consumer(model=pruned.outputs["pruned"]).set_caching_options(enable_caching=False)
        return Outputs(consumed.output, pruned.outputs["pruned"])

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
    runs, started = [], []
    for _ in range(2):
        runs.append(release(model_uri=files["model"], data=files["calibration"], storage_root=str(storage)))
        (prune_dir,) = (storage / "prune").iterdir()
        started.append(artifacts.read_manifest(str(prune_dir)).started)
    assert started[0] == started[1]  # made once, reused by the second run
    for run in runs:  # the second run reuses the stored artifact: the same URI, the same one copy
        pruned, report = run.outputs["pruned"], json.loads(run.outputs["report"])
        assert pruned.uri == pruned.path == pruned.metadata["uri"] == str(prune_dir)
        assert report["num_experts"] == 4 and report["finite"]  # 8 experts, half removed uniformly
        assert report["weight_bytes"] > 1 << 20 and report["parameter_bytes"] == int(pruned.metadata["parameter_bytes"])
        stored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in prune_dir.glob("*.safetensors")}
        assert report["weights"] == stored  # read from model.path alone: the stored weights themselves
        everywhere = _sha256_of_files(storage, pipeline_root)
        assert all(everywhere.count(digest) == 1 for digest in stored.values())  # no second copy anywhere
    assert len(list((storage / "calibrate").iterdir())) == 1


def test_a_quantize_artifact_carries_the_labels_of_the_pruned_model_it_quantized(tiny_quantized, tmp_path):
    """The evaluate component labels a run from its model's metadata: a quantized model's come from its pruning.json."""
    from evoesap.records import facts

    pruning = json.loads(Path(tiny_quantized["pruned"], "pruning.json").read_text())
    found = facts.facts(tiny_quantized["quantized"])
    assert {k: found[k] for k in ("method", "criterion", "sparsity")} == {
        k: pruning[k] for k in ("method", "criterion", "sparsity")
    }
    assert found["recipe"] == "fp8-dynamic" and found["stage"] == "quantize"
    moved = tmp_path / "elsewhere"  # its pruned input no longer where the manifest says: no labels, still its facts
    import shutil

    shutil.copytree(tiny_quantized["quantized"], moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["inputs"]["model"]["uri"] = str(tmp_path / "gone")
    (moved / "manifest.json").write_text(artifacts.seal(manifest))
    assert "method" not in facts.facts(str(moved)) and facts.facts(str(moved))["recipe"] == "fp8-dynamic"


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("Yes", True), (" ON ", True), ("0", False), ("false", False), ("No", False),
     ("OFF", False), ("", False)],
)  # fmt: skip
def test_the_copy_switch_reads_the_words_for_on_and_off(tmp_path, monkeypatch, value, on):
    """EVOESAP_COPY_MODELS=false copies nothing (any word but "" and "0" used to turn copying on)."""
    from evoesap.components import kfp_artifacts

    copied, viewed = [], []
    monkeypatch.setattr(kfp_artifacts, "artifact_uri", lambda own, uri: None)  # KFP keeps the artifact at its own URI
    monkeypatch.setattr(kfp_artifacts.facts, "facts", lambda uri: {"uri": uri})
    monkeypatch.setattr(kfp_artifacts, "export_all", lambda uri, dest: copied.append(uri))
    monkeypatch.setattr(kfp_artifacts.facts, "export_small_files", lambda uri, dest: viewed.append(uri))
    monkeypatch.setenv(kfp_artifacts.COPY_MODELS, value)
    model = dsl.Model(name="pruned", uri="s3://b/root/run/prune/pruned")
    model.set_path(str(tmp_path / "pruned"))
    publish(model, "s3://b/evoesap/prune/k")
    assert (copied, viewed) == ((["s3://b/evoesap/prune/k"], []) if on else ([], ["s3://b/evoesap/prune/k"]))


@pytest.mark.parametrize("value", ["2", "flase", "enabled", "1 0"])
def test_a_copy_switch_that_is_neither_on_nor_off_is_refused_before_the_stage_runs(monkeypatch, value):
    from evoesap.components import kfp_artifacts
    from evoesap.components.runner import run_component

    from evoesap import steps
    from evoesap.errors import ConfigError

    ran = []
    monkeypatch.setattr(steps, "run_step", lambda *args: ran.append(args))
    monkeypatch.setenv(kfp_artifacts.COPY_MODELS, value)
    with pytest.raises(ConfigError, match=f"EVOESAP_COPY_MODELS={value!r} is neither on nor off: set it to one of 1, true"):
        run_component("report", storage_root="/tmp/x", params={})
    assert ran == []


def test_every_evoesap_switch_in_the_environment_is_read_by_one_parser():
    """No EVOESAP_* variable is compared with words of its own (`os.environ.get(X) not in ("", "0")`)."""
    import re

    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("evoesap/**/*.py"), *root.glob("components/*.py"), *root.glob("pipeline/*.py")]
    own = re.compile(r"environ(?:\.get)?[\[(][^)\]]*\)?\s*(?:not\s+)?(?:in|==|!=)\s*[(\[\"']")
    assert [str(p) for p in sources if own.search(p.read_text())] == []
