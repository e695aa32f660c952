"""`evoesap calibrate`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, echo_uri, revision_option
from evoesap.identity import pin


@app.command("calibrate")
def calibrate_cmd(
    model: str = typer.Option(..., "--model", help="Model: path, URI or hub name."),
    revision: str = revision_option(),
    data: str = typer.Option(..., "--data", help="Calibration data: JSONL/JSON/Parquet/CSV path or URI, or a hub dataset."),
    out: str = typer.Option(..., "--out", help="Where to write the scores artifact."),
    samples: int = typer.Option(1024, "--samples", help="Samples drawn from the data."),
    max_length: int = typer.Option(2048, "--max-length", help="Tokens per sample (or packed sequence)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample selection."),
    split: str = typer.Option("train", "--split", help="Dataset split."),
    subset: str = typer.Option(None, "--subset", help="Hub dataset configuration."),
    messages_field: str = typer.Option("messages", "--messages-field", help="Field with chat turns."),
    prompt_field: str = typer.Option(None, "--prompt-field", help="Field with the prompt (with --response-field)."),
    response_field: str = typer.Option(None, "--response-field", help="Field with the answer (with --prompt-field)."),
    text_field: str = typer.Option(None, "--text-field", help="Field with plain text; every token counts."),
    enable_thinking: bool = typer.Option(False, "--enable-thinking/--no-enable-thinking", help="Passed to the chat template."),
    pack: bool = typer.Option(False, "--pack/--no-pack", help="Concatenate samples into max-length sequences."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="Model dtype: auto, float32, bfloat16, float16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
    device_map: str = typer.Option(None, "--device-map", help="'auto' spreads a large model over several GPUs."),
) -> None:
    """Score every expert (frequency, SEER, EAN, REAP) in one observer pass over calibration samples.

    Example: evoesap calibrate --model runs/demo/model --data runs/demo/data/calibration.jsonl --samples 64 --out runs/cal
    """
    from evoesap.stages.calibrate import CalibrateParams
    from evoesap.steps import run_stage

    params = CalibrateParams(
        samples=samples,
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        split=split,
        subset=subset,
        messages_field=messages_field,
        prompt_field=prompt_field,
        response_field=response_field,
        text_field=text_field,
        enable_thinking=enable_thinking,
        pack=pack,
        model_dtype=model_dtype,
        device=device,
        device_map=device_map,
    )
    run_stage("calibrate", {"model": pin(model, revision), "data": data}, params, out)
    echo_uri(out)
