"""The teacher cache: the full model's next-token distributions at scored positions, in Parquet.

One teacher-forced pass of the full model writes one row per scored position (position t is scored
when token t+1 is an answer token, `evoesap.data.scored_mask`), so candidates are compared with the
teacher without re-running it and without holding full-vocabulary logits in Python objects.

Layout of a cache directory (the stage publishes it as an artifact with a manifest):

- `cache.json`: `CacheMeta` (mode, dtype, top_k, vocab size, model weights / tokenizer / data hashes,
  counts, shard names).
- `samples.parquet`: sample_id, input_ids list<int32>, answer_mask list<bool>; enough to score a
  candidate from the cache alone.
- `positions/part-NNNNN.parquet`: sample_id, position int32 (t), target int32 (token t+1) and
  - mode `full`: logprobs (log-softmax over the vocabulary, V values);
  - mode `topk`: topk_ids list<int32>[K], topk_logprobs (K values), tail_mass float32
    (1 - the top-K probability mass, summed over the tail itself so it never cancels).
  Log-probabilities are stored as fixed_size_binary rows of W little-endian float16|float32 values:
  Parquet writes a float16 list value by value (about 50 MB/s), a binary row as one block (GB/s).
  Row groups hold about ROW_GROUP_BYTES, so that a reader decodes little at a time.

float16 log-probabilities round p(v) by at most 2^-12 |log p(v)| relatively: ESAP read from a float16
cache differs from float32 by about 1e-4 at most on typical distributions; use float32 where that
matters (tests, the live-vs-cache check).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from evoesap.errors import ArtifactError, ConfigError, DataError
from evoesap.offload import state_tensors
from evoesap.progress import progress
from evoesap.scoring.forward import final_hidden, head_logits, model_device, pad_right
from evoesap.store import artifacts, jsontext

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: log-probabilities as binary rows
META_FILE = "cache.json"
SAMPLES_FILE = "samples.parquet"
SHARD_DIR = "positions"
MODES = ("full", "topk")
DTYPES = {"float16": (torch.float16, pa.float16()), "float32": (torch.float32, pa.float32())}
SHARD_BYTES = 256 << 20  # a shard holds about this many bytes of log-probabilities
ROW_GROUP_BYTES = 8 << 20  # a row group holds about this many: what a reader decodes at once
HEAD_BYTES = 256 << 20  # the [rows, V] temporaries of the LM head and softmax together, on any device
HEAD_TEMPORARIES = 3  # [rows, V] float32-sized tensors alive at once in `_write_rows`
WRITE_QUEUE = 2  # chunks waiting for the writer thread at most


class TokenizedLike(Protocol):
    """What the cache needs from `evoesap.data.TokenizedSample`."""

    sample_id: Any
    input_ids: Sequence[int]
    answer_mask: Sequence[bool]


# --------------------------------------------------------------------------------------------------
# Identity: which model, tokenizer and data a cache belongs to


def model_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes), so any weight change is detected.

    Costs one read of every weight (seconds per GB); it runs once per cache and once per evaluator. An
    offloaded model hashes as the same model loaded whole.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(state_tensors(model), key=lambda item: item[0]):
        t = tensor.detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.contiguous().reshape(-1)
        if flat.numel():
            digest.update(flat.view(torch.uint8).cpu().numpy().tobytes())  # bf16 has no numpy dtype
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return artifacts.sha256_bytes(text.encode("utf-8"))


def data_hash(tokenized: Sequence[TokenizedLike]) -> str:
    """sha256 of the tokenized samples (ids, tokens, answer masks): what the cache was computed on."""
    digest = hashlib.sha256()
    for s in tokenized:
        digest.update(json.dumps([str(s.sample_id), list(s.input_ids), [bool(m) for m in s.answer_mask]]).encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheMeta:
    """What a cache holds and what it was made from; `cache.json`."""

    mode: str  # "full" | "topk"
    dtype: str  # storage dtype of the log-probabilities
    top_k: int | None
    vocab_size: int
    model_hash: str
    tokenizer_hash: str | None
    data_hash: str
    num_samples: int
    num_positions: int
    shards: tuple[str, ...]
    format: int = CACHE_FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CacheMeta:
        data = jsontext.loads(text, "the teacher cache's cache.json", hint="rebuild it with `evoesap cache-logits`")
        if data.get("format") != CACHE_FORMAT:
            raise ArtifactError(
                f"teacher cache format {data.get('format')!r} is not {CACHE_FORMAT}: rebuild it with `evoesap cache-logits`"
            )
        data["shards"] = tuple(data["shards"])
        return cls(**data)


# --------------------------------------------------------------------------------------------------
# Writing: one teacher-forced forward, the LM head only at scored positions


def scored_positions(answer_mask: Sequence[bool]) -> list[int]:
    """Positions t whose logits are scored (token t+1 is an answer token), via `data.scored_mask`."""
    from evoesap.data import scored_mask

    return [t for t, m in enumerate(scored_mask(answer_mask)) if m]


class _ShardWriter:
    """Parquet shards of about SHARD_BYTES each, written chunk by chunk (never the whole cache in RAM) on a
    background thread, so that the teacher's next forward overlaps the encoding and the disk."""

    def __init__(self, root: Path, schema: pa.Schema, rows_per_shard: int, rows_per_group: int) -> None:
        self.root, self.schema, self.rows_per_shard = root, schema, max(1, rows_per_shard)
        self.rows_per_group = max(1, rows_per_group)
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self.shards: list[str] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-writer")
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

    def write(self, table: pa.Table) -> None:
        """Queue `table` for writing; waits while WRITE_QUEUE tables are already queued (bounded host memory)."""
        while len(self._pending) >= WRITE_QUEUE:
            self._pending.popleft().result()
        self._pending.append(self._thread.submit(self._write, table))

    def _write(self, table: pa.Table) -> None:
        start = 0
        while start < table.num_rows:
            if self._writer is None or self._rows >= self.rows_per_shard:
                self._roll()
            take = min(table.num_rows - start, self.rows_per_shard - self._rows)
            self._writer.write_table(table.slice(start, take), row_group_size=self.rows_per_group)
            self._rows += take
            start += take

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"{SHARD_DIR}/part-{len(self.shards):05d}.parquet"
        self.shards.append(name)
        light = [f.name for f in self.schema if not pa.types.is_fixed_size_binary(f.type)]
        # binary rows of log-probabilities hardly compress and need no statistics or dictionary
        self._writer = pq.ParquetWriter(
            self.root / name,
            self.schema,
            use_dictionary=light,
            write_statistics=light,
            compression={f.name: "snappy" if f.name in light else "none" for f in self.schema},
        )
        self._rows = 0

    def close(self) -> None:
        """Finish every queued write (raising the first error) and close the last shard. After a failed
        write the open shard is closed too: its file descriptor would otherwise keep the space of a
        deleted staging file (a full disk stays full) for as long as the process lives."""
        try:
            while self._pending:
                self._pending.popleft().result()
        except BaseException:
            self._thread.shutdown(wait=True, cancel_futures=True)
            if self._writer is not None:
                with contextlib.suppress(Exception):  # the write's own error is the one to raise
                    self._writer.close()
            raise
        self._thread.shutdown(wait=True)
        if self._writer is None:  # no scored position at all: still write an empty shard
            self._roll()
        self._writer.close()


