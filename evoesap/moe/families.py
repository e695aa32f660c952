"""The facts that differ between MoE families, as one table of data read by one piece of code.

Each row says where a family keeps its expert count and top-k in the config, which module routes,
how it routes, which tensors are indexed by expert, how its decoder layer adds each half to the residual
(what the ESAP scorer runs layer by layer), and what the tiny test model looks like. A new
family is a new row here, never a new class. Verified against transformers 5.24 (each row's tiny
config builds that family's model in tests/unit/test_moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from evoesap.errors import ModelError

# Routing kinds; the maths of each lives in `evoesap.moe.routing`.
SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, top-k, optional renormalisation, scaling
SIGMOID_GROUP_TOPK = "sigmoid_group_topk"  # sigmoid, biased group-limited top-k, unbiased weights
SOFTMAX_BIAS_TOPK = "softmax_bias_topk"  # softmax, top-k on probs + bias, unbiased probs renormalised
TOPK_SOFTMAX = "topk_softmax"  # top-k on raw logits, softmax over the k chosen
SPARSEMIXER = "sparsemixer"  # Phi-3.5-MoE: top-2 by two thresholded argmax rounds, each softmax-weighted
TOPK_SIGMOID = "topk_sigmoid"  # top-k on raw logits, sigmoid of each chosen logit (Llama 4)

# What a router's forward returns, by name: the transformers 5 convention (raw logits [T, E], top-k weights [T, k],
# top-k indices [T, k]), or Llama 4's (dense weights [T, E], 0 for experts not chosen; raw logits [T, E]).
ROUTER_TOPK = ("logits", "weights", "index")
ROUTER_DENSE = ("dense_weights", "logits")
# What the experts module's forward takes: the routed tokens (hidden [T, H], top-k indices, top-k weights), or every
# token for every expert, already multiplied by its dense weight (hidden [E*T, H], Llama 4).
EXPERTS_ROUTED = "routed"
EXPERTS_SCALED_DENSE = "scaled_dense"

# The per-layer expert counts of a non-uniformly pruned checkpoint: {str(decoder index): count}.
PER_LAYER_KEY = "evoesap_num_experts_per_layer"
# A non-uniform checkpoint's config.json names its architecture as this prefix + the stock class name
# (EvoESAPOlmoeForCausalLM): the evoesap-vllm plugin (serving/vllm) registers exactly those names, and
# a vLLM without the plugin refuses them as unsupported instead of failing on a weight shape.
NONUNIFORM_ARCHITECTURE_PREFIX = "EvoESAP"

_FUSED = (("gate_up_proj", 0), ("down_proj", 0))


@dataclasses.dataclass(frozen=True)
class Residual:
    """One residual half of a decoder layer, as `evoesap.scoring.forward.LayerRunner` runs it:
    `out = r * residual_scale + post_norm(f(norm(h))) * scale`, where `f` is the half's module (the token mixer, or
    the block with any modules beside it) and `r` is `h`, or `norm(h)` with `normed_residual`. Every name is an
    attribute of the decoder layer; None where the layer has no such part."""

    norm: str | None  # the norm on the half's input (pre-norm); None: the module reads h itself
    post_norm: str | None = None  # the norm on the module's output, before the sum (FlexOlmo, AFMoE)
    scale: str | None = None  # a number multiplying the module's output (Granite's residual_multiplier)
    residual_scale: str | None = None  # a number multiplying the residual (MiniMax's alpha factors)
    normed_residual: bool = False  # the residual is norm(h), not h (MiniMax's post-norm layers)


PRE_NORM_MIXER = Residual("input_layernorm")  # h + mixer(input_layernorm(h))
PRE_NORM_BLOCK = Residual("post_attention_layernorm")  # h + block(post_attention_layernorm(h))


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers MoE family is laid out; every field is data, read by shared code."""

    model_type: str
    num_experts_field: str  # config field stored in config.json (not an attribute_map alias)
    top_k_field: str
    routing: str  # one of the routing kinds above
    block: str = "mlp"  # attribute of a decoder layer holding its MLP (an MoE block or a dense MLP)
    router: str = "gate"  # attribute of the MoE block holding the router module
    experts: str = "experts"  # attribute of the MoE block holding the fused experts module
    layers: str = "base_model.layers"  # path from the model (of `auto_class`) to its decoder layers
    # a multimodal checkpoint: the config attribute holding its language model's config, where every config field
    # above is read (and the expert count written); None where the config is the language model's own
    text_config: str | None = None
    auto_class: str = "AutoModelForCausalLM"  # the transformers auto class that builds and loads the whole checkpoint
    router_outputs: tuple[str, ...] = ROUTER_TOPK  # what the router's forward returns (ROUTER_TOPK or ROUTER_DENSE)
    experts_input: str = EXPERTS_ROUTED  # what the experts module's forward takes (EXPERTS_ROUTED or EXPERTS_SCALED_DENSE)
    # (path inside the router / experts module / MoE block, expert axis) of every tensor indexed by expert
    router_tensors: tuple[tuple[str, int], ...] = (("weight", 0),)
    expert_tensors: tuple[tuple[str, int], ...] = _FUSED
    block_tensors: tuple[tuple[str, int], ...] = ()  # held by the MoE block itself (MiniMax-M2's selection bias)
    selection_bias: str | None = None  # path inside the MoE block of the bias added for selection only
    renormalize: bool | str = False  # renormalise the top-k weights: always, never, or a config flag
    renorm_epsilon: float = 1e-20  # sigmoid routing: added to the top-k sum it divides by (LFM2-MoE: 1e-6)
    scaling_field: str | None = None  # config field of the factor applied to routed weights
    norm_min_field: str | None = None  # config field clamping the renormalisation denominator
    threshold_field: str | None = None  # sparsemixer: config field of half its relative selection gap
    group_fields: tuple[str, str] | None = None  # (n_group, topk_group) for group-limited top-k
    group_when: tuple[str, str] | None = None  # (config field, value) that switches groups on
    shared_experts: tuple[str, ...] = ()  # paths inside a decoder layer of always-on shared experts (never pruned)
    dense_layer_fields: tuple[str, ...] = ()  # config fields that choose the dense (non-MoE) layers
    mtp_field: str | None = None  # config field counting multi-token-prediction layers (see `MTP_NOTE`)
    # decoder-layer attributes that may hold the token mixer (attention, linear attention, Mamba, convolution); each
    # layer has exactly one of them, and the scorer runs it as the layer's first half
    mixers: tuple[str, ...] = ("self_attn",)
    # a decoder layer's maths, half by half: the mixer's residual half, then the block's (see `Residual`)
    mixer_half: Residual = PRE_NORM_MIXER
    block_half: Residual = PRE_NORM_BLOCK
    block_beside: tuple[str, ...] = ()  # decoder-layer modules run on the block's input, added to its output (a dense MLP)
    final_norm: str = "norm"  # base-model attribute: the norm after the last decoder layer
    rotary: str = "rotary_emb"  # base-model attribute: the rotary position embedding (none there: no positions)
    embedding_scale: str | None = None  # config field multiplying the token embeddings (Granite's embedding_multiplier)
    embedding_sqrt_when: str | None = None  # config flag: when set, embeddings are multiplied by sqrt(hidden_size) (muP)
    logits_divisor: str | None = None  # config field dividing the LM head's logits (Granite's logits_scaling)
    notes: str = ""  # what a user should know (parts left unpruned, ...), shown by `evoesap families`
    tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # config of `tiny_model`

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))

    def expert_config(self, config: Any) -> Any:
        """The config that holds this family's expert fields: `config` itself, or its language model's config."""
        return getattr(config, self.text_config) if self.text_config else config

    def model_class(self, config: Any) -> type:
        """The stock transformers class that builds a checkpoint of this family from its (top-level) config."""
        import transformers

        auto = getattr(transformers, self.auto_class)
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            raise ModelError(f"{self.auto_class} has no class for {type(config).__name__} ({self.model_type})") from None


