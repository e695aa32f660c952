"""On the trained demo world: full, uniform-REAP-50% and searched-REAP-50% through lm-eval into the report.

The whole chain runs through the stages (calibrate on code, cache and search on math, prune, evaluate
with the world's local lm-eval tasks, report), and the report's table is checked number by number
against each run's metrics.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import check_numbers, check_page, check_summary, check_table

from evoesap import records
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.evaluate import EvaluateParams, run_evaluate
from evoesap.stages.prune import PruneParams, run_prune
from evoesap.stages.report import ReportParams, run_allocations, run_report
from evoesap.stages.search import SearchParams, run_search
from evoesap.store import artifacts

SPARSITY = 0.5
LIMIT = 8  # examples per task: a smoke run; every table cell is still a real lm-eval number
DIGITS = 3


def search_demo_world(demo_world, root: Path) -> tuple[str, str, str]:
    """(model, scores, search) of a small REAP-50% search on the demo world, as `make demo` makes its searches
    (calibrate on code, cache and search on math) with smaller settings; the artifacts under `root`."""
    model, scores, cache, search = str(demo_world.model_dir), str(root / "scores"), str(root / "cache"), str(root / "search")
    run_calibrate(
        model,
        str(demo_world.data_file("code", "calibration")),
        CalibrateParams(samples=32, max_length=256, batch_size=16, device="cpu"),
        scores,
    )
    run_cache_logits(
        model,
        str(demo_world.data_file("math", "search")),
        CacheLogitsParams(samples=32, max_length=256, batch_size=16, dtype="float32", device="cpu"),
        cache,
    )
    run_search(
        model,
        scores,
        cache,
        SearchParams(criterion="reap", sparsity=SPARSITY, population=8, elites=2, generations=3, batch_size=16, device="cpu"),
        search,
    )
    return model, scores, search


@pytest.mark.slow
def test_demo_full_uniform_and_searched_reap_50_report_equals_metrics_json(demo_world, tmp_path):
    model, scores, search = search_demo_world(demo_world, tmp_path)
    found = artifacts.read_json(artifacts.join(search, "allocation.json"))

    checkpoints = {"full": model}
    for method, allocation in (("uniform", None), ("searched", search)):
        checkpoints[method] = str(tmp_path / f"model-{method}")
        run_prune(model, scores, PruneParams(criterion="reap", sparsity=SPARSITY), checkpoints[method], allocation=allocation)

    runs = {}
    for method, checkpoint in checkpoints.items():
        labels = {} if method == "full" else {"criterion": "reap", "sparsity": SPARSITY}
        params = EvaluateParams(
            tasks=(str(demo_world.tasks_dir),), limit=LIMIT, batch_size=16, device="cpu", method=method, **labels
        )
        runs[method] = str(tmp_path / f"eval-{method}")
        run_evaluate(checkpoint, params, runs[method])
    report = tmp_path / "report"
    run_report(list(runs.values()), ReportParams(digits=DIGITS), str(report), searches=[search])

    files = {p.name for p in report.iterdir()}
    assert {"report.md", "report.html", "density_reap_50.png", "search_curves.png"} <= files, files
    by_method = {m: artifacts.read_json(str(Path(u) / "metrics.json")) for m, u in runs.items()}
    tasks = {r["task"] for r in by_method["full"]["records"] if r["primary"]}
    assert set(demo_world.generative_tasks) | set(demo_world.multiple_choice_tasks) <= tasks, tasks
    # The stage runs local tasks on their own prompts: the full model keeps the quality it was trained to.
    full_scores = {r["task"]: r["value"] for r in by_method["full"]["records"] if r["primary"]}
    assert all(full_scores[t] >= 0.75 for t in demo_world.generative_tasks), full_scores
    for metrics in by_method.values():
        assert all(r["samples"] == LIMIT for r in metrics["records"] if r["primary"]), metrics["records"]
    check_table((report / "report.md").read_text(), by_method, DIGITS)
    page = check_page((report / "report.html").read_text())  # self-contained, fully rendered
    check_numbers(page, by_method, DIGITS)

    # 16 experts in each of 4 MoE layers, top-2: half of the 64 go, 8 per layer uniformly
    full_counts = [16, 16, 16, 16]
    searched_r = found["searched"]["removal_counts"]
    assert found["removal_counts"] == searched_r and not found["fallback_applied"]
    check_summary(page, by_method, found, DIGITS)
    assert sum(searched_r) == 32 and all(0 <= r <= 16 - 2 for r in searched_r), searched_r
    expected = {"full": full_counts, "uniform": [8, 8, 8, 8], "searched": [16 - r for r in searched_r]}
    for method, counts in expected.items():
        assert by_method[method]["experts"]["num_experts"] == counts, (method, by_method[method]["experts"])
    for method in ("uniform", "searched"):
        pruning = artifacts.read_json(str(Path(checkpoints[method]) / "pruning.json"))
        assert [16 - len(pruning["pruned"][str(layer)]) for layer in range(4)] == expected[method]
    typed = [records.MetricsRecord.from_json(m, "metrics.json") for m in by_method.values()]
    assert run_allocations(typed, [])[(SPARSITY, "reap")] == {
        "uniform": ([8, 8, 8, 8], full_counts),
        "searched": (searched_r, full_counts),
    }
    config = artifacts.read_json(str(demo_world.model_dir / "config.json"))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    expert_bytes = (3 * hidden * inter + hidden) * 4  # gate, up and down projections and its router row, float32
    for method in ("uniform", "searched"):
        assert (
            by_method[method]["memory"]["parameter_bytes"] == by_method["full"]["memory"]["parameter_bytes"] - 32 * expert_bytes
        )