def _fixed_list(values: np.ndarray, pa_type: pa.DataType) -> pa.Array:
    """[N, W] numpy -> fixed_size_list<pa_type>[W] without a Python object per value."""
    n, width = values.shape
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=pa_type), width)


def _binary_rows(values: np.ndarray) -> pa.Array:
    """[N, W] numpy -> fixed_size_binary[W * itemsize], one row per value row, without copying."""
    values = np.ascontiguousarray(values)
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(values.shape[1] * values.itemsize), len(values), [None, pa.py_buffer(values)]
    )


def _rows_of(column: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A fixed_size_binary or fixed/variable list column of N rows -> [N, W] numpy view (no copy)."""
    n = len(column)
    if pa.types.is_fixed_size_binary(column.type):
        width = column.type.byte_width // dtype.itemsize
        return np.frombuffer(
            column.buffers()[1], dtype=dtype, count=n * width, offset=column.offset * column.type.byte_width
        ).reshape(n, width)
    return column.flatten().to_numpy(zero_copy_only=False).reshape(n, -1)


def _id_type(tokenized: Sequence[TokenizedLike]) -> pa.DataType:
    return pa.int64() if all(isinstance(s.sample_id, (int, np.integer)) for s in tokenized) else pa.string()


def write_cache(
    model: torch.nn.Module,
    tokenized: Sequence[TokenizedLike],
    out_dir: Path,
    *,
    mode: str = "full",
    top_k: int | None = None,
    dtype: str = "float16",
    batch_size: int = 8,
    tokenizer: Any = None,
    shard_bytes: int = SHARD_BYTES,
    head_bytes: int = HEAD_BYTES,
) -> CacheMeta:
    """Run the full model once over `tokenized` and write the cache into the local directory `out_dir`.

    Memory on the model's device: the model, one batch's forward, and `head_bytes` of [rows, V]
    temporaries, whatever the batch size; on the host, WRITE_QUEUE chunks waiting to be written.
    """
    vocab = int(model.get_output_embeddings().weight.shape[0])
    _check_request(tokenized, mode, top_k, dtype, batch_size, vocab)
    torch_dtype = DTYPES[dtype][0]
    out_dir = Path(out_dir)
    id_type = _id_type(tokenized)
    width = vocab if mode == "full" else 2 * top_k
    writer = _ShardWriter(
        out_dir,
        _schema(mode, top_k, vocab, torch_dtype, id_type),
        shard_bytes // max(1, width * torch_dtype.itemsize),
        ROW_GROUP_BYTES // max(1, width * torch_dtype.itemsize),
    )
    layout = _Rows(mode, top_k, torch_dtype, id_type, max(1, head_bytes // (HEAD_TEMPORARIES * 4 * vocab)))
    scored = [scored_positions(s.answer_mask) for s in tokenized]
    empty = sum(1 for p in scored if not p)
    if empty:
        log.warning("%d of %d samples have no scored position (answer truncated?); they are not cached", empty, len(tokenized))
    keep = [i for i, p in enumerate(scored) if p]
    if not keep:
        raise DataError("no sample has a scored position: check the answer masks and max_length")
    total = 0
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in progress(range(0, len(keep), batch_size), desc="teacher", unit="batch"):
                chunk = keep[start : start + batch_size]
                total += _write_batch(model, tokenized, scored, chunk, writer, layout, device)
    finally:
        model.train(was_training)
        writer.close()

    kept = [tokenized[i] for i in keep]
    pq.write_table(_samples_table(kept, id_type), out_dir / SAMPLES_FILE)
    meta = CacheMeta(
        mode=mode,
        dtype=dtype,
        top_k=top_k if mode == "topk" else None,
        vocab_size=vocab,
        model_hash=model_hash(model),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else None,
        data_hash=data_hash(kept),
        num_samples=len(kept),
        num_positions=total,
        shards=tuple(writer.shards),
    )
    (out_dir / META_FILE).write_text(meta.to_json())
    log.info("teacher cache: %d samples, %d scored positions, mode %s, %s", len(kept), total, mode, dtype)
    return meta


def _check_request(
    tokenized: Sequence[TokenizedLike], mode: str, top_k: int | None, dtype: str, batch_size: int, vocab: int
) -> None:
    """Refuse a cache that cannot be written, before the model runs."""
    if mode not in MODES:
        raise ConfigError(f"cache mode {mode!r} is not one of {MODES}")
    if dtype not in DTYPES:
        raise ConfigError(f"cache dtype {dtype!r} is not one of {tuple(DTYPES)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not tokenized:
        raise DataError("no tokenized samples to cache")
    ids_seen = [s.sample_id for s in tokenized]
    if len(set(ids_seen)) != len(ids_seen):
        raise DataError("sample ids in the tokenized samples are not unique: the cache indexes rows by them")
    if mode == "topk" and not (top_k and 1 <= top_k <= vocab):
        raise ConfigError(f"top_k must be in 1..{vocab} for mode 'topk', got {top_k}")


def _schema(mode: str, top_k: int | None, vocab: int, torch_dtype: torch.dtype, id_type: pa.DataType) -> pa.Schema:
    """One row per scored position: its sample, position and target, then the teacher's distribution
    (the whole vocabulary's log-probabilities, or the top K with the tail's mass)."""
    fields = [("sample_id", id_type), ("position", pa.int32()), ("target", pa.int32())]
    if mode == "full":
        fields.append(("logprobs", pa.binary(vocab * torch_dtype.itemsize)))
    else:
        fields += [
            ("topk_ids", pa.list_(pa.int32(), top_k)),
            ("topk_logprobs", pa.binary(top_k * torch_dtype.itemsize)),
            ("tail_mass", pa.float32()),
        ]
    return pa.schema(fields)


def _samples_table(kept: Sequence[TokenizedLike], id_type: pa.DataType) -> pa.Table:
    """samples.parquet: each cached sample's ids and answer mask, so a reader can rebuild its batches."""
    return pa.table(
        {
            "sample_id": pa.array([s.sample_id for s in kept], type=id_type),
            "input_ids": pa.array([list(map(int, s.input_ids)) for s in kept], type=pa.list_(pa.int32())),
            "answer_mask": pa.array([[bool(m) for m in s.answer_mask] for s in kept], type=pa.list_(pa.bool_())),
        }
    )


@dataclasses.dataclass(frozen=True)
class _Rows:
    """How scored rows become cache columns: mode, K, storage dtype, id type, rows per head chunk."""

    mode: str
    top_k: int | None
    dtype: torch.dtype
    id_type: pa.DataType
    head_rows: int


def _write_batch(
    model: torch.nn.Module,
    tokenized: Sequence[TokenizedLike],
    scored: list[list[int]],
    chunk: list[int],
    writer: _ShardWriter,
    layout: _Rows,
    device: torch.device,
) -> int:
    """One teacher forward over the samples `chunk`; the head and softmax then run in chunks of
    `layout.head_rows` scored rows, each written as it is done."""
    seqs = [torch.as_tensor(list(tokenized[i].input_ids), dtype=torch.long) for i in chunk]
    input_ids, attention_mask = pad_right(seqs)
    rows = torch.cat([torch.full((len(scored[i]),), r, dtype=torch.long) for r, i in enumerate(chunk)])  # [P]
    pos = torch.cat([torch.as_tensor(scored[i], dtype=torch.long) for i in chunk])  # [P]
    hidden = final_hidden(model, input_ids.to(device), attention_mask.to(device))  # [B, T, H]
    picked = hidden[rows.to(hidden.device), pos.to(hidden.device)]  # [P, H]
    del hidden
    targets = input_ids[rows, pos + 1].numpy().astype(np.int32)  # [P]: the token each scored position predicts
    ids = [tokenized[i].sample_id for i in chunk for _ in scored[i]]
    positions = pos.numpy().astype(np.int32)
    for a in range(0, len(ids), layout.head_rows):
        b = a + layout.head_rows
        columns = {
            "sample_id": pa.array(ids[a:b], type=layout.id_type),
            "position": pa.array(positions[a:b]),
            "target": pa.array(targets[a:b]),
            **_teacher_columns(model, picked[a:b], layout),
        }
        writer.write(pa.table(columns, schema=writer.schema))
    return len(ids)


def _teacher_columns(model: torch.nn.Module, hidden: torch.Tensor, layout: _Rows) -> dict[str, pa.Array]:
    """The teacher columns of scored rows [n, H]: at most HEAD_TEMPORARIES [n, V] float32-sized temporaries."""
    logprobs = torch.log_softmax(head_logits(model, hidden).float(), dim=-1)  # [n, V] float32
    if layout.mode == "full":
        return {"logprobs": _binary_rows(logprobs.to(layout.dtype).cpu().numpy())}
    top_lp, top_ids = logprobs.topk(layout.top_k, dim=-1)  # [n, K] float32, [n, K] long
    tail = logprobs.exp_().scatter_(-1, top_ids, 0.0).sum(dim=-1)  # [n] float32, summed over the tail itself
    return {
        "topk_ids": _fixed_list(top_ids.to(torch.int32).cpu().numpy(), pa.int32()),
        "topk_logprobs": _binary_rows(top_lp.to(layout.dtype).cpu().numpy()),
        "tail_mass": pa.array(tail.cpu().numpy()),
    }


# --------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass
class TeacherCache:
    """A loaded cache: rows grouped by sample in cache order (`offsets[i]:offsets[i+1]` is sample i).

    Log-probabilities stay in their stored dtype (float16 halves memory); the metrics upcast per batch.
    """

    meta: CacheMeta
    sample_ids: list[Any]  # [S]
    input_ids: list[torch.Tensor]  # S x [T_i] long
    offsets: torch.Tensor  # [S + 1] long
    positions: torch.Tensor  # [P] long
    targets: torch.Tensor  # [P] long
    logprobs: torch.Tensor | None = None  # [P, V] (mode full)
    topk_ids: torch.Tensor | None = None  # [P, K] int32, as stored (mode topk)
    topk_logprobs: torch.Tensor | None = None  # [P, K]
    tail_mass: torch.Tensor | None = None  # [P] float32

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def mode(self) -> str:
        return self.meta.mode

    def rows(self, sample: int) -> slice:
        """Rows of sample index `sample` (0..S-1, cache order)."""
        return slice(int(self.offsets[sample]), int(self.offsets[sample + 1]))

    def sample(self, sample: int) -> dict[str, torch.Tensor]:
        """Per-sample tensors: input_ids, positions, targets and the teacher columns of its rows."""
        rows = self.rows(sample)
        out = {"input_ids": self.input_ids[sample], "positions": self.positions[rows], "targets": self.targets[rows]}
        for name in ("logprobs", "topk_ids", "topk_logprobs", "tail_mass"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value[rows]
        return out

    @property
    def heavy_bytes(self) -> int:
        """Bytes of the [P, W] teacher columns: what the cache costs wherever it sits."""
        return sum(t.numel() * t.element_size() for t in (self.logprobs, self.topk_ids, self.topk_logprobs) if t is not None)

    def to(self, device: torch.device | str, heavy: bool = True) -> TeacherCache:
        """The teacher columns moved to `device` once (not per candidate); with `heavy=False` the [P, W]
        columns stay where they are (the host) and `column_rows` streams them batch by batch."""
        names = ["positions", "targets", "tail_mass"] + (["logprobs", "topk_ids", "topk_logprobs"] if heavy else [])
        moved = {name: getattr(self, name).to(device) for name in names if getattr(self, name) is not None}
        return dataclasses.replace(self, **moved)

    def column_rows(self, name: str, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Rows `rows` of column `name` on `device`: indexed in place, or gathered on the host and sent over
        from pinned memory (a host-resident column of a GPU search)."""
        column = getattr(self, name)
        if column.device == device:
            return column[rows]
        picked = column[rows.to(column.device)]
        if device.type == "cuda":
            return picked.pin_memory().to(device, non_blocking=True)
        return picked.to(device)

    def check_model(self, model: torch.nn.Module, tokenizer: Any = None, *, weights_hash: str | None = None) -> None:
        """Refuse a model (or tokenizer) other than the one the cache was made from."""
        got = weights_hash or model_hash(model)
        if got != self.meta.model_hash:
            raise ArtifactError(
                f"the teacher cache was made from model weights {self.meta.model_hash[:16]}, but this model's "
                f"weights hash to {got[:16]}: score candidates of the model the cache was made from, or rebuild "
                "the cache from this model with `evoesap cache-logits --model ...`"
            )
        if tokenizer is not None and self.meta.tokenizer_hash is not None:
            got_tok = tokenizer_hash(tokenizer)
            if got_tok != self.meta.tokenizer_hash:
                raise ArtifactError(
                    f"the teacher cache was made with tokenizer {self.meta.tokenizer_hash[:16]}, but this "
                    f"tokenizer hashes to {got_tok[:16]}: use the model's own tokenizer, or rebuild the cache "
                    "with `evoesap cache-logits`"
                )
        self.check_vocab(model)

    def check_vocab(self, model: torch.nn.Module) -> None:
        """Refuse a model whose vocabulary differs from the cache's."""
        vocab = int(model.get_output_embeddings().weight.shape[0])
        if vocab != self.meta.vocab_size:
            raise ArtifactError(
                f"the model's vocabulary has {vocab} tokens but the teacher cache's has {self.meta.vocab_size}: "
                "score a model of the same family and tokenizer, or rebuild the cache with `evoesap cache-logits`"
            )


_HEAVY = {"full": ("logprobs",), "topk": ("topk_ids", "topk_logprobs")}  # [P, W] columns, by mode
READ_BYTES = 2 << 20  # [rows, W] bytes decoded at a time while loading: the loader's memory beside the cache


def load_cache(uri: str) -> TeacherCache:
    """Read a teacher cache from a local path or any fsspec URI, at about its own size in memory.

    The light columns are read first to order the rows by (sample, position); each [P, W] column is
    then allocated once, in its stored dtype (top-K ids stay int32), and filled batch by batch from
    the shards, so no whole-column copy is ever made.
    """
    with artifacts.local_copy(uri) as root:
        meta_path = Path(root) / META_FILE
        if not meta_path.exists():
            raise ArtifactError(f"{artifacts.redact(uri)} is not a teacher cache (no {META_FILE}): run `evoesap cache-logits`")
        if (Path(root) / artifacts.MANIFEST).exists():  # a published cache (stages require one): check every file
            artifacts.verify(uri, "cache-logits", local=Path(root))
        try:
            meta = CacheMeta.from_json(meta_path.read_text())
            for shard in meta.shards:
                artifacts.join(uri, shard)  # shard names stay inside the artifact
        except (ValueError, TypeError, KeyError, ArtifactError) as exc:
            raise ArtifactError(
                f"{artifacts.redact(uri)}/{META_FILE} is malformed ({exc}): rebuild it with `evoesap cache-logits`"
            ) from None
        files = [Path(root) / s for s in meta.shards]
        missing = [s for s, f in zip(meta.shards, files) if not f.exists()]
        if missing or not (Path(root) / SAMPLES_FILE).exists():
            raise ArtifactError(
                f"teacher cache {artifacts.redact(uri)} is incomplete (missing {missing or SAMPLES_FILE}): rebuild it"
            )
        samples = pq.read_table(Path(root) / SAMPLES_FILE)
        light = pa.concat_tables([pq.read_table(f, columns=["sample_id", "position", "target"]) for f in files])
        cache, destination = _index(meta, samples, light)
        _fill(cache, files, destination)
    return cache


def _index(meta: CacheMeta, samples: pa.Table, light: pa.Table) -> tuple[TeacherCache, np.ndarray | None]:
    """The cache with its light columns in (sample, position) order and its [P, W] columns allocated,
    and each stored row's place in that order (None when the shards are already in order)."""
    sample_ids = samples.column("sample_id").to_pylist()
    index = {sid: i for i, sid in enumerate(sample_ids)}
    row_sample = np.array([index[s] for s in light.column("sample_id").to_pylist()], dtype=np.int64)  # [P]
    position = light.column("position").to_numpy().astype(np.int64)  # [P]
    order = np.lexsort((position, row_sample))
    destination = None
    if not np.array_equal(order, np.arange(len(order))):
        destination = np.empty_like(order)
        destination[order] = np.arange(len(order))  # stored row i goes to row destination[i]
    counts = np.bincount(row_sample, minlength=len(sample_ids))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if len(sample_ids) != meta.num_samples or int(offsets[-1]) != meta.num_positions:
        raise ArtifactError("teacher cache rows do not match cache.json counts: the cache is corrupt, rebuild it")
    rows, stored = meta.num_positions, DTYPES[meta.dtype][0]
    if meta.mode == "full":
        heavy = {"logprobs": torch.empty((rows, meta.vocab_size), dtype=stored)}  # [P, V]
    else:
        heavy = {
            "topk_ids": torch.empty((rows, meta.top_k), dtype=torch.int32),  # [P, K] as stored
            "topk_logprobs": torch.empty((rows, meta.top_k), dtype=stored),  # [P, K]
            "tail_mass": torch.empty(rows, dtype=torch.float32),  # [P]
        }
    cache = TeacherCache(
        meta=meta,
        sample_ids=sample_ids,
        input_ids=[torch.as_tensor(np.asarray(ids, dtype=np.int64)) for ids in samples.column("input_ids").to_pylist()],
        offsets=torch.from_numpy(offsets),
        positions=torch.from_numpy(position if destination is None else position[order]),
        targets=torch.from_numpy(light.column("target").to_numpy().astype(np.int64)[order]),
        **heavy,
    )
    return cache, destination


def _fill(cache: TeacherCache, files: Sequence[Path], destination: np.ndarray | None) -> None:
    """Copy the [P, W] columns (and tail mass) from the shards into the allocated tensors, a batch at a time."""
    names = list(_HEAVY[cache.mode]) + (["tail_mass"] if cache.mode == "topk" else [])
    width = sum(getattr(cache, name)[0].numel() * getattr(cache, name).element_size() for name in names)
    row = 0
    for file in files:
        stream = pq.ParquetFile(file, pre_buffer=False, buffer_size=1 << 20)  # read as decoded, not a row group ahead
        for batch in stream.iter_batches(batch_size=max(1, READ_BYTES // width), columns=names, use_threads=False):
            n = batch.num_rows
            where = slice(row, row + n) if destination is None else torch.from_numpy(destination[row : row + n])
            for name in names:
                column, target = batch.column(name), getattr(cache, name)
                if name == "tail_mass":
                    values = column.to_numpy(zero_copy_only=False)  # [n]
                else:
                    values = _rows_of(column, np.dtype(str(target.dtype).removeprefix("torch.")))  # [n, W] view
                with warnings.catch_warnings():  # read-only Arrow memory: copied into the cache, never written
                    warnings.filterwarnings("ignore", message=".*not writable.*")
                    getattr(cache, name)[where] = torch.from_numpy(values)
            row += n
    if row != cache.meta.num_positions:
        raise ArtifactError("teacher cache shards hold fewer rows than cache.json says: the cache is corrupt, rebuild it")
