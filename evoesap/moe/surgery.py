"""Physical expert removal and the safetensors checkpoint that stores it, stock-loadable where possible.

Uniform pruning keeps one expert count, so stock `AutoModelForCausalLM.from_pretrained` loads it.
Non-uniform pruning writes the per-layer counts to config.json (`PER_LAYER_KEY`); `load_pruned`
builds the stock class from that config, shrinks each layer's expert tensors before the weights load,
then loads strictly: no remote code, no `ignore_mismatched_sizes`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from evoesap.errors import ArtifactError, ConfigError, ModelError
from evoesap.moe import per_layer_modeling
from evoesap.moe.families import FAMILIES, NONUNIFORM_ARCHITECTURE_PREFIX, PER_LAYER_KEY, Family, family_of
from evoesap.moe.remote_code import drop_auto_map, layout, write_modeling_file
from evoesap.moe.spec import MoEBlock, Pruned, check_pruned, inspect, model_family, moe_blocks
from evoesap.store import artifacts
from evoesap.store.identity import is_uri, locate

log = logging.getLogger(__name__)

# from_pretrained options that would load something other than this checkpoint, exactly.
_REFUSED_KWARGS = ("trust_remote_code", "ignore_mismatched_sizes", "output_loading_info", "config")
# Files of which any one means a checkpoint directory carries a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# from_pretrained options that also say where the config comes from.
_CONFIG_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "subfolder")


def _resize(block: MoEBlock, family: Family, num_experts: int, make: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Replace every expert-indexed tensor of `block` by `make(old, expert_axis)`, and the counts; the same
    code the modeling file of a non-uniform checkpoint runs (`per_layer_modeling`)."""
    per_layer_modeling.resize_experts(block.block, layout(family), num_experts, make)


def record_counts(model: nn.Module) -> None:
    """Write the modules' expert counts to the config: one int when uniform, else the per-layer map."""
    counts = {str(b.decoder_index): int(b.experts.num_experts) for b in moe_blocks(model)}
    set_counts(model.config, model_family(model), counts)


def set_counts(config: Any, family: Family, counts: Mapping[str, int]) -> None:
    """Expert counts per decoder layer into a config: one int when uniform, else the per-layer map."""
    setattr(family.expert_config(config), family.num_experts_field, max(counts.values()))  # stock classes build the widest
    if len(set(counts.values())) > 1:
        setattr(config, PER_LAYER_KEY, dict(counts))
    else:
        if hasattr(config, PER_LAYER_KEY):
            delattr(config, PER_LAYER_KEY)
        drop_auto_map(config)


def prune_experts(model: nn.Module, pruned: Pruned) -> nn.Module:
    """Remove the experts in `pruned` (MoE ordinal -> ids) from `model`, in place; returns it."""
    sets = check_pruned(inspect(model), pruned)
    family = model_family(model)
    for block in moe_blocks(model):
        ids = set(sets.get(block.ordinal, ()))
        if not ids:
            continue
        total = int(block.experts.num_experts)
        keep_ids = [e for e in range(total) if e not in ids]

        def keep(old: torch.Tensor, axis: int, keep_ids: list[int] = keep_ids) -> torch.Tensor:
            return old.index_select(axis, torch.tensor(keep_ids, device=old.device))

        _resize(block, family, len(keep_ids), keep)
    record_counts(model)
    log.info("pruned %d experts from %d MoE layers", sum(map(len, sets.values())), len(sets))
    return model


def save_pruned(model: PreTrainedModel, tokenizer: Any | None, uri: str) -> None:
    """Save a (pruned) model and its tokenizer as a safetensors checkpoint at any fsspec URI."""
    record_counts(model)  # also refuses unsupported models before anything is written
    fs, path = artifacts.split(uri)
    if artifacts.is_local(uri):
        _write(model, tokenizer, Path(path))
        return
    with tempfile.TemporaryDirectory(prefix="evoesap-ckpt-") as tmp:
        _write(model, tokenizer, Path(tmp))
        for file in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            fs.put_file(str(file), f"{path.rstrip('/')}/{file.relative_to(tmp).as_posix()}")


