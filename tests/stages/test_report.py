"""The report: its table numbers trace back to metrics.json, the plots draw the allocations and histories given,
report.html is one self-contained, fully rendered page with a summary on top and the lineage at the bottom."""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from evoesap import __version__, records
from evoesap.reporting import render
from evoesap.reporting import report as rp
from evoesap.stages.report import ReportParams, run_allocations, run_report
from evoesap.store import artifacts

N = [8, 8, 8, 8]  # experts per MoE layer of the full model
ALLOCATIONS = {"uniform": [2, 2, 2, 2], "searched": [0, 2, 4, 2], "frequency": [4, 2, 2, 0]}
TASKS = {"arc_easy": "mc", "boolq": "mc", "gsm8k": "math"}


def make_metrics(method: str, values: dict[str, float], criterion=None, sparsity=None) -> dict:
    kept = [n - r for n, r in zip(N, ALLOCATIONS.get(method, [0] * len(N)))]
    records = []
    for task, value in values.items():
        records.append(
            {
                "task": task,
                "domain": TASKS[task],
                "metric": "acc",
                "filter": "none",
                "value": value,
                "stderr": 0.01,
                "samples": 10,
                "primary": True,
            }
        )
        records.append(
            {
                "task": task,
                "domain": TASKS[task],
                "metric": "acc_raw",
                "filter": "none",
                "value": -1.0,
                "stderr": None,
                "samples": 10,
                "primary": False,
            }
        )  # never in the table
    params = 1000 + 100 * sum(kept)
    return {
        "schema": 1,
        "model": f"mem://{method}",
        "records": records,
        "limit": None,
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


def typed(runs: list[dict]) -> list[records.MetricsRecord]:
    return [records.MetricsRecord.from_json(doc, "metrics.json") for doc in runs]


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
    groups = run_allocations(typed(list(RUNS.values())), [])
    assert groups == {(0.25, "reap"): {"uniform": (ALLOCATIONS["uniform"], N), "searched": (ALLOCATIONS["searched"], N)}}


def allocation_doc(beats: bool, warnings: list[str] | None) -> dict:
    """An allocation.json as the search stage writes it; `warnings` None: one written before warnings were recorded."""
    difference = 0.01223 if beats else 4.2e-6  # the stage's verdict: beyond two standard errors (0.00456) or not
    doc = {
        "criterion": "reap",
        "sparsity": 0.25,
        "metric": "esap",
        "budget": 8,
        "granularity": 1,
        "num_experts": N,
        "removal_counts": ALLOCATIONS["searched"],
        "pruned": {str(layer): list(range(r)) for layer, r in enumerate(ALLOCATIONS["searched"])},
        "searched": {"removal_counts": ALLOCATIONS["searched"], "fitness": 0.91},
        "uniform": {"removal_counts": ALLOCATIONS["uniform"], "fitness": 0.9},
        "fallback_applied": False,
        "heldout": {
            "samples": 16,
            "searched": 0.80011 + difference,
            "uniform": 0.80011,
            "difference": difference,
            "stderr": 0.00456,
            "beats_uniform": beats,
        },
    }
    return doc if warnings is None else {**doc, "warnings": warnings}


def publish_search(root: Path, doc: dict, name: str = "search", inputs: dict | None = None, params: dict | None = None) -> str:
    history_frame().to_parquet(root / f"{name}.parquet")
    files = {"history.parquet": (root / f"{name}.parquet").read_bytes(), "allocation.json": json.dumps(doc).encode()}
    with artifacts.stage_output(
        str(root / name), "search", {"criterion": "reap", "sparsity": 0.25, **(params or {})}, inputs or {}
    ) as staging:
        for file, data in files.items():
            (staging / file).write_bytes(data)
    return str(root / name)


def make_report(tmp_path: Path, doc: dict, **params) -> tuple[Path, dict[str, dict]]:
    runs = [publish(tmp_path / m, "evaluate", {"metrics.json": json.dumps(d).encode()}) for m, d in RUNS.items()]
    search = publish_search(tmp_path, doc)
    run_report(runs, ReportParams(digits=3, **params), str(tmp_path / "report"), searches=[search])
    return tmp_path / "report", {m: artifacts.read_json(str(Path(u) / "metrics.json")) for m, u in zip(RUNS, runs)}


def test_report_table_numbers_equal_metrics_json(tmp_path):
    out, by_method = make_report(tmp_path, allocation_doc(True, []))
    assert {"report.md", "report.html", "search_curves.png", "density_reap_25.png"} <= {p.name for p in out.iterdir()}
    check_table((out / "report.md").read_text(), by_method, 3)
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


def test_the_report_shows_each_target_decision_with_its_probes_and_reason(tmp_path):
    probe = lambda s, v, meets: records.Probe(  # noqa: E731
        sparsity=s, budget=int(s * 32), search=f"/s/{s}", removal_counts=(1,), fitness=v, heldout=v, stderr=0.01,
        meets=meets, samples=8,
    )  # fmt: skip
    decision = records.TargetRecord(
        criterion="reap", metric="heldout_esap", threshold=0.95, grid=(0.125, 0.25, 0.375, 0.5), max_probes=3,
        probes=(probe(0.25, 0.96, True), probe(0.375, 0.94, False)), chosen=0.25, chosen_search="/s/0.25", warm_start=False,
    )  # fmt: skip
    target = publish(tmp_path / "target", "target", {"target.json": json.dumps(decision.to_json()).encode()})
    runs = [publish(tmp_path / m, "evaluate", {"metrics.json": json.dumps(d).encode()}) for m, d in RUNS.items()]
    run_report(runs, ReportParams(), str(tmp_path / "report"), targets=[target])
    text = (tmp_path / "report" / "report.md").read_text()
    section = text[text.index("## Sparsity target") : text.index("## Summary")]
    assert "**CHOSEN:** reap: sparsity 0.2500 meets heldout_esap >= 0.95 (0.9600 +/- 0.0100)" in section
    assert "2 of the grid's 4 points probed" in section and "the next point up, 0.3750, misses (0.9400 +/- 0.0100)" in section
    assert "within the noise" in section  # 0.96 and 0.94 lie one standard error from 0.95


def test_report_cli_writes_the_report(tmp_path):
    from evoesap.cli import main

    runs = [publish(tmp_path / m, "evaluate", {"metrics.json": json.dumps(d).encode()}) for m, d in RUNS.items()]
    args = ["report", *[a for u in runs for a in ("--runs", u)], "--out", str(tmp_path / "r"), "--no-html"]
    assert main(args) == 0
    assert (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "report.html").exists()


def test_full_uniform_and_searched_tiny_models_through_lm_eval_into_the_report(tmp_path):
    """End to end on checkpoints: save full and pruned tiny OLMoEs, evaluate on local tasks, report, check every number."""
    from test_evaluate import write_tasks

    from evoesap import moe
    from evoesap.demo.tokenizer import build_tokenizer
    from evoesap.stages.evaluate import EvaluateParams, run_evaluate

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
    groups = run_allocations(typed(list(by_method.values())), [])
    assert groups[(0.5, "reap")] == {m: (allocations[m], [8, 8, 8, 8]) for m in ("uniform", "searched")}
    full, uniform = by_method["full"]["memory"], by_method["uniform"]["memory"]
    assert uniform["parameter_bytes"] < full["parameter_bytes"]


def test_frequency_heuristic_panel_comes_from_the_search_scores(tmp_path):
    from evoesap.stages.report import _history

    rarity = {0: 1, 1: 100, 2: 2, 3: 100}  # layer 0 is rarest but keeps top_k=2; layer 2 is next
    scores = pd.DataFrame(
        [
            {"layer": layer, "expert": e, "frequency": f, "seer": 0.0, "ean": 0.0, "reap": 0.0, "tokens": 1}
            for layer, f in rarity.items()
            for e in range(8)
        ]
    )
    buf = tmp_path / "s.parquet"
    scores.to_parquet(buf)
    scores_uri = publish(tmp_path / "scores", "calibrate", {"scores.parquet": buf.read_bytes()})
    history_frame().to_parquet(tmp_path / "h.parquet")
    with artifacts.stage_output(
        str(tmp_path / "search"), "search", {"criterion": "reap", "sparsity": 0.25, "granularity": 1}, {"scores": scores_uri}
    ) as staging:
        (staging / "history.parquet").write_bytes((tmp_path / "h.parquet").read_bytes())
    groups = run_allocations(typed(list(RUNS.values())), [_history(str(tmp_path / "search"))[2]])
    assert groups[(0.25, "reap")]["frequency"] == ([6, 0, 2, 0], N)
    assert list(groups[(0.25, "reap")]) == ["uniform", "frequency", "searched"]


# ---- report.html: one self-contained page, every table rendered, every number of metrics.json in a table ----

RESOURCE_ATTRS = {"src", "href", "srcset", "poster", "data", "action", "background", "xlink:href", "formaction"}


class Page(HTMLParser):
    """What a browser would fetch (resource attributes, CSS url()), the visible text, and every table's cells."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.resources: list[str] = []
        self.text: list[str] = []  # visible text outside <code>, per text node
        self.tables: list[list[list[str]]] = []  # table -> rows -> cell texts
        self.blockquotes: list[str] = []
        self._stack: list[str] = []
        self._cell: list[str] | None = None
        self._quote: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self._stack.append(tag)
        for name, value in attrs:
            if name in RESOURCE_ATTRS:
                self.resources.append(value or "")
            if name == "style":
                self.resources += re.findall(r"url\(\s*['\"]?([^'\")]*)", value or "")
        if tag in ("link", "script", "iframe", "embed", "object", "base", "use"):
            self.resources.append(f"<{tag}>")  # none of these belongs on the page, whatever it points to
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "blockquote":
            self._quote = []

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self._stack.pop()

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop() != tag:
            pass
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "blockquote" and self._quote is not None:
            self.blockquotes.append(" ".join("".join(self._quote).split()))
            self._quote = None

    def handle_data(self, data):
        if "style" in self._stack:
            self.resources += re.findall(r"url\(\s*['\"]?([^'\")]*)", data)
            return
        if self._cell is not None:
            self._cell.append(data)
        if self._quote is not None:
            self._quote.append(data)
        if "code" not in self._stack:
            self.text.append(data)

    def table(self, first_header: str, containing: str | None = None) -> list[dict[str, str]]:
        """The rows (header -> cell) of the table whose first header is `first_header` (and that has a `containing` header)."""
        for table in self.tables:
            header = table[0]
            if header[0] == first_header and (containing is None or containing in header):
                return [dict(zip(header, row)) for row in table[1:]]
        raise AssertionError(
            f"no table headed {first_header!r} (containing {containing!r}); tables: {[t[0] for t in self.tables]}"
        )


def check_page(text: str) -> Page:
    """Fails on anything a browser would fetch from elsewhere and on Markdown that reached the page unrendered."""
    page = Page(text)
    outside = [r for r in page.resources if not (r.startswith("data:") or r.startswith("#"))]
    assert not outside, f"external or relative resources: {[r[:80] for r in outside]}"
    for chunk in page.text:
        for line in chunk.splitlines():
            line = line.strip()
            assert not line.startswith(("|", "#", "![", "```")), f"unrendered Markdown line: {line!r}"
            assert not re.search(r"\*\*|__|\]\(|\|\s*-{3}|-{3}\s*\|", line), f"unrendered Markdown in: {line!r}"
    assert page.tables, "no HTML table on the page"
    return page


def run_row(metrics: dict) -> tuple[str, ...]:
    labels = metrics["labels"]
    if labels.get("method") == "full":
        return ("Full", "", "")
    return (f"{labels['sparsity']:.0%}", labels["criterion"], labels["method"])


def check_numbers(page: Page, by_method: dict[str, dict], digits: int) -> None:
    """Every primary metric, memory figure and held-out ESAP of each metrics.json sits in the run's table row."""
    bench = page.table("Sparsity", "Method")
    memory = {row["Run"]: row for row in page.table("Run")}
    for _method, metrics in by_method.items():
        label = run_row(metrics)
        rows = [r for r in bench if (r["Sparsity"], r["Criterion"], r["Method"]) == label]
        assert len(rows) == 1, (label, bench)
        for record in metrics["records"]:
            if record["primary"]:
                assert rows[0][f"{record['task']} ({record['metric']})"] == f"{record['value']:.{digits}f}", (label, record)
        mem = memory[" ".join(x for x in label if x)]
        assert mem["Parameters"] == f"{metrics['memory']['parameters']:,}"
        assert mem["Parameter bytes"] == f"{metrics['memory']['parameter_bytes']:,}"
        esap = (metrics.get("heldout_esap") or {}).get("esap")
        assert mem["Held-out ESAP"] == ("–" if esap is None else f"{esap:.4f}")


def check_summary(page: Page, by_method: dict[str, dict], doc: dict, digits: int) -> dict[str, str]:
    """The summary row of the search's setting against allocation.json and an independent task and memory computation."""
    key = (f"{doc['sparsity']:.0%}", doc["criterion"])
    rows = [r for r in page.table("Sparsity", "Task avg Δ") if (r["Sparsity"], r["Criterion"]) == key]
    assert len(rows) == 1, rows
    row, check = rows[0], doc["heldout"]
    assert (row["Searched"], row["Uniform"]) == (f"{check['searched']:.4f}", f"{check['uniform']:.4f}")
    fine = {
        k: f"{check[k]:{s}.4f}" if abs(check[k]) >= 1e-3 or check[k] == 0 else f"{check[k]:{s}.1e}"
        for k, s in (("difference", "+"), ("stderr", ""))
    }  # a held-out gap can be 1e-6: never shown as 0.0000
    assert (row["Difference"], row["Std. error"]) == (fine["difference"], fine["stderr"])
    assert row["Samples"] == str(check["samples"])
    assert row["Check (diff > 2 SE)"] == ("passed" if check["difference"] > 2 * check["stderr"] else "failed")
    assert row["Fallback to uniform"] == ("applied" if doc["fallback_applied"] else "no")
    prim = {m: {r["task"]: r["value"] for r in by_method[m]["records"] if r["primary"]} for m in ("uniform", "searched")}
    delta = sum(prim["searched"][t] - prim["uniform"][t] for t in prim["uniform"]) / len(prim["uniform"])
    assert row["Task avg Δ"] == f"{delta:+.{digits}f}"
    err = {m: {r["task"]: r["stderr"] for r in by_method[m]["records"] if r["primary"]} for m in ("uniform", "searched")}
    clear = [
        f"{t} {prim['searched'][t] - prim['uniform'][t]:+.{digits}f}"
        for t in sorted(prim["uniform"])
        if abs(prim["searched"][t] - prim["uniform"][t]) > 2 * (err["uniform"][t] ** 2 + err["searched"][t] ** 2) ** 0.5
    ]
    assert row["Tasks Δ > 2 SE"] == (", ".join(clear) or "none")
    full, pruned = by_method["full"]["memory"]["bf16_bytes"], by_method["searched"]["memory"]["bf16_bytes"]
    assert row["Memory saved vs full"].startswith(f"{1 - pruned / full:.1%} (")
    return row


@pytest.fixture(scope="module")
def passing_report(tmp_path_factory) -> tuple[Path, dict[str, dict], dict]:
    doc = allocation_doc(True, [])
    return (*make_report(tmp_path_factory.mktemp("report"), doc), doc)


def test_report_html_is_self_contained_rendered_and_holds_every_metrics_number(passing_report):
    out, by_method, doc = passing_report
    page = check_page((out / "report.html").read_text())
    check_numbers(page, by_method, 3)
    check_summary(page, by_method, doc, 3)
    pngs = {p.name: p.read_bytes() for p in out.glob("*.png")}
    embedded = [r for r in page.resources if r.startswith("data:image/png;base64,")]
    assert sorted(embedded) == sorted(render.data_uri(b) for b in pngs.values())  # every plot, and only the plots, inline
    assert not page.blockquotes  # no warning when the check passed


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("<img src='density_reap_25.png'>", "relative"),
        ("<img src='https://example.org/p.png'>", "external"),
        ("<div style=\"background: url('p.png')\"></div>", "relative"),
        ("<link rel=stylesheet href='s.css'>", "relative"),
        ("<pre>| Run | Parameters |\n|---|---|</pre>", "unrendered"),
        ("<p>**0.854**</p>", "unrendered"),
        ("<p>## Memory</p>", "unrendered"),
    ],
)
def test_page_check_refuses_outside_resources_and_unrendered_markdown(passing_report, bad, problem):
    out = passing_report[0]
    good = (out / "report.html").read_text()
    check_page(good)
    with pytest.raises(AssertionError, match=problem):
        check_page(good.replace("</main>", bad + "</main>"))


