"""lm-eval task resolution, local-task evaluation against an independent log-likelihood computation, memory figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evoesap import records
from evoesap.demo.tokenizer import build_tokenizer
from evoesap.errors import ConfigError
from evoesap.evaluation import lmeval
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.store import artifacts

ROWS = [
    {"q": "1+1", "a": "2", "choices": ["2", "3"], "label": 0},
    {"q": "2+2", "a": "4", "choices": ["5", "4"], "label": 1},
    {"q": "3+3", "a": "6", "choices": ["6", "7", "8"], "label": 0},
    {"q": "4+1", "a": "5", "choices": ["9", "5"], "label": 1},
]


def write_tasks(root: Path) -> Path:
    """A task directory: one multiple-choice and one generate_until exact-match task over the same JSONL."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\ntag: arith\n"
    (root / "mc.yaml").write_text(
        "task: arith_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "q: {{q}} a:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n"
    )
    (root / "gen.yaml").write_text(
        "task: arith_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "q: {{q}} a:"\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 3\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return root


def tiny_olmoe(tokenizer) -> torch.nn.Module:
    from evoesap import moe

    return moe.tiny_model("olmoe", seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).eval()


def independent_mc_accuracy(model, tokenizer) -> tuple[float, float]:
    """acc and acc_norm from summed continuation log-probabilities, computed here without lm-eval."""
    acc, acc_norm = [], []
    for row in ROWS:
        context = tokenizer(f"q: {row['q']} a:", add_special_tokens=False).input_ids
        scores, normed = [], []
        for choice in row["choices"]:
            cont = tokenizer(f" {choice}", add_special_tokens=False).input_ids
            ids = torch.tensor([context + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V] float32
            positions = range(len(context) - 1, len(context) + len(cont) - 1)
            total = sum(float(logp[t, tok]) for t, tok in zip(positions, cont))
            scores.append(total)
            normed.append(total / len(f" {choice}".encode()))
        acc.append(max(range(len(scores)), key=scores.__getitem__) == row["label"])
        acc_norm.append(max(range(len(normed)), key=normed.__getitem__) == row["label"])
    return sum(acc) / len(acc), sum(acc_norm) / len(acc_norm)


def test_every_named_suite_task_resolves_in_lm_eval_index():
    from lm_eval.tasks import TaskManager

    plan = lmeval.resolve_tasks(list(lmeval.SUITES), allow_code_execution=True)
    index = TaskManager().task_index  # independent of the plan's own manager
    expected = [name for suite in lmeval.SUITES.values() for name in suite.tasks]
    assert [r.name for r in plan.requests] == expected
    assert all(name in index for name in expected)
    assert lmeval.MATH500_TASK in index and index[lmeval.MATH500_TASK].cfg["dataset_path"] == "HuggingFaceH4/MATH-500"
    assert {r.name: r.chat_template for r in plan.requests}["gsm8k"] is True
    assert {r.name: r.chat_template for r in plan.requests}["hellaswag"] is False


def test_code_suite_refused_without_permission():
    with pytest.raises(ConfigError, match="allow_code_execution"):
        lmeval.resolve_tasks(["mc", "code"])


def test_unknown_task_name_suggests_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'hellaswag'"):
        lmeval.resolve_tasks(["hellaswg"])
    with pytest.raises(ConfigError, match="did you mean 'math'"):
        lmeval.resolve_tasks(["mth"])


def test_missing_task_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        lmeval.resolve_tasks([str(tmp_path / "nope")])


def test_local_directory_tasks_are_discovered_with_their_tag_as_domain(tmp_path):
    plan = lmeval.resolve_tasks([str(write_tasks(tmp_path / "tasks"))])
    by_name = {r.name: r for r in plan.requests}
    assert set(by_name) == {"arith_mc", "arith_gen"}
    assert not by_name["arith_gen"].chat_template and not by_name["arith_mc"].chat_template  # local tasks write their own prompts
    assert {r.domain for r in plan.requests} == {"arith"}


def test_lm_eval_on_local_tasks_matches_independent_loglikelihood(tmp_path):
    tokenizer = build_tokenizer()
    model = tiny_olmoe(tokenizer)
    plan = lmeval.resolve_tasks([str(write_tasks(tmp_path / "tasks"))])
    records, raw = lmeval.run_lm_eval(model, tokenizer, plan, batch_size=2)
    by_key = {(r.task, r.metric): r for r in records}
    acc, acc_norm = independent_mc_accuracy(model, tokenizer)
    assert by_key[("arith_mc", "acc")].value == pytest.approx(acc)
    assert by_key[("arith_mc", "acc_norm")].value == pytest.approx(acc_norm)
    assert by_key[("arith_mc", "acc_norm")].primary and not by_key[("arith_mc", "acc")].primary
    assert by_key[("arith_mc", "acc")].samples == len(ROWS)
    gen = by_key[("arith_gen", "exact_match")]
    assert gen.primary and 0.0 <= gen.value <= 1.0 and gen.stderr is not None
    assert set(raw["results"]) == {"arith_mc", "arith_gen"}


def test_run_evaluate_writes_metrics_json(tmp_path):
    from evoesap import moe

    tokenizer = build_tokenizer()
    model = tiny_olmoe(tokenizer)
    checkpoint = tmp_path / "model"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    tasks = write_tasks(tmp_path / "tasks")
    params = EvaluateParams(
        tasks=(str(tasks),),
        limit=3,
        batch_size=2,
        model_dtype="float32",
        device="cpu",
        criterion="reap",
        sparsity=0.5,
        method="uniform",
    )
    manifest = run_evaluate(str(checkpoint), params, str(tmp_path / "eval"))
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert records.read(str(tmp_path / "eval"), records.MetricsRecord).to_json() == metrics
    assert manifest.files["metrics.json"] == artifacts.sha256_file(tmp_path / "eval" / "metrics.json")
    assert metrics["labels"] == {"criterion": "reap", "sparsity": 0.5, "method": "uniform"}
    assert {(r["task"], r["metric"]) for r in metrics["records"]} >= {("arith_mc", "acc"), ("arith_gen", "exact_match")}
    for record in metrics["records"]:
        assert set(record) == {"task", "domain", "metric", "filter", "value", "stderr", "samples", "primary"}
        assert record["samples"] == 3
    spec = moe.inspect(model)
    assert metrics["experts"]["num_experts"] == list(spec.num_experts)
    assert metrics["memory"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert metrics["memory"]["bf16_bytes"] == 2 * metrics["memory"]["parameters"]


def test_limit_validated_before_any_model_is_loaded(tmp_path):
    with pytest.raises(ConfigError, match="limit"):
        EvaluateParams(tasks=("mc",), limit=0)
    with pytest.raises(ConfigError, match="does not exist"):
        run_evaluate(str(tmp_path / "no-model"), EvaluateParams(tasks=(str(tmp_path / "none"),)), str(tmp_path / "o"))


PRUNED = {0: [0, 3], 1: [1], 2: [], 3: [2, 4, 5]}


def test_pruned_parameter_bytes_are_full_minus_removed_experts_exactly():
    from evoesap import moe

    full = moe.tiny_model("olmoe", seed=1)
    before = lmeval.memory_footprint(full)
    per_expert = moe.expert_bytes(full)
    pruned = moe.prune_experts(moe.tiny_model("olmoe", seed=1), PRUNED)
    after = lmeval.memory_footprint(pruned)
    removed = sum(len(PRUNED[layer]) * per_expert[layer] for layer in PRUNED)
    assert removed > 0
    assert after.parameter_bytes == before.parameter_bytes - removed
    # float32 tiny models: the bf16 load size is exactly half of what they hold
    assert after.bf16_bytes * 2 == after.parameter_bytes
    assert lmeval.expert_counts(pruned).num_experts == tuple(
        n - len(PRUNED[i]) for i, n in enumerate(moe.inspect(full).num_experts)
    )


def test_heldout_esap_of_a_pruned_checkpoint_equals_masking_the_full_model(tmp_path):
    from evoesap import moe
    from evoesap.data import TokenizedSample
    from evoesap.scoring import teacher
    from evoesap.scoring.evaluator import CandidateEvaluator

    full = moe.tiny_model("olmoe", seed=2)
    gen = torch.Generator().manual_seed(0)
    samples = [
        TokenizedSample(i, torch.randint(3, 256, (12,), generator=gen).tolist(), [False] * 5 + [True] * 7) for i in range(4)
    ]
    teacher.write_cache(full, samples, tmp_path / "cache", mode="full", dtype="float32", batch_size=2)
    masked_score = CandidateEvaluator(full, str(tmp_path / "cache")).score(PRUNED)
    pruned = moe.prune_experts(moe.tiny_model("olmoe", seed=2), PRUNED)
    result = lmeval.heldout_esap(pruned, None, str(tmp_path / "cache"), batch_size=2)
    assert result.samples == 4
    assert result.esap == pytest.approx(masked_score, abs=1e-5)
    assert result.esap < 1.0


def test_evaluate_cli_reports_a_missing_task_directory_as_one_error(tmp_path, capsys):
    from evoesap import moe
    from evoesap.cli import main

    moe.tiny_model("olmoe").save_pretrained(tmp_path / "model")  # a checkpoint that passes its own checks
    code = main(
        ["evaluate", "--model", str(tmp_path / "model"), "--tasks", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]
    )
    assert code == 1
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ vLLM tensor / pipeline parallel


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"tensor_parallel": 2}, "not 'hf': pass backend vllm"),
        ({"backend": "vllm", "pipeline_parallel": 0}, "pipeline_parallel must be a positive integer"),
    ],
)
def test_parallel_settings_that_cannot_apply_are_refused(settings, problem):
    from evoesap.stages.evaluate import EvaluateParams

    with pytest.raises(ConfigError, match=problem):
        EvaluateParams(**settings)


