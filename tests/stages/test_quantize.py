"""The quantize stage: llm-compressor's oneshot from its own venv (`.venv-quantize`) on tiny pruned checkpoints.

Uniform and non-uniform checkpoints of two families (OLMoE, Qwen3-MoE) under two recipes (fp8-dynamic,
w4a16-gptq). Hidden and expert sizes are 128 so that every quantized Linear holds whole groups of 128. The
checkpoint sizes are checked against the bytes computed from the input's own tensors; the non-uniform
outputs are opened in this venv's transformers (our loader and the opt-in modeling file) and compared with
the unquantized model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_moe import nonuniform_sets
from transformers import AutoModelForCausalLM
from venv_support import venv_python

from evoesap import moe, records
from evoesap.demo.domains import generate_splits, write_jsonl
from evoesap.demo.tokenizer import build_tokenizer
from evoesap.errors import ConfigError, EvoESAPError
from evoesap.stages.quantize import QuantizeParams, run_quantize
from evoesap.store import artifacts

FAMILIES = {"olmoe": {}, "qwen3_moe": {"moe_intermediate_size": 128, "head_dim": 32}}
SIZES = dict(hidden_size=128, intermediate_size=128)
BITS = {"fp8-dynamic": 8, "w4a16-gptq": 4}
CALIBRATION = dict(samples=8, max_length=64)


def quantize_python() -> str:
    return venv_python("EVOESAP_QUANTIZE_PYTHON", ".venv-quantize", "quantize-venv", "llm-compressor", "llmcompressor")


@pytest.fixture(autouse=True)
def _quantize_env(monkeypatch):
    monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", quantize_python())


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """Calibration JSONL plus a uniform and a non-uniform pruned checkpoint of each family."""
    root = tmp_path_factory.mktemp("quantize-world")
    tok = build_tokenizer()
    write_jsonl(generate_splits("math", seed=0, train_size=4)["calibration"][:16], root / "calibration.jsonl")
    paths = {"data": str(root / "calibration.jsonl")}
    for family, overrides in FAMILIES.items():
        config = {**SIZES, **overrides, "vocab_size": len(tok)}
        spec = moe.inspect(moe.tiny_model(family, seed=3, **config))
        uniform = {layer.ordinal: list(range(2)) for layer in spec.layers}  # 2 of 8 experts from every layer
        for kind, pruned in (("uniform", uniform), ("nonuniform", nonuniform_sets(spec, 0))):
            path = root / f"{family}-{kind}"
            moe.save_pruned(moe.prune_experts(moe.tiny_model(family, seed=3, **config), pruned), tok, str(path))
            paths[f"{family}-{kind}"] = str(path)
    return paths


def expected_bytes(checkpoint: str, bits: int) -> int:
    """Bytes of the weights once every attention, dense-MLP and expert matrix holds `bits` per value and the rest
    (embeddings, head, norms, routers) is unchanged; scales, headers and packing come on top."""
    total = 0
    with safe_open(str(Path(checkpoint) / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
            t = f.get_slice(name)
            numel = torch.Size(t.get_shape()).numel()
            quantized = name.endswith("_proj.weight") or ".experts." in name  # attention, dense MLPs, experts
            total += numel * bits // 8 if quantized else numel * 4  # the tiny models are float32
    return total


def tokens() -> torch.Tensor:
    return torch.tensor([[5 + (j * 7) % 60 for j in range(24)], [9 + (j * 5) % 50 for j in range(24)]])


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of sum_v min(p, q) (ESAP): 1 for identical next-token distributions."""
    p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
    return torch.minimum(p, q).sum(-1).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(BITS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_checkpoints_shrink_as_their_bits_say_and_keep_their_architecture(world, tmp_path, family, recipe):
    for kind in ("uniform", "nonuniform"):
        source, out = world[f"{family}-{kind}"], str(tmp_path / kind)
        run_quantize(source, QuantizeParams(recipe=recipe, **CALIBRATION), out, data=world["data"])
        artifacts.verify(out, "quantize")
        summary = records.read(out, records.QuantizationRecord).to_json()
        floor = expected_bytes(source, BITS[recipe])
        assert summary["checkpoint_bytes_before"] == (Path(source) / "model.safetensors").stat().st_size
        assert floor <= summary["checkpoint_bytes_after"] <= 1.1 * floor + 64 * 1024, (summary, floor)
        before, after = (json.loads((Path(p) / "config.json").read_text()) for p in (source, out))
        assert after["architectures"] == before["architectures"]
        assert after.get(moe.PER_LAYER_KEY) == before.get(moe.PER_LAYER_KEY)
        assert after["quantization_config"]["quant_method"] == "compressed-tensors"
        assert summary["calibration_samples"] == (0 if recipe == "fp8-dynamic" else CALIBRATION["samples"])


def test_two_runs_make_the_same_payload_and_keep_their_timings_in_the_manifest(world, tmp_path):
    """The artifact is a function of its inputs and parameters: what a run measures of itself (the worker's wall
    time per phase) goes to the manifest's run record, so a re-run after a fault makes the same payload."""
    outs = [str(tmp_path / name) for name in ("a", "b")]
    made = [run_quantize(world["olmoe-uniform"], QuantizeParams(recipe="fp8-dynamic"), out) for out in outs]
    assert made[0].files == made[1].files
    assert all(set(m.run["seconds"]) == {"load", "oneshot", "save"} for m in made)
    assert all(v >= 0 for m in made for v in m.run["seconds"].values())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(BITS))
