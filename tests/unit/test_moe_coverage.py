"""evoesap.moe.coverage and `evoesap families`: every MoE model_type of the installed transformers is listed, as
supported or with a reason; an unsupported one is refused in one line before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import CONFIG_MAPPING

from evoesap import moe
from evoesap.cli import main
from evoesap.errors import ConfigError, ModelError
from evoesap.moe import coverage


@pytest.fixture(scope="module")
def rows() -> dict[str, coverage.Coverage]:
    return {row.model_type: row for row in coverage.coverage()}


def test_every_supported_family_is_listed_as_supported_and_nothing_else_is(rows):
    assert not set(moe.FAMILIES) & set(moe.families.UNSUPPORTED)  # a row's model_type carries no stale refusal
    assert {name for name, row in rows.items() if row.status == coverage.SUPPORTED} == set(moe.FAMILIES)
    assert all(row.reason for row in rows.values() if row.status == coverage.NOT_SUPPORTED)


def test_every_config_that_declares_an_expert_count_is_listed(rows):
    for model_type in ("jetmoe", "dbrx", "longcat_flash", "nemotron_h", "switch_transformers", "ernie4_5_vl_moe"):
        assert model_type in CONFIG_MAPPING and rows[model_type].status == coverage.NOT_SUPPORTED, model_type
    assert rows["dbrx"].experts_field == "ffn_config.moe_num_experts"  # nested configs are searched
    assert "vision_moe" in rows["ernie4_5_vl_moe"].reason
    assert "llama" not in rows  # a dense model is not an MoE model_type


def test_no_supported_family_is_also_listed_as_unsupported():
    assert not set(moe.families.UNSUPPORTED) & set(moe.FAMILIES)


def test_a_model_type_without_a_known_reason_gets_the_generic_one(monkeypatch, rows):
    unknown = next(name for name, row in rows.items() if row.reason == coverage.GENERIC_REASON)
    assert unknown not in moe.families.UNSUPPORTED
    with pytest.raises(ModelError, match=f"{unknown}.*not a supported MoE family.*evoesap families"):
        moe.families.family_of(unknown)


@pytest.mark.parametrize(
    "model_type, nearest",
    [("jetmoe", "mixtral"), ("longcat_flash", "deepseek_v3"), ("dbrx", "mixtral"), ("nemotron_h", "qwen3_moe")],
)
def test_a_known_unsupported_family_is_refused_naming_the_nearest_supported_one_and_what_differs(model_type, nearest):
    with pytest.raises(ModelError, match=rf"{model_type}' is not supported: .*nearest supported family: {nearest} \(") as info:
        moe.tiny_model(model_type)
    assert "\n" not in str(info.value)


def test_an_unsupported_checkpoint_is_refused_by_prune_before_any_weight_is_read(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "jetmoe"}')  # no weights at all: refused before they are needed
    with pytest.raises(ModelError, match="jetmoe' is not supported: attention experts"):
        moe.prune_checkpoint(str(tmp_path), {0: [1]}, tmp_path / "out")


def test_the_families_command_prints_the_table(capsys):
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip() and not line.startswith(" ")}
    assert "supported" in lines["glm4_moe"] and "not supported" not in lines["glm4_moe"]
    assert "not supported" in lines["jetmoe"] and "attention experts" in lines["jetmoe"]
    assert f"{len(moe.FAMILIES)} of " in out


@pytest.mark.parametrize("model_type", ["llama4_text", "qwen3_5_moe", "glm4v_moe"])
def test_a_family_the_quantize_stage_cannot_walk_is_refused_there_in_one_line(model_type, tmp_path):
    from evoesap.stages import quantize

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ConfigError, match=f"{model_type} checkpoint .* leave the quantize step out") as info:
        quantize._family(str(tmp_path))
    assert "\n" not in str(info.value)


def test_llama4_is_refused_because_its_multimodal_forward_fails_on_every_input(rows):
    """The reason `llama4` has no row: its stock class cannot run in the pinned transformers, with or without
    return_dict. When a transformers upgrade fixes it, this fails: then give llama4 a multimodal row."""
    import transformers

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2)
    text |= dict(num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=1, head_dim=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8)
    vision |= dict(patch_size=4, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    for return_dict in (True, False):
        with pytest.raises(AttributeError, match="image_outputs"):
            model(input_ids=torch.randint(0, 64, (1, 5)), return_dict=return_dict)
    assert rows["llama4"].status == coverage.NOT_SUPPORTED and "fails on every input" in rows["llama4"].reason