def test_a_split_over_more_gpus_than_the_machine_shows_is_refused_before_work(tiny_artifacts, monkeypatch):
    from evoesap.machine import bounds
    from evoesap.stages.evaluate import EvaluateParams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    bounds.check_stage(EvaluateParams(backend="vllm", tensor_parallel=2), tiny_artifacts["model"])  # fits
    with pytest.raises(ConfigError, match=r"= 4 GPUs, but this machine shows 2: lower it to at most 2"):
        bounds.check_stage(EvaluateParams(backend="vllm", tensor_parallel=2, pipeline_parallel=2), tiny_artifacts["model"])


@pytest.mark.parametrize(
    ("tensor", "pipeline", "expected"),
    [
        (1, 1, {}),
        (4, 1, {"tensor_parallel_size": 4, "pipeline_parallel_size": 1}),
        (2, 3, {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}),
    ],
)
def test_vllm_engine_is_asked_for_the_split(tensor, pipeline, expected, tiny_artifacts, monkeypatch):
    from evoesap.evaluation import lmeval, vllm_eval

    asked = []

    def simple_evaluate(python, model_args, *args, **kwargs):
        asked.append(model_args)
        raise StopIteration  # the request is what this test reads

    monkeypatch.setattr(vllm_eval, "vllm_python", lambda: "python")
    monkeypatch.setattr(vllm_eval, "simple_evaluate", simple_evaluate)
    plan = lmeval.resolve_tasks((tiny_artifacts["tasks"],))
    with pytest.raises(StopIteration):
        lmeval.run_lm_eval(
            tiny_artifacts["model"], None, plan, backend="vllm", tensor_parallel=tensor, pipeline_parallel=pipeline
        )
    assert {k: v for k, v in asked[0].items() if k.endswith("_parallel_size")} == expected