def test_quantized_nonuniform_model_loads_in_transformers_and_stays_close(world, tmp_path, recipe):
    source, out = world["olmoe-nonuniform"], str(tmp_path / "q")
    run_quantize(source, QuantizeParams(recipe=recipe, **CALIBRATION), out, data=world["data"])
    reference = moe.load_pruned(source).eval()
    ours = moe.load_pruned(out).eval()  # our loader: no remote code
    opt_in, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    assert not any(info.values()), info
    assert type(opt_in).__name__ == json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    assert [layer.num_experts for layer in moe.inspect(ours).layers] == [
        layer.num_experts for layer in moe.inspect(reference).layers
    ]
    x = tokens()
    with torch.no_grad():
        full, mine, theirs = reference(x).logits, ours(x).logits, opt_in.eval()(x).logits
    torch.testing.assert_close(mine, theirs)  # one checkpoint, two loaders
    assert not torch.equal(full, mine)  # the weights did change
    assert agreement(full, mine) > (0.9 if recipe == "fp8-dynamic" else 0.8)
    # the same inputs make the same bytes: calibration takes the stage's seeded draw in its order (llm-compressor's
    # own shuffle is unseeded, and GPTQ's sums then round differently from run to run)
    run_quantize(source, QuantizeParams(recipe=recipe, **CALIBRATION), str(tmp_path / "again"), data=world["data"])
    assert (Path(out) / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


def fake_python(where: Path, llmcompressor: str, answer: str | None = None) -> str:
    """A "python" that finds every module (the environment check passes) and answers the version query with
    `answer`, by default llm-compressor at `llmcompressor` and compressed-tensors at 0.19.0."""
    where.mkdir(parents=True, exist_ok=True)
    reply = answer if answer is not None else json.dumps({"llmcompressor": llmcompressor, "compressed-tensors": "0.19.0"})
    script = where / "python"
    script.write_text(f"#!/bin/sh\ncase \"$2\" in *importlib.metadata*) echo '{reply}' ;; esac\n")
    script.chmod(0o755)
    return str(script)


def installed_version(python: str, distribution: str) -> str:
    """A distribution's version in the venv of `python`, read off its dist-info directory's name (no python asked)."""
    root = Path(python).absolute().parent.parent  # the venv, not where its python links to
    (info,) = root.glob(f"lib/python*/site-packages/{distribution.replace('-', '_')}-*.dist-info")
    return info.name.removesuffix(".dist-info").split("-", 1)[1]


def test_the_reuse_key_holds_the_llm_compressor_version_of_the_environment_used(world, tmp_path, monkeypatch):
    from evoesap.params import keyed
    from evoesap.steps import output_uri

    params, inputs = QuantizeParams(recipe="fp8-dynamic"), {"model": world["olmoe-uniform"], "data": None}

    def place(python: str) -> str:
        monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", python)
        return output_uri("quantize", str(tmp_path / "root"), inputs, params)

    python = quantize_python()
    versions = {name: installed_version(python, name) for name in ("llmcompressor", "compressed-tensors")}
    real = place(python)
    assert keyed(params)["tools"] == versions
    older = place(fake_python(tmp_path / "a", "0.13.0"))
    assert older != real  # another llm-compressor: another artifact
    assert place(fake_python(tmp_path / "b", "0.13.0")) == older  # another venv, the same versions: the same artifact
    assert place(fake_python(tmp_path / "c", versions["llmcompressor"])) == real
    with pytest.raises(
        ConfigError, match=r"did not report the versions of llmcompressor, compressed-tensors.*make quantize-venv"
    ):
        place(fake_python(tmp_path / "d", "", answer="no json"))


def test_unknown_recipe_is_refused_with_the_valid_names_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown recipe 'fp8'.*fp8-dynamic, w4a16-gptq"):
        QuantizeParams(recipe="fp8")


def test_quantize_has_no_placement_settings_since_llm_compressor_places_the_model():
    from evoesap.steps import make_params

    with pytest.raises(ConfigError, match=r"unknown parameter.*max_memory.*for stage 'quantize'"):
        make_params("quantize", {"recipe": "fp8-dynamic", "max_memory": "70GB"})
    assert make_params("quantize", {"recipe": "fp8-dynamic", "device_map": "auto"}).device_map == "auto"


def test_widths_that_are_not_whole_groups_are_refused_before_any_work(world, tmp_path):
    tok = build_tokenizer()
    moe.save_pruned(moe.tiny_model("olmoe", seed=3, vocab_size=len(tok)), tok, str(tmp_path / "m"))  # hidden 64
    with pytest.raises(ConfigError, match=r"widths \[32, 64\] are not multiples of the group size 128"):
        run_quantize(str(tmp_path / "m"), QuantizeParams(recipe="w4a16-gptq"), str(tmp_path / "q"), data=world["data"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_quantize_without_its_environment_says_how_to_build_it(world, tmp_path, monkeypatch):
    monkeypatch.delenv("EVOESAP_QUANTIZE_PYTHON")
    with pytest.raises(ConfigError, match="make quantize-venv"):
        run_quantize(world["olmoe-uniform"], QuantizeParams(recipe="fp8-dynamic"), str(tmp_path / "q"))
    assert not list(tmp_path.iterdir())


def test_a_failed_oneshot_is_one_line_and_publishes_nothing(world, tmp_path):
    # llm-compressor 0.14's AWQ needs an accelerator: on a CPU it fails inside the worker
    with pytest.raises(EvoESAPError, match=r"^llm-compressor oneshot failed \(exit 1\): \S.*") as failed:
        run_quantize(
            world["olmoe-uniform"], QuantizeParams(recipe="w4a16-awq", **CALIBRATION), str(tmp_path / "q"), data=world["data"]
        )
    assert "\n" not in str(failed.value)
    assert not list(tmp_path.iterdir())  # neither the artifact nor its staging directory


def test_a_quantize_recipe_in_the_configuration_adds_the_step_after_prune_and_none_leaves_it_out(tmp_path):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline

    base = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl", "storage_root": str(tmp_path / "a")}
    with pytest.raises(ConfigError, match="unknown recipe 'int4'"):
        load_config({**base, "quantize": {"recipe": "int4"}})
    off = compile_pipeline(load_config(base), tmp_path / "off.yaml").read_text()
    on = compile_pipeline(load_config({**base, "quantize": {"recipe": "fp8-dynamic"}}), tmp_path / "on.yaml").read_text()
    assert "comp-quantize" not in off and "quantize searched" not in off and "evaluate quantized" not in off
    assert "comp-quantize" in on and "quantize searched" in on and "evaluate quantized" in on
    published = {**base, "quantize": {"recipe": "fp8-dynamic"}, "publish_models": True}
    spec = compile_pipeline(load_config(published), tmp_path / "pub.yaml").read_text()
    assert "publish quantized" in spec and "publish searched" not in spec  # quantize on: the quantized model is released


@pytest.mark.slow
def test_a_prune_artifact_is_verified_its_lineage_recorded_and_a_second_run_reused(tmp_path, monkeypatch):
    from tiny_world import make_tiny_inputs

    from evoesap.errors import ArtifactError
    from evoesap.params import keyed
    from evoesap.stages.calibrate import CalibrateParams, run_calibrate
    from evoesap.stages.prune import PruneParams, run_prune
    from evoesap.steps import run_stage

    files = make_tiny_inputs(tmp_path)  # hidden 64: fp8-dynamic (per channel) fits any width
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=8, max_length=128), str(tmp_path / "cal"))
    pruned = str(tmp_path / "pruned")
    run_prune(files["model"], str(tmp_path / "cal"), PruneParams(criterion="reap", sparsity=0.5), pruned)
    params, out = QuantizeParams(recipe="fp8-dynamic"), str(tmp_path / "q")
    made = run_stage("quantize", {"model": pruned, "data": None}, params, out)
    assert made.inputs["model"]["manifest_sha256"] == artifacts.manifest_sha256(pruned)
    assert run_stage("quantize", {"model": pruned, "data": None}, params, out) == made  # same key: reused, not redone
    worker = records.read(out, records.QuantizationRecord).to_json()["versions"]  # what the worker imported, as it saw them
    assert made.params["tools"] == {name: worker[name] for name in ("llmcompressor", "compressed-tensors")}
    monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", fake_python(tmp_path / "newer", "0.15.0"))
    assert artifacts.cached(out, "quantize", keyed(params), {"model": pruned, "data": None}) is None  # made again
    monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", quantize_python())
    weights = Path(pruned) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))  # same size, other bytes
    with pytest.raises(ArtifactError, match="does not match the sha256 in its manifest"):
        run_quantize(pruned, params, str(tmp_path / "q2"))
    assert not (tmp_path / "q2").exists()


