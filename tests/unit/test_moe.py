"""evoesap.moe: masking equals removal for every family, surgery round-trips, bad input is refused early."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_support import FAMILIES, cached_model, experts_implementations, set_experts_implementation, tokens
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from evoesap import moe
from evoesap.errors import ConfigError, ModelError

TOL = 1e-5
# DeepSeek-V3's default tiny model routes group-limited; n_group=1 lets one layer keep exactly top-k.
UNGROUPED = {"deepseek_v3": {"n_group": 1, "topk_group": 1}}


@torch.no_grad()
def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


def nonuniform_sets(spec: moe.MoESpec, seed: int) -> dict[int, list[int]]:
    """First layer pruned to exactly top-k, last untouched, the rest random in between."""
    rng = np.random.default_rng(seed)
    last = len(spec.layers) - 1
    pruned = {}
    for layer in spec.layers:
        most = layer.num_experts - layer.top_k
        count = most if layer.ordinal == 0 else 0 if layer.ordinal == last else int(rng.integers(1, most))
        pruned[layer.ordinal] = sorted(rng.choice(layer.num_experts, count, replace=False).tolist())
    return pruned


def routed_experts(model: torch.nn.Module, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """The expert ids each MoE layer's experts module is asked for, seen by a forward pre-hook; where the experts
    take every token scaled by a dense weight (Llama 4), the experts whose scaled input is not zero."""
    seen: dict[int, torch.Tensor] = {}
    dense = moe.FAMILIES[model.config.model_type].experts_input == "scaled_dense"

    def hook(module, args, ordinal):
        if not dense:
            seen[ordinal] = args[1].clone()
            return
        rows = args[0].view(module.num_experts, -1, args[0].shape[-1])  # [E, T, H]
        reached = rows.abs().amax(dim=-1).T > 0  # [T, E]
        seen[ordinal] = torch.stack([row.nonzero().flatten() for row in reached])  # [T, k]

    handles = [
        block.experts.register_forward_pre_hook(lambda module, args, ordinal=block.ordinal: hook(module, args, ordinal))
        for block in moe.moe_blocks(model)
    ]
    try:
        logits(model, x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(before: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert torch.equal(tensor, after[key]), key


# --- inspect ---------------------------------------------------------------------------------------

EXPECTED_LAYOUT = {  # family -> (decoder indices of MoE layers, shared experts present), from the tiny configs
    "olmoe": ((0, 1, 2, 3), False),
    "qwen2_moe": ((0, 2, 3), True),
    "qwen3_moe": ((0, 2, 3), False),
    "mixtral": ((0, 1, 2, 3), False),
    "deepseek_v2": ((1, 2, 3), True),
    "deepseek_v3": ((1, 2, 3), True),
    "ernie4_5_moe": ((1, 2, 3), True),
    "gpt_oss": ((0, 1, 2, 3), False),
    "glm4_moe": ((1, 2, 3), True),
    "glm4_moe_lite": ((1, 2, 3), True),
    "minimax_m2": ((0, 1, 2, 3), False),
    "phimoe": ((0, 1, 2, 3), False),
    "hunyuan_v1_moe": ((0, 1, 2, 3), True),
    "dots1": ((1, 2, 3), True),
    "granitemoe": ((0, 1, 2, 3), False),
    "granitemoeshared": ((0, 1, 2, 3), True),
    "flex_olmo": ((0, 1, 2, 3), False),
    "exaone_moe": ((1, 2, 3), True),
    "afmoe": ((1, 2, 3), True),
    "qwen3_next": ((0, 2, 3), True),
    "qwen3_5_moe_text": ((0, 1, 2, 3), True),
    "kimi_linear": ((1, 2, 3), True),
    "minimax": ((0, 1, 2, 3), False),
    "granitemoehybrid": ((0, 1, 2, 3), False),
    "jamba": ((1, 3), False),
    "llama4_text": ((1, 3), True),
    "lfm2_moe": ((1, 2, 3), False),
    "qwen3_5_moe": ((0, 1, 2, 3), True),
    "qwen3_vl_moe": ((0, 2, 3), False),
    "glm4v_moe": ((1, 2, 3), True),
}


def test_table_covers_every_supported_family():
    assert set(moe.FAMILIES) == set(EXPECTED_LAYOUT)


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_finds_moe_layers_dense_layers_and_shared_experts(family):
    model = cached_model(family)
    spec = moe.inspect(model)
    decoder_indices, shared = EXPECTED_LAYOUT[family]
    assert spec.family == family
    assert tuple(layer.decoder_index for layer in spec.layers) == decoder_indices
    assert tuple(layer.ordinal for layer in spec.layers) == tuple(range(len(decoder_indices)))
    assert all(layer.shared_experts == shared for layer in spec.layers)
    experts = 16 if family == "deepseek_v3" else 8
    assert spec.num_experts == (experts,) * len(decoder_indices)
    assert spec.top_k == (2,) * len(decoder_indices)
    assert [b.decoder_index for b in moe.moe_blocks(model)] == list(decoder_indices)


def test_inspect_reports_group_limited_routing():
    layer = moe.inspect(cached_model("deepseek_v3")).layers[0]
    assert (layer.n_group, layer.topk_group) == (4, 2)
    assert moe.inspect(cached_model("olmoe")).layers[0].n_group == 1


def test_unsupported_architecture_names_the_supported_families():
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    dense = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelError, match="llama.*olmoe.*qwen3_moe"):
        moe.inspect(dense)
    with pytest.raises(ModelError, match="not a transformers model"):
        moe.inspect(torch.nn.Linear(2, 2))
    with pytest.raises(ModelError, match="supported"):
        moe.tiny_model("llama")


def test_tiny_model_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = moe.tiny_model("olmoe", seed=3), moe.tiny_model("olmoe", seed=3), moe.tiny_model("olmoe", seed=4)
    assert torch.equal(torch.rand(1), expected_next)
    assert_same_state(state(a), b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert all(p.dtype == torch.float32 for p in a.parameters())


# --- masking equals removal --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_equals_removed_saved_and_reloaded_for_each_family(family, tmp_path):
    model = copy.deepcopy(cached_model(family, **UNGROUPED.get(family, {})))
    spec = moe.inspect(model)
    pruned = nonuniform_sets(spec, seed=len(family))
    assert len(pruned[0]) == spec.layers[0].num_experts - spec.layers[0].top_k and not pruned[len(spec.layers) - 1]
    x = tokens()
    full = logits(model, x)

    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config[moe.PER_LAYER_KEY] == {
        str(layer.decoder_index): layer.num_experts - len(pruned[layer.ordinal]) for layer in spec.layers
    }
    assert not list(tmp_path.glob("*.bin"))
    reloaded = moe.load_pruned(str(tmp_path))
    assert type(reloaded) is type(model)
    assert moe.inspect(reloaded).num_experts == tuple(n - len(pruned[i]) for i, n in enumerate(spec.num_experts))

    for implementation in experts_implementations(model):
        set_experts_implementation(model, implementation)
        set_experts_implementation(reloaded, implementation)
        with moe.masked(model, pruned):
            masked_logits = logits(model, x)
            masked_routes = routed_experts(model, x)
        assert (masked_logits - logits(reloaded, x)).abs().max() <= TOL, implementation
        assert (masked_logits - full).abs().max() > 1e-3  # the mask really changed the model

        reloaded_routes = routed_experts(reloaded, x)
        for ordinal, ids in pruned.items():
            assert not set(ids) & set(masked_routes[ordinal].unique().tolist()), (implementation, ordinal)
            keep = torch.tensor([e for e in range(spec.layers[ordinal].num_experts) if e not in ids])
            assert torch.equal(  # the same experts per token, under their old and new ids
                masked_routes[ordinal].sort(dim=-1).values, keep[reloaded_routes[ordinal]].sort(dim=-1).values
            )


def test_nonuniform_checkpoint_refuses_stock_loading_rather_than_loading_wrongly(tmp_path):
    model = copy.deepcopy(cached_model("olmoe"))
    moe.save_pruned(moe.prune_experts(model, {0: [1, 2], 2: [5]}), None, str(tmp_path))
    with pytest.raises(RuntimeError, match="mismatch"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_nonuniform_checkpoint_names_the_serving_plugin_architecture_and_uniform_stays_stock(family, tmp_path):
    model = copy.deepcopy(cached_model(family, **UNGROUPED.get(family, {})))
    stock_name = type(model).__name__
    moe.save_pruned(model, None, str(tmp_path / "full"))
    assert json.loads((tmp_path / "full" / "config.json").read_text())["architectures"] == [stock_name]

    pruned = moe.prune_experts(model, nonuniform_sets(moe.inspect(model), seed=1))
    moe.save_pruned(pruned, None, str(tmp_path / "nonuniform"))
    config = json.loads((tmp_path / "nonuniform" / "config.json").read_text())
    assert config["architectures"] == [moe.NONUNIFORM_ARCHITECTURE_PREFIX + stock_name]
    reloaded = moe.load_pruned(str(tmp_path / "nonuniform"))  # the name changes nothing for our loader
    assert type(reloaded) is type(model)
    moe.save_pruned(reloaded, None, str(tmp_path / "again"))  # a reloaded model keeps the serving name
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == config["architectures"]


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_pruning_round_trips_through_stock_from_pretrained(family, tmp_path):
    model = cached_model(family)  # DeepSeek-V3 stays group-limited: one expert from each group of 4
    spec = moe.inspect(model)
    step = spec.layers[0].num_experts // 4
    pruned = {layer.ordinal: list(range(layer.ordinal % step, layer.num_experts, step)) for layer in spec.layers}
    pruned_model = moe.prune_experts(copy.deepcopy(model), pruned)
    moe.save_pruned(pruned_model, None, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    row = moe.FAMILIES[family]
    assert moe.PER_LAYER_KEY not in config
    assert config.get(row.text_config, config)[row.num_experts_field] == spec.layers[0].num_experts - len(pruned[0])

    stock = getattr(transformers, row.auto_class).from_pretrained(str(tmp_path))  # a multimodal family: its own class
    assert type(stock) is type(model)
    x = tokens(1)
    assert torch.equal(logits(stock, x), logits(pruned_model, x))
    with moe.masked(model, pruned):
        assert (logits(model, x) - logits(stock, x)).abs().max() <= TOL


@pytest.mark.parametrize("family", [name for name, row in moe.FAMILIES.items() if row.text_config])
def test_multimodal_pruning_keeps_every_tensor_outside_the_text_experts_and_loads_as_the_multimodal_model(family, tmp_path):
    model = cached_model(family)
    model.save_pretrained(tmp_path / "full", max_shard_size="50KB")
    spec = moe.inspect(model)
    pruned = nonuniform_sets(spec, seed=3)
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(tmp_path / "surgery"))
    moe.prune_checkpoint(str(tmp_path / "full"), pruned, tmp_path / "streamed")
    full = stored(tmp_path / "full")
    for name in ("surgery", "streamed"):
        kept = stored(tmp_path / name)
        experts = re.compile(r"language_model\.layers\.\d+\.mlp\.(experts|gate)\.")
        assert {k for k in full if not experts.search(k)} == {k for k in kept if not experts.search(k)}
        assert any("visual" in k for k in kept)
        for key in (k for k in kept if not experts.search(k)):  # the vision tower and everything else: as stored
            assert torch.equal(kept[key], full[key]), (name, key)
        reloaded = moe.load_pruned(str(tmp_path / name))
        assert type(reloaded) is type(model)
        assert moe.inspect(reloaded).num_experts == tuple(n - len(pruned[i]) for i, n in enumerate(spec.num_experts))
        auto_map = json.loads((tmp_path / name / "config.json").read_text())["auto_map"]
        assert list(auto_map) == [moe.FAMILIES[family].auto_class]
        with moe.masked(model, pruned):
            assert (logits(model, tokens(4)) - logits(reloaded, tokens(4))).abs().max() <= TOL


def stored(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 - a safetensors handle is not iterable
    return out


def test_lfm2_moe_without_its_selection_bias_masks_like_removal_and_round_trips(tmp_path):
    model = cached_model("lfm2_moe", use_expert_bias=False)  # top-k on the sigmoid scores alone, no expert_bias
    assert not hasattr(moe.moe_blocks(model)[0].block, "expert_bias")
    pruned = {0: [0, 1, 2, 3, 4, 5], 1: [3], 2: []}
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(tmp_path))
    reloaded = moe.load_pruned(str(tmp_path))
    x = tokens(2)
    with moe.masked(model, pruned):
        assert (logits(model, x) - logits(reloaded, x)).abs().max() <= TOL


def test_group_limited_routing_masks_like_even_removal(tmp_path):
    model = cached_model("deepseek_v3")  # 16 experts in 4 groups of 4, 2 groups per token
    pruned = {0: [0, 5, 10, 15], 1: [0, 1, 4, 5, 8, 9, 12, 13], 2: []}
    moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), None, str(tmp_path))
    reloaded = moe.load_pruned(str(tmp_path))
    x = tokens(2)
    with moe.masked(model, pruned):
        assert (logits(model, x) - logits(reloaded, x)).abs().max() <= TOL


@pytest.mark.parametrize(
    "family, overrides, pruned, message",
    [
        ("deepseek_v3", {}, {0: [0, 1]}, "same number of experts from every group"),
        ("deepseek_v3", {}, {0: [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14]}, "too few"),
        (
            "deepseek_v2",
            {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
            {0: [0, 4]},
            "cannot be reproduced",
        ),
    ],
)
def test_group_limited_routing_that_removal_cannot_reproduce_is_refused(family, overrides, pruned, message):
    model = cached_model(family, **overrides)
    before = state(model)
    with pytest.raises(ModelError, match=message), moe.masked(model, pruned):
        pytest.fail("masked must refuse before entering")
    with pytest.raises(ModelError, match=message):
        moe.prune_experts(model, pruned)
    assert_same_state(before, model)
    assert all(not b.router._forward_hooks for b in moe.moe_blocks(model))


# --- masked leaves no trace -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "ernie4_5_moe", "gpt_oss"])
def test_masked_leaves_weights_and_outputs_bit_identical_also_after_an_exception(family):
    model = cached_model(family, **UNGROUPED.get(family, {}))
    x = tokens(3)
    before, expected = state(model), logits(model, x)
    spec = moe.inspect(model)
    pruned = {layer.ordinal: list(range(layer.num_experts - layer.top_k)) for layer in spec.layers}
    with moe.masked(model, pruned):
        assert not torch.equal(logits(model, x), expected)
    assert torch.equal(logits(model, x), expected)
    with pytest.raises(RuntimeError, match="body failed"), moe.masked(model, pruned):
        logits(model, x)
        raise RuntimeError("body failed")
    assert torch.equal(logits(model, x), expected)
    assert_same_state(before, model)


def test_masking_many_candidates_in_a_row_needs_no_weight_copies():
    model = cached_model("olmoe")
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    x = tokens(4, batch=1, length=4)
    for candidate in range(50):
        with moe.masked(model, {candidate % 4: [candidate % 8]}):
            logits(model, x)
    assert pointers == {name: p.data_ptr() for name, p in model.named_parameters()}


# --- bad input is refused before anything changes ---------------------------------------------------------


@pytest.mark.parametrize(
    "pruned, message",
    [
        ({0: [0, 1, 2, 3, 4, 5, 6]}, "at most 6 may go"),
        ({0: [8]}, r"unknown expert ids \[8\]"),
        ({0: [-1]}, r"unknown expert ids \[-1\]"),
        ({4: [0]}, "unknown MoE layer 4"),
        ({-1: [0]}, "unknown MoE layer -1"),
        ({0: [1, 1]}, r"duplicate expert ids \[1\]"),
        ({0: [1.5]}, "must be an integer"),
        ([[0]], "must map MoE layer ordinal"),
    ],
)
def test_bad_pruned_sets_are_refused_before_anything_changes(pruned, message, tmp_path):
    model = cached_model("olmoe")
    before, config = state(model), model.config.to_dict()
    with pytest.raises(ConfigError, match=message), moe.masked(model, pruned):
        pytest.fail("masked must refuse before entering")
    with pytest.raises(ConfigError, match=message):
        moe.prune_experts(model, pruned)
    assert_same_state(before, model)
    assert model.config.to_dict() == config
    assert all(not b.router._forward_hooks for b in moe.moe_blocks(model))


def test_saving_an_unsupported_model_writes_nothing(tmp_path):
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(ModelError):
        moe.save_pruned(AutoModelForCausalLM.from_config(config), None, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kwargs", [{"trust_remote_code": True}, {"ignore_mismatched_sizes": True}, {"use_safetensors": False}])
def test_load_pruned_refuses_options_that_would_load_something_else(kwargs, tmp_path):
    with pytest.raises(ConfigError):
        moe.load_pruned(str(tmp_path), **kwargs)


# --- checkpoints at URIs ------------------------------------------------------------------------------------


def test_checkpoint_round_trips_through_memory_and_file_uris(tmp_path):
    model = moe.prune_experts(copy.deepcopy(cached_model("gpt_oss")), {0: [0, 3], 1: [7]})
    x = tokens(5)
    expected = logits(model, x)
    moe.save_pruned(model, None, "memory://evoesap-test/ckpt")
    assert torch.equal(logits(moe.load_pruned("memory://evoesap-test/ckpt"), x), expected)
    moe.save_pruned(model, None, f"file://{tmp_path}/ckpt")
    assert torch.equal(logits(moe.load_pruned(f"file://{tmp_path}/ckpt"), x), expected)
    assert moe.load_tokenizer(str(tmp_path / "ckpt")) is None


def test_reloaded_nonuniform_model_keeps_one_config_shared_by_every_layer(tmp_path):
    model = moe.prune_experts(copy.deepcopy(cached_model("qwen3_moe")), {0: [2], 2: [0, 1, 3]})
    moe.save_pruned(model, None, str(tmp_path))
    reloaded = moe.load_pruned(str(tmp_path))
    reloaded.set_experts_implementation("eager")
    assert all(b.experts.config is reloaded.config for b in moe.moe_blocks(reloaded))
    assert {b.experts.config._experts_implementation for b in moe.moe_blocks(reloaded)} == {"eager"}


def test_pruning_back_to_uniform_drops_the_per_layer_counts():
    model = moe.prune_experts(copy.deepcopy(cached_model("mixtral")), {0: [0, 1]})
    assert getattr(model.config, moe.PER_LAYER_KEY) == {"0": 6, "1": 8, "2": 8, "3": 8}
    assert model.config.num_local_experts == 8
    moe.prune_experts(model, {1: [0, 1], 2: [2, 3], 3: [4, 5]})
    assert not hasattr(model.config, moe.PER_LAYER_KEY)
    assert model.config.num_local_experts == 6


# --- the invariant, on random pruned sets -----------------------------------------------------------------


@st.composite
def family_and_pruned(draw):
    family = draw(
        st.sampled_from(
            [
                "olmoe",
                "mixtral",
                "deepseek_v2",
                "ernie4_5_moe",
                "gpt_oss",
                "phimoe",
                "minimax_m2",
                "afmoe",
                "llama4_text",
                "lfm2_moe",
            ]
        )
    )
    spec = moe.inspect(cached_model(family))
    pruned = {}
    for layer in spec.layers:
        most = layer.num_experts - layer.top_k
        ids = draw(st.lists(st.integers(0, layer.num_experts - 1), unique=True, max_size=most))
        if ids or draw(st.booleans()):
            pruned[layer.ordinal] = ids
    return family, pruned


@settings(max_examples=20, deadline=None)
@given(family_and_pruned(), st.integers(0, 2**16))
def test_masked_equals_pruned_for_random_pruned_sets(case, seed):
    family, pruned = case
    model = cached_model(family)
    x = tokens(seed, batch=1, length=12)
    with moe.masked(model, pruned):
        masked_logits = logits(model, x)
    pruned_model = moe.prune_experts(copy.deepcopy(model), pruned)
    assert (masked_logits - logits(pruned_model, x)).abs().max() <= TOL


@st.composite
def even_group_removal(draw):
    """DeepSeek-V3's tiny model: 4 groups of 4; each layer drops the same count from every group."""
    pruned = {}
    for ordinal in range(3):
        per_group = draw(st.integers(0, 2))  # keep >= 2 per group: groups are scored by their best two
        pruned[ordinal] = [4 * group + e for group in range(4) for e in draw(st.permutations(range(4)))[:per_group]]
    return pruned


@settings(max_examples=15, deadline=None)
@given(even_group_removal(), st.integers(0, 2**16))
def test_group_limited_masking_equals_pruning_for_random_even_removal(pruned, seed):
    model = cached_model("deepseek_v3")
    x = tokens(seed, batch=1, length=12)
    with moe.masked(model, pruned):
        masked_logits = logits(model, x)
    pruned_model = moe.prune_experts(copy.deepcopy(model), pruned)
    assert (masked_logits - logits(pruned_model, x)).abs().max() <= TOL
