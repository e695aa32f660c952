"""The report: its table numbers trace back to metrics.json, the plots draw the allocations and histories given."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from evoesap import artifacts
from evoesap import report as rp
from evoesap.stages.report import ReportParams, run_allocations, run_report

N = [8, 8, 8, 8]  # experts per MoE layer of the full model
ALLOCATIONS = {"uniform": [2, 2, 2, 2], "searched": [0, 2, 4, 2], "frequency": [4, 2, 2, 0]}
TASKS = {"arc_easy": "mc", "boolq": "mc", "gsm8k": "math"}


def make_metrics(method: str, values: dict[str, float], criterion=None, sparsity=None) -> dict:
    kept = [n - r for n, r in zip(N, ALLOCATIONS.get(method, [0] * len(N)))]
    records = []
    for task, value in values.items():
        records.append({"task": task, "domain": TASKS[task], "metric": "acc", "filter": "none", "value": value,
                        "stderr": 0.01, "samples": 10, "primary": True})
        records.append({"task": task, "domain": TASKS[task], "metric": "acc_raw", "filter": "none", "value": -1.0,
                        "stderr": None, "samples": 10, "primary": False})  # never in the table
    params = 1000 + 100 * sum(kept)
    return {
        "schema": 1, "model": f"mem://{method}", "records": records, "limit": None,
        "labels": {"criterion": criterion, "sparsity": sparsity, "method": method},
        "memory": {"parameters": params, "parameter_bytes": 4 * params, "bf16_bytes": 2 * params},
        "experts": {"family": "olmoe", "num_experts": kept, "top_k": [2] * len(N), "decoder_index": [0, 1, 2, 3]},
        "heldout_esap": None if method == "full" else {"esap": 0.9, "esap_upper": 0.9, "samples": 4},
    }


RUNS = {
    "full": make_metrics("full", {"arc_easy": 0.8, "boolq": 0.7, "gsm8k": 0.5}),
    "uniform": make_metrics("uniform", {"arc_easy": 0.61234, "boolq": 0.6, "gsm8k": 0.3}, "reap", 0.25),
    "searched": make_metrics("searched", {"arc_easy": 0.6, "boolq": 0.65, "gsm8k": 0.35}, "reap", 0.25),
}


def publish(uri: Path, stage: str, files: dict[str, bytes], params: dict | None = None) -> str:
    with artifacts.stage_output(str(uri), stage, params or {}, {}) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
    return str(uri)


def history_frame() -> pd.DataFrame:
    rows = []
    for gen, fits in enumerate([[0.5, 0.7, 0.6], [0.65, 0.68, 0.66], [0.9, 0.4, 0.8]]):
        for cand, fit in enumerate(fits):
            rows.append({"generation": gen, "candidate": cand, "allocation": [2, 2, 2, 2], "fitness": fit, "elite": cand == 0})
    return pd.DataFrame(rows)


def parse_table(markdown: str) -> tuple[list[str], list[list[str]]]:
    section = markdown.split("## Benchmarks", 1)[1].split("##", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return split[0], split[2:]


def number(cell: str) -> tuple[float, bool]:
    bold = cell.startswith("**")
    return float(cell.strip("*")), bold


def test_density_figure_draws_one_bar_per_layer_at_one_minus_r_over_n():
    fig = rp.density_figure({m: (ALLOCATIONS[m], N) for m in ("uniform", "frequency", "searched")}, "reap 25%")
    assert len(fig.axes) == 3
    for ax, method in zip(fig.axes, ("uniform", "frequency", "searched")):
        heights = [p.get_height() for p in ax.patches]
        assert len(heights) == len(N)
        assert heights == pytest.approx([1 - r / n for r, n in zip(ALLOCATIONS[method], N)])
        assert ax.get_xlabel() == "MoE layer"
        assert ax.get_title().startswith(method)
    assert fig.axes[0].get_ylabel() == "Expert density (1 - r/n)"


def test_search_curve_figure_plots_best_so_far_and_generation_mean():
    history = history_frame()
    fig = rp.search_curve_figure({"reap 25%": history})
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    best, mean, running = [], [], float("-inf")
    for gen in sorted(history["generation"].unique()):
        fits = history.loc[history["generation"] == gen, "fitness"].tolist()
        running = max(running, max(fits))
        best.append(running)
        mean.append(sum(fits) / len(fits))
    assert list(lines["reap 25% best"].get_ydata()) == pytest.approx(best)
    assert list(lines["reap 25% mean"].get_ydata()) == pytest.approx(mean)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Generation", "Fitness")


def test_allocations_are_read_off_expert_counts_against_the_full_model():
    groups = run_allocations(list(RUNS.values()), [])
    assert groups == {(0.25, "reap"): {"uniform": (ALLOCATIONS["uniform"], N), "searched": (ALLOCATIONS["searched"], N)}}


def test_report_table_numbers_equal_metrics_json(tmp_path):
    runs = [publish(tmp_path / m, "evaluate", {"metrics.json": json.dumps(d).encode()}) for m, d in RUNS.items()]
    buf = tmp_path / "h.parquet"
    history_frame().to_parquet(buf)
    search = publish(tmp_path / "search", "search", {"history.parquet": buf.read_bytes()}, {"criterion": "reap", "sparsity": 0.25})
    run_report(runs, ReportParams(digits=3), str(tmp_path / "report"), searches=[search])
    out = tmp_path / "report"
    assert {"report.md", "report.html", "search_curves.png", "density_reap_25.png"} <= {p.name for p in out.iterdir()}
    check_table((out / "report.md").read_text(), {m: artifacts.read_json(str(Path(u) / "metrics.json")) for m, u in zip(RUNS, runs)}, 3)
    assert "saving" in (out / "report.md").read_text().lower()


def check_table(markdown: str, by_method: dict[str, dict], digits: int) -> None:
    """Every table cell against the metrics.json values: tasks equal, averages are means, Δ = searched - uniform."""
    tol = 0.5 * 10**-digits + 1e-12
    header, rows = parse_table(markdown)
    tasks = {re.sub(r" \(.*\)$", "", h): i for i, h in enumerate(header) if h.endswith(")")}
    averages = {h[: -len(" Avg")]: i for i, h in enumerate(header) if h.endswith(" Avg")}
    seen: dict[str, dict[str, float]] = {}
    for row in rows:
        method = "full" if row[0] == "Full" else row[2]
        if method == "Δ vs uniform":
            for task, i in tasks.items():
                assert float(row[i]) == pytest.approx(seen["searched"][task] - seen["uniform"][task], abs=2 * tol)
            continue
        values = {r["task"]: r["value"] for r in by_method[method]["records"] if r["primary"]}
        domains = {r["task"]: r["domain"] for r in by_method[method]["records"]}
        seen[method] = values
        for task, i in tasks.items():
            assert number(row[i])[0] == pytest.approx(values[task], abs=tol)
        for domain, i in averages.items():
            members = [v for t, v in values.items() if domains[t] == domain]
            assert number(row[i])[0] == pytest.approx(sum(members) / len(members), abs=tol)
    for task, i in [*tasks.items()]:
        u, s = seen["uniform"][task], seen["searched"][task]
        bold = {m: number(r[i])[1] for r in rows if r[2] in ("uniform", "searched") for m in [r[2]]}
        assert bold["uniform"] == (u >= s) and bold["searched"] == (s >= u)
    assert set(seen) == set(by_method)


def test_report_cli_writes_the_report(tmp_path):
    from evoesap.cli import main

    runs = [publish(tmp_path / m, "evaluate", {"metrics.json": json.dumps(d).encode()}) for m, d in RUNS.items()]
    args = ["report", *[a for u in runs for a in ("--runs", u)], "--out", str(tmp_path / "r"), "--no-html"]
    assert main(args) == 0
    assert (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "report.html").exists()


def test_full_uniform_and_searched_tiny_models_through_lm_eval_into_the_report(tmp_path):
    """End to end on checkpoints: save full and pruned tiny OLMoEs, evaluate on local tasks, report, check every number."""
    from evoesap import moe
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.stages.evaluate import EvaluateParams, run_evaluate

    from test_evaluate import write_tasks

    tokenizer = build_tokenizer()
    tasks = str(write_tasks(tmp_path / "tasks"))
    allocations = {"full": [0, 0, 0, 0], "uniform": [4, 4, 4, 4], "searched": [2, 6, 4, 4]}
    runs = []
    for method, r in allocations.items():
        model = moe.tiny_model("olmoe", seed=3, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        if any(r):
            model = moe.prune_experts(model, {layer: list(range(n)) for layer, n in enumerate(r)})
        moe.save_pruned(model, tokenizer, str(tmp_path / f"model-{method}"))
        labels = {} if method == "full" else {"criterion": "reap", "sparsity": 0.5}
        params = EvaluateParams(tasks=(tasks,), batch_size=4, device="cpu", method=method, **labels)
        run_evaluate(str(tmp_path / f"model-{method}"), params, str(tmp_path / f"eval-{method}"))
        runs.append(str(tmp_path / f"eval-{method}"))
    run_report(runs, ReportParams(digits=4), str(tmp_path / "report"))
    by_method = {m: artifacts.read_json(str(Path(u) / "metrics.json")) for m, u in zip(allocations, runs)}
    check_table((tmp_path / "report" / "report.md").read_text(), by_method, 4)
    groups = run_allocations(list(by_method.values()), [])
    assert groups[(0.5, "reap")] == {m: (allocations[m], [8, 8, 8, 8]) for m in ("uniform", "searched")}
    full, uniform = by_method["full"]["memory"], by_method["uniform"]["memory"]
    assert uniform["parameter_bytes"] < full["parameter_bytes"]


def test_frequency_heuristic_panel_comes_from_the_search_scores(tmp_path):
    from evoesap.stages.report import _history

    rarity = {0: 1, 1: 100, 2: 2, 3: 100}  # layer 0 is rarest but keeps top_k=2; layer 2 is next
    scores = pd.DataFrame([{"layer": l, "expert": e, "frequency": f, "seer": 0.0, "ean": 0.0, "reap": 0.0, "tokens": 1}
                           for l, f in rarity.items() for e in range(8)])
    buf = tmp_path / "s.parquet"
    scores.to_parquet(buf)
    scores_uri = publish(tmp_path / "scores", "calibrate", {"scores.parquet": buf.read_bytes()})
    history_frame().to_parquet(tmp_path / "h.parquet")
    with artifacts.stage_output(str(tmp_path / "search"), "search", {"criterion": "reap", "sparsity": 0.25, "granularity": 1},
                                {"scores": scores_uri}) as staging:
        (staging / "history.parquet").write_bytes((tmp_path / "h.parquet").read_bytes())
    groups = run_allocations(list(RUNS.values()), [_history(str(tmp_path / "search"))[2]])
    assert groups[(0.25, "reap")]["frequency"] == ([6, 0, 2, 0], N)
    assert list(groups[(0.25, "reap")]) == ["uniform", "frequency", "searched"]
