"""The quantize recipes offered by name, and what the quantize worker is asked for one checkpoint.

Read by the quantize stage (`evoesap.stages.quantize`), which runs the worker, and by the memory target's sizing of a
quantized checkpoint (`evoesap.planning.quantized`), which quantizes a stand-in with the same request.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from evoesap.errors import ConfigError
from evoesap.moe.families import PER_LAYER_KEY


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One named recipe: a compressed-tensors preset scheme applied to every Linear by one algorithm."""

    scheme: str  # compressed-tensors preset (llm-compressor's `scheme=`)
    algorithm: str  # rtn (QuantizationModifier), gptq or awq
    calibrated: bool  # needs calibration samples
    group_size: int | None  # weights quantized in groups of this many inputs: every quantized width must divide
    note: str


RECIPES: dict[str, Recipe] = {
    "fp8-dynamic": Recipe(
        "FP8_DYNAMIC", "rtn", False, None, "FP8 weights per channel, FP8 activations per token at run time; no calibration data"
    ),
    "w4a16-gptq": Recipe("W4A16", "gptq", True, 128, "4-bit integer weights in groups of 128 by GPTQ, 16-bit activations"),
    "w4a16-awq": Recipe(
        "W4A16_ASYM",
        "awq",
        True,
        128,
        "4-bit asymmetric weights in groups of 128 by AWQ (llm-compressor 0.14 runs AWQ on an accelerator only)",
    ),
}
# Not offered: W8A8 int8. Its checkpoint of an MoE model opens neither in transformers 5.24 (the int8 experts fail
# the conversion to fused experts) nor in vLLM's CPU build 0.32 (no int8 MoE kernel): docs/results/quantization.md.


def check_recipe(name: str) -> Recipe:
    """The recipe called `name`; an unknown name is refused with the nearest and the valid ones."""
    if name in RECIPES:
        return RECIPES[name]
    near = difflib.get_close_matches(name, RECIPES, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"unknown recipe {name!r}{hint}; recipes are {', '.join(RECIPES)}")


def ignored_modules(family: Any) -> list[str]:
    """Modules left unquantized: the output head and every router (a few rows whose every bit decides routing),
    the shared experts' gates too."""
    block, router = family.block, family.router
    return ["lm_head", f"re:.*\\.{block}\\.{router}$", f"re:.*\\.{block}\\.shared_expert_gate$"]


def per_layer(family: Any, config: dict[str, Any]) -> dict[str, Any] | None:
    """What the worker needs to build a non-uniform checkpoint's class without remote code: evoesap's modeling
    template (torch only), the stock class and the family's facts; None for a uniform checkpoint."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from evoesap.moe import per_layer_modeling, remote_code

    if not config.get(PER_LAYER_KEY):
        return None
    stock = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]
    return {"module_file": per_layer_modeling.__file__, "stock": stock, "facts": remote_code.facts(family, stock)}


def worker_request(
    name: str, family: Any, config: dict[str, Any], dtype: str, device_map: Any, input_ids: list[list[int]], max_length: int,
    batch_size: int,
) -> dict[str, Any]:  # fmt: skip
    """What the worker is asked for a checkpoint of `family` with `config` (config.json), the model and out places aside."""
    recipe = check_recipe(name)
    return {
        "recipe": {"name": name, "scheme": recipe.scheme, "algorithm": recipe.algorithm,
                   "calibrated": recipe.calibrated, "ignore": ignored_modules(family)},
        "counts": config.get(PER_LAYER_KEY),
        "per_layer": per_layer(family, config),
        "num_experts_field": family.num_experts_field,
        "block": family.block,
        "experts": family.experts,
        "dtype": dtype,
        "device_map": device_map,
        "input_ids": input_ids,
        "max_length": max_length,
        "batch_size": batch_size,
    }  # fmt: skip