def test_number_check_fails_when_a_table_lacks_a_metrics_number(passing_report):
    out, by_method, _ = passing_report
    text = (out / "report.html").read_text()
    check_numbers(check_page(text), by_method, 3)
    dropped = text.replace(
        f'<td style="text-align:right">{RUNS["searched"]["memory"]["parameters"]:,}</td>', '<td style="text-align:right">–</td>'
    )
    assert dropped != text
    with pytest.raises(AssertionError):
        check_numbers(check_page(dropped), by_method, 3)


@pytest.mark.parametrize("recorded", [True, False], ids=["warnings-in-allocation-json", "older-allocation-json"])
def test_a_search_that_does_not_beat_uniform_is_flagged_in_summary_and_warning(tmp_path, recorded):
    warning = "searched allocation does not beat uniform on held-out samples: esap 0.8001 vs uniform 0.8001"
    doc = allocation_doc(False, [warning] if recorded else None)
    out, by_method = make_report(tmp_path, doc)
    page = check_page((out / "report.html").read_text())
    assert check_summary(page, by_method, doc, 3)["Check (diff > 2 SE)"] == "failed"
    assert len(page.blockquotes) == 1 and page.blockquotes[0].startswith("Warning, reap 25%:")
    assert "does not beat uniform on held-out samples" in page.blockquotes[0]
    assert "does not beat uniform" in (out / "report.md").read_text()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126)).filter(str.strip))
