"""The documented public interface of the stage components: what each key of a stage's `params` means.

A stage's `params` input holds exactly the fields of its parameter dataclass (the YAML configuration's
section of the same name, the CLI's options). Their meaning is declared once, with the field
(`evoesap.params.param`); this module reads it from there, so a component's description never drifts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from evoesap import params as parameters
from evoesap import registry as stages


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def param_docs(stage: str) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, meaning) of every parameter of `stage`."""
    cls = stages.get(stage).params_class()
    return [(f.name, _type_name(f.type), f.default, parameters.help_of(f).rstrip(".")) for f in dataclasses.fields(cls)]


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