_DEEPSEEK_ATTENTION = dict(
    num_key_value_heads=4,  # DeepSeek-V2 requires as many KV heads as attention heads
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)

# IBM Granite's muP multipliers: embeddings times embedding_multiplier, each half's output times residual_multiplier (a
# decoder-layer attribute copied from the config), logits divided by logits_scaling
_GRANITE_LAYER = dict(
    mixer_half=Residual("input_layernorm", scale="residual_multiplier"),
    block_half=Residual("post_attention_layernorm", scale="residual_multiplier"),
    embedding_scale="embedding_multiplier",
    logits_divisor="logits_scaling",
)

_ROWS = (
    Family(
        model_type="olmoe",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize="norm_topk_prob",
        tiny=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    ),
    Family(
        model_type="qwen2_moe",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize="norm_topk_prob",
        shared_experts=("mlp.shared_expert",),
        dense_layer_fields=("mlp_only_layers", "decoder_sparse_step"),
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        ),
    ),
    Family(
        model_type="qwen3_moe",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize="norm_topk_prob",
        dense_layer_fields=("mlp_only_layers", "decoder_sparse_step"),
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            head_dim=16,
        ),
    ),
    Family(
        model_type="mixtral",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize=True,
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    ),
    Family(
        model_type="deepseek_v2",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        scaling_field="routed_scaling_factor",
        group_fields=("n_group", "topk_group"),
        group_when=("topk_method", "group_limited_greedy"),
        shared_experts=("mlp.shared_experts",),
        dense_layer_fields=("first_k_dense_replace",),
        tiny=dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            **_DEEPSEEK_ATTENTION,
        ),
    ),
    Family(
        model_type="deepseek_v3",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        routing=SIGMOID_GROUP_TOPK,
        router_tensors=(("weight", 0), ("e_score_correction_bias", 0)),
        selection_bias="gate.e_score_correction_bias",
        renormalize="norm_topk_prob",
        scaling_field="routed_scaling_factor",
        group_fields=("n_group", "topk_group"),
        shared_experts=("mlp.shared_experts",),
        dense_layer_fields=("first_k_dense_replace",),
        tiny=dict(
            n_routed_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            **_DEEPSEEK_ATTENTION,
        ),
    ),
    Family(
        model_type="ernie4_5_moe",
        num_experts_field="moe_num_experts",
        top_k_field="moe_k",
        routing=SOFTMAX_BIAS_TOPK,
        router_tensors=(("weight", 0), ("moe_statics.e_score_correction_bias", 1)),
        selection_bias="gate.moe_statics.e_score_correction_bias",
        renormalize=True,
        norm_min_field="moe_norm_min",
        shared_experts=("mlp.shared_experts",),
        dense_layer_fields=("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
        tiny=dict(
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
        ),
    ),
    Family(
        model_type="gpt_oss",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=TOPK_SOFTMAX,
        router="router",
        router_tensors=(("weight", 0), ("bias", 0)),
        expert_tensors=(
            ("gate_up_proj", 0),  # [E, H, 2I], gate and up interleaved
            ("gate_up_proj_bias", 0),
            ("down_proj", 0),  # [E, I, H]
            ("down_proj_bias", 0),
        ),
        tiny=dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            max_position_embeddings=131072,  # matches its YaRN rope parameters, which warn otherwise
        ),
    ),
)

