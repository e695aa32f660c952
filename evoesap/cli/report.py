"""`evoesap report`."""

from __future__ import annotations

from typing import List

import typer

from evoesap.cli.app import app, echo_uri


@app.command("report")
def report_cmd(
    runs: List[str] = typer.Option(..., "--runs", help="Evaluate artifacts (repeat the option): full, uniform, searched runs."),
    out: str = typer.Option(..., "--out", help="Where to write the report artifact."),
    searches: List[str] = typer.Option([], "--searches", help="Search artifacts whose history.parquet gives the search curves."),
    title: str = typer.Option("EvoESAP report", "--title", help="Title of the report."),
    digits: int = typer.Option(3, "--digits", help="Decimals in the benchmark table."),
    html: bool = typer.Option(True, "--html/--no-html", help="Also write report.html."),
) -> None:
    """Tables like the paper's Table 2, memory savings, per-layer density plots and search curves.

    Example: evoesap report --runs runs/eval-full --runs runs/eval-uniform --runs runs/eval-searched --searches runs/search --out runs/report
    """
    from evoesap.stages.report import ReportParams
    from evoesap.steps import run_stage

    run_stage("report", {"runs": list(runs), "searches": list(searches)}, ReportParams(title=title, digits=digits, html=html), out)
    echo_uri(out)
