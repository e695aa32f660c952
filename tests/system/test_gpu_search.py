"""benchmarks/gpu_search.py at test size on the CPU: it builds both shapes, times every method, and prefix
reuse does less work than a full forward per candidate."""

from __future__ import annotations

from scripts import load_script


def _load():
    return load_script("benchmarks/gpu_search.py")


def test_gpu_search_runs_on_cpu_at_tiny_size(capsys):
    timings = _load().main(
        ["--tiny", "--device", "cpu", "--samples", "4", "--length", "32", "--children", "3", "--prefix-cache-gib", "0.01"]
    )  # one torch thread: tests/conftest.py
    methods = {(t.shape, t.method) for t in timings}
    assert methods == {(s, m) for s in ("olmoe", "qwen3") for m in ("(a) reference", "(b) exact", "(c) prefix")}
    for t in timings:
        assert t.seconds > 0 and t.candidates > 0
        if t.method == "(b) exact":  # cut after the last scored position: just under one forward
            assert 0.9 < t.ffe <= 1.0
        if t.method == "(c) prefix":  # children one step from the parent start at their first changed layer
            assert t.ffe < 0.9
    assert "| qwen3 | (c) prefix |" in capsys.readouterr().out
