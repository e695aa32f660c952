"""`evoesap evaluate`."""

from __future__ import annotations

import typer

from evoesap.cli.app import app, echo_uri, revision_option
from evoesap.identity import pin


@app.command("evaluate")
def evaluate_cmd(
    model: str = typer.Option(..., "--model", help="Checkpoint (path or URI) or hub name; pruned checkpoints load too."),
    revision: str = revision_option(),
    tasks: str = typer.Option("mc,math", "--tasks", help="Comma-separated: suites mc, math, code; lm-eval task names; task directories."),
    out: str = typer.Option(..., "--out", help="Where to write the metrics artifact."),
    limit: float = typer.Option(None, "--limit", help="At most N examples per task (smoke runs)."),
    batch_size: str = typer.Option("8", "--batch-size", help="An integer or 'auto'."),
    allow_code_execution: bool = typer.Option(False, "--allow-code-execution", help="Run model-written code (code suite); use a sandbox."),
    enable_thinking: bool = typer.Option(False, "--enable-thinking", help="Chat template thinking switch for generation tasks."),
    think_end_token: str = typer.Option("</think>", "--think-end-token", help="The answer follows this, with --enable-thinking."),
    max_length: int = typer.Option(None, "--max-length", help="Context length; default: the model's."),
    model_dtype: str = typer.Option("auto", "--model-dtype", help="auto, bfloat16, float16 or float32."),
    device: str = typer.Option("auto", "--device"),
    backend: str = typer.Option("hf", "--backend", help="lm-eval model: hf (transformers) or vllm (needs EVOESAP_VLLM_PYTHON)."),
    teacher_cache: str = typer.Option(None, "--teacher-cache", help="Full model's cache on held-out samples: adds held-out ESAP."),
    esap_batch_size: int = typer.Option(8, "--esap-batch-size"),
    allocation: str = typer.Option(None, "--allocation", help="Allocation artifact the model was pruned with (lineage)."),
    criterion: str = typer.Option(None, "--criterion", help="Label for the report."),
    sparsity: float = typer.Option(None, "--sparsity", help="Label for the report."),
    method: str = typer.Option(None, "--method", help="Label for the report: full, uniform, searched, frequency."),
) -> None:
    """Evaluate a model with lm-eval, its memory footprint and expert counts; write metrics.json.

    Example: evoesap evaluate --model runs/pruned --tasks mc,math,./my_tasks --out runs/eval --limit 20 --method searched
    """
    from evoesap.stages.evaluate import EvaluateParams
    from evoesap.steps import run_stage

    params = EvaluateParams(
        tasks=tuple(tasks.split(",")), limit=limit, batch_size=int(batch_size) if batch_size.isdigit() else batch_size,
        allow_code_execution=allow_code_execution, enable_thinking=enable_thinking, think_end_token=think_end_token,
        max_length=max_length, model_dtype=model_dtype, device=device, backend=backend, esap_batch_size=esap_batch_size,
        criterion=criterion, sparsity=sparsity, method=method,
    )
    run_stage("evaluate", {"model": pin(model, revision), "teacher_cache": teacher_cache, "allocation": allocation}, params, out)
    echo_uri(out)