# DeepSeek-V3's router (sigmoid, selection bias, group-limited top-k, unbiased weights, renorm?, scale) and its
# MoE block (gate, experts, shared_experts), as GLM-4.5, dots.llm1, EXAONE MoE and DeepSeek-V3.2 reuse them.
_V3_ROUTER = dict(
    routing=SIGMOID_GROUP_TOPK,
    router_tensors=(("weight", 0), ("e_score_correction_bias", 0)),
    selection_bias="gate.e_score_correction_bias",
    renormalize="norm_topk_prob",
    scaling_field="routed_scaling_factor",
    group_fields=("n_group", "topk_group"),
    shared_experts=("mlp.shared_experts",),
)
_V3_TINY = dict(num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, routed_scaling_factor=2.5)
# transformers builds no multi-token-prediction layer: the in-memory save never holds one, a streamed prune
# copies its stored tensors unchanged (its experts unpruned).
_MTP = "num_nextn_predict_layers"

_ROWS += (
    Family(
        model_type="glm4_moe",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        dense_layer_fields=("first_k_dense_replace",),
        mtp_field=_MTP,
        **_V3_ROUTER,
        tiny=dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, head_dim=16, **_V3_TINY),
    ),
    Family(
        model_type="glm4_moe_lite",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        dense_layer_fields=("mlp_layer_types",),
        mtp_field=_MTP,
        **_V3_ROUTER,
        tiny=dict(
            n_routed_experts=8,
            n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            **_V3_TINY,
            **{**_DEEPSEEK_ATTENTION, "num_key_value_heads": 4},
        ),
    ),
    Family(
        model_type="minimax_m2",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=SIGMOID_GROUP_TOPK,  # without groups: sigmoid, top-k on scores + bias, unbiased weights renormalised
        block_tensors=(("e_score_correction_bias", 0),),
        selection_bias="e_score_correction_bias",
        renormalize=True,
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16),
    ),
    Family(
        model_type="phimoe",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=SPARSEMIXER,
        block="mlp",
        router="router",
        threshold_field="router_jitter_noise",
        notes="sparsemixer routing as at inference (eval mode): always two experts per token",
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, router_jitter_noise=0.1),
    ),
    Family(
        model_type="hunyuan_v1_moe",
        num_experts_field="num_experts",
        top_k_field="moe_topk",
        routing=SOFTMAX_TOPK,
        router_tensors=(("wg.weight", 0),),
        renormalize=True,
        shared_experts=("mlp.shared_mlp",),
        tiny=dict(num_experts=8, moe_topk=2, intermediate_size=32, head_dim=16),
    ),
    Family(
        model_type="dots1",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        dense_layer_fields=("first_k_dense_replace",),
        **_V3_ROUTER,
        tiny=dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, head_dim=16, **_V3_TINY),
    ),
    Family(
        model_type="granitemoe",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=TOPK_SOFTMAX,
        block="block_sparse_moe",
        router="router",
        **_GRANITE_LAYER,
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    ),
    Family(
        model_type="granitemoeshared",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=TOPK_SOFTMAX,
        block="block_sparse_moe",
        router="router",
        shared_experts=("shared_mlp",),
        block_beside=("shared_mlp",),  # a dense MLP on the block's input, its output added to the block's
        **_GRANITE_LAYER,
        tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=64),
    ),
    Family(
        model_type="flex_olmo",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize="norm_topk_prob",
        mixer_half=Residual(None, post_norm="post_attention_layernorm"),  # h + norm(attn(h)): norms after, none before
        block_half=Residual(None, post_norm="post_feedforward_layernorm"),
        tiny=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    ),
    Family(
        model_type="exaone_moe",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        dense_layer_fields=("mlp_layer_types", "first_k_dense_replace"),
        mtp_field=_MTP,
        **_V3_ROUTER,
        tiny=dict(num_experts=8, num_shared_experts=1, first_k_dense_replace=1, head_dim=16, **_V3_TINY),
    ),
    Family(
        model_type="afmoe",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SIGMOID_GROUP_TOPK,  # without groups: sigmoid, top-k on scores + bias, renormalised, times route_scale
        router="router",
        router_tensors=(("gate.weight", 0),),
        block_tensors=(("expert_bias", 0),),
        selection_bias="expert_bias",
        renormalize=True,
        scaling_field="route_scale",
        shared_experts=("mlp.shared_experts",),
        dense_layer_fields=("num_dense_layers",),
        mixer_half=Residual("input_layernorm", post_norm="post_attention_layernorm"),  # norms before and after both
        block_half=Residual("pre_mlp_layernorm", post_norm="post_mlp_layernorm"),
        embedding_sqrt_when="mup_enabled",
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.0,
            head_dim=16,
            sliding_window=8,
        ),
    ),
)

