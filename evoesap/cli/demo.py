"""`evoesap demo build`: make the demo world (tiny trained MoE, synthetic data, local lm-eval tasks)."""

from __future__ import annotations

from pathlib import Path

import typer

from evoesap.cli.app import app

demo_app = typer.Typer(
    help="The demo world: a tiny trained OLMoE, synthetic chat domains, local lm-eval tasks.", no_args_is_help=True
)
app.add_typer(demo_app, name="demo")


@demo_app.command("build")
def build(
    out: Path = typer.Option(..., "--out", help="Directory of the demo world (created; reused when up to date)."),
    seed: int = typer.Option(0, "--seed", help="Seed for data, initialisation and data order."),
    profile: str = typer.Option("default", "--profile", help="default (meets the quality bar) or quick (smoke test)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when up to date; replace a non-world directory."),
    train: bool = typer.Option(
        False,
        "--train",
        help="Train the weights even when the recorded ones ship with evoesap (the default world: about 15-40 CPU "
        "minutes); fails unless training reproduces the recorded weights bit for bit.",
    ),
) -> None:
    """Build the demo world, or reuse it when code, seed and profile are unchanged.

    Example: evoesap demo build --out runs/demo --seed 0
    """
    from evoesap.demo.world import build_demo_world, world_identity

    world = build_demo_world(out, seed=seed, profile=profile, force=force, train=train)
    info = world.info
    typer.echo(f"demo world:  {world.root}")
    typer.echo(f"identity:    {world_identity(world)}")
    typer.echo(
        f"model:       {world.model_dir}  ({info['parameters']:,} parameters, "
        f"{info['safetensors_bytes']:,} bytes, built in {info['build_seconds']:.0f}s)"
    )
    typer.echo(f"data:        {world.data_dir}/<domain>/<split>.jsonl  domains {', '.join(world.domains)}")
    typer.echo(f"tasks:       {world.tasks_dir}  (lm-eval include_path; tag {world.tag})")
    typer.echo(f"             {' '.join(world.generative_tasks + world.multiple_choice_tasks)}")
