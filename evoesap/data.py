"""Calibration and search samples: loading, chat-template tokenisation, answer masks, batching.

Samples come from a local file or any fsspec URI (JSONL, JSON, Parquet, CSV) or a datasets hub name.
A sample is a chat (`messages`: (role, content) pairs; prompt/response fields become one user and one
assistant turn) or plain `text` (corpora like C4), where every token counts as an answer token.

Answer masks mark exactly what the model produces in each assistant turn: the turn's content plus the
token(s) that end the turn in the chat template (`<|im_end|>`, eos, `</s>`, `<|end|>`/`<|return|>`...),
not the role header: a speculative draft must propose the end of turn too, since the target generates it.
Content is found by character spans, which works with any chat template, including those without
`{% generation %}` markers: the conversation is rendered once to text; for each assistant turn the
conversation before it is rendered with the generation prompt, so the search for that turn's content
starts after its header (content that also appears in a prompt or a role name cannot be mistaken for it);
tokens whose offset span overlaps a content span are answer tokens (a token that merges a separator into
the content's first characters counts). The end of a turn is the first special token after its content,
with any whitespace tokens between them; a template that writes no special token there (only text, or the
next turn's text) has no end-of-turn token to score. This needs a tokenizer with offset mappings (every
"fast" tokenizer).

Without a chat template, chats are rendered as plain lines `"{Role}: {content}\\n"` (`User: ...`,
`Assistant: ...`) with the tokenizer's own special tokens (BOS) added; the newline ends an assistant turn.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from evoesap.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# Bounds of one sample, checked before it is parsed or tokenised (every sample is cut to max_length tokens, and the
# longest contexts are ~10^6 characters): a runaway export cannot fill host memory or render for minutes.
MAX_LINE_BYTES = 16 << 20  # one JSONL line as stored
MAX_SAMPLE_CHARS = 4 << 20  # the text, or the chat's contents together
MAX_TURNS = 1024  # messages in one chat (rendering is quadratic in them)
_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Which source fields hold a sample: `text` wins, then `prompt`+`response`, else `messages`."""

    messages: str = "messages"  # list of {"role", "content"} (or ShareGPT {"from", "value"})
    prompt: str | None = None  # user turn, with `response` as the assistant turn
    response: str | None = None
    text: str | None = None  # plain text: every token is an answer token

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.response is None):
            raise ConfigError(f"prompt and response fields go together, got prompt={self.prompt!r} response={self.response!r}")
        if self.text is not None and self.prompt is not None:
            raise ConfigError(f"set either a text field ({self.text!r}) or prompt/response fields, not both")

    @property
    def mode(self) -> str:
        return "text" if self.text is not None else "pair" if self.prompt is not None else "messages"

    @property
    def needed(self) -> tuple[str, ...]:
        return {"text": (self.text,), "pair": (self.prompt, self.response), "messages": (self.messages,)}[self.mode]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample; `id` is its row index in the source, stable across seeds and sample counts."""

    id: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    sample_id: int
    input_ids: list[int]
    answer_mask: list[bool]  # True on assistant content and its end-of-turn token(s) (all tokens for text samples)


@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    answer_mask: torch.Tensor  # [B, T] bool, False on padding
    sample_ids: list[int]


# ---------------------------------------------------------------- loading


def load_samples(
    source: str,
    *,
    split: str = "train",
    subset: str | None = None,
    fields: FieldMap = FieldMap(),
    n: int | None = None,
    seed: int = 0,
    at_most: bool = False,
) -> list[Sample]:
    """`n` samples drawn without replacement by a seeded permutation (all, in file order, when `n` is None).

    The first `n` of a seed's permutation are taken, so a smaller `n` selects a subset of a larger one.
    A source with fewer than `n` rows is refused, unless `at_most` (`n` is a default, not the user's ask):
    then all its rows are used, with a warning.
    """
    if n is not None and n < 1:
        raise ConfigError(f"number of samples must be at least 1, got {n}")
    fmt = _file_format(source)
    if fmt is not None:
        if subset is not None:
            raise ConfigError(f"subset {subset!r} applies to hub datasets only, not to the file {source}")
        rows = _FileRows(source, fmt, split)
    else:
        from evoesap.store.identity import check_local_or_hub

        check_local_or_hub(source)  # a mistyped path is not sent to the hub
        rows = _HubRows(source, split, subset)
    missing = [f for f in fields.needed if f not in rows.columns]
    if missing:
        raise DataError(
            f"field {missing[0]!r} not found in {source}; available fields: {', '.join(rows.columns) or '(none)'}; "
            "choose the messages, prompt/response or text field accordingly"
        )
    total = len(rows)
    if total == 0:
        raise DataError(f"{source} has no rows")
    if n is None:
        order = np.arange(total)
    elif n > total and not at_most:
        raise DataError(f"asked for {n} samples but {source} has only {total}; lower the number of samples")
    else:
        if n > total:
            log.warning("%s has %d rows, fewer than the default of %d samples: using all of them", source, total, n)
        order = np.random.default_rng(seed).permutation(total)[:n]
    samples = [_to_sample(int(i), row, fields, source) for i, row in zip(order, rows.take(order))]
    log.info("selected %d of %d samples from %s (seed %d)", len(samples), total, source, seed)
    return samples


def _file_format(source: str) -> str | None:
    name = str(source).lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(suffix)
    return next((fmt for ext, fmt in _FORMATS.items() if name.endswith(ext)), None)


class _FileRows:
    """Rows of a local or remote file, read through fsspec into one pyarrow table."""

    def __init__(self, source: str, fmt: str, split: str) -> None:
        import fsspec

        from evoesap.store.identity import refuse_special

        if "://" not in source:
            refuse_special(source, fix="give a data file")
        try:
            with fsspec.open(source, "rb", compression="infer") as f:
                raw, lines = (b"", _jsonl_rows(f, source)) if fmt == "jsonl" else (f.read(), [])
        except FileNotFoundError as exc:
            raise DataError(f"data file {source} does not exist") from exc
        except IsADirectoryError:
            raise DataError(f"{source} is a directory, not a {fmt} file: give the data file itself") from None
        if fmt in ("parquet", "csv"):
            import pyarrow as pa
            import pyarrow.csv as pcsv
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(io.BytesIO(raw)) if fmt == "parquet" else pcsv.read_csv(io.BytesIO(raw))
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"{source} is not a readable {fmt} file ({exc}): check or re-export it") from None
            self._rows = table.to_pylist()
        elif fmt == "jsonl":
            self._rows = lines
        else:
            from evoesap.store.jsontext import loads

            data = loads(_text(raw, source), source, DataError)
            self._rows = _json_records(data, split, source)
        if not all(isinstance(r, Mapping) for r in self._rows):
            raise DataError(f"{source}: every row must be an object with named fields")
        self.columns = list(dict.fromkeys(k for r in self._rows for k in r))

    def __len__(self) -> int:
        return len(self._rows)

    def take(self, order: np.ndarray) -> list[Mapping[str, Any]]:
        return [self._rows[i] for i in order]


def _text(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{source} line {line} (byte {exc.start}) is not UTF-8 text: re-encode the file as UTF-8") from None


def _jsonl_rows(f: Any, source: str) -> list[Any]:
    """The records of a JSONL file, read in chunks, each line at most `MAX_LINE_BYTES`: a longer line is refused by
    its number, never held whole."""
    rows: list[Any] = []
    number, offset, pending = 0, 0, b""
    while True:
        chunk = f.read(_CHUNK_BYTES)
        *lines, pending = (pending + chunk).split(b"\n") if chunk else [pending, b""]
        for line in lines:
            number += 1
            _check_line(len(line), source, number)
            if line.strip():
                rows.append(_json_line(_line_text(line, source, number, offset), number, source))
            offset += len(line) + 1
        _check_line(len(pending), source, number + 1)
        if not chunk:
            return rows


def _check_line(size: int, source: str, number: int) -> None:
    if size > MAX_LINE_BYTES:
        raise DataError(
            f"{source} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB, the most one sample may take: split or drop it"
        )


def _line_text(line: bytes, source: str, number: int, offset: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{source} line {number} (byte {offset + exc.start}) is not UTF-8 text: re-encode the file as UTF-8"
        ) from None


def _json_line(line: str, number: int, source: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{source} line {number} column {exc.colno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise DataError(f"{source} line {number}: JSON nested too deeply to read (more than about a thousand levels)") from None


def _json_records(data: Any, split: str, source: str) -> list[Any]:
    """A JSON file holds a list of records, or an object whose `split` (or only list) value is one."""
    if isinstance(data, list):
        return data
    if isinstance(data, Mapping):
        if isinstance(data.get(split), list):
            return data[split]
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) == 1:
            return data[lists[0]]
        raise DataError(f"{source}: JSON object has no list under split {split!r}; keys with lists: {lists}")
    raise DataError(f"{source}: expected a JSON list of records, got {type(data).__name__}")


class _HubRows:
    """Rows of a datasets hub dataset (needs network or a populated datasets cache)."""

    def __init__(self, name: str, split: str, subset: str | None) -> None:
        import datasets

        from evoesap.store.identity import hub_model

        repo, revision = hub_model(name) or (name, None)  # `org/name@revision` pins a branch, tag or commit
        try:
            self._ds = datasets.load_dataset(repo, subset, split=split, revision=revision)
        except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; all mean "cannot load"
            raise DataError(
                f"cannot load {name!r} (split {split!r}, subset {subset!r}): {exc}; a local file needs a "
                f"{'/'.join(sorted(_FORMATS))} extension"
            ) from exc
        self.columns = list(self._ds.column_names)

    def __len__(self) -> int:
        return len(self._ds)

    def take(self, order: np.ndarray) -> list[Mapping[str, Any]]:
        return list(self._ds.select(order.tolist()))


def _to_sample(index: int, row: Mapping[str, Any], fields: FieldMap, source: str) -> Sample:
    where = f"{source} row {index}"
    absent = [f for f in fields.needed if f not in row]
    if absent:
        raise DataError(
            f"{where} has no field {absent[0]!r} (it has {', '.join(map(str, row)) or 'none'}): "
            "fix or drop the row, or choose the field with the messages/prompt/response/text options"
        )
    if fields.mode == "text":
        text = row[fields.text]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: field {fields.text!r} is empty; every sample needs text")
        _check_size(len(text), where)
        return Sample(id=index, text=text)
    if fields.mode == "pair":
        prompt, response = row[fields.prompt], row[fields.response]
        messages = (("user", _content(prompt, fields.prompt, where)), ("assistant", _content(response, fields.response, where)))
    else:
        messages = _messages(row[fields.messages], fields.messages, where)
    _check_size(sum(len(content) for _, content in messages), where)
    if not any(role == "assistant" and content.strip() for role, content in messages):
        raise DataError(f"{where}: empty answer (no assistant turn with content); drop the row or fix the field mapping")
    return Sample(id=index, messages=messages)


def _check_size(chars: int, where: str) -> None:
    if chars > MAX_SAMPLE_CHARS:
        raise DataError(
            f"{where}: {chars} characters, more than the {MAX_SAMPLE_CHARS} a sample may have (it is cut to "
            "max_length tokens anyway): shorten or drop it"
        )


def _content(value: Any, field: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _messages(value: Any, field: str, where: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):  # CSV and some exports store the list as JSON text
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise DataError(f"{where}: field {field!r} is a string but not a JSON list of messages") from None
    if not isinstance(value, Sequence) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages, got {value!r:.80}")
    if len(value) > MAX_TURNS:
        raise DataError(f"{where}: {len(value)} messages, more than the {MAX_TURNS} a chat may have: split or drop it")
    out = []
    for m in value:
        if isinstance(m, Mapping) and "role" in m and "content" in m:
            out.append((str(m["role"]), _content(m["content"], f"{field}.content", where)))
        elif isinstance(m, Mapping) and "from" in m and "value" in m:
            out.append((_SHAREGPT_ROLES.get(m["from"], str(m["from"])), _content(m["value"], f"{field}.value", where)))
        else:
            raise DataError(f"{where}: each message needs 'role' and 'content' (or 'from' and 'value'), got {m!r:.80}")
    return tuple(out)


# ---------------------------------------------------------------- tokenising


def tokenize_samples(
    samples: Iterable[Sample],
    tokenizer: Any,
    *,
    max_length: int,
    enable_thinking: bool = False,
    pack: bool = False,
) -> list[TokenizedSample]:
    """Token ids and answer masks, truncated to `max_length` (kept from the start).

    With `pack`, samples are concatenated in order (untruncated) and cut into sequences of `max_length`
    tokens (the last may be shorter); attention then crosses sample boundaries, `sample_id` is the packed
    sequence's index, and a sequence may hold no answer token (it still counts for calibration).
    Without `pack`, a sample whose truncation leaves no scored position is an error.
    """
    if max_length < 2:
        raise ConfigError(f"max_length must be at least 2 (one context token, one target), got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{type(tokenizer).__name__} has no offset mapping; answer masks need a fast tokenizer")
    encoded = [(s.id, *encode_sample(s, tokenizer, enable_thinking)) for s in samples]
    if pack:
        ids = [t for _, i, _ in encoded for t in i]
        mask = [a for _, _, m in encoded for a in m]
        return [
            TokenizedSample(k, ids[start : start + max_length], mask[start : start + max_length])
            for k, start in enumerate(range(0, len(ids), max_length))
        ]
    out = []
    for sample_id, ids, mask in encoded:
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(scored_mask(mask)):
            raise DataError(
                f"sample {sample_id} has no answer token after truncation to {max_length} tokens; "
                "raise max_length or drop the sample"
            )
        out.append(TokenizedSample(sample_id, ids, mask))
    return out


def encode_sample(sample: Sample, tokenizer: Any, enable_thinking: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of one untruncated sample and its answer mask; the one definition of what is scored
    (calibration, search and evaluation score it, the demo model trains on it)."""
    if sample.text is not None:
        ids = tokenizer(sample.text, add_special_tokens=True)["input_ids"]
        return ids, [True] * len(ids)
    chat = bool(getattr(tokenizer, "chat_template", None))
    text, spans = _render_chat(sample, tokenizer, enable_thinking) if chat else _render_plain(sample)
    # a chat template writes its own BOS, as apply_chat_template does
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [any(a < end and b > start for start, end in spans) and b > a for a, b in offsets]
    if not any(mask):
        raise DataError(f"sample {sample.id}: the answer produced no tokens")
    if chat:
        mask = _with_turn_ends(ids, offsets, text, mask, _special_ids(tokenizer))
    return ids, mask


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens: named ones (eos, pad...) and added tokens flagged special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _with_turn_ends(
    ids: list[int], offsets: Sequence[tuple[int, int]], text: str, content: list[bool], special: set[int]
) -> list[bool]:
    """`content` plus, after each run of content tokens, the first special token and the whitespace before it."""
    mask = list(content)
    for i in range(len(ids) - 1):
        if not content[i] or content[i + 1]:
            continue
        j = i + 1
        while j < len(ids) and ids[j] not in special and not text[offsets[j][0] : offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in special:
            mask[i + 1 : j + 1] = [True] * (j - i)
    return mask


def _render_chat(sample: Sample, tokenizer: Any, enable_thinking: bool) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant contents."""
    msgs = [{"role": r, "content": c} for r, c in sample.messages]

    def render(upto: int, gen: bool) -> str | None:
        try:
            return tokenizer.apply_chat_template(
                msgs[:upto], tokenize=False, add_generation_prompt=gen, enable_thinking=enable_thinking
            )
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation; fall back below
            return None

    full = render(len(msgs), False)
    if full is None:
        raise DataError(f"sample {sample.id}: the chat template cannot render this conversation")
    spans, cursor = [], 0
    for i, (role, content) in enumerate(sample.messages):
        if role != "assistant" or not content.strip():
            continue
        for gen in (True, False):
            prefix = render(i, gen) if i else ""
            if prefix is not None and full.startswith(prefix):
                cursor = max(cursor, len(prefix))
                break
        start, found = _find(full, content, cursor)
        if start < 0:
            raise DataError(f"sample {sample.id}: assistant turn {i} not found in the rendered chat template output")
        spans.append((start, start + len(found)))
        cursor = start + len(found)
    return full, spans


def _find(text: str, content: str, cursor: int) -> tuple[int, str]:
    """Position of `content` in `text` after `cursor`, as written or as the template trimmed it."""
    for candidate in (content, content.strip(), content.strip("\n")):
        pos = text.find(candidate, cursor)
        if pos >= 0 and candidate:
            return pos, candidate
    return -1, content


def _render_plain(sample: Sample) -> tuple[str, list[tuple[int, int]]]:
    parts, spans, pos = [], [], 0
    for role, content in sample.messages:
        head = f"{role.capitalize()}: "
        if role == "assistant":  # content and the newline that ends the turn
            spans.append((pos + len(head), pos + len(head) + len(content) + 1))
        line = f"{head}{content}\n"
        parts.append(line)
        pos += len(line)
    return "".join(parts), spans


def check_vocab(tokenizer: Any, model: Any) -> None:
    """Refuse a tokenizer whose ids the model's embedding cannot look up (a mismatched pair)."""
    model_vocab = model.get_input_embeddings().num_embeddings
    tok_vocab = len(tokenizer)
    if tok_vocab > model_vocab:
        raise DataError(
            f"tokenizer has {tok_vocab} tokens but the model's embedding has {model_vocab}; "
            "use the tokenizer saved with this model"
        )


# ---------------------------------------------------------------- scoring positions and batches


def scored_mask(answer_mask: Sequence[bool] | torch.Tensor) -> Any:
    """Positions whose logits are scored: t is scored iff token t+1 is an answer token.

    The logits at t predict token t+1, so the answer mask is shifted left by one and the last position
    is never scored. (The reference applies the answer mask unshifted, scoring the logits at each answer
    token, which predict the token after it: an off-by-one.) Lists give lists, tensors [.., T] give
    tensors.
    """
    if isinstance(answer_mask, torch.Tensor):
        out = torch.zeros_like(answer_mask, dtype=torch.bool)
        out[..., :-1] = answer_mask[..., 1:].bool()
        return out
    return [bool(a) for a in answer_mask[1:]] + [False] if len(answer_mask) else []


def batches(tokenized: Sequence[TokenizedSample], batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Consecutive groups of `batch_size` samples, right-padded to the longest in the group."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    for start in range(0, len(tokenized), batch_size):
        group = tokenized[start : start + batch_size]
        width = max(len(s.input_ids) for s in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # [B, T]
        attn = torch.zeros((len(group), width), dtype=torch.long)  # [B, T]
        ans = torch.zeros((len(group), width), dtype=torch.bool)  # [B, T]
        for row, s in enumerate(group):
            n = len(s.input_ids)
            ids[row, :n] = torch.tensor(s.input_ids, dtype=torch.long)
            attn[row, :n] = 1
            ans[row, :n] = torch.tensor(s.answer_mask, dtype=torch.bool)
        yield Batch(ids, attn, ans, [s.sample_id for s in group])