# Hybrid families: linear attention (Gated DeltaNet, lightning), Mamba or short convolutions beside
# attention; the MoE half of each layer is one of the layouts above.
_LINEAR_ATTENTION = dict(  # Gated DeltaNet widths of the Qwen3-Next / Qwen3.5 tiny models
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)

_HYBRID_ROWS = (
    Family(
        model_type="qwen3_next",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize="norm_topk_prob",
        shared_experts=("mlp.shared_expert",),  # gated by a sigmoid `shared_expert_gate`, never pruned
        dense_layer_fields=("mlp_only_layers", "decoder_sparse_step"),
        mixers=("self_attn", "linear_attn"),
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            **_LINEAR_ATTENTION,
        ),
    ),
    Family(  # the language model of Qwen3.5 MoE; every layer is MoE, top-k always renormalised
        model_type="qwen3_5_moe_text",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize=True,
        shared_experts=("mlp.shared_expert",),
        mixers=("self_attn", "linear_attn"),
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            **_LINEAR_ATTENTION,
        ),
    ),
    Family(  # Kimi-Linear: KDA linear attention beside MLA; DeepSeek-V3 routing, computed in float32
        model_type="kimi_linear",
        num_experts_field="num_experts",  # attribute_map aliases num_local_experts, num_experts_per_tok, ...
        top_k_field="num_experts_per_token",
        **{**_V3_ROUTER, "renormalize": "moe_renormalize", "group_fields": ("num_expert_group", "topk_group")},
        dense_layer_fields=("mlp_layer_types",),
        tiny=dict(
            num_experts=8,
            num_experts_per_token=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_head_dim=16,
            linear_num_heads=4,
            **_DEEPSEEK_ATTENTION,
        ),
    ),
    Family(  # MiniMax-Text-01: lightning (linear) attention beside softmax attention; Mixtral routing
        model_type="minimax",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize=True,
        # post-norm layers: n = norm(h), n * alpha + f(n) * beta, alpha and beta per layer kind (full or linear attention)
        mixer_half=Residual(
            "input_layernorm", scale="attn_beta_factor", residual_scale="attn_alpha_factor", normed_residual=True
        ),
        block_half=Residual(
            "post_attention_layernorm", scale="mlp_beta_factor", residual_scale="mlp_alpha_factor", normed_residual=True
        ),
        tiny=dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
    ),
    Family(  # Granite 4.0: Mamba-2 beside attention; a dense shared MLP beside the MoE block, outside it
        model_type="granitemoehybrid",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=TOPK_SOFTMAX,  # top-k on float32 logits, softmax over the k chosen
        block="block_sparse_moe",
        router="router",
        mixers=("self_attn", "mamba"),
        block_beside=("shared_mlp",),  # a dense MLP on the block's input, its output added to the block's
        **_GRANITE_LAYER,
        tiny=dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=64,
            mamba_n_heads=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        ),
    ),
    Family(  # Jamba: Mamba beside attention, MoE every expert_layer_period layers from expert_layer_offset
        model_type="jamba",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,  # never renormalised
        block="feed_forward",
        router="router",
        dense_layer_fields=("expert_layer_period", "expert_layer_offset"),
        mixers=("self_attn", "mamba"),
        block_half=Residual("pre_ff_layernorm"),
        final_norm="final_layernorm",
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=0,
        ),
    ),
)

