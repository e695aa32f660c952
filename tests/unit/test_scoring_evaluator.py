"""CandidateEvaluator against live computations from the full model (independent of the cache path)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_scoring_teacher import VOCAB, random_samples, tiny

from evoesap.data import TokenizedSample, scored_mask
from evoesap.errors import ArtifactError, ConfigError
from evoesap.scoring import teacher
from evoesap.scoring.evaluator import CandidateEvaluator, read_pruned

PRUNED = {0: [0, 1, 2], 1: [5]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, its samples and its float32 full and top-K caches, built once."""
    root = tmp_path_factory.mktemp("world")
    model, samples = tiny(), random_samples(6)
    teacher.write_cache(model, samples, root / "full", mode="full", dtype="float32", batch_size=4)
    teacher.write_cache(model, samples, root / "topk", mode="topk", top_k=8, dtype="float32", batch_size=4)
    return model, samples, teacher.load_cache(str(root / "full")), teacher.load_cache(str(root / "topk"))


def live(model, samples, pruned, per_position) -> float:
    """Reference path: full logits of the unmasked and masked model at every position, one sample at a time,
    the scored mask applied afterwards; mean over samples of per-sample means."""
    from evoesap.moe import masked

    means = []
    for s in samples:
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            p_logits = model(ids).logits[0].double()  # [T, V]
            with masked(model, pruned):
                q_logits = model(ids).logits[0].double()
        keep = torch.tensor(scored_mask(s.answer_mask))
        targets = torch.tensor(s.input_ids[1:] + [0])
        values = per_position(p_logits.log_softmax(-1)[keep], q_logits.log_softmax(-1)[keep], targets[keep])
        means.append(values.mean())
    return float(torch.stack(means).mean())


def tv_esap(log_p, log_q, _targets):
    return 1.0 - 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def test_unpruned_model_scores_one_against_its_own_cache(world) -> None:
    model, _, full, _ = world
    assert abs(CandidateEvaluator(model, full).score({}) - 1.0) < 1e-4


@pytest.mark.parametrize("pruned", [PRUNED, {0: [3, 4, 6, 7]}, {1: [0, 1, 2, 3]}])
def test_esap_through_the_cache_matches_the_live_teacher(world, pruned) -> None:
    model, samples, full, _ = world
    got = CandidateEvaluator(model, full, batch_size=4).score(pruned)
    want = live(model, samples, pruned, tv_esap)
    assert want < 0.999  # the allocation changes the model, so the check means something
    assert abs(got - want) < 1e-4


def test_kl_and_nll_match_live_and_are_negated_as_fitness(world) -> None:
    model, samples, full, _ = world
    kl_live = live(model, samples, PRUNED, lambda lp, lq, _t: (lp.exp() * (lp - lq)).sum(-1))
    nll_live = live(model, samples, PRUNED, lambda _lp, lq, t: -lq.gather(-1, t[:, None])[:, 0])
    assert abs(CandidateEvaluator(model, full, metric="kl").score(PRUNED) + kl_live) < 1e-4
    assert abs(CandidateEvaluator(model, full, metric="nll").score(PRUNED) + nll_live) < 1e-4


def test_sap_is_seeded_and_close_to_esap(world) -> None:
    model, _, full, _ = world
    a = CandidateEvaluator(model, full, metric="sap", seed=3).score(PRUNED)
    b = CandidateEvaluator(model, full, metric="sap", seed=3).score(PRUNED)
    assert a == b and 0.0 < a <= 1.0
    assert abs(CandidateEvaluator(model, full, metric="sap", seed=3).score({}) - 1.0) < 1e-4


def test_topk_cache_bounds_contain_the_full_cache_value(world) -> None:
    model, _, full, topk = world
    exact = CandidateEvaluator(model, full).sample_values(PRUNED)
    scorer = CandidateEvaluator(model, topk)
    lower, upper = scorer.sample_bounds(PRUNED)
    assert bool((lower <= exact + 1e-6).all()) and bool((exact <= upper + 1e-6).all())
    lo, up = scorer.bounds(PRUNED)
    assert scorer.score(PRUNED) == lo < up


def test_scores_are_memoised_and_subsets_reuse_them(world) -> None:
    model, _, full, _ = world
    scorer = CandidateEvaluator(model, full, batch_size=2)
    part = scorer.score(PRUNED, samples=[1, 4])
    assert scorer.forwards == 2
    whole = scorer.sample_values(PRUNED)
    assert scorer.forwards == 6  # only the four missing samples ran
    assert abs(part - float(whole[[1, 4]].double().mean())) < 1e-7
    scorer.score({0: [2, 1, 0], 1: [5]})  # the same allocation in another order
    assert scorer.forwards == 6


def test_batch_size_does_not_change_the_score(world) -> None:
    model, _, full, _ = world
    one = CandidateEvaluator(model, full, batch_size=1).sample_values(PRUNED)
    many = CandidateEvaluator(model, full, batch_size=6).sample_values(PRUNED)
    torch.testing.assert_close(one, many, atol=1e-5, rtol=0)


