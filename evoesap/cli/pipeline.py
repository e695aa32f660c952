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
    overrides: list[str] = typer.Option(
        [], "--set", help="Compile a pipeline parameter's default, key=value (repeatable; as submit's --set)."
    ),
) -> None:
    """Compile the DAG to a KFP pipeline spec.  Example: evoesap pipeline compile demo.yaml -o pipeline.yaml --set search_params.generations=100"""
    import os
    import tempfile

    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline
    from evoesap.pipeline.files import SPEC_MARKER, claim_output_file
    from evoesap.pipeline.submit import bake_defaults, parse_overrides

    claim_output_file(output, "--output", SPEC_MARKER, inputs=(config,))
    values = parse_overrides(overrides)
    output.parent.mkdir(parents=True, exist_ok=True)
    loaded = load_config(config)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.partial-") as tmp:
        staged = compile_pipeline(loaded, Path(tmp) / output.name)
        if values:
            bake_defaults(staged, values, loaded)  # a bad --set stops here: nothing is written at --output
        os.replace(staged, output)
    typer.echo(str(output))
    _say_floor(output)


def _say_floor(spec: Path) -> None:
    """The lowest Kubeflow Pipelines backend the spec's fields need, and any field whose floor is not known."""
    from evoesap.pipeline.backend_floor import TABLE_FILE, spec_floor

    floor = spec_floor(spec)
    typer.echo(f"the spec {floor.line()}")
    if floor.unknown:
        typer.echo(
            f"warning: the floor leaves out {len(floor.unknown)} field(s) {TABLE_FILE.name} does not know: "
            f"{', '.join(floor.unknown[:3])}; check them against the backend's release notes",
            err=True,
        )


@pipeline_app.command("components")
def components_cmd(
    out: Path = typer.Option(Path("components"), "--out", help="Directory for the <stage>.yaml files."),
    config: Path = typer.Option(
        None, "--config", help="Pipeline YAML whose `registry`/`image` the components name (default: the project's image)."
    ),
) -> None:
    """Compile each stage to a single-stage KFP component YAML.

    Example: evoesap pipeline components --out components --config pipeline.yaml
    """
    from evoesap.components import DEFAULT_IMAGE, write_component_yamls
    from evoesap.pipeline.files import SPEC_MARKER, claim_output_dir, claim_output_file
    from evoesap.registry import STAGES

    claim_output_dir(out, "--out")
    for stage in STAGES:  # before any work: a user's own <stage>.yaml there is never overwritten
        claim_output_file(out / f"{stage.section}.yaml", "--out", SPEC_MARKER)
    image = DEFAULT_IMAGE
    if config is not None:
        from evoesap.pipeline.config import load_config

        image = load_config(config).default_image
    for path in write_component_yamls(out, image):
        typer.echo(str(path))


@pipeline_app.command("run")
def run_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    log: Path = typer.Option(None, "--log", help="Write the tasks' full logs here; the terminal shows one line per task."),
    runner: str = typer.Option(
        "subprocess",
        "--runner",
        help="subprocess (this environment) or docker (each stage in its own container of the stage image, through DOCKER_HOST).",
    ),
) -> None:
    """Run the DAG on this machine (kfp.local).  Example: evoesap pipeline run demo.yaml --log runs/pipeline.log"""
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.files import LOG_HEADER, claim_output_file
    from evoesap.pipeline.run import report_uri, run_local

    if log is not None:
        claim_output_file(log, "--log", LOG_HEADER, inputs=(config,))
    outputs = run_local(load_config(config), log_path=log, runner=runner)
    for model in outputs["pruned_models"]:
        typer.echo(f"pruned model: {model.metadata['uri']}")
    for verdict in outputs.get("verdicts", []):  # with a gate; a failing one has ended the run (GateFailed) unless told not to
        typer.echo(verdict.metadata["verdict"])
    typer.echo(report_uri(outputs))


@pipeline_app.command("target")
def target_cmd(config: Path = typer.Argument(..., help="Pipeline YAML configuration with a target: section.")) -> None:
    """Find, per criterion, the largest sparsity on the grid whose searched allocation meets the configuration's target
    (held-out ESAP, or the gate's thresholds on the pruned model; bisection, each probe reusable artifacts), or with
    choose_criterion the criterion that reaches the largest, and record the decision.  Example: evoesap pipeline target
    target.yaml"""
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.target import cost_line, fan_out, run_target, unmet

    loaded = load_config(config)
    if loaded.target is None:
        raise typer.BadParameter(f"{config} has no target: section; add e.g. target: {{heldout_esap: 0.97}}")
    typer.echo(cost_line(loaded))
    found = run_target(loaded)
    choose = loaded.target.choose_criterion
    for uri, record in found:
        if record.chosen is not None or choose:
            typer.echo(f"{record.criterion}: {record.line()}")
        typer.echo(uri)  # a missed target's decision is recorded too
    missed = unmet(found, choose)
    if missed is not None:  # the release cannot go on: an error like any other (`error: ...`, exit 1)
        raise missed
    if choose:
        (point,) = fan_out(found, choose)
        probes = sum(len(record.probes) for _, record in found)
        typer.echo(
            f"chosen: {point['criterion']} at sparsity {point['sparsity']:.4f}, the largest any criterion reaches ({probes} probes)"
        )


