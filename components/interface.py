"""The documented public interface of the stage components: what each key of a stage's `params` means.

A stage's `params` input holds exactly the fields of its parameter dataclass (the YAML configuration's
section of the same name, the CLI's options). Their meaning is written once, in the CLI's help or the
dataclass's field comment; this module reads it from there, so a component's description never drifts.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

_FIELD_COMMENT = re.compile(r"^\s*(\w+)\s*:[^#]*#\s*(.+)$")


def _cli_help(stage: str) -> dict[str, str]:
    import typer.main

    from evoesap.cli import _load_commands, app

    _load_commands()
    command = typer.main.get_command(app).commands[stage]  # CLI verbs are the stage names
    return {p.name: p.help for p in command.params if getattr(p, "help", None)}


def _field_comments(params_class: type) -> dict[str, str]:
    lines = inspect.getsource(params_class).splitlines()
    return {m.group(1): m.group(2).strip() for m in map(_FIELD_COMMENT.match, lines) if m}


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def param_docs(stage: str) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, meaning) of every parameter of `stage`; a parameter without a meaning is an error."""
    from evoesap.errors import ConfigError
    from evoesap.steps import params_class

    cls = params_class(stage)
    helps, comments = _cli_help(stage), _field_comments(cls)
    docs = []
    for field in dataclasses.fields(cls):
        meaning = helps.get(field.name) or comments.get(field.name)
        if not meaning:
            raise ConfigError(
                f"parameter {field.name!r} of stage {stage!r} is undocumented: give its CLI option a help text "
                "or its dataclass field a comment"
            )
        docs.append((field.name, _type_name(field.type), field.default, meaning.rstrip(".")))
    return docs


def params_description(stage: str, exclude: tuple[str, ...] = ()) -> str:
    """One line describing the `params` input of a stage's component, key by key (without the parameters
    in `exclude`: the component's own inputs, which take precedence)."""
    docs = [doc for doc in param_docs(stage) if doc[0] not in exclude]
    keys = "; ".join(f"{name} ({kind}, default {default!r}): {meaning}" for name, kind, default, meaning in docs)
    section = stage.replace("-", "_")
    return (
        f"Parameters of the {stage} stage, as in the pipeline configuration's `{section}` section (unset keys "
        f"keep their defaults; unknown keys are refused). Keys: {keys}."
    )
