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
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline

    typer.echo(str(compile_pipeline(load_config(config), output)))


@pipeline_app.command("components")
def components_cmd(
    out: Path = typer.Option(Path("components"), "--out", help="Directory for the <stage>.yaml files."),
    image: str = typer.Option(None, "--image", help="Stage image (default: the project's image of this version)."),
) -> None:
    """Compile each stage to a single-stage KFP component YAML.  Example: evoesap pipeline components --out components"""
    from evoesap.components import DEFAULT_IMAGE, write_component_yamls

    for path in write_component_yamls(out, image or DEFAULT_IMAGE):
        typer.echo(str(path))


@pipeline_app.command("run")
def run_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    log: Path = typer.Option(None, "--log", help="Write the tasks' full logs here; the terminal shows one line per task."),
) -> None:
    """Run the DAG on this machine (kfp.local).  Example: evoesap pipeline run demo.yaml --log runs/pipeline.log"""
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.run import report_uri, run_local

    outputs = run_local(load_config(config), log_path=log)
    for model in outputs["pruned_models"]:
        typer.echo(f"pruned model: {model.metadata['uri']}")
    typer.echo(report_uri(outputs))


@pipeline_app.command("submit")
def submit_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    host: str = typer.Option(..., "--host", help="Kubeflow Pipelines API endpoint URL."),
    experiment: str = typer.Option(None, "--experiment", help="Experiment name (default: the config's name)."),
) -> None:
    """Submit the DAG to a cluster.  Example: evoesap pipeline submit demo.yaml --host https://kfp.example.org"""
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.run import submit

    typer.echo(submit(load_config(config), host, experiment=experiment))


@pipeline_app.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Where the demo world and all artifacts go."),
    seed: int = typer.Option(0, "--seed", help="Seed of the demo world."),
    profile: str = typer.Option("default", "--profile", help="Demo world profile: default or quick."),
) -> None:
    """Build the demo world and run the whole pipeline on it locally.  Example: evoesap pipeline demo --out runs/demo"""
    from evoesap.pipeline.demo import main_table, run_demo

    out = out.resolve()
    typer.echo(f"building the demo world and running the pipeline; task logs in {out / 'pipeline.log'}")
    report = run_demo(out, seed=seed, profile=profile, log_path=out / "pipeline.log")
    typer.echo(f"\nreport: {report}/report.md (and report.html, plots beside it)\n")
    typer.echo(main_table(report))
