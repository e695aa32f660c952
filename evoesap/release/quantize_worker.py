"""llm-compressor's `oneshot` on one checkpoint, run by the quantize stage in llm-compressor's own environment.

llm-compressor 0.14 pins transformers <= 5.17 and this package needs >= 5.23, so this file runs as a script
with the python of `.venv-quantize` (`make quantize-venv`): it imports only torch, transformers and
llm-compressor, never evoesap. The stage (`evoesap.stages.quantize`) validates everything, tokenizes the
calibration samples and sends one request as JSON; this script answers with a small JSON result.

Non-uniformly pruned checkpoints open without remote code: the stage names evoesap's per-layer modeling
template (evoesap/moe/per_layer_modeling.py, torch only; it works under transformers 5.17), which this script
imports by file path to build the per-layer class, as the checkpoint's own modeling file would. llm-compressor
linearizes fused experts with one expert count for the whole model (the config's), so each MoE layer is
linearized here with a copy of the config holding that layer's count. The experts are saved linearized
(`experts.<i>.gate_proj.weight_*`, the families' original hub layout), which compressed-tensors compresses
and transformers >= 5.23 fuses again on load; llm-compressor's `repack_moe` is not used: with transformers
5.17 it saved the experts uncompressed. The per-layer counts stay in config.json; the stage names the architecture.

    python quantize_worker.py request.json result.json
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any


def _modifiers(recipe: dict[str, Any]) -> list[Any]:
    """The llm-compressor modifiers of a recipe as the stage describes it (algorithm, scheme, ignore)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    common = {"targets": "Linear", "scheme": recipe["scheme"], "ignore": recipe["ignore"]}
    if recipe["algorithm"] == "rtn":
        return [QuantizationModifier(**common)]
    if recipe["algorithm"] == "gptq":
        return [GPTQModifier(**common)]
    if recipe["algorithm"] == "awq":
        from llmcompressor.modifiers.awq import AWQModifier

        return [AWQModifier(**common)]
    raise ValueError(f"unknown algorithm {recipe['algorithm']!r}")


def _linearize(model: Any, counts: dict[str, int] | None, num_experts_field: str, block: str, experts: str) -> int:
    """Linearize every MoE layer's fused experts, each with its own expert count; returns how many layers."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    done = 0
    for index, layer in enumerate(model.base_model.layers):
        owner = getattr(layer, block, None)
        fused = getattr(owner, experts, None)
        if fused is None or not hasattr(fused, "down_proj"):
            continue
        config = copy.copy(getattr(fused, "config", None) or model.config)
        if counts:
            setattr(config, num_experts_field, int(counts[str(index)]))
        linear = LinearExperts2D.get_linear_experts_cls(type(fused)).from_experts_module(fused, config)
        setattr(owner, experts, linear)
        done += 1
    return done


def _per_layer_class(module_file: str, stock: type, facts: dict[str, Any]) -> type:
    """evoesap's per-layer subclass of `stock`, from the modeling template at `module_file` (imports torch only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("evoesap_per_layer_modeling", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.per_layer_class(stock, facts)


def _dataset(input_ids: list[list[int]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": input_ids, "attention_mask": [[1] * len(ids) for ids in input_ids]})


def quantize(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    source, out = request["model"], Path(request["out"])
    counts = request.get("counts")
    dtype = getattr(torch, request["dtype"]) if request["dtype"] != "auto" else "auto"
    per_layer = request.get("per_layer")
    if per_layer:  # a non-uniform checkpoint: the stock class with each MoE layer's own expert count
        cls = _per_layer_class(per_layer["module_file"], getattr(transformers, per_layer["stock"]), per_layer["facts"])
        model = cls.from_pretrained(source, dtype=dtype, device_map=request["device_map"])
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=request["device_map"])
    layers = _linearize(model, counts, request["num_experts_field"], request["block"], request["experts"])
    recipe = request["recipe"]
    calibration = {}
    if recipe["calibrated"]:
        calibration = dict(
            dataset=_dataset(request["input_ids"]),
            num_calibration_samples=len(request["input_ids"]),
            max_seq_length=request["max_length"],
            batch_size=request["batch_size"],
            shuffle_calibration_samples=False,  # the stage's seeded draw, in its order: unseeded, GPTQ's sums vary
        )
    loaded = time.perf_counter()
    oneshot(model=model, recipe=_modifiers(recipe), **calibration)
    quantized = time.perf_counter()
    model.save_pretrained(out, save_compressed=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(out)
    return {
        "moe_layers_linearized": layers,
        "seconds": {"load": loaded - started, "oneshot": quantized - loaded, "save": time.perf_counter() - quantized},
        "versions": {
            "llmcompressor": _version("llmcompressor"),
            "compressed-tensors": _version("compressed-tensors"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv: list[str]) -> int:
    request_file, result_file = map(Path, argv)
    result = quantize(json.loads(request_file.read_text()))
    result_file.write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
