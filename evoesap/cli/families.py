"""`evoesap families`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app


@app.command("families")
def families_cmd() -> None:
    """List every MoE model_type of the installed transformers: supported, or why not.

    Example: evoesap families
    """
    from evoesap.moe.coverage import coverage, format_table

    typer.echo(format_table(coverage()))
