"""Stage `quantize`: llm-compressor's `oneshot` on a (pruned) checkpoint, by a recipe picked by name.

llm-compressor runs in its own environment (`evoesap.release.quantize_env`: its transformers pin excludes ours).
This stage checks everything first (the recipe name, that environment, the output place, the checkpoint's
family), draws and tokenizes the calibration samples as every data stage does, then hands the worker one
request. The artifact is a compressed-tensors checkpoint that keeps the input's architecture name, its
per-layer expert counts and modeling file (non-uniform checkpoints), plus quantization.json: the recipe,
the bytes of the weights before and after, and the tool versions.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from evoesap import records
from evoesap.errors import ConfigError, ModelError
from evoesap.machine import bounds, runtime
from evoesap.moe.families import PER_LAYER_KEY, family_of
from evoesap.params import DeviceParams, SampleParams, keyed, param
from evoesap.release import quantize_env
from evoesap.release.quantize_recipes import RECIPES, Recipe, check_recipe, worker_request
from evoesap.store import artifacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QuantizeParams(DeviceParams, SampleParams):
    """Which recipe, and which calibration samples the calibrated recipes observe (llm-compressor places the model
    and onloads its layers itself: no max_memory or offload here)."""

    DEFAULT_SAMPLES: ClassVar[int] = 256

    recipe: str | None = param(
        None, f"Quantization recipe by name: {', '.join(RECIPES)}. Unset in a pipeline configuration: no quantize step."
    )
    batch_size: int = param(1, "Calibration sequences per forward.")

    def __post_init__(self) -> None:
        if self.recipe is not None:
            check_recipe(self.recipe)
        super().__post_init__()

    def tool_versions(self) -> dict[str, str]:
        """llm-compressor's and compressed-tensors' versions in the environment that runs them: in the reuse key."""
        return quantize_env.tool_versions()


def check_widths(config: dict[str, Any], recipe: Recipe, where: str) -> None:
    """Refuse, before any work, a model whose quantized matrices are not whole groups of the recipe's group size:
    the input widths of its Linear layers and the trailing dimensions of its fused experts, read from the config
    alone (a model on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from evoesap.moe.stream_prune import config_from_dict

    if recipe.group_size is None:
        return
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config_from_dict(config))
    widths = {m.in_features for m in net.modules() if isinstance(m, torch.nn.Linear)}
    widths |= {d for name, p in net.named_parameters() if ".experts." in name and p.ndim == 3 for d in p.shape[1:]}
    bad = sorted(w for w in widths if w % recipe.group_size)
    if bad:
        raise ConfigError(
            f"{where}: widths {bad} are not multiples of the group size {recipe.group_size} that "
            f"{recipe.scheme} quantizes in: choose fp8-dynamic (per channel)"
        )


def _family(model: str) -> tuple[Any, dict[str, Any]]:
    """(family row, config.json) of a checkpoint; unsupported or already quantized checkpoints are refused."""
    config = artifacts.read_json(artifacts.join(model, "config.json"))
    if config.get("quantization_config"):
        raise ConfigError(
            f"{artifacts.redact(model)} is already quantized ({config['quantization_config'].get('quant_method')}): "
            "give the unquantized (pruned) checkpoint"
        )
    family = family_of(str(config.get("model_type")))
    if family.layers != "base_model.layers" or family.auto_class != "AutoModelForCausalLM":
        raise ConfigError(
            f"{artifacts.redact(model)} is a {family.model_type} checkpoint (decoder layers at {family.layers}, loaded "
            f"by {family.auto_class}): quantize handles text causal LMs with layers at base_model.layers only; "
            "leave the quantize step out for it"
        )
    return family, config


def run_quantize(model: str, params: QuantizeParams, out_uri: str, data: str | None = None) -> artifacts.Manifest:
    """Quantize `model` (a prune artifact or any supported MoE checkpoint) and publish the compressed checkpoint."""
    from evoesap.moe import surgery

    if params.recipe is None:
        raise ConfigError(f"give a recipe (--recipe): one of {', '.join(RECIPES)}")
    recipe = check_recipe(params.recipe)
    if recipe.calibrated and data is None:
        raise ConfigError(f"recipe {params.recipe!r} calibrates: give --data (the run's calibration set)")
    python = quantize_env.quantize_python()  # fails before anything loads
    inputs = {"model": model, "data": data if recipe.calibrated else None}
    seen = artifacts.preflight(out_uri, "quantize", inputs)
    bounds.check_stage(params, model)
    if artifacts.exists(artifacts.join(model, artifacts.MANIFEST)):
        artifacts.verify(model, "prune")  # a damaged pruned checkpoint is refused here, not half-way through
    family, config = _family(model)
    check_widths({k: v for k, v in config.items() if k != PER_LAYER_KEY}, recipe, artifacts.redact(model))
    input_ids: list[list[int]] = []
    if recipe.calibrated:
        _, tokenized = runtime.tokenized_samples(model, data, params)
        input_ids = [list(map(int, sample.input_ids)) for sample in tokenized]
    request = worker_request(params.recipe, family, config, params.model_dtype, params.device_map, input_ids,
                             params.max_length, params.batch_size)  # fmt: skip
    measured: dict[str, Any] = {}  # the worker's wall time per phase: in the manifest's run record, read when it is
    # written after the block, not in the payload (two runs that make the same checkpoint differ in it)
    with artifacts.stage_output(out_uri, "quantize", keyed(params), inputs, seen, run=measured) as staging:
        with artifacts.local_copy(model) as local:
            before = runtime.checkpoint_bytes(str(local))
            # on the CPU a tiny model runs one thread (runtime.cpu_threads): two spin-wait whenever a core is shared
            threads = runtime.cpu_threads(before // 4) if runtime.resolve_device(params.device) == "cpu" else None
            job = {**request, "model": str(local), "out": str(staging)}
            result = quantize_env.run_worker(python, job, device=params.device, threads=threads)
            measured["seconds"] = result["seconds"]
        if request["per_layer"]:  # the architecture name, auto_map and opt-in modeling file of every non-uniform checkpoint
            surgery.name_nonuniform(staging, family, request["per_layer"]["stock"])
        after = runtime.checkpoint_bytes(str(staging))
        if not after:
            raise ModelError(f"llm-compressor wrote no safetensors for {artifacts.redact(model)}")
        architectures, counts = config.get("architectures"), request["counts"]
        summary = records.QuantizationRecord(
            recipe=params.recipe,
            scheme=recipe.scheme,
            algorithm=recipe.algorithm,
            calibration_samples=len(input_ids),
            architectures=None if architectures is None else tuple(architectures),
            num_experts_per_layer=None if counts is None else {int(layer): n for layer, n in counts.items()},
            checkpoint_bytes_before=before,
            checkpoint_bytes_after=after,
            versions=result["versions"],
        )
        records.write(staging, summary)
    log.info("quantized %s (%s): %d -> %d bytes of weights", artifacts.redact(model), params.recipe, before, after)
    return artifacts.read_manifest(out_uri)
