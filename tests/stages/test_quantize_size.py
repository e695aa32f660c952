"""The memory target with a quantize recipe: the sparsity it picks is the least whose checkpoint, as the quantize stage
really writes it from the pruned one, fits the budget; combinations it cannot size are refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
from evoesap.pipeline.target import fitting_sparsity, searchable
from test_quantize import quantize_python

from evoesap import moe
from evoesap.demo.tokenizer import build_tokenizer
from evoesap.errors import ConfigError
from evoesap.method import allocation as alloc
from evoesap.stages.quantize import QuantizeParams, run_quantize


@pytest.fixture(autouse=True)
def _quantize_env(monkeypatch):
    monkeypatch.setenv("EVOESAP_QUANTIZE_PYTHON", quantize_python())


def _allocations(n: list[int], k: list[int], budget: int) -> list[list[int]]:
    """The uniform removal of `budget` experts and the removal packed into the first layers and into the last."""

    def packed(order: list[int]) -> list[int]:
        counts, left = [0] * len(n), budget
        for layer in order:
            counts[layer] = min(n[layer] - k[layer], left)
            left -= counts[layer]
        return counts

    return [list(alloc.uniform(n, k, budget, 1)), packed(list(range(len(n)))), packed(list(range(len(n)))[::-1])]


def _quantized(model: str, counts: list[int], root: Path, recipe: str) -> int:
    """Bytes on disk of the quantize stage's checkpoint of the pruned model (its quantization.json and manifest aside)."""
    name = "-".join(map(str, counts))
    pruned, out = root / f"p{name}", root / f"q{name}"
    if not out.exists():
        moe.prune_checkpoint(model, _pruned_sets(counts), pruned)
        run_quantize(str(pruned), QuantizeParams(recipe=recipe), str(out))
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name not in ("manifest.json", "quantization.json"))


def _pruned_sets(counts: list[int]) -> dict[int, list[int]]:
    return {layer: list(range(c)) for layer, c in enumerate(counts) if c}


@pytest.mark.slow
def test_memory_target_with_a_recipe_picks_the_least_sparsity_whose_quantized_checkpoint_fits(tmp_path):
    """The predicted size is the real one, byte for byte, for a uniform and a non-uniform checkpoint; so the point
    the target picks by predicted sizes fits as really quantized and the next-lower sparsity's does not."""
    from evoesap.planning import quantized

    model = str(tmp_path / "full")
    moe.save_pruned(moe.tiny_model("olmoe", seed=3, hidden_size=128, intermediate_size=128), build_tokenizer(), model)
    space, points = searchable(model, 1)
    n, k = list(space.num_experts), list(space.min_kept)
    at = len(points) // 2
    uniform, packed, _ = _allocations(n, k, alloc.budget(points[at], n, k, 1))
    real = [_quantized(model, counts, tmp_path, "fp8-dynamic") for counts in (uniform, packed)]
    assert quantized.quantized_bytes(model, [_pruned_sets(uniform), _pruned_sets(packed)], None, "fp8-dynamic") == real
    assert max(real) < moe.checkpoint_bytes(model, [{}])[0] / 3  # sized as quantized, far below the pruned checkpoint

    def predicted(index: int) -> int:  # the largest quantized checkpoint among the point's sized allocations
        counts = _allocations(n, k, alloc.budget(points[index], n, k, 1))
        return max(quantized.quantized_bytes(model, [_pruned_sets(c) for c in counts], None, "fp8-dynamic"))

    sizes = {i: predicted(i) for i in (at - 1, at, at + 1)}
    for budget, chosen in ((sizes[at], at), (sizes[at] - 1, at + 1), (sizes[at - 1] - 1, at)):
        assert fitting_sparsity(model, budget, 1, "auto", "fp8-dynamic") == points[chosen], budget
        assert sizes[chosen] <= budget < sizes[chosen - 1]  # it fits; the next-lower sparsity's does not


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"recipe": "w4a16-awq"}, "cannot size the checkpoint quantize.recipe 'w4a16-awq' writes"),
        ({"recipe": "fp8-dynamic", "model_dtype": "bfloat16"}, "quantize.model_dtype 'bfloat16' converts them"),
    ],
)
def test_memory_target_refuses_at_load_a_quantization_it_cannot_size(tmp_path, section, words):
    from evoesap.pipeline.config import PipelineConfig

    config = {
        "model": str(tmp_path / "m"), "calibration_data": "c.jsonl", "search_data": "s.jsonl",
        "target": {"bytes": "1GiB"}, "quantize": section,
    }  # fmt: skip
    with pytest.raises(ValueError, match=words) as refused:
        PipelineConfig.model_validate(config)
    assert str(refused.value).count("\n") <= 3  # pydantic's one error, one line of ours


def test_fitting_sparsity_refuses_a_recipe_it_cannot_size_before_reading_the_model(tmp_path):
    with pytest.raises(ConfigError, match="w4a16-awq"):
        fitting_sparsity(str(tmp_path / "absent"), "1GiB", 1, "auto", "w4a16-awq")
