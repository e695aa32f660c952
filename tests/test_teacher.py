"""Teacher cache: rows at the right positions, Parquet round trip, top-K columns, identity checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evoesap import teacher
from evoesap.data import TokenizedSample, scored_mask
from evoesap.errors import ArtifactError, ConfigError
from evoesap.moe import tiny_model

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


def test_head_at_scored_positions_equals_the_model_logits() -> None:
    model = tiny()
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = teacher.final_hidden(model, ids, torch.ones_like(ids))
        torch.testing.assert_close(teacher.head_logits(model, hidden[:, [3, 9]]), model(ids).logits[:, [3, 9]])


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
    many = teacher.write_cache(model, samples, tmp_path / "many", mode="full", dtype="float32",
                               batch_size=2, shard_bytes=VOCAB * 4 * 5)
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
