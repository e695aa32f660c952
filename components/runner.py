"""The one body of every stage component, read from the stage's registry entry (`evoesap.registry`).

A component's arguments (`evoesap.components.stages` makes its signature from the same entry) become the stage's
inputs, each the URI `kfp_artifacts.source` names (a list input gathered from its arguments in their declared
order, an argument with a `read` hook standing for the URIs that hook names; an optional text input's "" meaning
none) and its parameters (its `params`, what its `kfp_params` hook adds, the grid's own arguments); `run_step` runs
it under `storage_root`, and each output is filled from the finished artifact by its declared `fill`. A stage with a `withheld` hook (publish) that the release gate refuses fills each
output with what that hook writes (a withheld entry) and succeeds: its outputs are typed whether or not it released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evoesap import registry


def run_component(name: str, **arguments: Any) -> str | None:
    """Run stage `name` from its component's `arguments` and fill its outputs; what the stage declares it returns
    (the gate's "pass"/"fail"), else None."""
    from evoesap.components.kfp_artifacts import COPY_MODELS
    from evoesap.components.workspace import share_digests

    from evoesap.machine.env import flag
    from evoesap.steps import run_step

    flag(COPY_MODELS)  # a switch that reads as neither on nor off is refused before the stage runs, not after
    stage = registry.get(name)
    share_digests(arguments.get("workspace") or "")
    inputs = {item.name: _gathered(item, arguments) for item in stage.inputs if item.kfp_arguments}
    params = dict(arguments.get("params") or {})
    if stage.kfp_params is not None:
        params = registry.load(stage.kfp_params)(arguments, params)
    from evoesap.release.gate import GateFailed

    try:
        uri = run_step(name, arguments["storage_root"], inputs, {**params, **{key: arguments[key] for key in stage.grid}})
    except GateFailed as refused:
        if stage.withheld is None:
            raise
        for output in stage.outputs:
            registry.load(stage.withheld)(arguments[output.name], str(refused))
        return None
    for output in stage.outputs:
        registry.load(output.fill)(arguments[output.name], uri)
    return None if stage.returns is None else registry.load(stage.returns.value)(uri)


def _gathered(item: registry.StageInput, arguments: Mapping[str, Any]) -> str | list[str] | None:
    """What the stage reads for `item`: one URI (None when not given), or the URIs of a list input's arguments."""
    from evoesap.components.kfp_artifacts import source

    if item.many:
        return [
            uri
            for argument in item.kfp_arguments
            for a in _listed(argument, arguments.get(argument.name))
            for uri in (registry.load(argument.read)(a) if argument.read else [source(a)])
        ]
    (argument,) = item.kfp_arguments
    value = arguments.get(argument.name)
    if argument.kind == "str":
        return value if argument.required else value or None
    return source(value)


def _listed(argument: registry.KfpArgument, value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if argument.many else [value]
