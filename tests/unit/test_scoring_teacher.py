"""Teacher cache: rows at the right positions, Parquet round trip, top-K columns, identity checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evoesap.data import TokenizedSample, scored_mask
from evoesap.errors import ArtifactError, ConfigError
from evoesap.moe import tiny_model
from evoesap.scoring import teacher

VOCAB = 96


def tiny(seed: int = 0) -> torch.nn.Module:
    """A tiny random OLMoE (float32, 4 layers of 8 experts, top-2)."""
    return tiny_model("olmoe", seed=seed, vocab_size=VOCAB).eval()


def random_samples(n: int = 5, seed: int = 0, vocab: int = VOCAB) -> list[TokenizedSample]:
    """Prompt tokens (not answers) followed by answer tokens, lengths varying so batches are padded."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, answer = int(rng.integers(3, 12)), int(rng.integers(2, 10))
        ids = rng.integers(3, vocab, size=prompt + answer).tolist()
        out.append(TokenizedSample(i, ids, [False] * prompt + [True] * answer))
    return out


def live_logprobs(model: torch.nn.Module, sample: TokenizedSample) -> torch.Tensor:
    """Full-model log-probabilities at the sample's scored positions, from the plain forward -> [P, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([sample.input_ids])).logits[0].float()  # [T, V]
    keep = torch.tensor(scored_mask(sample.answer_mask))
    return torch.log_softmax(logits[keep], dim=-1)


def test_full_cache_round_trips_the_teacher_log_probabilities(tmp_path) -> None:
    model, samples = tiny(), random_samples()
    meta = teacher.write_cache(model, samples, tmp_path, mode="full", dtype="float32", batch_size=2)
    cache = teacher.load_cache(str(tmp_path))
    assert meta.num_positions == sum(sum(scored_mask(s.answer_mask)) for s in samples)
    assert cache.sample_ids == [s.sample_id for s in samples]
    for i, s in enumerate(samples):
        rows = cache.sample(i)
        expected_pos = [t for t in range(len(s.input_ids) - 1) if s.answer_mask[t + 1]]
        assert rows["positions"].tolist() == expected_pos
        assert rows["targets"].tolist() == [s.input_ids[t + 1] for t in expected_pos]
        assert rows["input_ids"].tolist() == s.input_ids
        torch.testing.assert_close(rows["logprobs"], live_logprobs(model, s), atol=1e-5, rtol=0)


def test_float16_cache_stores_half_precision(tmp_path) -> None:
    model, samples = tiny(), random_samples(3)
    teacher.write_cache(model, samples, tmp_path, mode="full", dtype="float16")
    cache = teacher.load_cache(str(tmp_path))
    assert cache.logprobs.dtype == torch.float16
    torch.testing.assert_close(cache.sample(0)["logprobs"].float(), live_logprobs(model, samples[0]), atol=0.01, rtol=1e-3)


def test_topk_cache_holds_the_top_tokens_and_the_tail_mass(tmp_path) -> None:
    model, samples = tiny(), random_samples()
    teacher.write_cache(model, samples, tmp_path, mode="topk", top_k=8, dtype="float32")
    cache = teacher.load_cache(str(tmp_path))
    assert cache.logprobs is None and cache.topk_ids.shape[1] == 8
    for i, s in enumerate(samples):
        rows, full = cache.sample(i), live_logprobs(model, s)
        top_lp, top_ids = full.topk(8, dim=-1)
        assert torch.equal(rows["topk_ids"], top_ids)
        torch.testing.assert_close(rows["topk_logprobs"], top_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(rows["tail_mass"], 1 - top_lp.exp().sum(-1), atol=1e-5, rtol=0)


def test_shards_split_the_rows_and_load_back_whole(tmp_path) -> None:
    model, samples = tiny(), random_samples(6)
    one = teacher.write_cache(model, samples, tmp_path / "one", mode="full", dtype="float32")
    many = teacher.write_cache(
        model, samples, tmp_path / "many", mode="full", dtype="float32", batch_size=2, shard_bytes=VOCAB * 4 * 5
    )
    assert len(one.shards) == 1 and len(many.shards) > 2
    a, b = teacher.load_cache(str(tmp_path / "one")), teacher.load_cache(str(tmp_path / "many"))
    assert torch.equal(a.offsets, b.offsets) and torch.allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_cache_metadata_pins_model_and_data(tmp_path) -> None:
    model, samples = tiny(), random_samples()
    teacher.write_cache(model, samples, tmp_path, mode="topk", top_k=4, dtype="float16")
    meta = json.loads((tmp_path / teacher.META_FILE).read_text())
    assert meta["mode"] == "topk" and meta["top_k"] == 4 and meta["vocab_size"] == VOCAB
    assert meta["model_hash"] == teacher.model_hash(model) != teacher.model_hash(tiny(seed=1))
    assert meta["data_hash"] == teacher.data_hash(samples) != teacher.data_hash(random_samples(seed=1))


def test_a_cache_from_another_model_is_refused(tmp_path) -> None:
    teacher.write_cache(tiny(seed=0), random_samples(), tmp_path, mode="full")
    cache = teacher.load_cache(str(tmp_path))
    other = tiny(seed=1)
    with pytest.raises(ArtifactError, match=r"(?s)weights.*cache-logits") as err:
        cache.check_model(other)
    assert cache.meta.model_hash[:16] in str(err.value) and teacher.model_hash(other)[:16] in str(err.value)
    cache.check_model(tiny(seed=0))  # the same weights pass


def test_a_cache_made_with_another_tokenizer_is_refused(tmp_path) -> None:
    from evoesap.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = tiny()
    teacher.write_cache(model, random_samples(), tmp_path, mode="full", tokenizer=tok)
    cache = teacher.load_cache(str(tmp_path))
    cache.check_model(model, tok)
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ArtifactError, match="tokenizer"):
        cache.check_model(model, other)


def test_bad_parameters_are_refused_before_any_forward(tmp_path) -> None:
    with pytest.raises(ConfigError, match="mode"):
        teacher.write_cache(tiny(), random_samples(), tmp_path, mode="dense")
    with pytest.raises(ConfigError, match="top_k"):
        teacher.write_cache(tiny(), random_samples(), tmp_path, mode="topk", top_k=0)


def test_incomplete_cache_is_refused(tmp_path) -> None:
    meta = teacher.write_cache(tiny(), random_samples(), tmp_path, mode="full")
    (tmp_path / meta.shards[0]).unlink()
    with pytest.raises(ArtifactError, match="incomplete"):
        teacher.load_cache(str(tmp_path))


@pytest.mark.parametrize("mode", ["full", "topk"])
def test_rows_stored_out_of_order_load_in_sample_and_position_order(tmp_path, mode) -> None:
    import pyarrow.parquet as pq

    model, samples = tiny(), random_samples(6, seed=3)
    meta = teacher.write_cache(model, samples, tmp_path, mode=mode, top_k=5, dtype="float32", batch_size=2, shard_bytes=4096)
    expected = teacher.load_cache(str(tmp_path))
    tables = [pq.read_table(tmp_path / s) for s in meta.shards]  # shuffle rows across and within the shards
    import pyarrow as pa

    whole = pa.concat_tables(tables)
    shuffled = whole.take(np.random.default_rng(0).permutation(whole.num_rows))
    start = 0
    for shard, table in zip(meta.shards, tables):
        pq.write_table(shuffled.slice(start, table.num_rows), tmp_path / shard)
        start += table.num_rows
    got = teacher.load_cache(str(tmp_path))
    for name in ("positions", "targets", "logprobs", "topk_ids", "topk_logprobs", "tail_mass"):
        want = getattr(expected, name)
        assert (want is None and getattr(got, name) is None) or torch.equal(getattr(got, name), want), name


LOAD_PROBE = """
import sys
from evoesap.scoring import teacher
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
teacher.load_cache(sys.argv[2])  # imports, thread pools and allocators warmed on a one-sample cache: the constant
open('/proc/self/clear_refs', 'w').write('5')  # restart the peak (VmHWM) from the current RSS
before = status('VmRSS:')
cache = teacher.load_cache(sys.argv[1])
held = sum(t.numel() * t.element_size() for t in (cache.logprobs, cache.topk_ids, cache.topk_logprobs) if t is not None)
print(status('VmHWM:') - before, held)
"""


def test_a_cache_loads_at_about_its_own_size(tmp_path) -> None:
    """Peak RSS growth of a process loading a cache grows by at most 1.2 bytes per byte of [P, V] columns
    (two cache sizes, so that the loader's fixed overhead cancels; whole-column copies made it 2.2)."""
    import subprocess
    import sys

    vocab = 32768
    model = tiny_model("olmoe", seed=0, vocab_size=vocab, hidden_size=32, num_hidden_layers=1).eval()
    rng = np.random.default_rng(0)
    samples = [TokenizedSample(i, rng.integers(3, vocab, 128).tolist(), [False] + [True] * 127) for i in range(20)]
    for name, n in (("warm", 1), ("half", 10), ("whole", 20)):
        teacher.write_cache(model, samples[:n], tmp_path / name, mode="full", dtype="float16", batch_size=4, shard_bytes=32 << 20)
    measured = {}
    for name in ("half", "whole"):
        probe = [sys.executable, "-c", LOAD_PROBE, str(tmp_path / name), str(tmp_path / "warm")]
        measured[name] = tuple(map(int, subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()))
    (grown_half, held_half), (grown, held) = measured["half"], measured["whole"]
    assert held == 20 * 127 * vocab * 2 == 2 * held_half
    slope = (grown - grown_half) / (held - held_half)
    assert slope <= 1.2, f"loading grew RSS by {slope:.2f} bytes per cache byte ({grown / held:.2f}x the whole cache)"


@pytest.mark.parametrize("mode", ["full", "topk"])
def test_head_chunks_of_any_size_write_the_same_cache(tmp_path, mode) -> None:
    """A byte budget of one row per head chunk gives the cache of unchunked batches (the temporaries no
    longer grow with the batch)."""
    model, samples = tiny(), random_samples(6, seed=4)
    kwargs = dict(mode=mode, top_k=7, dtype="float32", batch_size=3)
    teacher.write_cache(model, samples, tmp_path / "one", head_bytes=1, **kwargs)
    teacher.write_cache(model, samples, tmp_path / "all", head_bytes=1 << 30, **kwargs)
    one, whole = teacher.load_cache(str(tmp_path / "one")), teacher.load_cache(str(tmp_path / "all"))
    for name in ("positions", "targets", "logprobs", "topk_ids", "topk_logprobs", "tail_mass"):
        a, b = getattr(one, name), getattr(whole, name)
        assert (a is None and b is None) or torch.allclose(a.float(), b.float(), atol=1e-6), name


def test_a_failed_cache_write_closes_its_shard_so_a_full_disk_gets_its_space_back(tmp_path, monkeypatch):
    import errno
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from evoesap.scoring.teacher import _ShardWriter

    def open_files() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}

    def disk_full(self, table, row_group_size=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    schema = pa.schema([("x", pa.int32())])
    writer = _ShardWriter(tmp_path, schema, rows_per_shard=8, rows_per_group=4)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", disk_full)
    writer.write(pa.table({"x": [1, 2, 3]}, schema=schema))
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    assert not {f for f in open_files() if f.startswith(str(tmp_path))}  # the shard's descriptor is closed