_HYBRID_ROWS += (
    Family(  # LFM2-MoE: gated short convolutions beside attention, first num_dense_layers dense
        model_type="lfm2_moe",
        num_experts_field="num_experts",
        top_k_field="num_experts_per_tok",
        routing=SIGMOID_GROUP_TOPK,  # without groups: sigmoid, top-k on scores + expert_bias, unbiased weights
        block="feed_forward",
        block_tensors=(("expert_bias", 0),),  # a buffer of the MoE block, passed to the router as an argument
        selection_bias="expert_bias",  # absent where use_expert_bias is off: then top-k on the scores alone
        renormalize="norm_topk_prob",
        renorm_epsilon=1e-6,
        scaling_field="routed_scaling_factor",
        dense_layer_fields=("num_dense_layers",),
        mixers=("self_attn", "conv"),
        mixer_half=Residual("operator_norm"),
        block_half=Residual("ffn_norm"),
        final_norm="embedding_norm",  # its name, though it follows the last layer
        rotary="pos_emb",
        tiny=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_dense_layers=1,
            routed_scaling_factor=1.5,
            head_dim=16,
            layer_types=["conv", "full_attention", "conv", "conv"],
        ),
    ),
    Family(  # Llama 4's language model: MoE every interleave_moe_layer_step layers, a shared expert in each MoE block
        model_type="llama4_text",
        num_experts_field="num_local_experts",
        top_k_field="num_experts_per_tok",
        routing=TOPK_SIGMOID,
        block="feed_forward",
        router="router",
        expert_tensors=(("gate_up_proj", 0), ("down_proj", 0)),  # [E, H, 2I], [E, I, H]
        layers="model.layers",  # Llama4ForCausalLM names its base model prefix language_model but holds it at .model
        router_outputs=ROUTER_DENSE,
        experts_input=EXPERTS_SCALED_DENSE,
        shared_experts=("feed_forward.shared_expert",),
        dense_layer_fields=("interleave_moe_layer_step", "moe_layers"),
        notes=(
            "the gate multiplies each expert's input, not its output: g_i(x) is that sigmoid weight and f_i(x) the "
            "expert's output on the unscaled token, so REAP's g*||f|| is not the norm of what the expert adds"
        ),
        tiny=dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=2,
            head_dim=16,
            attention_chunk_size=8,
        ),
    ),
)

