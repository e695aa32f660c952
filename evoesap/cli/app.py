"""The `evoesap` typer application; command modules register their verbs on `app`."""

from __future__ import annotations

import logging

import typer

from evoesap.progress import set_quiet

app = typer.Typer(
    name="evoesap",
    help="Non-uniform expert pruning for MoE LLMs: calibrate, cache-logits, search, prune, evaluate, report.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

state = {"debug": False}


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars, warnings only."),
) -> None:
    state["debug"] = debug
    set_quiet(quiet)
    level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
