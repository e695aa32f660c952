"""`evoesap cache-logits`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, echo_uri, revision_option
from evoesap.identity import pin


@app.command("cache-logits")
def cache_logits_cmd(
    model: str = typer.Option(..., "--model", help="Full model: path, URI or hub name."),
    revision: str = revision_option(),
    data: str = typer.Option(..., "--data", help="Search samples: JSONL/JSON/Parquet/CSV path or URI, or a hub dataset."),
    out: str = typer.Option(..., "--out", help="Where to write the teacher cache artifact."),
    mode: str = typer.Option(None, "--mode", help="full (whole vocabulary) or topk (top-K + tail mass: ESAP bounds); unset: full where it fits this machine."),
    top_k: int = typer.Option(64, "--top-k", help="K for --mode topk."),
    dtype: str = typer.Option("float16", "--dtype", help="Storage of log-probabilities: float16 or float32."),
    samples: int = typer.Option(64, "--samples", help="Number of search samples drawn from the data."),
    max_length: int = typer.Option(2048, "--max-length", help="Tokens per sample."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward."),
    seed: int = typer.Option(42, "--seed", help="Which samples are drawn."),
    split: str = typer.Option("train", "--split", help="Dataset split."),
    subset: str = typer.Option(None, "--subset", help="Hub dataset configuration."),
    messages_field: str = typer.Option("messages", "--messages-field", help="Field with chat turns."),
    prompt_field: str = typer.Option(None, "--prompt-field", help="Field with the prompt (with --response-field)."),
    response_field: str = typer.Option(None, "--response-field", help="Field with the answer (with --prompt-field)."),
    text_field: str = typer.Option(None, "--text-field", help="Field with plain text; every token counts."),
    enable_thinking: bool = typer.Option(False, "--enable-thinking", help="Chat template thinking switch."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="auto, bfloat16, float16 or float32."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1, ..."),
) -> None:
    """Run the full model once over the search samples and cache its next-token distributions.

    Example: evoesap cache-logits --model runs/demo/model --data runs/demo/search.jsonl --out runs/cache --mode topk --top-k 32
    """
    from evoesap.stages.cache_logits import CacheLogitsParams
    from evoesap.steps import run_stage

    params = CacheLogitsParams(
        mode=mode, top_k=top_k, dtype=dtype, samples=samples, max_length=max_length, batch_size=batch_size,
        seed=seed, split=split, subset=subset, messages_field=messages_field, prompt_field=prompt_field,
        response_field=response_field, text_field=text_field, enable_thinking=enable_thinking,
        model_dtype=model_dtype, device=device,
    )
    run_stage("cache-logits", {"model": pin(model, revision), "data": data}, params, out)
    echo_uri(out)
