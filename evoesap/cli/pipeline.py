"""`evoesap pipeline compile|run|submit`."""

from __future__ import annotations

from pathlib import Path

import typer

from evoesap.cli.app import app

pipeline_app = typer.Typer(help="Compile, run locally, or submit the whole EvoESAP DAG.", no_args_is_help=True)
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("compile")
def compile_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    output: Path = typer.Option(Path("pipeline.yaml"), "--output", "-o", help="Where to write the KFP spec."),
) -> None:
    """Compile the DAG to a KFP pipeline spec.  Example: evoesap pipeline compile demo.yaml -o pipeline.yaml"""
    from pipeline.config import load_config
    from pipeline.dag import compile_pipeline

    typer.echo(str(compile_pipeline(load_config(config), output)))


@pipeline_app.command("run")
def run_cmd(config: Path = typer.Argument(..., help="Pipeline YAML configuration.")) -> None:
    """Run the DAG on this machine (kfp.local).  Example: evoesap pipeline run demo.yaml"""
    from pipeline.config import load_config
    from pipeline.run import run_local

    typer.echo(run_local(load_config(config)))


@pipeline_app.command("submit")
def submit_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    host: str = typer.Option(..., "--host", help="Kubeflow Pipelines API endpoint URL."),
    experiment: str = typer.Option(None, "--experiment", help="Experiment name (default: the config's name)."),
) -> None:
    """Submit the DAG to a cluster.  Example: evoesap pipeline submit demo.yaml --host https://kfp.example.org"""
    from pipeline.config import load_config
    from pipeline.run import submit

    typer.echo(submit(load_config(config), host, experiment=experiment))
