"""The `evoesap` typer application; command modules register their verbs on `app`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
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
    for name in CHATTY_LIBRARIES:  # their debug logs print request headers and credentials
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    if not getattr(logging.getLogRecordFactory(), "scrubs", False):
        logging.setLogRecordFactory(_scrubbing(logging.getLogRecordFactory()))


CHATTY_LIBRARIES = ("botocore", "boto3", "aiobotocore", "s3fs", "fsspec", "urllib3", "httpx", "httpcore", "huggingface_hub")


def scrub(text: str) -> str:
    """`text` without credentials (`evoesap.network.scrub`: user:password@ of a URI, Authorization values, tokens, the
    value of any secret environment variable): for everything the command prints or logs."""
    from evoesap.network import scrub as scrubbed

    return scrubbed(text)


def _scrubbing(factory: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    """A log record factory that scrubs each record as it is made, so no handler prints a secret: ours, or one a
    library installed itself (huggingface_hub prints its retry warnings through its own)."""

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        with contextlib.suppress(Exception):  # a malformed record is left to logging's own error handling
            record.msg, record.args = scrub(record.getMessage()), None
        return record

    make.scrubs = True  # type: ignore[attr-defined]
    return make


def echo_uri(uri: str) -> None:
    """Print an artifact's URI (the command's result) without credentials."""
    typer.echo(scrub(uri))


def revision_option() -> Any:
    """`--revision`, the same on every command that loads the full model."""
    return typer.Option(
        None, "--revision", help="Hub models only: branch, tag or commit of --model (default: the default branch)."
    )