@pipeline_app.command("submit")
def submit_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    host: str = typer.Option(..., "--host", envvar="KF_PIPELINES_ENDPOINT", help="Kubeflow Pipelines API endpoint URL."),
    experiment: str = typer.Option(None, "--experiment", help="Experiment name (default: the config's name)."),
    run_name: str = typer.Option(None, "--run-name", help="Run (or recurring run) name (default: the config's name)."),
    namespace: str = typer.Option(None, "--namespace", help="Profile namespace on a multi-user cluster."),
    overrides: list[str] = typer.Option([], "--set", help="Override a pipeline parameter, key=value (repeatable)."),
    token: str = typer.Option(
        None,
        "--token",
        envvar="EVOESAP_KFP_TOKEN",
        show_default=False,
        help="Bearer token; prefer the EVOESAP_KFP_TOKEN variable (default: the kfp client's "
        "own credentials, e.g. KF_PIPELINES_SA_TOKEN_PATH).",
    ),
    service_account: str = typer.Option(
        None, "--service-account", help="Kubernetes service account of the run's pods (default: the cluster's)."
    ),
    wait: bool = typer.Option(False, "--wait", help="Follow the run; exit 0 when it succeeds, 1 otherwise."),
    schedule: str = typer.Option(None, "--schedule", help="Cron schedule for a recurring run, e.g. '0 3 * * *'."),
    interval: int = typer.Option(None, "--interval", help="Seconds between recurring runs (instead of --schedule)."),
    max_concurrency: int = typer.Option(1, "--max-concurrency", help="Recurring runs allowed at once."),
    catchup: bool = typer.Option(False, "--catchup", help="Backfill intervals missed while a recurring run was paused."),
) -> None:
    """Submit the DAG to a cluster, once or on a schedule, as a version of the pipeline named like the config.

    Example: evoesap pipeline submit demo.yaml --host https://kfp.example.org --run-name nightly --set search_params.generations=100 --wait
    """
    from evoesap.pipeline.submit import Submission, follow, parse_overrides, submit

    submission = Submission(
        host=host,
        experiment=experiment,
        run_name=run_name,
        namespace=namespace,
        overrides=parse_overrides(overrides),
        token=token,
        service_account=service_account,
        wait=wait,
        schedule=schedule,
        interval_seconds=interval,
        max_concurrency=max_concurrency,
        catchup=catchup,
    )
    run_id = submit(config, submission)  # the endpoint is checked before the configuration is loaded
    if not wait:
        typer.echo(f"submitted {'recurring run' if submission.recurring else 'run'} {run_id}")
        return
    state = follow(submission, run_id)
    typer.echo(f"run {run_id} {state}")
    if state != "SUCCEEDED":
        raise typer.Exit(1)


@pipeline_app.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Where the demo world and all artifacts go."),
    seed: int = typer.Option(0, "--seed", help="Seed of the demo world."),
    profile: str = typer.Option(
        "default", "--profile", help="Demo world profile: default, or quick (a smoke test: 25% only, fp8-dynamic)."
    ),
    runner: str = typer.Option(
        "subprocess",
        "--runner",
        help="subprocess (this environment) or docker (each stage in its own container of the stage image, through DOCKER_HOST).",
    ),
    image: str = typer.Option(None, "--image", help="Stage image for the docker runner (default: the project's)."),
) -> None:
    """Build the demo world and run the whole pipeline on it locally.  Example: evoesap pipeline demo --out runs/demo"""
    from evoesap.pipeline.demo import main_table, run_demo

    out = out.resolve()
    typer.echo(f"building the demo world and running the pipeline; task logs in {out / 'pipeline.log'}")
    report = run_demo(out, seed=seed, profile=profile, log_path=out / "pipeline.log", runner=runner, image=image)
    from evoesap.demo.world import load_demo_world, world_identity

    typer.echo(f"\nreport: {report}/report.md (and report.html, plots beside it)")
    typer.echo(f"demo world: {world_identity(load_demo_world(out / 'world'))}\n")
    typer.echo(main_table(report))
