"""Bytes on disk of the checkpoint the quantize stage writes from a pruned one, predicted from the pruned tensors' shapes.

A quantized file's size follows from names, dtypes and shapes alone, never from the weights' values: compressed-tensors
stores each quantized Linear weight as the recipe's scheme says (`SCHEMES`), llm-compressor leaves the rest as loaded,
and the safetensors library writes one file (tensors by dtype, then by name; transformers shards only above
`SHARD_LIMIT`). The other files differ from the pruned checkpoint's by bytes that depend on the model and the recipe,
never on the allocation (config.json's quantization_config, recipe.yaml, the tokenizer as the quantize environment's
transformers writes it): measured once by quantizing a stand-in, the model's own configuration at tiny widths, in the
quantize environment (seconds). Checked against the quantize stage's real outputs (tests/stages/test_quantize_size.py,
benchmarks/memory_target_check.py --recipe).
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from evoesap.errors import ConfigError

Shape = tuple[int, ...]
# scheme -> the tensors stored for one quantized Linear weight [out, in] of dtype d: (suffix, dtype or None for d,
# shape from (out, in)); compressed-tensors 0.19: FP8 per channel, int4 packed eight to an int32 with group scales
SCHEMES: dict[str, tuple[tuple[str, str | None, Callable[[int, int], Shape]], ...]] = {
    "FP8_DYNAMIC": (("weight", "F8_E4M3", lambda o, i: (o, i)), ("weight_scale", None, lambda o, i: (o, 1))),
    "W4A16": (
        ("weight_packed", "I32", lambda o, i: (o, -(-i // 8))),
        ("weight_scale", None, lambda o, i: (o, i // 128)),
        ("weight_shape", "I64", lambda o, i: (2,)),
    ),
}
# the order the safetensors library writes dtypes in (its Dtype enum, descending); equal dtypes by name
_DTYPE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3",
                "F8_E5M2", "I8", "U8", "F6_E3M2", "F6_E2M3", "F4", "BOOL")  # fmt: skip
SHARD_LIMIT = 50 * 10**9  # transformers' save_pretrained max_shard_size ("50GB"): above it, shards and an index
_STAND_IN_WIDTH = 128  # every width of the stand-in: a whole group of W4A16's 128
_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim")
_NOT_CARRIED = ("architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype")
_LINEAR_EXPERT = re.compile(r"\.experts\.\d+\.[A-Za-z_0-9]+\.weight$")  # a linearized expert's projection


def refusal(recipe: str | None, model_dtype: str = "auto") -> str | None:
    """Why a memory target cannot size the checkpoint `recipe` makes (one line naming the fix); None when it can."""
    from evoesap.release.quantize_recipes import check_recipe

    if recipe is None:
        return None
    scheme = check_recipe(recipe).scheme
    if scheme not in SCHEMES:
        sized = ", ".join(name for name, r in _recipes().items() if r.scheme in SCHEMES)
        return (
            f"target.bytes cannot size the checkpoint quantize.recipe {recipe!r} writes ({scheme}: its zero points' "
            f"layout is not checked against real outputs): use {sized}, or give sparsities: [s]"
        )
    if model_dtype != "auto":
        return (
            f"target.bytes sizes the quantized checkpoint from the pruned one's dtypes, and quantize.model_dtype "
            f"{model_dtype!r} converts them: set the dtype with prune.model_dtype and leave quantize.model_dtype auto"
        )
    return None


def _recipes() -> dict[str, Any]:
    from evoesap.release.quantize_recipes import RECIPES

    return RECIPES


def weights_bytes(tensors: Sequence[Any], model: str, scheme: str) -> int:
    """Bytes of the safetensors file the quantize stage writes from a pruned checkpoint of `tensors`
    (`shards.Planned`, as prune writes them) of `model`'s family; refused where transformers would shard it."""
    from evoesap.moe import shards

    linear, ignore = _linear_modules(model)
    stored = []
    for t in tensors:
        module = t.name[: -len(".weight")] if t.name.endswith(".weight") else None
        if module is None or not (module in linear or _LINEAR_EXPERT.search(t.name)) or _ignored(module, ignore):
            stored.append(t)
            continue
        if len(t.shape) != 2:
            raise ConfigError(
                f"target.bytes: {t.name} of {model} is a fused {len(t.shape)}-D expert tensor on disk, whose quantized "
                "layout is not sized: give sparsities: [s]"
            )
        out, width = t.shape
        for suffix, dtype, shape in SCHEMES[scheme]:
            stored.append(shards.Planned(f"{module}.{suffix}", dtype or t.dtype, shape(out, width), ()))
    stored.sort(key=lambda t: (_DTYPE_ORDER.index(t.dtype), t.name))
    size = shards.file_bytes(stored, {"format": "pt"})
    if size > SHARD_LIMIT:
        raise ConfigError(
            f"target.bytes: the quantized checkpoint of {model} holds {size:,} bytes of weights, above the "
            f"{SHARD_LIMIT:,} at which transformers shards it, a layout not sized: give sparsities: [s]"
        )
    return size