def test_text_from_artifacts_reaches_the_page_literally(text):
    """Titles, labels, URIs and warnings come from artifacts: none may turn into markup, in a paragraph or a cell."""
    renderer = MarkdownIt("commonmark", {"html": False}).enable("table")
    literal = " ".join(text.split())
    assert html.unescape(renderer.render(render.md(text))) == f"<p>{literal}</p>\n"
    table = renderer.render(f"| h | c |\n|---|---|\n| {render.cell(rp.Cell(text))} | {render.cell(rp.Cell(text, 'code'))} |\n")
    assert f"<td>{literal}</td>\n<td><code>{literal}</code></td>" in html.unescape(table)


def test_lineage_names_the_model_data_configuration_software_and_every_artifact(tmp_path):
    """Searches and runs lead through their manifests to the model directory and data file, with their content identity."""
    model, data = tmp_path / "model", tmp_path / "calibration.jsonl"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.write_text('{"text": "x"}\n')
    scores_frame = pd.DataFrame(
        [
            {"layer": layer, "expert": e, "frequency": e + 1, "seer": 0.0, "ean": 0.0, "reap": 0.0, "tokens": 1}
            for layer in range(len(N))
            for e in range(N[layer])
        ]
    )
    with artifacts.stage_output(
        str(tmp_path / "scores"), "calibrate", {"samples": 64}, {"model": str(model), "data": str(data)}
    ) as staging:
        scores_frame.to_parquet(staging / "scores.parquet")
    scores = str(tmp_path / "scores")
    search = publish_search(
        tmp_path, allocation_doc(True, []), inputs={"model": str(model), "scores": scores}, params={"population": 16}
    )
    runs = []
    for method, metrics in RUNS.items():
        with artifacts.stage_output(
            str(tmp_path / method), "evaluate", {"limit": 48, "method": method}, {"model": str(model)}
        ) as staging:
            (staging / "metrics.json").write_text(json.dumps(metrics))
        runs.append(str(tmp_path / method))
    run_report(runs, ReportParams(title="Lineage | check"), str(tmp_path / "report"), searches=[search])
    page = check_page((tmp_path / "report" / "report.html").read_text())

    sources = {row["URI"]: row for row in page.table("Input")}
    assert set(sources) == {str(model), str(data)}
    for name, path in (("model", model), ("data", data)):
        assert sources[str(path)]["Input"] == name
    data_sha = hashlib.sha256(data.read_bytes()).hexdigest()
    assert sources[str(data)]["Content identity"] == f"file, {data.stat().st_size} bytes, sha256 {data_sha[:12]}"
    assert sources[str(model)]["Content identity"].startswith("directory of 1 files, digest ")
    assert (
        sources[str(model)]["Read by"] == "evaluate (runs of report); search (searches of report); calibrate (scores of search)"
    )
    assert sources[str(data)]["Read by"] == "calibrate (scores of search)"

    config = {row["Stage"]: row["Parameters"] for row in page.table("Stage")}
    assert config["calibrate"] == "samples=64"
    assert config["evaluate"] == "limit=48, method in {full, searched, uniform}"
    assert "population=16" in config["search"] and "title=Lineage | check" in config["report (this page)"]
    software = page.table("Package version")
    assert [row["Package version"] for row in software] == [__version__]

    behind = {row["Artifact"]: row for row in page.table("Artifact")}
    assert set(behind) == {*runs, search, scores}
    for uri in (*runs, search, scores):
        assert behind[uri]["Content sha256"] == _content_by_hand(uri)
    assert behind[runs[2]]["Gives"] == "Benchmarks and Memory: 25% reap searched"
    assert behind[search]["Gives"] == "Summary and plots: reap 25%"
    assert behind[scores]["Gives"] == "scores of search (25% reap)"
    assert page.table("Sparsity", "Method")  # the title's pipe stayed text: the tables still parse
    assert "<h1>Lineage | check</h1>" in (tmp_path / "report" / "report.html").read_text()