# Multimodal checkpoints: the language model's experts are pruned, every other tensor is kept as it is stored, and
# the result loads as the multimodal model through its own auto class.
_QWEN3_5_TEXT = next(row for row in _HYBRID_ROWS if row.model_type == "qwen3_5_moe_text")
_MULTIMODAL = dict(text_config="text_config", auto_class="AutoModelForImageTextToText")
_MULTIMODAL_NOTES = (
    "multimodal: the language model's routed experts are pruned, the vision tower is kept unchanged; calibration, "
    "teacher caches, the search and ESAP run on text alone"
)
# the smallest vision tower of the Qwen-VL line (Qwen3.5, Qwen3-VL, GLM-4.5V): one block, 32 wide, 4-pixel patches
_TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
_MULTIMODAL_ROWS = (
    dataclasses.replace(  # Qwen3.5 MoE as published: a vision tower beside the qwen3_5_moe_text language model
        _QWEN3_5_TEXT,
        model_type="qwen3_5_moe",
        layers="model.language_model.layers",
        **_MULTIMODAL,
        notes=_MULTIMODAL_NOTES,
        tiny=dict(
            text_config=dict(_QWEN3_5_TEXT.tiny),
            vision_config=dict(_TINY_VISION),
            tie_word_embeddings=False,
        ),
    ),
)

_MULTIMODAL_ROWS += (
    Family(  # GLM-4.5V / 4.6V: a vision tower beside a GLM-4.5 language model (DeepSeek-V3 routing, shared experts)
        model_type="glm4v_moe",
        num_experts_field="n_routed_experts",
        top_k_field="num_experts_per_tok",
        dense_layer_fields=("first_k_dense_replace",),
        **{**_V3_ROUTER, **_MULTIMODAL},
        layers="model.language_model.layers",
        notes=_MULTIMODAL_NOTES,
        tiny=dict(
            text_config=dict(
                n_routed_experts=8,
                n_shared_experts=1,
                first_k_dense_replace=1,
                head_dim=16,
                # half the head rotates: 4 frequencies, split over (temporal, height, width) positions
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]),
                **_V3_TINY,
            ),
            vision_config=dict(_TINY_VISION, image_size=16),
            tie_word_embeddings=False,
        ),
    ),
    Family(  # Qwen3-VL MoE: a vision tower beside a Qwen3-MoE language model (softmax top-k, always renormalised)
        model_type="qwen3_vl_moe",
        num_experts_field="num_local_experts",  # its text config stores this name; num_experts is an alias
        top_k_field="num_experts_per_tok",
        routing=SOFTMAX_TOPK,
        renormalize=True,
        dense_layer_fields=("mlp_only_layers", "decoder_sparse_step"),
        layers="model.language_model.layers",
        notes=_MULTIMODAL_NOTES,
        **_MULTIMODAL,
        tiny=dict(
            text_config=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], head_dim=16),
            vision_config=dict(_TINY_VISION, deepstack_visual_indexes=[0]),
            tie_word_embeddings=False,
        ),
    ),
)

