"""The demo world's searched (non-uniform) checkpoint on vLLM with the evoesap-vllm plugin.

The checkpoint comes from our own stages, as `make demo` makes its searched checkpoints (calibrate on
code, cache and search on math, prune by the found allocation), with tiny search settings. Through the
plugin its greedy tokens equal transformers', and the demo's lm-eval tasks score the same through the
`vllm` evaluation backend as through `hf`, within one sample per task (vLLM started as from a user's
shell, so the backend's own CPU settings are what runs). Two vLLM processes in all: one for the greedy
check, one for every lm-eval task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_demo_world_report import SPARSITY, search_demo_world
from test_serving import GENERATE, VLLM_ENV, run_vllm, transformers_greedy, vllm_env, vllm_python

from evoesap import moe, records
from evoesap.demo.domains import read_jsonl
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.store import artifacts

LIMIT = 16  # examples per task: |EM_vllm - EM_hf| may differ by one of these
PROMPTS_PER_DOMAIN = 2
MAX_TOKENS = 40  # characters: past the longest demo answer (math, ~35) and its end-of-turn token


@pytest.fixture(scope="module")
def searched(demo_world, tmp_path_factory) -> Path:
    """REAP-50% checkpoint at the allocation a small search found (the demo's own stages, smaller settings)."""
    root = tmp_path_factory.mktemp("demo-searched")
    model, scores, search = search_demo_world(demo_world, root)
    run_prune(model, scores, PruneParams(criterion="reap", sparsity=SPARSITY), str(root / "model"), allocation=search)
    return root / "model"


@pytest.mark.slow
def test_demo_searched_checkpoint_generates_transformers_greedy_tokens_through_the_plugin(demo_world, searched, tmp_path):
    config = artifacts.read_json(str(searched / "config.json"))
    assert config["architectures"] == [f"{moe.NONUNIFORM_ARCHITECTURE_PREFIX}OlmoeForCausalLM"]  # the plugin's class
    reloaded = moe.load_pruned(str(searched)).eval()
    assert len(set(moe.inspect(reloaded).num_experts)) > 1  # the search made it non-uniform
    tok = moe.load_tokenizer(str(searched))
    rows = [row for d in demo_world.domains for row in read_jsonl(demo_world.data_file(d, "evaluation"))[:PROMPTS_PER_DOMAIN]]
    prompts = [
        tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=False) for row in rows
    ]
    expected = [transformers_greedy(reloaded, p, MAX_TOKENS) for p in prompts]
    assert any(tok.eos_token_id in e for e in expected)  # answers end within the window, as lm-eval's stop needs
    (tmp_path / "jobs.json").write_text(json.dumps([{"model": str(searched), "prompts": prompts, "max_tokens": MAX_TOKENS}]))
    run_vllm([str(GENERATE), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")], 600)
    result = json.loads((tmp_path / "out.json").read_text())[0]
    assert result.get("tokens") == expected, result


@pytest.mark.slow
def test_demo_searched_checkpoint_scores_the_same_through_the_vllm_and_hf_backends(demo_world, searched, tmp_path, monkeypatch):
    monkeypatch.setenv("EVOESAP_VLLM_PYTHON", vllm_python())
    # vLLM as a user's shell starts it (engine process, KV cache as the backend sizes it), bar the class cache.
    for name in VLLM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", VLLM_ENV["VLLM_CACHE_ROOT"])
    monkeypatch.setenv("PYTHONPATH", vllm_env()["PYTHONPATH"])  # this checkout's plugin
    scores = {}
    for backend in ("hf", "vllm"):
        params = EvaluateParams(tasks=(str(demo_world.tasks_dir),), limit=LIMIT, batch_size=16, device="cpu", backend=backend)
        run_evaluate(str(searched), params, str(tmp_path / backend))
        metrics = records.read(str(tmp_path / backend), records.MetricsRecord).to_json()
        assert metrics["experts"]["num_experts"] == list(moe.inspect(moe.load_pruned(str(searched))).num_experts)
        scores[backend] = {r["task"]: (r["value"], r["samples"]) for r in metrics["records"] if r["primary"]}
    tasks = set(demo_world.generative_tasks) | set(demo_world.multiple_choice_tasks)
    assert scores["hf"].keys() == scores["vllm"].keys() == tasks, scores
    for task in tasks:
        (em_hf, n_hf), (em_vllm, n_vllm) = scores["hf"][task], scores["vllm"][task]
        assert n_hf == n_vllm == LIMIT, (task, n_hf, n_vllm)
        assert abs(em_vllm - em_hf) <= 1 / LIMIT + 1e-9, (task, scores)  # within one sample
    # Half its experts gone, the searched model still answers some domains well (it forgets others):
    # agreement on wrong answers alone would show little.
    assert max(scores["hf"][t][0] for t in demo_world.generative_tasks) >= 0.75, scores
