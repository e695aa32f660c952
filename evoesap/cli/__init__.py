"""The `evoesap` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from evoesap.cli.app import app, state
from evoesap.errors import EvoESAPError


def _load_commands() -> None:
    """Import every command module of this package; each registers its verbs on `app`."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "app":
            importlib.import_module(f"evoesap.cli.{info.name}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 on usage errors, 1 on other errors (one line, traceback with --debug)."""
    _load_commands()
    command = typer.main.get_command(app)
    try:
        returned = command.main(args=argv if argv is not None else sys.argv[1:], prog_name="evoesap", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.BadParameter, typer.Abort) as exc:  # pragma: no cover - click formats these itself
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the CLI turns every failure into one clear line
        import click

        if isinstance(exc, click.exceptions.UsageError):
            exc.show()
            return 2
        if isinstance(exc, click.exceptions.Exit):
            return exc.exit_code
        if state["debug"]:
            raise
        from evoesap.artifacts import redact

        kind = "error" if isinstance(exc, EvoESAPError) else f"internal error ({type(exc).__name__})"
        print(redact(f"{kind}: {exc}"), file=sys.stderr)
        return 1
    if returned == INTERRUPTED:  # typer turns Ctrl-C into this exit code when click does not exit itself
        print("interrupted: stopped before finishing; nothing was published (re-run to start again)", file=sys.stderr)
        return INTERRUPTED
    return 0


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