@functools.cache
def _linear_modules(model: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """(the names of the model's nn.Linear modules, the modules the quantize stage leaves unquantized), from its
    config alone (a meta-device model)."""
    import torch

    from evoesap.moe import families, stream_prune
    from evoesap.release.quantize_recipes import ignored_modules

    config = stream_prune.read_config(*stream_prune.checkpoint_files(model, patterns=("config.json",)))
    meta = stream_prune.meta_model(config)
    linear = frozenset(name for name, m in meta.named_modules() if isinstance(m, torch.nn.Linear))
    return linear, tuple(ignored_modules(families.family_of(config.model_type)))


def _ignored(module: str, ignore: Sequence[str]) -> bool:
    """compressed-tensors' matching of an ignore entry: `re:` a regular expression matched from the start, else the name."""
    return any(re.match(i[3:], module) if i.startswith("re:") else module == i for i in ignore)


@functools.cache
def fixed_bytes(model: str, recipe: str, dtype: str | None) -> tuple[int, int]:
    """(bytes the quantize stage adds to a uniform pruned checkpoint's files other than its weights: config.json's
    quantization_config, recipe.yaml, the tokenizer re-written; what its rewrite of a non-uniform checkpoint's
    config.json adds to that, the newline transformers leaves out), the same at every allocation: measured by
    quantizing a stand-in (`model`'s configuration at tiny widths, with its tokenizer and other small files) in the
    quantize environment. `dtype`: the pruned checkpoint's floating dtype (safetensors name), None for the model's own."""
    from evoesap.release import quantize_env, quantize_recipes

    python = quantize_env.quantize_python()
    with tempfile.TemporaryDirectory(prefix="evoesap-stand-in-") as tmp:
        source, out = Path(tmp) / "in", Path(tmp) / "out"
        family, config = _stand_in(model, dtype, source)
        spec = quantize_recipes.check_recipe(recipe)
        ids = [[i % 8 for i in range(16)]] if spec.calibrated else []
        request = quantize_recipes.worker_request(recipe, family, config, "auto", "cpu", ids, 16, 1)
        quantize_env.run_worker(python, {**request, "model": str(source), "out": str(out)}, device="cpu", threads=1)
        written = (out / "config.json").stat().st_size
        rewritten = len((json.dumps(json.loads((out / "config.json").read_text()), indent=2, sort_keys=True) + "\n").encode())
        return _other_bytes(out) - _other_bytes(source), rewritten - written


def _other_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file() and not p.name.startswith("model.safetensors"))


def _stand_in(model: str, dtype: str | None, out: Path) -> tuple[Any, dict[str, Any]]:
    """Write a checkpoint of `model`'s family and configuration at tiny widths (uniform experts) with its small
    files, in `dtype` (else the model's); (its family, its config.json)."""

    from evoesap import moe
    from evoesap.moe import families, shards, stream_prune

    fs, root = stream_prune.checkpoint_files(model, patterns=("config.json",))
    raw = json.loads(fs.cat_file(f"{root}/config.json"))
    family = families.family_of(str(raw.get("model_type")))
    kept = {k: v for k, v in raw.items() if k not in (*_WIDTHS, *_NOT_CARRIED, family.num_experts_field)}
    kept = {k: v for k, v in kept.items() if k not in (moe.PER_LAYER_KEY, "num_experts_per_tok")}
    widths = {k: _STAND_IN_WIDTH for k in _WIDTHS if k in raw}
    if "num_attention_heads" in raw:  # heads x head_dim a whole group too
        kept |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": _STAND_IN_WIDTH // 2}
    net = moe.tiny_model(family.model_type, seed=0, **{**kept, **widths})
    stored = dtype or _stored_dtype(model)
    if stored is not None:
        net = net.to(shards.DTYPES[stored])
    moe.save_pruned(net, None, str(out))
    stream_prune.copy_small_files(model, out)
    return family, json.loads((out / "config.json").read_text())


def _stored_dtype(model: str) -> str | None:
    """The floating dtype of the model's weights as stored (the largest tensor's)."""
    from evoesap.moe import shards, stream_prune

    biggest = max(stream_prune.stored_tensors(model), key=lambda e: e.nbytes)
    return biggest.dtype if biggest.dtype in shards.FLOATS else None


def quantized_bytes(model: str, allocations: Sequence[Any], dtype: Any, recipe: str) -> list[int]:
    """Bytes on disk of the checkpoint the quantize stage writes by `recipe` from each pruned checkpoint of `model`
    (`allocations` as `moe.checkpoint_bytes` takes them, `dtype` the prune's), without writing a weight; the artifact's
    own quantization.json and manifest.json not counted, as a prune artifact's pruning.json is not."""
    from evoesap import moe
    from evoesap.moe import shards
    from evoesap.release.quantize_recipes import check_recipe

    scheme = check_recipe(recipe).scheme
    fixed, rewrite = fixed_bytes(model, recipe, None if dtype is None else shards.NAMES[dtype])
    return [
        weights_bytes(tensors, model, scheme) + other + fixed + (rewrite if len(set(counts.values())) > 1 else 0)
        for _, other, tensors, counts in moe.stream_prune.checkpoint_parts(model, allocations, dtype)
    ]
