"""`evoesap search`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, echo_uri, revision_option
from evoesap.identity import pin


@app.command("search")
def search_cmd(
    model: str = typer.Option(..., "--model", help="Full model: path, URI or hub name."),
    revision: str = revision_option(),
    scores: str = typer.Option(..., "--scores", help="Calibration artifact (scores.parquet)."),
    cache: str = typer.Option(..., "--cache", help="Teacher cache artifact from cache-logits."),
    heldout_cache: str = typer.Option(
        None, "--heldout-cache", help="Teacher cache of other samples for the held-out check (then --cache is all search)."
    ),
    out: str = typer.Option(..., "--out", help="Where to write the search artifact."),
    criterion: str = typer.Option("reap", "--criterion", help="frequency, seer, ean or reap."),
    sparsity: float = typer.Option(0.25, "--sparsity", help="Global share of routed experts removed."),
    population: int = typer.Option(32, "--population", help="Candidate allocations per generation (P)."),
    elites: int = typer.Option(4, "--elites", help="Fittest allocations kept each generation (m)."),
    generations: int = typer.Option(50, "--generations", help="Generations of the evolutionary search."),
    max_transfer: int = typer.Option(4, "--max-transfer", help="Largest level-switch transfer."),
    max_steps: int = typer.Option(3, "--max-steps", help="tau_max: composed steps per offspring."),
    granularity: int = typer.Option(1, "--granularity", help="Counts and transfers in multiples of this."),
    seed: int = typer.Option(42, "--seed", help="Seed of the search."),
    metric: str = typer.Option("esap", "--metric", help="esap, sap, kl or nll."),
    heldout_fraction: float = typer.Option(
        0.25, "--heldout-fraction", help="Share of --cache kept for the held-out check when there is no --heldout-cache."
    ),
    fallback_to_uniform: bool = typer.Option(False, "--fallback-to-uniform", help="Return uniform when the search does not generalise."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted search from its checkpoint."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="Model dtype: auto, float32, bfloat16, float16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
    racing: bool = typer.Option(False, "--racing", help="Race new candidates over sample subsets first; elites on the full set."),
    racing_schedule: str = typer.Option("0.0625,0.25:0.25", "--racing-schedule", help="Subset shares, then the share that advances."),
    racing_min_samples: int = typer.Option(4, "--racing-min-samples", help="Least samples any racing level scores."),
    racing_min_positions: int = typer.Option(256, "--racing-min-positions", help="Least scored positions any racing level scores."),
    prefix_reuse: bool = typer.Option(True, "--prefix-reuse/--no-prefix-reuse", help="Start candidates from cached hidden states (exact)."),
    prefix_cache_bytes: int = typer.Option(
        None, "--prefix-cache-bytes", help="Budget of the prefix cache on the model's device (default: states of 32 x (elites + 1) allocations, at most half its free memory)."
    ),
    workers: int = typer.Option(1, "--workers", help="Processes scoring each generation's candidates (torchrun underneath), each with a model replica."),
) -> None:
    """Search the per-layer allocation with ESAP as fitness.

    Example: evoesap search --model runs/demo/model --scores runs/cal --cache runs/cache --criterion reap --sparsity 0.25 --out runs/search --racing
    """
    from evoesap.stages.search import SearchParams
    from evoesap.steps import run_stage

    params = SearchParams(
        criterion=criterion,
        sparsity=sparsity,
        population=population,
        elites=elites,
        generations=generations,
        max_transfer=max_transfer,
        max_steps=max_steps,
        granularity=granularity,
        seed=seed,
        metric=metric,
        heldout_fraction=heldout_fraction,
        fallback_to_uniform=fallback_to_uniform,
        resume=resume,
        batch_size=batch_size,
        model_dtype=model_dtype,
        device=device,
        racing=racing,
        racing_schedule=racing_schedule,
        racing_min_samples=racing_min_samples,
        racing_min_positions=racing_min_positions,
        prefix_reuse=prefix_reuse,
        prefix_cache_bytes=prefix_cache_bytes,
        workers=workers,
    )
    run_stage("search", {"model": pin(model, revision), "scores": scores, "cache": cache, "heldout_cache": heldout_cache}, params, out)
    echo_uri(out)