def test_task_differences_clear_two_standard_errors_only_when_both_runs_carry_them():
    uniform, searched = typed([RUNS["uniform"], RUNS["searched"]])
    # arc_easy -0.012 is within 2 * sqrt(0.01^2 + 0.01^2) = 0.028; boolq and gsm8k +0.05 are beyond it
    assert [(t, round(d, 6)) for t, d in rp.clear_differences(uniform, searched)] == [("boolq", 0.05), ("gsm8k", 0.05)]
    bare = dataclasses.replace(searched, records=tuple(dataclasses.replace(r, stderr=None) for r in searched.records))
    assert rp.clear_differences(uniform, bare) is None
    assert rp._clear(None, 3) == "–" and rp._clear((), 3) == "none"


def _section_table(markdown: str, section: str) -> list[dict[str, str]]:
    """The first table under `## section`, as dicts keyed by its header."""
    part = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in part.splitlines() if line.startswith("|")]
    header, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return [dict(zip(header, row)) for row in rows[1:]]


def test_full_pruned_and_pruned_quantized_runs_stand_side_by_side_with_accuracy_and_checkpoint_bytes(tiny_quantized):
    q = tiny_quantized
    text = Path(q["report_quantized"], "report.md").read_text()
    runs = {k: json.loads(Path(q[k], "metrics.json").read_text()) for k in ("evaluated_full", "evaluated", "evaluated_quantized")}
    recipe = json.loads(Path(q["quantized"], "quantization.json").read_text())["recipe"]
    assert runs["evaluated_quantized"]["quantization"] == {"recipe": recipe, "scheme": "FP8_DYNAMIC"}
    assert runs["evaluated"]["quantization"] is None and runs["evaluated_full"]["quantization"] is None
    bench = {row["Method"] or row["Sparsity"]: row for row in _section_table(text, "Benchmarks")}
    assert list(bench) == ["Full", "searched", f"searched + {recipe}"]  # full, pruned, pruned+quantized: one row each
    for key, method in (("evaluated_full", "Full"), ("evaluated", "searched"), ("evaluated_quantized", f"searched + {recipe}")):
        for record in (r for r in runs[key]["records"] if r["primary"]):
            assert bench[method][f"{record['task']} ({record['metric']})"] == f"{record['value']:.3f}"
    memory = {row["Run"]: row for row in _section_table(text, "Memory")}
    stored = {  # the safetensors files on disk, summed here
        k: sum(p.stat().st_size for p in Path(src).glob("*.safetensors"))
        for k, src in (("evaluated_full", q["model"]), ("evaluated", q["pruned"]), ("evaluated_quantized", q["quantized"]))
    }
    assert stored["evaluated_quantized"] < stored["evaluated"] < stored["evaluated_full"]
    for key, run in (("evaluated_full", "Full"), ("evaluated", "– searched"), ("evaluated_quantized", f"– searched + {recipe}")):
        assert memory[run]["Checkpoint bytes"] == f"{stored[key]:,}" == f"{runs[key]['memory']['checkpoint_bytes']:,}"
        assert memory[run]["Checkpoint saving"] == f"{1 - stored[key] / stored['evaluated_full']:.1%}"


def _content_by_hand(uri: str) -> str:
    """An artifact's content identity, by its definition: the sha256 of its stage, cache key and payload files' sha256
    as sorted JSON; never its manifest's sha256, which changes when it is made again from the same bytes."""
    manifest = json.loads(Path(uri, "manifest.json").read_text())
    content = {"stage": manifest["stage"], "cache_key": manifest["cache_key"], "files": manifest["files"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