def test_a_quantize_stage_starting_beside_a_running_worker_leaves_its_files_alone(tmp_path, monkeypatch):
    """Two quantize steps of one pipeline run at once: the later one's clean-up of what killed runs left in TMPDIR
    (`evoesap-quantize-*`) must not take the earlier one's live worker directory (the demo lost a result so)."""
    import subprocess

    from evoesap.release import quantize_env

    threads = []

    def worker(args, **kwargs):
        threads.append(kwargs["env"].get("OMP_NUM_THREADS"))
        monkeypatch.setattr(artifacts, "_STARTED", float("inf"))  # a quantize stage that started after this one
        artifacts.clean_orphans(str(tmp_path / "other"), "quantize")
        Path(args[-1]).write_text(json.dumps({"done": True}))
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(quantize_env.subprocess, "run", worker)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert quantize_env.run_worker("python", {"recipe": {"name": "fp8-dynamic"}}, threads=1) == {"done": True}
    assert quantize_env.run_worker("python", {"recipe": {"name": "fp8-dynamic"}}) == {"done": True}
    assert threads == ["1", None]  # one thread for a tiny model on the CPU, else torch's own count


def test_a_quantized_release_opens_in_plain_transformers_but_does_not_save_again(tiny_quantized, tmp_path):
    """What docs/guides/serve-vllm.md says of a quantized release in plain transformers: it opens (its modeling file, with
    trust_remote_code) and runs, but save_pretrained fails inside transformers (reverting its weight conversion
    over the compressed-tensors weights), so a release is copied as files, never re-saved from a loaded model.
    Should transformers fix it, this fails and the guide's qualification goes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_quantized["quantized"], trust_remote_code=True)
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits  # [1, 4, V]
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="Undefined Operation"):
        model.save_pretrained(tmp_path / "saved")
