"""The `evoesap` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click
import typer

from evoesap.cli.app import app, scrub, state
from evoesap.cli.stages import stage_commands
from evoesap.errors import EvoESAPError, Interrupted


def command() -> click.Group:
    """The whole `evoesap` command: the stage verbs generated from the registry, then every other command
    module of this package (each registers its verbs on `app`)."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("app", "stages"):
            importlib.import_module(f"evoesap.cli.{info.name}")
    group = typer.main.get_command(app)
    for stage_command in stage_commands():
        group.add_command(stage_command)
    return group


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 on usage errors, 1 on other errors (one line, traceback with --debug)."""
    command_group = command()
    try:
        returned = command_group.main(args=argv if argv is not None else sys.argv[1:], prog_name="evoesap", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.BadParameter, typer.Abort) as exc:  # pragma: no cover - click formats these itself
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI turns every failure into one clear line
        if isinstance(exc, _USAGE_ERRORS):
            exc.show()
            return 2
        if isinstance(exc, _EXITS):
            return exc.exit_code
        if state["debug"]:
            raise
        if isinstance(exc, OSError) and exc.filename and exc.strerror:  # the file system refused: the place, not us
            print(scrub(f"error: {exc.filename}: {exc.strerror}: give a place this user can read and write"), file=sys.stderr)
            return 1
        kind = "error" if isinstance(exc, EvoESAPError) else f"internal error ({type(exc).__name__})"
        print(scrub(f"{kind}: {exc}"), file=sys.stderr)
        return exc.exit_code if isinstance(exc, Interrupted) else 1
    if returned == INTERRUPTED:  # typer turns Ctrl-C into this exit code when click does not exit itself
        print("interrupted: stopped before finishing; nothing was published (re-run to start again)", file=sys.stderr)
        return INTERRUPTED
    return returned if type(returned) is int else 0  # a command's `typer.Exit(code)` (click returns the code)


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def _click_exceptions() -> list:
    """click's exception modules: the package (the stage verbs are click commands) and the copy typer bundles
    (its own group raises from that one, e.g. for an unknown verb)."""
    import importlib

    modules = [click.exceptions]
    try:
        modules.append(importlib.import_module("typer._click.exceptions"))
    except ImportError:  # a typer that uses the click package itself
        pass
    return modules


_USAGE_ERRORS = tuple(m.UsageError for m in _click_exceptions())
_EXITS = tuple(m.Exit for m in _click_exceptions() if hasattr(m, "Exit"))


if __name__ == "__main__":
    sys.exit(main())
