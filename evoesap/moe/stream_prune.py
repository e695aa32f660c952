"""Expert removal on the checkpoint files themselves: tensor by tensor, never the whole model in memory.

Each safetensors shard is rewritten with the removed experts' slices left out: per-expert keys
(`mlp.experts.3.gate_proj.weight`, as hub checkpoints and `save_pretrained` store them) are dropped or
renumbered, fused expert tensors and router rows (and selection biases) are sliced along their expert
axis. Which disk key is which model tensor comes from transformers' own checkpoint conversion mapping,
so every layout transformers loads is recognised, and the output keeps the source's layout. config.json
gets the counts exactly as `save_pruned` writes them (and a non-uniform result the same modeling file,
`remote_code`); tokenizer and other small files are copied.
Memory: one copy step (`shards.COPY_BYTES`) plus the few small tensors indexed along another axis.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import fsspec
import torch
from transformers import AutoConfig, PreTrainedConfig

from evoesap.errors import ArtifactError, ConfigError
from evoesap.moe import shards
from evoesap.moe.families import PER_LAYER_KEY
from evoesap.moe.spec import Pruned, check_pruned, expert_tensors, inspect, meta_model, model_family, moe_blocks
from evoesap.moe.surgery import name_nonuniform, set_counts
from evoesap.store import artifacts
from evoesap.store.identity import is_uri, locate

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")  # the expert number inside a per-expert key
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
# Files worth fetching from a hub repository: config, tokenizer and weights; never pickled weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclasses.dataclass(frozen=True)
class _Indexed:
    """An expert-indexed tensor of a pruned layer: its expert axis, experts count and kept ids."""

    axis: int
    num_experts: int
    keep: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StreamedPrune:
    """What a streamed prune wrote."""

    bytes_full: int  # tensor bytes of the source checkpoint
    bytes_pruned: int  # tensor bytes written
    num_experts: tuple[int, ...]  # experts per MoE layer after pruning


def checkpoint_files(source: str, patterns: tuple[str, ...] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root) holding a checkpoint: a path or fsspec URI read in place; a hub name (at its pinned
    revision's commit) fetched to the hub's cache (config, tokenizer and safetensors only, or the files
    matching `patterns`)."""
    if is_uri(source) or Path(source).exists():
        return artifacts.split(source)
    from huggingface_hub import snapshot_download

    name, pinned = locate(source)  # a missing path is never sent to the hub; a hub model at its commit
    return artifacts.split(snapshot_download(name, allow_patterns=list(patterns or _HUB_PATTERNS), **pinned))


def read_config(fs: fsspec.AbstractFileSystem, root: str) -> Any:
    """The transformers config of a checkpoint directory, from its config.json alone (no remote code)."""
    try:
        with fs.open(f"{root}/config.json", "rb") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ArtifactError(f"{root} has no config.json: give a transformers checkpoint directory") from None
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> Any:
    """The transformers config of a parsed config.json, decoded as `from_pretrained` decodes it: config.json
    stores inf and nan as {"__float__": "Infinity"} (Granite 4.0's `time_step_limit`), which the config
    classes refuse undecoded."""
    return AutoConfig.for_model(**PreTrainedConfig._decode_special_floats(data))


def shard_names(fs: fsspec.AbstractFileSystem, root: str) -> tuple[list[str], dict[str, Any] | None]:
    """The safetensors files of a checkpoint in index order, and its index (None for a single file)."""
    if fs.exists(f"{root}/{INDEX_FILE}"):
        with fs.open(f"{root}/{INDEX_FILE}", "rb") as f:
            index = json.load(f)
        return sorted(set(index["weight_map"].values())), index
    if fs.exists(f"{root}/{SINGLE_FILE}"):
        return [SINGLE_FILE], None
    raise ArtifactError(f"{root} has no {INDEX_FILE} or {SINGLE_FILE}: only safetensors checkpoints are pruned")


def prune_checkpoint(source: str, pruned: Pruned, out_dir: Path, dtype: torch.dtype | None = None) -> StreamedPrune:
    """Write the checkpoint at `source` without the experts in `pruned` (MoE ordinal -> ids) into the local
    directory `out_dir`, shard by shard; `dtype` converts floating tensors as `from_pretrained(dtype=...)` would."""
    fs, root = checkpoint_files(source)
    config = read_config(fs, root)
    if getattr(config, PER_LAYER_KEY, None):
        raise ConfigError(f"{artifacts.redact(source)} is already pruned: prune the full model")
    meta = meta_model(config)
    spec = inspect(meta)
    sets = check_pruned(spec, pruned)
    indexed = _indexed_tensors(meta, sets)
    mapper = _KeyMapper(meta, dtype)
    names, index = shard_names(fs, root)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    seen: set[str] = set()
    full = written = 0
    for name in names:
        with fs.open(f"{root}/{name}", "rb") as src, open(out_dir / name, "wb") as out:
            start, entries, metadata = shards.read_header(src)
            planned = []
            for entry in sorted(entries.values(), key=lambda e: e.begin):
                full += entry.nbytes
                model_key, per_expert = mapper.model_key(entry.name)
                seen.add(model_key)
                item = _plan(entry, start, indexed.get(model_key), per_expert, mapper.target_dtype(model_key, entry.dtype))
                if item is not None:
                    planned.append(item)
                    weight_map[item.name] = name
            written += shards.write_file(out, src, planned, metadata or {"format": "pt"})
    missing = sorted(set(indexed) - seen)
    if missing:
        raise ArtifactError(
            f"{artifacts.redact(source)} stores no tensor for {missing[:3]}: its key layout is not one "
            "transformers loads for this model type"
        )
    if index is not None:
        meta_data = {**index.get("metadata", {}), "total_size": written}
        (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": meta_data, "weight_map": weight_map}, indent=2))
    counts = {str(layer.decoder_index): layer.num_experts - len(sets.get(layer.ordinal, ())) for layer in spec.layers}
    set_counts(config, model_family(meta), counts)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out_dir)
    if hasattr(config, PER_LAYER_KEY):  # the serving plugin's architecture and the modeling file, as save_pruned writes them
        name_nonuniform(out_dir, model_family(meta), type(meta).__name__)
    _copy_small_files(fs, root, out_dir, names)
    log.info("streamed prune: %d -> %d tensor bytes", full, written)
    return StreamedPrune(full, written, tuple(counts[str(layer.decoder_index)] for layer in spec.layers))


