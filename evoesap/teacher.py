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
  - mode `full`: logprobs fixed_size_list<float16|float32>[V] (log-softmax over the vocabulary);
  - mode `topk`: topk_ids list<int32>[K], topk_logprobs list<float16|float32>[K], tail_mass float32
    (1 - the top-K probability mass, summed over the tail itself so it never cancels).

float16 log-probabilities round p(v) by at most 2^-12 |log p(v)| relatively: ESAP read from a float16
cache differs from float32 by about 1e-4 at most on typical distributions; use float32 where that
matters (tests, the live-vs-cache check).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from evoesap import artifacts
from evoesap.errors import ArtifactError, ConfigError, DataError
from evoesap.progress import progress

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
META_FILE = "cache.json"
SAMPLES_FILE = "samples.parquet"
SHARD_DIR = "positions"
MODES = ("full", "topk")
DTYPES = {"float16": (torch.float16, pa.float16()), "float32": (torch.float32, pa.float32())}
SHARD_BYTES = 256 << 20  # a shard holds about this many bytes of log-probabilities


class TokenizedLike(Protocol):
    """What the cache needs from `evoesap.data.TokenizedSample`."""

    sample_id: Any
    input_ids: Sequence[int]
    answer_mask: Sequence[bool]


# --------------------------------------------------------------------------------------------------
# Identity: which model, tokenizer and data a cache belongs to


def model_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes), so any weight change is detected.

    Costs one read of every weight (seconds per GB); it runs once per cache and once per evaluator.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.contiguous().reshape(-1)
        if flat.numel():
            digest.update(flat.view(torch.uint8).cpu().numpy().tobytes())  # bf16 has no numpy dtype
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
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
    def from_json(cls, text: str) -> "CacheMeta":
        data = json.loads(text)
        if data.get("format") != CACHE_FORMAT:
            raise ArtifactError(
                f"teacher cache format {data.get('format')!r} is not {CACHE_FORMAT}: rebuild it with "
                "`evoesap cache-logits`"
            )
        data["shards"] = tuple(data["shards"])
        return cls(**data)


# --------------------------------------------------------------------------------------------------
# Teacher-forced forward with the LM head only where it is needed


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states (after the final norm) of a causal LM -> [B, T, H], without the LM head."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if isinstance(base, torch.nn.Module) and base is not model:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
    return out.hidden_states[-1]


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head (and any final logit soft-capping the family applies) on [P, H] -> [P, V]."""
    head = model.get_output_embeddings()
    logits = head(hidden.to(head.weight.device))  # [P, V] model dtype
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def scored_positions(answer_mask: Sequence[bool]) -> list[int]:
    """Positions t whose logits are scored (token t+1 is an answer token), via `data.scored_mask`."""
    from evoesap.data import scored_mask

    return [t for t, m in enumerate(scored_mask(answer_mask)) if m]


def pad_right(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D long tensors -> (input_ids [B, T], attention_mask [B, T]).

    Right padding under causal attention leaves every real token's hidden state exactly as unpadded.
    """
    length = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()] = s
        mask[row, : s.numel()] = 1
    return ids, mask


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------------------
# Writing


class _ShardWriter:
    """Parquet shards of about SHARD_BYTES each, written batch by batch (never the whole cache in RAM)."""

    def __init__(self, root: Path, schema: pa.Schema, rows_per_shard: int) -> None:
        self.root, self.schema, self.rows_per_shard = root, schema, max(1, rows_per_shard)
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self.shards: list[str] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0

    def write(self, table: pa.Table) -> None:
        start = 0
        while start < table.num_rows:
            if self._writer is None or self._rows >= self.rows_per_shard:
                self._roll()
            take = min(table.num_rows - start, self.rows_per_shard - self._rows)
            self._writer.write_table(table.slice(start, take))
            self._rows += take
            start += take

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.close()
        name = f"{SHARD_DIR}/part-{len(self.shards):05d}.parquet"
        self.shards.append(name)
        self._writer = pq.ParquetWriter(self.root / name, self.schema)
        self._rows = 0

    def close(self) -> None:
        if self._writer is None:  # no scored position at all: still write an empty shard
            self._roll()
        self._writer.close()


