"""`evoesap plan`."""

from __future__ import annotations

from pathlib import Path

import typer

from evoesap.cli.app import app


@app.command("plan")
def plan_cmd(
    config: Path = typer.Argument(..., help="Pipeline YAML configuration."),
    gpus: int = typer.Option(
        None, "--gpus", help="GPUs per stage pod (default: the config's search resources, else this machine's)."
    ),
    gpu_memory: str = typer.Option(None, "--gpu-memory", help="Memory of one GPU, e.g. 80GB (default: this machine's free)."),
    host_memory: str = typer.Option(
        None, "--host-memory", help="Host memory, e.g. 256GB (default: the config's search memory, else this machine's free)."
    ),
    disk: str = typer.Option(None, "--disk", help="Free space where artifacts go, e.g. 500GB (default: not checked)."),
    model_config: Path = typer.Option(
        None,
        "--model-config",
        help="A local folder holding the model's config.json, read instead of the config's "
        "model (plans offline; examples/models/ has the example models').",
    ),
) -> None:
    """Predict every stage's peak host and GPU memory, disk and temporary space, from config.json alone.

    Exits 1 when a stage would not fit, naming the setting to change.
    Example: evoesap plan examples/mixtral-8x7b.yaml --model-config examples/models/mixtral-8x7b --gpus 2 --gpu-memory 80GB
    """
    from evoesap.machine import sizes
    from evoesap.pipeline.config import load_config
    from evoesap.planning import footprint, plan

    cfg = load_config(config)
    here = footprint.local_machine(cfg.search.get("device", "auto"))
    wanted = cfg.resources.get("search")
    count = gpus if gpus is not None else (wanted.accelerator_count if wanted and wanted.accelerator_type else here.devices)
    host = (
        sizes.parse_bytes(host_memory)
        if host_memory
        else (sizes.parse_bytes(wanted.memory) if wanted and wanted.memory else here.host)
    )
    per_gpu = sizes.parse_bytes(gpu_memory) if gpu_memory else here.device
    if count and not per_gpu:
        raise typer.BadParameter("give --gpu-memory: this machine has no GPU to read it from")
    machine = footprint.Machine(host, per_gpu if count else 0, count, sizes.parse_bytes(disk) if disk else None)
    if model_config is not None and not (model_config / "config.json").is_file():
        raise typer.BadParameter(f"{model_config} holds no config.json: give the folder the model's config.json is in")
    shape, data, params, plans = plan.pipeline_plan(cfg, machine, model=str(model_config) if model_config else None)
    typer.echo(plan.format_table(shape, plans, data, params))
    if cfg.target is not None and cfg.target.quality:  # a bytes target's sparsity is in the table
        from evoesap.pipeline.target import cost_line

        typer.echo("\n" + cost_line(cfg, str(model_config) if model_config else None))
    refused = [p.stage for p in plans if p.refusal]
    if refused:
        from evoesap.errors import ResourceError

        raise ResourceError(f"{', '.join(refused)} would not fit: change the settings named above")