@contextlib.contextmanager
def perturbed_at(model, position: int):
    """The candidate differs from the teacher only in the logits at `position` (the last decoder layer's attention
    output nudged there; the evaluator runs that layer's feed-forward and the final norm on scored rows only)."""
    last = model.model.layers[-1].self_attn

    def hook(_module, _inputs, out):
        hidden, *rest = out
        if position >= hidden.shape[1]:  # the evaluator cut the sample before `position`
            return out
        hidden = hidden.clone()
        hidden[:, position] += torch.linspace(-3.0, 3.0, hidden.shape[-1])
        return (hidden, *rest)

    handle = last.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_only_scored_positions_count(tmp_path) -> None:
    """Answer tokens at 6..9: the logits at 5 predict the first answer token (scored); the logits at 9, after
    the last answer token, predict a non-answer token (not scored, though an unshifted mask would score them)."""
    model = tiny()
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    sample = TokenizedSample(0, ids, [False] * 6 + [True] * 4 + [False] * 2)
    teacher.write_cache(model, [sample], tmp_path, mode="full", dtype="float32")
    cache = teacher.load_cache(str(tmp_path))
    assert cache.positions.tolist() == [5, 6, 7, 8]
    with perturbed_at(model, 5):
        first = CandidateEvaluator(model, cache).score({})
    with perturbed_at(model, 9):
        after_last = CandidateEvaluator(model, cache).score({})
    assert first < 0.99
    assert abs(after_last - 1.0) < 1e-6


def test_a_cache_from_another_model_is_refused(world) -> None:
    _, _, full, _ = world
    with pytest.raises(ArtifactError, match="cache-logits"):
        CandidateEvaluator(tiny(seed=1), full)


def test_metrics_needing_the_full_vocabulary_refuse_a_topk_cache(world) -> None:
    model, _, _, topk = world
    with pytest.raises(ConfigError, match="mode full"):
        CandidateEvaluator(model, topk, metric="kl")
    CandidateEvaluator(model, topk, metric="nll")


def test_allocation_file_format(tmp_path) -> None:
    (tmp_path / "allocation.json").write_text('{"pruned": {"0": [1, 2], "3": []}, "r": [2, 0]}')
    assert read_pruned(str(tmp_path / "allocation.json")) == {0: [1, 2], 3: []}
    assert read_pruned(str(tmp_path)) == {0: [1, 2], 3: []}
    (tmp_path / "bad.json").write_text('{"r": [2, 0]}')
    with pytest.raises(ConfigError, match="pruned"):
        read_pruned(str(tmp_path / "bad.json"))


def test_cli_caches_then_scores_an_allocation(tmp_path, capsys) -> None:
    from evoesap.cli import main
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.moe import save_pruned, tiny_model

    tok = build_tokenizer()
    save_pruned(tiny_model("olmoe", seed=0, vocab_size=len(tok)), tok, str(tmp_path / "model"))
    rows = [
        {"messages": [{"role": "user", "content": f"add {i} and {i + 2}"}, {"role": "assistant", "content": f"{2 * i + 2}"}]}
        for i in range(8)
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows))
    (tmp_path / "alloc.json").write_text('{"pruned": {"0": [0, 1, 2, 3], "2": [4, 5]}}')
    common = ["--model", str(tmp_path / "model")]
    assert (
        main(
            [
                "cache-logits",
                *common,
                "--data",
                str(tmp_path / "data.jsonl"),
                "--out",
                str(tmp_path / "cache"),
                "--samples",
                "6",
                "--max-length",
                "64",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["esap", *common, "--cache", str(tmp_path / "cache")]) == 0
    assert abs(float(capsys.readouterr().out.split()[0]) - 1.0) < 1e-4
    assert main(["esap", *common, "--cache", str(tmp_path / "cache"), "--allocation", str(tmp_path / "alloc.json")]) == 0
    assert float(capsys.readouterr().out.split()[0]) < 0.999
    # a mode outside the declared choices is a usage error (exit 2) that lists them, before anything loads
    assert (
        main(["cache-logits", *common, "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "c2"), "--mode", "dense"])
        == 2
    )
    assert "'dense' is not one of 'full', 'topk'" in capsys.readouterr().err
    assert not (tmp_path / "c2").exists()


@pytest.mark.parametrize("metric", ["esap", "nll"])
@pytest.mark.parametrize("prefix", [0, 1 << 24])
def test_floor_returns_the_exact_fitness_or_a_bound_below_it(world, metric, prefix) -> None:
    model, samples, full, _ = world
    make = lambda: CandidateEvaluator(model, full, metric=metric, batch_size=2, prefix_cache_bytes=prefix)  # noqa: E731
    plain = make()
    exact = plain.score(PRUNED)
    reachable = make()
    assert reachable.score(PRUNED, floor=exact - 1e-3) == exact  # reachable: every batch runs, the same value
    assert reachable.forwards == plain.forwards == len(samples)
    best = 1.0 if metric == "esap" else 0.0  # the metric's best per-sample fitness: bounds unscored samples
    for floor in (best + 0.5, exact + 1e-6):
        stopped = make()
        bound = stopped.score(PRUNED, floor=floor)
        assert exact <= bound < floor
        if floor > best:  # nothing can reach it: the bound of no sample scored, nothing run
            assert bound == best and stopped.forwards == 0
        assert abs(stopped.score(PRUNED) - exact) < 1e-6  # finishing later gives the value
        assert stopped.forwards == len(samples)  # the samples already scored are not run again
    partial = make()  # two samples known already (a racing level) settle a floor above their bound at once
    known = partial.score(PRUNED, samples=[0, 1]) * 2
    settled = (known + (len(samples) - 2) * best) / len(samples)
    assert partial.score(PRUNED, floor=settled + 1e-9) == pytest.approx(settled, abs=1e-12)
    assert partial.forwards == 2 and settled >= exact