def _fixed_list(values: np.ndarray, pa_type: pa.DataType) -> pa.Array:
    """[N, W] numpy -> fixed_size_list<pa_type>[W] without a Python object per value."""
    n, width = values.shape
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=pa_type), width)


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
) -> CacheMeta:
    """Run the full model once over `tokenized` and write the cache into the local directory `out_dir`."""
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
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if mode == "topk" and not (top_k and 1 <= top_k <= vocab):
        raise ConfigError(f"top_k must be in 1..{vocab} for mode 'topk', got {top_k}")
    torch_dtype, pa_dtype = DTYPES[dtype]
    out_dir = Path(out_dir)
    id_type = _id_type(tokenized)

    width = vocab if mode == "full" else 2 * top_k
    rows_per_shard = shard_bytes // max(1, width * torch_dtype.itemsize)
    fields = [("sample_id", id_type), ("position", pa.int32()), ("target", pa.int32())]
    if mode == "full":
        fields.append(("logprobs", pa.list_(pa_dtype, vocab)))
    else:
        fields += [
            ("topk_ids", pa.list_(pa.int32(), top_k)),
            ("topk_logprobs", pa.list_(pa_dtype, top_k)),
            ("tail_mass", pa.float32()),
        ]
    writer = _ShardWriter(out_dir, pa.schema(fields), rows_per_shard)

    device = model_device(model)
    scored = [scored_positions(s.answer_mask) for s in tokenized]
    empty = sum(1 for p in scored if not p)
    if empty:
        log.warning("%d of %d samples have no scored position (answer truncated?); they are not cached", empty, len(tokenized))
    keep = [i for i, p in enumerate(scored) if p]
    if not keep:
        raise DataError("no sample has a scored position: check the answer masks and max_length")
    total = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in progress(range(0, len(keep), batch_size), desc="teacher", unit="batch"):
                chunk = keep[start : start + batch_size]
                total += _write_batch(model, tokenized, scored, chunk, writer, mode, top_k, torch_dtype, device, id_type)
    finally:
        model.train(was_training)
        writer.close()

    kept = [tokenized[i] for i in keep]
    samples = pa.table(
        {
            "sample_id": pa.array([s.sample_id for s in kept], type=id_type),
            "input_ids": pa.array([list(map(int, s.input_ids)) for s in kept], type=pa.list_(pa.int32())),
            "answer_mask": pa.array([[bool(m) for m in s.answer_mask] for s in kept], type=pa.list_(pa.bool_())),
        }
    )
    pq.write_table(samples, out_dir / SAMPLES_FILE)
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


def _write_batch(
    model: torch.nn.Module,
    tokenized: Sequence[TokenizedLike],
    scored: list[list[int]],
    chunk: list[int],
    writer: _ShardWriter,
    mode: str,
    top_k: int | None,
    torch_dtype: torch.dtype,
    device: torch.device,
    id_type: pa.DataType,
) -> int:
    seqs = [torch.as_tensor(list(tokenized[i].input_ids), dtype=torch.long) for i in chunk]
    input_ids, attention_mask = pad_right(seqs)
    rows = torch.cat([torch.full((len(scored[i]),), r, dtype=torch.long) for r, i in enumerate(chunk)])  # [P]
    pos = torch.cat([torch.as_tensor(scored[i], dtype=torch.long) for i in chunk])  # [P]
    hidden = final_hidden(model, input_ids.to(device), attention_mask.to(device))  # [B, T, H]
    logits = head_logits(model, hidden[rows.to(device), pos.to(device)])  # [P, V] model dtype
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, V] float32
    targets = input_ids[rows, pos + 1]  # [P] long: the token each scored position predicts

    columns: dict[str, pa.Array] = {
        "sample_id": pa.array([tokenized[i].sample_id for i in chunk for _ in scored[i]], type=id_type),
        "position": pa.array(pos.numpy().astype(np.int32)),
        "target": pa.array(targets.numpy().astype(np.int32)),
    }
    if mode == "full":
        columns["logprobs"] = _fixed_list(logprobs.to(torch_dtype).cpu().numpy(), writer.schema.field("logprobs").type.value_type)
    else:
        top_lp, top_ids = logprobs.topk(top_k, dim=-1)  # [P, K] float32, [P, K] long
        tail = logprobs.exp().scatter(-1, top_ids, 0.0).sum(dim=-1)  # [P] float32, summed over the tail itself
        columns["topk_ids"] = _fixed_list(top_ids.to(torch.int32).cpu().numpy(), pa.int32())
        columns["topk_logprobs"] = _fixed_list(
            top_lp.to(torch_dtype).cpu().numpy(), writer.schema.field("topk_logprobs").type.value_type
        )
        columns["tail_mass"] = pa.array(tail.cpu().numpy())
    writer.write(pa.table(columns, schema=writer.schema))
    return int(pos.numel())