def test_a_pipeline_gives_the_evaluate_task_the_gpus_its_split_spans(tmp_path):
    from evoesap.pipeline.config import load_config

    base = {
        "model": "org/model",
        "calibration_data": "c.jsonl",
        "search_data": "s.jsonl",
        "storage_root": str(tmp_path / "runs"),
        "evaluate": {"backend": "vllm", "tensor_parallel": 2},
    }
    with pytest.raises(ConfigError, match=r"evaluate: .* spans 2 GPUs but resources.evaluate.accelerator_count is 0"):
        load_config(base)
    gpus = {"evaluate": {"accelerator_type": "nvidia.com/gpu", "accelerator_count": 2}}
    assert load_config({**base, "resources": gpus}).parsed_params("evaluate").gpus() == 2


def test_a_quantized_checkpoint_for_vllm_on_the_cpu_is_refused_before_any_work(tiny_quantized, tmp_path, monkeypatch):
    from venv_support import venv_python

    monkeypatch.setenv("EVOESAP_VLLM_PYTHON", venv_python("EVOESAP_VLLM_PYTHON", ".venv-vllm", "vllm-venv", "vLLM", "vllm"))
    params = EvaluateParams(tasks=(tiny_quantized["tasks"],), backend="vllm", device="cpu")
    with pytest.raises(ConfigError, match=r"is quantized \(compressed-tensors\) and vLLM's CPU build .*backend hf"):
        run_evaluate(tiny_quantized["quantized"], params, str(tmp_path / "eval"))
    assert not list(tmp_path.iterdir())


def test_held_out_esap_runs_on_a_quantized_checkpoint_and_stays_near_the_pruned_models(tiny_quantized):
    from evoesap import moe
    from evoesap.machine import runtime

    q = tiny_quantized
    tokenizer = moe.load_tokenizer(q["pruned"])
    esap = {
        k: lmeval.heldout_esap(runtime.load_model(q[k], device="cpu"), tokenizer, q["cache"]).esap
        for k in ("pruned", "quantized")
    }
    assert 0 < esap["quantized"] <= 1 and abs(esap["quantized"] - esap["pruned"]) < 0.05, esap  # fp8: close, not equal
    assert esap["quantized"] != esap["pruned"]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings (Linux)")
def test_the_evaluated_checkpoint_is_unmapped_when_the_stage_returns(tiny_quantized, tmp_path):
    """Loading a quantized checkpoint leaves objects in reference cycles that map its weights: without a collection
    when the stage ends, the mapping (memory, and disk space once the file is deleted) stays in a process that runs
    more stages, as the chaos harness's stage process does."""
    import gc

    checkpoint = tiny_quantized["quantized"]
    params = EvaluateParams(tasks=(str(write_tasks(tmp_path / "tasks")),), limit=2, batch_size=2, device="cpu")
    gc.disable()  # only the stage's own collection may free them
    try:
        run_evaluate(checkpoint, params, str(tmp_path / "eval"))
        mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    finally:
        gc.enable()
    assert [m for m in mapped if m.startswith(str(Path(checkpoint).resolve()))] == []
