"""The `evoesap` typer application; command modules register their verbs on `app`."""

from __future__ import annotations

import logging
from typing import Any

import typer

from evoesap.progress import set_quiet
from evoesap.registry import NAMES

app = typer.Typer(
    name="evoesap",
    help=f"Non-uniform expert pruning for MoE LLMs in {len(NAMES)} stages: {', '.join(NAMES)}.",
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
    for handler in logging.getLogger().handlers:
        handler.addFilter(_redact_record)


def _redact_record(record: logging.LogRecord) -> bool:
    """No user:password@ of any URI reaches the log (the message is formatted here, then redacted)."""
    from evoesap.store.artifacts import redact

    record.msg, record.args = redact(record.getMessage()), None
    return True


def echo_uri(uri: str) -> None:
    """Print an artifact's URI (the command's result) without credentials."""
    from evoesap.store.artifacts import redact

    typer.echo(redact(uri))


def revision_option() -> Any:
    """`--revision`, the same on every command that loads the full model."""
    return typer.Option(
        None, "--revision", help="Hub models only: branch, tag or commit of --model (default: the default branch)."
    )
