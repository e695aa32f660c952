"""`evoesap prune`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, echo_uri, revision_option
from evoesap.identity import pin


@app.command("prune")
def prune_cmd(
    model: str = typer.Option(..., "--model", help="Full model: path, URI or hub name."),
    revision: str = revision_option(),
    scores: str = typer.Option(..., "--scores", help="Calibration artifact (scores.parquet)."),
    out: str = typer.Option(..., "--out", help="Where to write the pruned checkpoint artifact."),
    allocation: str = typer.Option(None, "--allocation", help="Search artifact; omit for the uniform allocation."),
    criterion: str = typer.Option("reap", "--criterion", help="frequency, seer, ean or reap."),
    sparsity: float = typer.Option(0.25, "--sparsity", help="Global share of routed experts removed."),
    granularity: int = typer.Option(1, "--granularity", help="Per-layer counts are multiples of this."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="Checkpoint dtype: auto, float32, bfloat16, float16."),
) -> None:
    """Cut experts out of a checkpoint.

    Example: evoesap prune --model runs/demo/model --scores runs/cal --allocation runs/search --criterion reap --sparsity 0.5 --out runs/pruned
    """
    from evoesap.stages.prune import PruneParams
    from evoesap.steps import run_stage

    params = PruneParams(criterion=criterion, sparsity=sparsity, granularity=granularity, model_dtype=model_dtype)
    run_stage("prune", {"model": pin(model, revision), "scores": scores, "allocation": allocation}, params, out)
    echo_uri(out)
