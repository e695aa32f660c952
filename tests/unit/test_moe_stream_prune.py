"""Streamed prune (checkpoint files, tensor by tensor) equals loaded-model surgery for every family and layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from moe_support import FAMILIES, cached_model, tokens
from safetensors import safe_open
from safetensors.torch import save_file
from test_moe import UNGROUPED, logits, nonuniform_sets

from evoesap import moe
from evoesap.errors import ArtifactError, ConfigError


def stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by key, read back with the safetensors library."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 - a safetensors handle is not iterable
    return out


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_prune_of_a_sharded_checkpoint_equals_loaded_model_surgery(family, tmp_path):
    model = cached_model(family, **UNGROUPED.get(family, {}))
    source = tmp_path / "full"
    model.save_pretrained(source, max_shard_size="20KB")
    assert len(list(source.glob("*.safetensors"))) > 3  # really sharded, experts split across files
    pruned = nonuniform_sets(moe.inspect(model), seed=1)

    reference = tmp_path / "surgery"
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(reference))
    result = moe.prune_checkpoint(str(source), pruned, tmp_path / "streamed")

    assert_same_tensors(stored(tmp_path / "streamed"), stored(reference))
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored(reference))
    assert index["metadata"]["total_size"] == result.bytes_pruned == sum(t.nbytes for t in stored(reference).values())
    config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    want = json.loads((reference / "config.json").read_text())
    family_row = moe.FAMILIES[family]
    for key in (family_row.num_experts_field, moe.PER_LAYER_KEY, "architectures"):  # vLLM's plugin reads the name
        assert config.get(key) == want.get(key)
    assert config["architectures"][0].startswith(moe.NONUNIFORM_ARCHITECTURE_PREFIX)
    assert list(result.num_experts) == list(moe.inspect(moe.load_pruned(str(reference))).num_experts)
    x = tokens(seed=2)
    assert torch.equal(logits(moe.load_pruned(str(tmp_path / "streamed")), x), logits(moe.load_pruned(str(reference)), x))


def test_streamed_prune_keeps_a_fused_layout_and_gives_the_surgery_logits(tmp_path):
    """A checkpoint written by hand in the model's own fused key layout (`experts.gate_up_proj`) stays fused."""
    model = cached_model("qwen3_moe")
    source = tmp_path / "fused"
    source.mkdir()
    model.config.save_pretrained(source)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(tensors)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(source / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert any(k.endswith("experts.gate_up_proj") for k in keys)
    pruned = {0: [1, 5], 2: [0, 2, 3, 7]}

    result = moe.prune_checkpoint(str(source), pruned, tmp_path / "streamed")

    got = stored(tmp_path / "streamed")
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 6
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"][[0, 2, 3, 4, 6, 7]])
    assert not any(".experts.0." in k for k in got)
    reference = moe.prune_experts(copy.deepcopy(model), pruned)
    x = tokens(seed=3)
    assert torch.equal(logits(moe.load_pruned(str(tmp_path / "streamed")), x), logits(reference, x))
    assert result.bytes_pruned == moe.parameter_bytes(reference)


def test_streamed_prune_converts_dtype_like_loading_in_that_dtype(tmp_path):
    model = cached_model("deepseek_v3", **UNGROUPED["deepseek_v3"])
    model.save_pretrained(tmp_path / "full", max_shard_size="50KB")
    pruned = {0: [3, 4], 2: [15]}
    loaded = moe.load_pruned(str(tmp_path / "full"), dtype=torch.bfloat16)
    moe.save_pruned(moe.prune_experts(loaded, pruned), None, str(tmp_path / "surgery"))

    moe.prune_checkpoint(str(tmp_path / "full"), pruned, tmp_path / "streamed", dtype=torch.bfloat16)

    got, want = stored(tmp_path / "streamed"), stored(tmp_path / "surgery")
    assert_same_tensors(got, want)
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # kept in float32 as transformers keeps it


def test_streamed_prune_copies_the_tokenizer_and_small_files(tmp_path):
    from evoesap.demo.tokenizer import build_tokenizer

    model = cached_model("olmoe")
    tokenizer = build_tokenizer()
    moe.save_pruned(copy.deepcopy(model), tokenizer, str(tmp_path / "full"))
    moe.prune_checkpoint(str(tmp_path / "full"), {1: [0]}, tmp_path / "out")
    assert moe.load_tokenizer(str(tmp_path / "out")).get_vocab() == tokenizer.get_vocab()


def test_streamed_prune_refuses_bad_sets_and_pruned_sources_before_writing(tmp_path):
    model = cached_model("olmoe")
    model.save_pretrained(tmp_path / "full")
    with pytest.raises(ConfigError, match="unknown expert"):
        moe.prune_checkpoint(str(tmp_path / "full"), {0: [99]}, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    moe.prune_checkpoint(str(tmp_path / "full"), {0: [1, 2], 1: [3]}, tmp_path / "once")
    with pytest.raises(ConfigError, match="already pruned"):
        moe.prune_checkpoint(str(tmp_path / "once"), {2: [1]}, tmp_path / "twice")


def test_streamed_prune_refuses_a_checkpoint_that_disagrees_with_its_config(tmp_path):
    model = cached_model("gpt_oss")
    model.save_pretrained(tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config["num_local_experts"] = 16
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="expert axis"):
        moe.prune_checkpoint(str(tmp_path / "full"), {0: [1]}, tmp_path / "out")


def test_configs_with_infinite_values_are_read_as_from_pretrained_reads_them(tmp_path):
    """config.json writes inf as {"__float__": "Infinity"} (Granite 4.0's Mamba time_step_limit): every reader of a
    raw config.json (streamed prune, the checkpoint check, inspect from a URI) must decode it, not refuse it."""
    from evoesap.machine import runtime

    model = cached_model("granitemoehybrid")
    assert model.config.time_step_limit[1] == float("inf")
    moe.save_pruned(model, None, str(tmp_path / "full"))
    assert json.loads((tmp_path / "full" / "config.json").read_text())["time_step_limit"][1] == {"__float__": "Infinity"}
    runtime.check_checkpoint(str(tmp_path / "full"))  # refused the valid checkpoint as "not a valid config" before
    assert runtime.inspect_checkpoint(f"file://{tmp_path}/full").num_experts == moe.inspect(model).num_experts
    moe.prune_checkpoint(str(tmp_path / "full"), {0: [1, 2]}, tmp_path / "pruned")
    assert moe.load_pruned(str(tmp_path / "pruned")).config.time_step_limit[1] == float("inf")
