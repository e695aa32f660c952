"""Greedy tokens from vLLM for several checkpoints in one process: run by the vLLM venv's python.

    python tests/vllm_generate.py jobs.json results.json

jobs.json: [{"model": dir, "prompts": [[token ids], ...], "max_tokens": n, "engine_args": {...}}, ...]
(engine_args optional, overriding the defaults below). Every engine starts in this one process (imports paid once; run it with
VLLM_ENABLE_V1_MULTIPROCESSING=0), eager and float32 so that tokens can equal transformers'.
results.json: one entry per job, {"tokens": [[ids], ...]} or {"error": "<type>: <message>"}: a refused
model is a result, not a crash, so the caller can assert on vLLM's own message.
"""

import gc
import json
import sys
import traceback


def generate(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        settings = dict(
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=8,
            seed=0,
            distributed_executor_backend="uni",  # no worker process: every engine shares this one
        )
        llm = LLM(model=job["model"], **{**settings, **job.get("engine_args", {})})  # a job may change any of them
    except Exception as exc:  # noqa: BLE001 (the caller asserts on the refusal message)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=2)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        return {
            "tokens": [list(out.outputs[0].token_ids) for out in outputs],
            # per generated position: {token id: logprob} of the two most likely tokens
            "top2": [[{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs] for out in outputs],
        }
    except Exception as exc:  # noqa: BLE001 (one model's failure must not hide the others' results)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        del llm
        gc.collect()


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    results = [generate(job) for job in jobs]
    with open(sys.argv[2], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":  # vLLM's engine processes re-import this file
    main()
