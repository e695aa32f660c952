"""Quantize stage figures (docs/results/quantization.md): tiny uniform and non-uniform checkpoints x families x recipes.

For each: checkpoint bytes before and after, the stage's wall time and the worker's (load, oneshot, save),
and, for the quantized model loaded back in this venv's transformers, the agreement of its next-token
distributions with the unquantized model's (mean sum_v min(p, q), ESAP). Needs EVOESAP_QUANTIZE_PYTHON
(default: .venv-quantize/bin/python, `make quantize-venv`).

    python benchmarks/bench_quantize.py [--recipes fp8-dynamic w4a16-gptq]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

FAMILIES = {"olmoe": {}, "qwen3_moe": {"moe_intermediate_size": 128, "head_dim": 32}}


def main() -> None:
    from test_moe import nonuniform_sets

    from evoesap import moe, records
    from evoesap.demo.domains import generate_splits, write_jsonl
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.stages.quantize import QuantizeParams, run_quantize

    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", default=["fp8-dynamic", "w4a16-gptq"])
    args = parser.parse_args()
    os.environ.setdefault("EVOESAP_QUANTIZE_PYTHON", str(REPO / ".venv-quantize" / "bin" / "python"))
    tok = build_tokenizer()
    x = torch.tensor([[5 + (j * 7) % 60 for j in range(24)], [9 + (j * 5) % 50 for j in range(24)]])
    print(
        "| family | checkpoint | experts per MoE layer | recipe | bytes before | bytes after | ratio | stage s | "
        "oneshot s | loads in transformers | ESAP vs unquantized |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_jsonl(generate_splits("math", seed=0, train_size=4)["calibration"][:16], root / "calibration.jsonl")
        for family, overrides in FAMILIES.items():
            config = dict(hidden_size=128, intermediate_size=128, vocab_size=len(tok), **overrides)
            spec = moe.inspect(moe.tiny_model(family, seed=3, **config))
            uniform = {layer.ordinal: list(range(2)) for layer in spec.layers}
            for kind, pruned in (("uniform", uniform), ("non-uniform", nonuniform_sets(spec, 0))):
                source = root / f"{family}-{kind}"
                moe.save_pruned(moe.prune_experts(moe.tiny_model(family, seed=3, **config), pruned), tok, str(source))
                reference = moe.load_pruned(str(source)).eval()
                counts = [layer.num_experts for layer in moe.inspect(reference).layers]
                for recipe in args.recipes:
                    out = root / f"{family}-{kind}-{recipe}"
                    started = time.perf_counter()
                    run_quantize(
                        str(source),
                        QuantizeParams(recipe=recipe, samples=8, max_length=64),
                        str(out),
                        data=str(root / "calibration.jsonl"),
                    )
                    wall = time.perf_counter() - started
                    doc = records.read(str(out), records.QuantizationRecord)
                    try:
                        with torch.no_grad():
                            p = reference(x).logits.float().softmax(-1)
                            q = moe.load_pruned(str(out)).eval()(x).logits.float().softmax(-1)
                        loads, esap = "yes", f"{torch.minimum(p, q).sum(-1).mean().item():.3f}"
                    except Exception as exc:  # noqa: BLE001 - a figure to report, not a failure
                        loads, esap = f"no ({type(exc).__name__})", "-"
                    before, after = doc.checkpoint_bytes_before, doc.checkpoint_bytes_after
                    print(
                        f"| {family} | {kind} | {counts} | {recipe} | {before:,} | {after:,} | {before / after:.2f}x | "
                        f"{wall:.1f} | {doc.seconds['oneshot']:.1f} | {loads} | {esap} |",
                        flush=True,
                    )
    print(json.dumps({"torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
