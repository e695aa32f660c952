"""A tiny random OLMoE with the demo tokenizer and demo data: stage and pipeline tests without training."""

import sys
from pathlib import Path
from typing import Any

from evoesap import moe
from evoesap.demo.domains import generate_splits, write_jsonl
from evoesap.demo.tasks import write_tasks
from evoesap.demo.tokenizer import build_tokenizer


def make_tiny_inputs(root: Path, family: str = "olmoe") -> dict[str, str]:
    """Model directory (with tokenizer), calibration / search / held-out JSONL files and a local lm-eval task."""
    tok = build_tokenizer()
    model = moe.tiny_model(family, seed=3, vocab_size=len(tok))
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    splits = generate_splits("math", seed=0, train_size=4)
    write_jsonl(splits["calibration"][:16], root / "calibration.jsonl")
    write_jsonl(splits["search"][:12], root / "search.jsonl")
    write_jsonl(splits["evaluation"][:12], root / "heldout.jsonl")
    write_tasks(root / "tasks", {"math": root / "heldout.jsonl"}, tok, multiple_choice=(), max_gen_toks=8)
    return {
        "model": str(model_dir),
        "calibration": str(root / "calibration.jsonl"),
        "search": str(root / "search.jsonl"),
        "heldout": str(root / "heldout.jsonl"),
        "tasks": str(root / "tasks"),
    }


def quick_world_config(root: Path) -> Path:
    """config.json alone, of the quick demo world's shape (2 MoE layers of 4 experts, top-2): all that the
    pipeline's feasibility check reads. At 50% sparsity it admits one allocation, so nothing to search."""
    from transformers import OlmoeConfig

    OlmoeConfig(
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    ).save_pretrained(root)
    return root


# The search settings a command line states (the rest keep their defaults); racing and prefix reuse are flags.
_SEARCH_OPTIONS = (
    "criterion",
    "sparsity",
    "population",
    "elites",
    "generations",
    "workers",
    "racing_mode",
    "racing_delta",
    "racing_tolerance",
    "racing_schedule",
    "racing_min_samples",
    "racing_min_positions",
)


def search_command(inputs: dict[str, str], out: str, params: Any) -> list[str]:
    """`python -m evoesap -q search ...` over `inputs` (model, scores, cache) with `params` (a SearchParams)."""
    args = [sys.executable, "-m", "evoesap", "-q", "search"]
    args += ["--model", inputs["model"], "--scores", inputs["scores"], "--cache", inputs["cache"], "--out", str(out)]
    for key in _SEARCH_OPTIONS:
        args += [f"--{key.replace('_', '-')}", str(getattr(params, key))]
    return args + ["--racing"] * params.racing + ([] if params.prefix_reuse else ["--no-prefix-reuse"])
