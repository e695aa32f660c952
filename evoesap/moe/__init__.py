"""The only package that knows transformers' MoE internals: inspect, mask, prune, save, load.

Family differences live in one table (`families.FAMILIES`); everything else is one code path.
"""

from evoesap.moe.families import FAMILIES, NONUNIFORM_ARCHITECTURE_PREFIX, PER_LAYER_KEY, Family
from evoesap.moe.masking import masked
from evoesap.moe.memory import BytesReport, bytes_report, expert_bytes, parameter_bytes
from evoesap.moe.observe import observe_routing
from evoesap.moe.spec import (
    LayerSpec,
    MoEBlock,
    MoESpec,
    PruningSpace,
    admissible_order,
    check_pruned,
    inspect,
    moe_blocks,
    pruning_space,
)
from evoesap.moe.stream_prune import StreamedPrune, checkpoint_bytes, prune_checkpoint
from evoesap.moe.surgery import load_pruned, load_tokenizer, prune_experts, save_pruned
from evoesap.moe.tiny import tiny_model

__all__ = [
    "FAMILIES",
    "NONUNIFORM_ARCHITECTURE_PREFIX",
    "PER_LAYER_KEY",
    "BytesReport",
    "Family",
    "LayerSpec",
    "MoEBlock",
    "MoESpec",
    "PruningSpace",
    "StreamedPrune",
    "admissible_order",
    "bytes_report",
    "check_pruned",
    "checkpoint_bytes",
    "expert_bytes",
    "inspect",
    "load_pruned",
    "load_tokenizer",
    "masked",
    "moe_blocks",
    "observe_routing",
    "prune_checkpoint",
    "pruning_space",
    "parameter_bytes",
    "prune_experts",
    "save_pruned",
    "tiny_model",
]
