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

import copy
import dataclasses
import fnmatch
import json
import logging
import re
import tempfile
from collections.abc import Sequence
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


@dataclasses.dataclass(frozen=True)
class _Source:
    """A checkpoint read once for pruning: its config, meta model and shard headers (no weight read)."""

    fs: fsspec.AbstractFileSystem
    root: str
    config: Any
    meta: torch.nn.Module
    names: list[str]
    index: dict[str, Any] | None
    headers: list[tuple[str, int, dict[str, shards.Entry], dict[str, str]]]  # (shard, data start, entries, metadata)


def _read_source(source: str, *, headers_only: bool = False) -> _Source:
    """`source` read for pruning; `headers_only`: a hub model read in place, by range requests, never downloaded."""
    fs, root = _hub_in_place(source) if headers_only else checkpoint_files(source)
    config = read_config(fs, root)
    if getattr(config, PER_LAYER_KEY, None):
        raise ConfigError(f"{artifacts.redact(source)} is already pruned: prune the full model")
    meta = meta_model(config)  # an unsupported model is refused before any weight file is looked for
    names, index = shard_names(fs, root)
    headers = []
    for name in names:
        with fs.open(f"{root}/{name}", "rb") as f:
            headers.append((name, *shards.read_header(f)))
    return _Source(fs, root, config, meta, names, index, headers)


def _plan_shards(
    src: _Source, source: str, pruned: Pruned, dtype: torch.dtype | None
) -> tuple[list[tuple[str, list[shards.Planned], dict[str, str]]], dict[str, str], int, dict[str, int]]:
    """(per shard: its name, the tensors written and its metadata; the index's weight map; tensor bytes of the source;
    experts kept per decoder layer), refused before anything is written when a pruned layer's tensor is missing."""
    spec = inspect(src.meta)
    sets = check_pruned(spec, pruned)
    indexed = _indexed_tensors(src.meta, sets)
    mapper = _KeyMapper(src.meta, dtype)
    plans, weight_map, seen, full = [], {}, set(), 0
    for name, start, entries, metadata in src.headers:
        planned = []
        for entry in sorted(entries.values(), key=lambda e: e.begin):
            full += entry.nbytes
            model_key, per_expert = mapper.model_key(entry.name)
            seen.add(model_key)
            item = _plan(entry, start, indexed.get(model_key), per_expert, mapper.target_dtype(model_key, entry.dtype))
            if item is not None:
                planned.append(item)
                weight_map[item.name] = name
        plans.append((name, planned, metadata or {"format": "pt"}))
    missing = sorted(set(indexed) - seen)
    if missing:
        raise ArtifactError(
            f"{artifacts.redact(source)} stores no tensor for {missing[:3]}: its key layout is not one "
            "transformers loads for this model type"
        )
    counts = {str(layer.decoder_index): layer.num_experts - len(sets.get(layer.ordinal, ())) for layer in spec.layers}
    return plans, weight_map, full, counts


def _index_text(index: dict[str, Any], written: int, weight_map: dict[str, str]) -> str:
    return json.dumps({"metadata": {**index.get("metadata", {}), "total_size": written}, "weight_map": weight_map}, indent=2)


def _write_config(src: _Source, counts: dict[str, int], dtype: torch.dtype | None, out_dir: Path) -> None:
    """config.json with the counts exactly as `save_pruned` writes them (and a non-uniform result's modeling file)."""
    config = copy.deepcopy(src.config)
    set_counts(config, model_family(src.meta), counts)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out_dir)
    if hasattr(config, PER_LAYER_KEY):  # the serving plugin's architecture and the modeling file, as save_pruned writes them
        name_nonuniform(out_dir, model_family(src.meta), type(src.meta).__name__)