def _indexed_tensors(meta: torch.nn.Module, sets: dict[int, tuple[int, ...]]) -> dict[str, _Indexed]:
    """Model state-dict key -> expert axis and kept ids, for every expert-indexed tensor of a pruned layer."""
    family = model_family(meta)
    module_names = {id(m): n for n, m in meta.named_modules()}
    out: dict[str, _Indexed] = {}
    for block in moe_blocks(meta):
        removed = set(sets.get(block.ordinal, ()))
        if not removed:
            continue
        n = int(block.experts.num_experts)
        keep = tuple(e for e in range(n) if e not in removed)
        for owner, name, axis in expert_tensors(block, family):
            out[f"{module_names[id(owner)]}.{name}"] = _Indexed(axis, n, keep)
    return out


class _KeyMapper:
    """Disk key -> model key, through transformers' conversion mapping for the model's type, and the dtype
    each tensor is written in."""

    def __init__(self, meta: Any, dtype: torch.dtype | None) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, build_glob_alternation

        transforms = get_model_conversion_mapping(meta)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._prefix, self._state = meta.base_model_prefix, meta.state_dict()
        self._dtype = shards.NAMES[dtype] if dtype is not None else None
        plan = meta._get_dtype_plan(dtype) if dtype is not None else {}
        self._fp32 = build_glob_alternation(list(plan))[0] if plan else None  # kept in float32 whatever `dtype` says

    def model_key(self, disk_key: str) -> tuple[str, bool]:
        """(model key, whether the disk key is one expert's slice that transformers merges on load). A converted key
        without an expert number is a fused tensor stored in another layout (Qwen3-VL MoE's transposed experts): it
        keeps its expert axis first, and is sliced like the model's own."""
        from transformers.core_model_loading import rename_source_key

        key, converter = rename_source_key(disk_key, self._renamings, self._converters, self._prefix, self._state)
        return key, converter is not None and _EXPERT_ID.search(disk_key) is not None

    def target_dtype(self, model_key: str, stored: str) -> str:
        if self._dtype is None or stored not in shards.FLOATS:
            return stored
        if self._fp32 is not None and self._fp32.search(model_key):
            return "F32"
        return self._dtype


def _plan(entry: shards.Entry, start: int, indexed: _Indexed | None, per_expert: bool, dtype: str) -> shards.Planned | None:
    """How one stored tensor is written: whole, renamed (per-expert key), sliced, or not at all (removed)."""
    convert = entry.dtype if dtype != entry.dtype else None
    whole = ((start + entry.begin, start + entry.end),)
    if indexed is None:
        return shards.Planned(entry.name, dtype, entry.shape, whole, convert)
    if per_expert:
        match = _EXPERT_ID.search(entry.name)
        if match is None:
            raise ArtifactError(f"checkpoint key {entry.name} merges into expert tensors but names no expert number")
        expert = int(match.group(1))
        if expert not in indexed.keep:
            return None
        name = f"{entry.name[: match.start()]}.experts.{indexed.keep.index(expert)}.{entry.name[match.end() :]}"
        return shards.Planned(name, dtype, entry.shape, whole, convert)
    axis = indexed.axis
    if entry.shape[axis] != indexed.num_experts:
        raise ArtifactError(
            f"checkpoint tensor {entry.name} has {entry.shape[axis]} entries on its expert axis, but the config "
            f"says {indexed.num_experts} experts: the checkpoint does not match its config.json"
        )
    shape = (*entry.shape[:axis], len(indexed.keep), *entry.shape[axis + 1 :])
    if axis != 0:  # only small tensors (ERNIE's selection bias) are expert-indexed on another axis
        return shards.Planned(entry.name, dtype, shape, whole, convert, (axis, indexed.keep), entry.shape)
    row = entry.nbytes // indexed.num_experts
    return shards.Planned(entry.name, dtype, shape, _runs(start + entry.begin, row, indexed.keep), convert)


def _runs(base: int, row: int, keep: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Byte ranges of rows `keep` (sorted) of `row` bytes each from `base`, consecutive rows merged."""
    runs: list[list[int]] = []
    for e in keep:
        if runs and runs[-1][1] == base + e * row:
            runs[-1][1] += row
        else:
            runs.append([base + e * row, base + (e + 1) * row])
    return tuple((a, b) for a, b in runs)


def _copy_small_files(fs: fsspec.AbstractFileSystem, root: str, out_dir: Path, shard_files: list[str]) -> None:
    """Tokenizer, generation config and other top-level files; never weights, the old index or config."""
    skip = {INDEX_FILE, "config.json", *shard_files}
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name in skip or name.endswith(_WEIGHT_SUFFIXES) or name.startswith(".") or fs.isdir(path):
            continue
        fs.get_file(path, str(out_dir / name))
