"""`evoesap esap`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, revision_option
from evoesap.store.identity import pin


@app.command("esap")
def esap_cmd(
    model: str = typer.Option(..., "--model", help="The full model the cache was made from: path, URI or hub name."),
    revision: str = revision_option(),
    cache: str = typer.Option(..., "--cache", help="Teacher cache artifact (evoesap cache-logits)."),
    allocation: str = typer.Option(
        None,
        "--allocation",
        help='JSON file or URI with {"pruned": {"<MoE layer>": [expert ids], ...}}; omit to score the full model.',
    ),
    metric: str = typer.Option("esap", "--metric", help="esap, sap, kl or nll (kl and nll printed as raw values)."),
    batch_size: int = typer.Option(8, "--batch-size"),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="auto, bfloat16, float16 or float32."),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Score one pruning candidate (experts masked in the full model) against a teacher cache; prints the score.

    Example: evoesap esap --model runs/demo/model --cache runs/cache --allocation allocation.json
    """
    from evoesap.scoring.evaluator import score_allocation

    lower, upper = score_allocation(
        pin(model, revision), cache, allocation, metric=metric, batch_size=batch_size, model_dtype=model_dtype, device=device
    )
    typer.echo(f"{lower:.6f}" if upper == lower else f"{lower:.6f} (top-K bounds: {lower:.6f} .. {upper:.6f})")
