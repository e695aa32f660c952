"""benchmarks/profile_candidate.py on the CPU at test size: every part is charged time, and the FLOPs the hooks
count match the shapes the evaluator runs (computed here independently from the config)."""

from __future__ import annotations

from scripts import load_script


def _load():
    return load_script("benchmarks/profile_candidate.py")


def test_profile_splits_one_candidate_by_part(capsys, tmp_path):
    samples, length = 3, 32
    parts, info = _load().main(
        ["--samples", str(samples), "--length", str(length), "--batch-size", "2", "--json", str(tmp_path / "p.jsonl")]
    )
    by = {p.name: p for p in parts}
    for name in ("attention", "router", "experts", "norm", "head", "metric"):
        assert by[name].seconds > 0 and by[name].flop > 0 and by[name].bytes > 0, name
    assert abs(sum(p.seconds for p in parts) - info["wall_s"]) < 0.05 * info["wall_s"]
    # tiny OLMoE (gpu_search.TINY): 4 layers, hidden 64, 8 experts top-2 of 3 x 32 x 64 weights, vocabulary 512.
    # The random cache scores positions length/2 .. length-2, so each sample runs length-1 tokens and the last
    # layer's feed-forward and the head run on its length/2-1 scored rows.
    tokens, scored = samples * (length - 1), samples * (length // 2 - 1)
    assert by["experts"].flop == 2 * 2 * 3 * 32 * 64 * (3 * tokens + scored)
    assert by["router"].flop == 2 * 64 * 8 * (3 * tokens + scored)
    assert by["head"].flop == 2 * 64 * 512 * scored
    assert 0.9 < info["ffe"] <= 1.0
    assert "| experts |" in capsys.readouterr().out
    assert (tmp_path / "p.jsonl").read_text().count("\n") == 1