# --------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass
class TeacherCache:
    """A loaded cache: rows grouped by sample in cache order (`offsets[i]:offsets[i+1]` is sample i).

    Log-probabilities stay in their stored dtype (float16 halves memory); fitness upcasts per batch.
    """

    meta: CacheMeta
    sample_ids: list[Any]  # [S]
    input_ids: list[torch.Tensor]  # S x [T_i] long
    offsets: torch.Tensor  # [S + 1] long
    positions: torch.Tensor  # [P] long
    targets: torch.Tensor  # [P] long
    logprobs: torch.Tensor | None = None  # [P, V] (mode full)
    topk_ids: torch.Tensor | None = None  # [P, K] long (mode topk)
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

    def to(self, device: torch.device | str) -> "TeacherCache":
        """The teacher columns moved to `device` once (not per candidate)."""
        moved = {
            name: (getattr(self, name).to(device) if getattr(self, name) is not None else None)
            for name in ("positions", "targets", "logprobs", "topk_ids", "topk_logprobs", "tail_mass")
        }
        return dataclasses.replace(self, **moved)

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


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array read from Arrow (read-only; never written, so no copy is made)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


def _column_2d(table: pa.Table, name: str) -> np.ndarray:
    """A list column of equal widths -> [N, W] numpy, via the flat child array (no per-row objects)."""
    col = table.column(name).combine_chunks()
    width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
    flat = col.flatten().to_numpy(zero_copy_only=False)
    if width is None:
        width = flat.size // max(1, len(col))
    return flat.reshape(len(col), width)


def load_cache(uri: str) -> TeacherCache:
    """Read a teacher cache from a local path or any fsspec URI."""
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
            raise ArtifactError(f"{artifacts.redact(uri)}/{META_FILE} is malformed ({exc}): rebuild it with "
                                "`evoesap cache-logits`") from None
        missing = [s for s in meta.shards if not (Path(root) / s).exists()]
        if missing or not (Path(root) / SAMPLES_FILE).exists():
            raise ArtifactError(
                f"teacher cache {artifacts.redact(uri)} is incomplete (missing {missing or SAMPLES_FILE}): rebuild it"
            )
        samples = pq.read_table(Path(root) / SAMPLES_FILE)
        table = pa.concat_tables([pq.read_table(Path(root) / s) for s in meta.shards])
    return _from_tables(meta, samples, table)


def _from_tables(meta: CacheMeta, samples: pa.Table, table: pa.Table) -> TeacherCache:
    sample_ids = samples.column("sample_id").to_pylist()
    index = {sid: i for i, sid in enumerate(sample_ids)}
    row_sample = np.array([index[s] for s in table.column("sample_id").to_pylist()], dtype=np.int64)  # [P]
    position = table.column("position").to_numpy().astype(np.int64)  # [P]
    order = np.lexsort((position, row_sample))
    in_order = bool(np.all(order == np.arange(len(order))))
    take = (lambda a: a) if in_order else (lambda a: a[order])
    counts = np.bincount(row_sample, minlength=len(sample_ids))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    input_ids = [torch.as_tensor(np.asarray(ids, dtype=np.int64)) for ids in samples.column("input_ids").to_pylist()]
    cols: dict[str, torch.Tensor] = {}
    if meta.mode == "full":
        cols["logprobs"] = _tensor(np.ascontiguousarray(take(_column_2d(table, "logprobs"))))
    else:
        cols["topk_ids"] = torch.from_numpy(take(_column_2d(table, "topk_ids")).astype(np.int64))
        cols["topk_logprobs"] = _tensor(np.ascontiguousarray(take(_column_2d(table, "topk_logprobs"))))
        cols["tail_mass"] = torch.from_numpy(take(table.column("tail_mass").to_numpy()).astype(np.float32))
    if len(sample_ids) != meta.num_samples or int(offsets[-1]) != meta.num_positions:
        raise ArtifactError("teacher cache rows do not match cache.json counts: the cache is corrupt, rebuild it")
    return TeacherCache(
        meta=meta,
        sample_ids=sample_ids,
        input_ids=input_ids,
        offsets=torch.from_numpy(offsets),
        positions=torch.from_numpy(take(position)),
        targets=torch.from_numpy(take(table.column("target").to_numpy().astype(np.int64))),
        **cols,
    )


def iter_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices grouped into batches of similar length (longest first), to waste little on padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]
