"""Full-model exact match of a built demo world on every evaluation sample, with standard errors and the misses.

The scores come from lm-eval (`evoesap.demo.run_tasks(limit=None)`, what the tests and the pipeline use); the
misses from a plain greedy `generate` on the same prompts, whose count is printed beside lm-eval's as a check.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/eval_world.py .cache/demo-world [--misses code math]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evoesap.demo import load_demo_world, run_tasks, weights_hash
from evoesap.demo.domains import read_jsonl
from evoesap.machine import runtime


def greedy_misses(model, tok, rows: list[dict], batch_size: int = 32, max_new_tokens: int = 64) -> list[dict]:
    """Rows whose greedy answer (up to the end of turn) differs from the reference, with what came out."""
    misses = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in chunk]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [B, T + new]
        for row, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            text = tok.decode(ids, skip_special_tokens=False).split(tok.eos_token)[0]
            if text != row["messages"][1]["content"]:
                misses.append({"user": row["messages"][0]["content"], "want": row["messages"][1]["content"], "got": text})
    return misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("world", help="a built demo world's directory")
    parser.add_argument("--misses", nargs="*", default=[], help="generative domains whose misses to list")
    args = parser.parse_args()
    world = load_demo_world(args.world)
    tok = AutoTokenizer.from_pretrained(str(world.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(world.model_dir)).eval()
    runtime.use_cpu_threads(runtime.parameter_count(model))
    tasks = list(world.generative_tasks + world.multiple_choice_tasks)
    scores = run_tasks(model, tok, world.tasks_dir, tasks, limit=None)
    figures = {}
    for task, p in sorted(scores.items()):
        domain = task.removeprefix(world.tag + "_").removesuffix("_mc")
        n = len(read_jsonl(world.data_file(domain, "evaluation")))
        figures[task] = {"score": round(p, 4), "correct": round(p * n), "n": n, "stderr": round(math.sqrt(p * (1 - p) / n), 4)}
    info = {k: world.info.get(k) for k in ("steps", "train_seconds", "train_cpu_seconds", "final_loss", "load_average")}
    report = {"key": world.key[:12], "weights_sha256": weights_hash(world.model_dir), "info": info, "scores": figures}
    for domain in args.misses:
        misses = greedy_misses(model, tok, read_jsonl(world.data_file(domain, "evaluation")))
        report[f"misses_{domain}"] = misses
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
