"""Safetensors files read and written by byte ranges, so that no whole tensor or shard sits in memory.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape and data offsets of
each tensor) and the raw data. The safetensors library writes a file only from tensors held in memory;
streaming needs the header first, which the shapes alone determine, then each tensor's bytes copied
piece by piece from the source file (any fsspec file object: local or object store).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterable, Iterator
from typing import IO

import torch

from evoesap.errors import ArtifactError
from evoesap.store import jsontext

COPY_BYTES = 16 << 20  # one read/write step: bounds a copy's memory, not its speed
HEADER_LIMIT = 100 << 20  # a header larger than this is not a safetensors file
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
FLOATS = ("F64", "F32", "F16", "BF16")  # the dtypes a dtype change converts; others are copied as they are
NAMES = {v: k for k, v in DTYPES.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype string (F8_* and other unlisted ones: 1 byte unless known)."""
    if dtype in DTYPES:
        return DTYPES[dtype].itemsize
    if dtype.startswith("F8") or dtype in ("U8", "I8"):
        return 1
    raise ArtifactError(f"safetensors dtype {dtype!r} is not supported by streaming prune")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape and where its bytes lie (from the data start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(f: IO[bytes]) -> tuple[int, dict[str, Entry], dict[str, str]]:
    """(data start, tensors by name, file metadata) of an open safetensors file."""
    f.seek(0)
    raw = f.read(8)
    if len(raw) != 8:
        raise ArtifactError("not a safetensors file: shorter than its 8-byte header length")
    (size,) = struct.unpack("<Q", raw)
    if size > HEADER_LIMIT:
        raise ArtifactError(f"not a safetensors file: header length {size} is implausible")
    header = jsontext.loads(f.read(size), "not a safetensors file: its header")
    metadata = header.pop("__metadata__", None) or {}
    entries = {name: Entry(name, info["dtype"], tuple(info["shape"]), *info["data_offsets"]) for name, info in header.items()}
    return 8 + size, entries, metadata


@dataclasses.dataclass(frozen=True)
class Planned:
    """One tensor to write: its name, dtype and shape, and the pieces of the source it is made from.

    `ranges` are byte ranges of the source file (absolute), concatenated in order; `convert` is the
    source dtype when the bytes must change dtype on the way; `gather` (axis, ids) selects along an
    axis other than 0 (the whole tensor is then read: only small tensors are indexed that way).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    convert: str | None = None
    gather: tuple[int, tuple[int, ...]] | None = None
    source_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def write_file(out: IO[bytes], source: IO[bytes], tensors: Iterable[Planned], metadata: dict[str, str]) -> int:
    """Write a safetensors file of `tensors` into `out`, reading their bytes from `source`; returns bytes of data."""
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes it
    out.write(struct.pack("<Q", len(text)))
    out.write(text)
    for t in tensors:
        written = 0
        for chunk in _pieces(source, t):
            out.write(chunk)
            written += len(chunk)
        if written != t.nbytes:
            raise ArtifactError(f"tensor {t.name}: wrote {written} bytes, expected {t.nbytes}")
    return offset


def _read(source: IO[bytes], begin: int, end: int, step: int) -> Iterator[bytes]:
    source.seek(begin)
    while begin < end:
        chunk = source.read(min(step, end - begin))
        if not chunk:
            raise ArtifactError(f"safetensors file ends at byte {begin}, before its tensor's end {end}")
        begin += len(chunk)
        yield chunk


def _pieces(source: IO[bytes], t: Planned) -> Iterator[bytes]:
    """The bytes of `t`, at most about COPY_BYTES at a time (one whole tensor when gathering)."""
    if t.gather is not None:
        data = b"".join(chunk for a, b in t.ranges for chunk in _read(source, a, b, COPY_BYTES))
        src_dtype = DTYPES[t.convert or t.dtype]
        tensor = torch.frombuffer(bytearray(data), dtype=src_dtype).reshape(t.source_shape)
        axis, ids = t.gather
        tensor = tensor.index_select(axis, torch.tensor(ids, dtype=torch.long)).to(DTYPES[t.dtype]).contiguous()
        yield tensor.view(torch.uint8).numpy().tobytes()
        return
    step = COPY_BYTES - COPY_BYTES % 8  # a whole number of elements of every dtype
    for begin, end in t.ranges:
        for chunk in _read(source, begin, end, step):
            if t.convert is None:
                yield chunk
            else:
                values = torch.frombuffer(bytearray(chunk), dtype=DTYPES[t.convert]).to(DTYPES[t.dtype])
                yield values.view(torch.uint8).numpy().tobytes()
