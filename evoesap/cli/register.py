"""`evoesap register`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, scrub


@app.command("register")
def register_cmd(
    published: str = typer.Option(..., "--published", help="Publish artifact (evoesap publish --out) of the release."),
    name: str = typer.Option(..., "--name", help="Registered model name in MLflow's model registry."),
    source: str = typer.Option(
        None,
        "--source",
        help="Where others read the release (s3://..., hf://org/name); default: where publish pushed it (--to, --repo).",
    ),
) -> None:
    """Record a released model in MLflow's model registry: a version whose source is the release, its lineage as tags.

    The server and its token from MLFLOW_TRACKING_URI and MLFLOW_TRACKING_TOKEN (never printed).

    Example: MLFLOW_TRACKING_URI=https://mlflow.example.org evoesap register --published runs/publish --name olmoe-pruned
    """
    from evoesap.release.mlflow_registry import register

    done = register(published, name, source=source)
    verb = "registered" if done.created else "already registered (tags set again)"
    typer.echo(scrub(f"{verb}: {done.name} version {done.version}, source {done.source}"))
