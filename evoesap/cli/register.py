"""`evoesap register`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, scrub


@app.command("register")
def register_cmd(
    published: str = typer.Option(..., "--published", help="Publish artifact (evoesap publish --out) of the release."),
    name: str = typer.Option(..., "--name", help="Registered model name in the model registry."),
    source: str = typer.Option(
        None,
        "--source",
        help="Where others read the release (s3://..., hf://org/name); default: where publish pushed it (--to, --repo).",
    ),
    registry: str = typer.Option(
        "mlflow", "--registry", help="mlflow (MLflow's model registry) or kubeflow (the Kubeflow Model Registry)."
    ),
    version: str = typer.Option(
        None,
        "--version",
        help="The version's name (kubeflow only; MLflow numbers its versions); default: one more than the highest number.",
    ),
) -> None:
    """Record a released model in a model registry: a version whose model is the release, its lineage as tags.

    MLflow: the server and its token from MLFLOW_TRACKING_URI and MLFLOW_TRACKING_TOKEN. Kubeflow Model Registry
    (pip install 'evoesap[kubeflow-registry]'): from EVOESAP_KF_REGISTRY_URL and EVOESAP_KF_REGISTRY_TOKEN. Tokens are
    never printed.

    Example: MLFLOW_TRACKING_URI=https://mlflow.example.org evoesap register --published runs/publish --name olmoe-pruned

    Example: EVOESAP_KF_REGISTRY_URL=https://model-registry.example.org:443 evoesap register --registry kubeflow
    --published runs/publish --name olmoe-pruned
    """
    from evoesap.release.registry import register

    done = register(published, name, registry=registry, source=source, version=version)
    verb = "registered" if done.created else "already registered (tags set again)"
    typer.echo(scrub(f"{verb}: {done.name} version {done.version}, source {done.source}"))
