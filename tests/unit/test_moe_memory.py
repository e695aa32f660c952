"""Weight bytes: what a checkpoint stores, and exactly what removing experts saves."""

from __future__ import annotations

import copy

import pytest
from moe_support import FAMILIES
from safetensors import safe_open

from evoesap import moe

EXPERTS_AT_INTERMEDIATE_SIZE = ("minimax", "granitemoehybrid", "jamba")  # hybrids whose experts use intermediate_size


def one_expert_bytes(family: str, config) -> int:
    """Independent count for one routed expert: its router row, its gate/up/down weights, its biases."""
    hidden = config.hidden_size
    plain = (
        "olmoe",
        "mixtral",
        "gpt_oss",
        "minimax_m2",
        "phimoe",
        "hunyuan_v1_moe",
        "granitemoe",
        "granitemoeshared",
        "flex_olmo",
        "llama4_text",
        *EXPERTS_AT_INTERMEDIATE_SIZE,
    )
    inner = config.intermediate_size if family in plain else config.moe_intermediate_size
    selection_bias = (
        "deepseek_v3",
        "ernie4_5_moe",
        "glm4_moe",
        "glm4_moe_lite",
        "dots1",
        "exaone_moe",
        "minimax_m2",
        "afmoe",
        "kimi_linear",
        "lfm2_moe",
        "glm4v_moe",
    )
    extra = {"gpt_oss": 1 + 2 * inner + hidden}.get(family, int(family in selection_bias))  # router/selection/expert biases
    return 4 * (hidden + 3 * inner * hidden + extra)  # float32


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_bytes_are_full_bytes_minus_the_removed_experts_exactly(family, tmp_path):
    model = moe.tiny_model(family, **({"n_group": 1, "topk_group": 1} if family == "deepseek_v3" else {}))
    spec = moe.inspect(model)
    assert moe.expert_bytes(model) == (one_expert_bytes(family, model.config.get_text_config()),) * len(spec.layers)

    pruned = {0: [1, 2, 3], len(spec.layers) - 1: [0]}
    report = moe.bytes_report(model, pruned)
    removed = 4 * one_expert_bytes(family, model.config.get_text_config())
    assert report.full == moe.parameter_bytes(model)
    assert report.pruned == report.full - removed and report.saved == removed
    assert report.removed_experts[0] == 3

    pruned_model = moe.prune_experts(copy.deepcopy(model), pruned)
    assert moe.parameter_bytes(pruned_model) == report.full - removed

    moe.save_pruned(pruned_model, None, str(tmp_path))  # the checkpoint stores exactly these bytes
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118 - a safetensors handle is not iterable
    assert stored == moe.parameter_bytes(pruned_model)


def test_bytes_report_without_pruning_saves_nothing():
    model = moe.tiny_model("olmoe")
    report = moe.bytes_report(model)
    assert report.pruned == report.full and report.ratio == 1.0 and report.removed_experts == (0, 0, 0, 0)