def prune_checkpoint(source: str, pruned: Pruned, out_dir: Path, dtype: torch.dtype | None = None) -> StreamedPrune:
    """Write the checkpoint at `source` without the experts in `pruned` (MoE ordinal -> ids) into the local
    directory `out_dir`, shard by shard; `dtype` converts floating tensors as `from_pretrained(dtype=...)` would."""
    src = _read_source(source)
    plans, weight_map, full, counts = _plan_shards(src, source, pruned, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, planned, metadata in plans:
        with src.fs.open(f"{src.root}/{name}", "rb") as f, open(out_dir / name, "wb") as out:
            written += shards.write_file(out, f, planned, metadata)
    if src.index is not None:
        (out_dir / INDEX_FILE).write_text(_index_text(src.index, written, weight_map))
    _write_config(src, counts, dtype, out_dir)
    for path in _small_files(src):
        src.fs.get_file(path, str(out_dir / path.rstrip("/").rsplit("/", 1)[-1]))
    log.info("streamed prune: %d -> %d tensor bytes", full, written)
    return StreamedPrune(full, written, tuple(counts.values()))


def checkpoint_bytes(source: str, allocations: Sequence[Pruned], dtype: torch.dtype | None = None) -> list[int]:
    """Bytes on disk of the checkpoint `prune_checkpoint` would write for each of `allocations`, without writing it:
    every shard (length prefix, JSON header, data), the index, config.json, a non-uniform result's modeling file and
    the copied small files. Only the config files are written, to a temporary directory, to be measured."""
    return [weights + other for weights, other, _, _ in checkpoint_parts(source, allocations, dtype)]


def checkpoint_parts(
    source: str, allocations: Sequence[Pruned], dtype: torch.dtype | None = None
) -> list[tuple[int, int, list[shards.Planned], dict[str, int]]]:
    """Per allocation, the checkpoint `prune_checkpoint` would write in parts: (bytes of its weight files and index,
    bytes of every other file, the tensors written, experts kept per decoder layer). The quantized checkpoint's size
    starts from these."""
    src = _read_source(source, headers_only=True)
    small = sum(int(src.fs.size(path)) for path in _small_files(src))
    parts = []
    for pruned in allocations:
        plans, weight_map, _, counts = _plan_shards(src, source, pruned, dtype)
        data = sum(t.nbytes for _, planned, _ in plans for t in planned)
        weights = sum(shards.file_bytes(planned, metadata) for _, planned, metadata in plans)
        if src.index is not None:
            weights += len(_index_text(src.index, data, weight_map).encode())
        with tempfile.TemporaryDirectory() as tmp:
            _write_config(src, counts, dtype, Path(tmp))
            other = small + sum(p.stat().st_size for p in Path(tmp).iterdir())
        parts.append((weights, other, [t for _, planned, _ in plans for t in planned], counts))
    return parts


def stored_tensors(source: str) -> list[shards.Entry]:
    """Every tensor of the checkpoint at `source` as its headers list it (no weight read)."""
    return [entry for _, _, entries, _ in _read_source(source, headers_only=True).headers for entry in entries.values()]


def copy_small_files(source: str, out_dir: Path) -> None:
    """Copy the files prune copies unchanged (tokenizer, generation config, ...) of `source` into `out_dir`."""
    src = _read_source(source, headers_only=True)
    for path in _small_files(src):
        src.fs.get_file(path, str(out_dir / path.rstrip("/").rsplit("/", 1)[-1]))


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


def _small_files(src: _Source) -> list[str]:
    """Tokenizer, generation config and other top-level files to copy; never weights, the old index or config (of a hub
    model, only those `checkpoint_files` fetches)."""
    skip = {INDEX_FILE, "config.json", *src.names}
    hub = src.fs.protocol in ("hf", ("hf",))
    found = []
    for path in src.fs.ls(src.root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name in skip or name.endswith(_WEIGHT_SUFFIXES) or name.startswith(".") or src.fs.isdir(path):
            continue
        if hub and not any(fnmatch.fnmatch(name, pattern) for pattern in _HUB_PATTERNS):
            continue
        found.append(path)
    return found


def _hub_in_place(source: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root) of a checkpoint read where it lies: a path or URI as `checkpoint_files` opens it, a hub model
    through the hub's filesystem at its pinned commit (headers and sizes by range requests, no weight fetched)."""
    if is_uri(source) or Path(source).exists():
        return artifacts.split(source)
    from huggingface_hub import HfFileSystem

    name, pinned = locate(source)
    return HfFileSystem(), f"{name}@{pinned['revision']}" if pinned.get("revision") else name
