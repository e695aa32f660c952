"""The documented public interface of the stage components: what each key of a stage's `params` means.

A stage's `params` input holds exactly the fields of its parameter dataclass (the YAML configuration's
section of the same name, the CLI's options). Their meaning is declared once, with the field
(`evoesap.params.param`); this module reads it from there, so a component's description never drifts.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from evoesap import params as parameters
from evoesap import registry as stages


def _type_name(annotation: Any) -> str:
    """`int | None`, `str`; a `Literal` by the type of its choices (the choices go with the meaning)."""
    if parameters.choices_of(annotation):
        return " | ".join(sorted(t.__name__ for t in parameters.kinds(annotation)))
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def param_docs(stage: str) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, meaning) of every parameter of `stage`; the meaning with the declared choices or
    range and what unset means for this stage (`params.describe`)."""
    cls = stages.get(stage).params_class()
    hints = typing.get_type_hints(cls)
    return [
        (f.name, _type_name(hints[f.name]), f.default, parameters.describe(cls, f, hints[f.name]).rstrip("."))
        for f in dataclasses.fields(cls)
    ]


def params_description(stage: str, exclude: tuple[str, ...] = ()) -> str:
    """One line describing the `params` input of a stage's component, key by key (without the parameters
    in `exclude`: the component's own inputs, which take precedence)."""
    docs = [doc for doc in param_docs(stage) if doc[0] not in exclude]
    keys = "; ".join(f"{name} ({kind}, default {default!r}): {meaning}" for name, kind, default, meaning in docs)
    section = stages.get(stage).section
    return (
        f"Parameters of the {stage} stage, as in the pipeline configuration's `{section}` section (unset keys "
        f"keep their defaults; unknown keys are refused). Keys: {keys}."
    )