FAMILIES: Mapping[str, Family] = MappingProxyType({row.model_type: row for row in (*_ROWS, *_HYBRID_ROWS, *_MULTIMODAL_ROWS)})


_HYBRID = "hybrid layers (linear attention, state-space or convolution) beside attention; not in this table yet"
# Known MoE model_types without a row: (why, nearest supported family, what differs from it). `evoesap families`
# lists them (and any other MoE model_type of the installed transformers, with a generic reason); `family_of` refuses
# them with this line before any weight is read.
UNSUPPORTED: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        "llama4": (
            "Llama4ForConditionalGeneration's forward fails on every input in transformers 5.24 (it reads image_outputs "
            "from its language model's output, which has none), so masking cannot be checked against removal",
            "llama4_text",
            "the same language model, at .language_model; prune a text-only llama4_text checkpoint",
        ),
        "ernie4_5_vl_moe": (
            "each MoE layer holds two MoE blocks, text_moe and vision_moe, each token routed to one by its modality; "
            "not modelled",
            "ernie4_5_moe",
            "the text block routes like ERNIE-4.5; its vision block and the modality switch do not exist there",
        ),
        "deepseek_v32": ("DeepSeek sparse attention (indexer) not checked yet", "deepseek_v3", "same router and experts"),
        "glm_moe_dsa": ("DeepSeek sparse attention (indexer) not checked yet", "glm4_moe", "same router and experts"),
        "longcat_flash": (
            "zero-computation (identity) experts share the router with the routed ones; not modelled",
            "deepseek_v3",
            "its router scores routed and zero-computation experts together",
        ),
        "dbrx": (
            "expert weights flattened to [experts x width, hidden] (w1, v1, w2); that expert axis is not modelled",
            "mixtral",
            "softmax top-k routing is the same, the expert tensors are not",
        ),
        "jetmoe": (
            "attention experts (mixture of attention heads) beside the MoE MLP; not modelled",
            "mixtral",
            "its attention is also routed",
        ),
        "cohere2_moe": (
            "parallel attention and MLP in one residual step, routing chosen by expert_selection_fn; not modelled",
            "granitemoe",
            "top-k then softmax is the same, the decoder layer is not",
        ),
        **{
            name: (_HYBRID, "qwen3_moe", "its linear-attention or state-space layers")
            for name in ("nemotron_h", "bailing_hybrid")
        },
    }
)


def family_of(model_type: str) -> Family:
    """The table row of a transformers `model_type`; an unsupported one is refused in one line that says why,
    names the nearest supported family and what differs from it."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        pass
    if model_type in UNSUPPORTED:
        why, nearest, differs = UNSUPPORTED[model_type]
        raise ModelError(
            f"model_type {model_type!r} is not supported: {why}; nearest supported family: {nearest} ({differs}). "
            "`evoesap families` lists what is supported"
        )
    import difflib

    close = difflib.get_close_matches(str(model_type), list(FAMILIES), n=1, cutoff=0.5)
    hint = f"nearest by name: {close[0]}; " if close else ""
    raise ModelError(
        f"model_type {model_type!r} is not a supported MoE family ({hint}supported: {', '.join(sorted(FAMILIES))}); "
        "`evoesap families` lists every MoE model_type of the installed transformers and why each is or is not supported"
    )
