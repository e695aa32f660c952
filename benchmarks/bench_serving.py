"""Decode throughput on vLLM of a non-uniformly pruned model against its full model, same run, same engine settings.

Builds a small random OLMoE (our tiny factory at a larger width), prunes it non-uniformly with our
surgery, then times greedy generation of both checkpoints in one vLLM process (the vLLM venv's
python, EVOESAP_VLLM_PYTHON or .venv-vllm), the full model through stock vLLM and the pruned one
through the evoesap-vllm plugin. Each round times both, in alternating order; the best round counts.

    EVOESAP_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_serving.py \
        [--hidden 256 --experts 32 --sparsity 0.5 --prompts 16 --tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(root: Path, args: argparse.Namespace) -> tuple[Path, Path, list[int]]:
    """Full and non-uniformly pruned checkpoints: layer l loses a share of experts rising with l."""
    import numpy as np

    from evoesap import moe
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.method import allocation

    tok = build_tokenizer()
    model = moe.tiny_model(
        "olmoe", vocab_size=len(tok), hidden_size=args.hidden, num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 32, num_experts=args.experts, num_experts_per_tok=args.top_k,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers, max_position_embeddings=512,
    )  # fmt: skip
    spec = moe.inspect(model)
    budget = allocation.budget(args.sparsity, spec.num_experts, spec.top_k)
    weights = np.arange(1, len(spec.layers) + 1, dtype=float)
    removed = np.minimum(np.floor(budget * weights / weights.sum()).astype(int), args.experts - args.top_k)
    removed[-1] += budget - removed.sum()  # the last layer takes the rounding remainder
    pruned_sets = {i: list(range(int(r))) for i, r in enumerate(removed)}
    full, pruned = root / "full", root / "pruned"
    moe.save_pruned(model, tok, str(full))
    moe.save_pruned(moe.prune_experts(model, pruned_sets), tok, str(pruned))
    return full, pruned, [args.experts - int(r) for r in removed]


def engine_side(jobs_file: str, out_file: str) -> None:
    """Runs in the vLLM venv: tokens/s of each checkpoint, rounds alternating the order."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(jobs_file).read_text())
    llms = {name: LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                      distributed_executor_backend="uni") for name, path in job["models"].items()}  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=[5 + (i * 7 + j) % 60 for j in range(16)]) for i in range(job["prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    best = {name: 0.0 for name in llms}
    for round_ in range(job["rounds"]):
        order = list(llms) if round_ % 2 == 0 else list(reversed(llms))
        for name in order:
            start = time.perf_counter()
            outputs = llms[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            best[name] = max(best[name], tokens / elapsed)
    Path(out_file).write_text(json.dumps(best))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    python = os.environ.get("EVOESAP_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        full, pruned, counts = build(Path(tmp), args)
        job = {"models": {"full": str(full), "pruned": str(pruned)}, "prompts": args.prompts,
               "tokens": args.tokens, "rounds": args.rounds}  # fmt: skip
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        subprocess.run([python, __file__, "--engine", str(Path(tmp) / "job.json"), str(Path(tmp) / "out.json")],
                       env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        best = json.loads((Path(tmp) / "out.json").read_text())
    print(f"experts per layer: full {[args.experts] * args.layers}, pruned {counts}")
    print(f"tokens/s (best of {args.rounds}): full {best['full']:.1f}, pruned {best['pruned']:.1f}")
    print(f"pruned / full: {best['pruned'] / best['full']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        engine_side(sys.argv[2], sys.argv[3])
    else:
        main()
