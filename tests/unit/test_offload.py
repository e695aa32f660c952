"""A model with layers offloaded by accelerate (a device_map with offloaded entries) calibrates, caches its
teacher logits and scores candidates exactly as the same model loaded whole.

On the CPU, accelerate's disk offload stands in for host offload beside a GPU: the same hooks keep an offloaded
layer's weights on the meta device and bring them in for each forward, so every place that asks a module for
its device or calls a layer's parts one by one meets what it meets on a GPU with `offload: true`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from evoesap.scoring import importance
from evoesap import moe
from evoesap.scoring import teacher
from evoesap.scoring.evaluator import CandidateEvaluator

from test_scoring_teacher import random_samples, tiny

# the embeddings, layer 0, the final norm and the head stay; layers 1-3 and the head are offloaded
OFFLOADED = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}
ALLOCATIONS = [{0: [0, 1, 2], 1: [5]}, {2: [1, 3], 3: [0, 7]}, {}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    tiny().save_pretrained(root / "model")
    whole = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    offloaded = AutoModelForCausalLM.from_pretrained(
        root / "model", device_map=OFFLOADED, offload_folder=str(root / "offload")
    ).eval()
    assert {p.device.type for p in offloaded.model.layers[2].parameters()} == {"meta"}  # the offload is real
    return whole, offloaded, random_samples(6), root


def test_calibration_scores_of_an_offloaded_model_equal_the_whole_models(models):
    whole, offloaded, samples, _ = models
    want = importance.observe(whole, samples, batch_size=4)
    got = importance.observe(offloaded, samples, batch_size=4)
    assert got.equals(want)


def test_an_offloaded_teacher_writes_the_same_cache(models):
    whole, offloaded, samples, root = models
    for name, model in (("whole", whole), ("offloaded", offloaded)):
        teacher.write_cache(model, samples, root / name, mode="full", dtype="float32", batch_size=4)
    want, got = teacher.load_cache(str(root / "whole")), teacher.load_cache(str(root / "offloaded"))
    assert got.meta == want.meta  # the model's hash included: the offloaded model hashes as the whole one
    assert all(torch.equal(a, b) for a, b in zip(got.input_ids, want.input_ids, strict=True))
    assert torch.equal(got.targets, want.targets) and torch.equal(got.logprobs, want.logprobs)


@pytest.mark.parametrize("prefix_reuse", [False, True])
def test_candidates_of_an_offloaded_model_score_as_the_whole_models(models, prefix_reuse):
    whole, offloaded, samples, root = models
    teacher.write_cache(whole, samples, root / f"cache-{prefix_reuse}", mode="full", dtype="float32", batch_size=4)
    cache = teacher.load_cache(str(root / f"cache-{prefix_reuse}"))
    budget = None if prefix_reuse else 0
    want = CandidateEvaluator(whole, cache, batch_size=4, prefix_cache_bytes=budget)
    got = CandidateEvaluator(offloaded, cache, batch_size=4, prefix_cache_bytes=budget)
    for pruned in ALLOCATIONS:
        assert got.score(pruned) == want.score(pruned)


def test_a_masked_offloaded_model_routes_as_the_masked_whole_model(models):
    whole, offloaded, samples, _ = models
    ids = torch.tensor([samples[0].input_ids])
    with torch.no_grad(), moe.masked(whole, ALLOCATIONS[0]):
        want = whole(ids).logits
    with torch.no_grad(), moe.masked(offloaded, ALLOCATIONS[0]):
        got = offloaded(ids).logits
    assert torch.equal(got, want)