def _write(model: PreTrainedModel, tokenizer: Any | None, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)  # safetensors is the only format transformers 5 writes
    if hasattr(model.config, PER_LAYER_KEY):
        name_nonuniform(directory, model_family(model), type(model).__name__)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def name_nonuniform(directory: Path, family: Family, stock_name: str) -> None:
    """Name the architecture the serving plugin registers (save_pretrained always writes the stock class) and
    add the opt-in modeling file that plain transformers opens with trust_remote_code (`remote_code`)."""
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [NONUNIFORM_ARCHITECTURE_PREFIX + stock_name]
    config["auto_map"] = {**config.get("auto_map", {}), **write_modeling_file(directory, family, stock_name)}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _source(uri_or_hub_name: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(a path or hub name that from_pretrained understands, its `revision` keyword for a hub name);
    object-store URIs are downloaded."""
    if is_uri(uri_or_hub_name):
        with artifacts.local_copy(uri_or_hub_name) as local:
            yield str(local), {}
    else:
        yield locate(uri_or_hub_name)  # a missing path is never sent to the hub


def load_pruned(uri_or_hub_name: str, **from_pretrained_kwargs: Any) -> PreTrainedModel:
    """Load a stock or pruned checkpoint (path, fsspec URI or hub name) strictly, without remote code."""
    refused = sorted(k for k in _REFUSED_KWARGS if k in from_pretrained_kwargs)
    if refused or from_pretrained_kwargs.get("use_safetensors", True) is not True:
        raise ConfigError(
            f"load_pruned does not accept {refused or ['use_safetensors=False']}: it loads safetensors "
            "strictly and never runs remote code"
        )
    kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k != "use_safetensors"}
    with _source(uri_or_hub_name) as (source, pinned):
        kwargs.update(pinned)  # a hub model loads at the commit its identity recorded
        config_kwargs = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, **config_kwargs)
        counts = getattr(config, PER_LAYER_KEY, None)
        if config.model_type in FAMILIES or counts:
            stock = family_of(config.model_type).model_class(config)  # a multimodal family loads whole
        elif type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            stock = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        else:
            raise ModelError(f"{uri_or_hub_name} ({config.model_type}) has no causal-LM class in transformers")
        cls = _shrinking(stock, family_of(config.model_type), counts) if counts else stock
        model, info = cls.from_pretrained(source, config=config, use_safetensors=True, output_loading_info=True, **kwargs)
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        raise ArtifactError(f"{uri_or_hub_name} does not match its model exactly: {problems}")
    model.__class__ = stock  # the shrinking subclass only existed to resize before the weights load
    return model


def load_tokenizer(uri_or_hub_name: str) -> Any | None:
    """The tokenizer saved with a checkpoint (path, fsspec URI or hub name); None when it has none."""
    with _source(uri_or_hub_name) as (source, pinned):
        local = Path(source)
        if local.is_dir() and not any((local / name).exists() for name in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False, **pinned)


def _shrinking(stock: type[PreTrainedModel], family: Family, counts: Mapping[str, int]) -> type[PreTrainedModel]:
    """A subclass of the stock class whose constructor resizes each MoE layer to its saved count."""

    def __init__(self: PreTrainedModel, config: Any, *args: Any, **kwargs: Any) -> None:
        stock.__init__(self, config, *args, **kwargs)
        blocks = moe_blocks(self)
        if sorted(counts, key=int) != [str(b.decoder_index) for b in blocks]:
            raise ArtifactError(
                f"config.json {PER_LAYER_KEY} names decoder layers {sorted(counts, key=int)}, but the model "
                f"has MoE layers {[b.decoder_index for b in blocks]}"
            )
        for block in blocks:
            n = int(counts[str(block.decoder_index)])

            _resize(block, family, n, lambda old, axis, n=n: per_layer_modeling.empty_like_resized(old, axis, n))

    return type(stock.__name__, (stock,), {"__init__": __init__})
