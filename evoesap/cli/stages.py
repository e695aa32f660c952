"""`evoesap <stage>`: one command per registry entry (`evoesap.registry.STAGES`), its options generated from the
stage's inputs and parameter fields, so the CLI cannot drift from the Python API or the pipeline YAML."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import click

from evoesap import params as parameters
from evoesap.cli.app import echo_uri, scrub
from evoesap.progress import is_quiet
from evoesap.registry import STAGES, Stage, StageInput, load


def flag(name: str) -> str:
    """The CLI spelling of a parameter or input name (`max_length` -> `--max-length`)."""
    return "--" + name.replace("_", "-")


def stage_commands() -> list[click.Command]:
    return [StageCommand(stage) for stage in STAGES]


class StageCommand(click.Command):
    """`evoesap <stage>`; its options are built on first use, so listing the verbs imports no stage code."""

    def __init__(self, stage: Stage) -> None:
        super().__init__(
            stage.name, callback=_runner(stage), help=f"{stage.summary}\n\nExample: {stage.example}", short_help=stage.summary
        )
        self.stage = stage

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not self.params:
            self.params = options(self.stage)
        return super().get_params(ctx)


def options(stage: Stage) -> list[click.Option]:
    """The command's options: inputs, --revision where a model can be pinned, --out, then every parameter (the
    stage's own first, then the groups it shares with other stages)."""
    found = [_input_option(item) for item in stage.inputs]
    if any(item.model for item in stage.inputs):
        found.append(
            click.Option(
                ["--revision"],
                default=None,
                help="Hub models only: branch, tag or commit of --model (default: the default branch).",
            )
        )
    found.append(click.Option(["--out"], required=True, help=f"Where to write {stage.output}."))
    cls = stage.params_class()
    hints = typing.get_type_hints(cls)
    own_first = sorted(dataclasses.fields(cls), key=lambda field: field.name not in cls.__annotations__)
    return found + [_param_option(cls, field, hints[field.name]) for field in own_first]


def _input_option(item: StageInput) -> click.Option:
    if item.many:
        return click.Option([flag(item.name)], multiple=True, required=item.required, help=item.help)
    return click.Option([flag(item.name)], required=item.required, default=None, help=item.help)


def _param_option(cls: type, field: dataclasses.Field, hint: Any) -> click.Option:
    """The option of one parameter field: its type, choices and range as declared (click shows and checks them),
    and its default, or what unset means for this stage."""
    kinds = parameters.kinds(hint)
    name, text, default = flag(field.name), parameters.help_of(field), field.default
    if bool in kinds:
        return click.Option([f"{name}/--no-{name[2:]}"], default=default, show_default=True, help=text)
    if tuple in kinds:
        return click.Option([name], type=str, default=",".join(default), show_default=True, help=text)
    shown = parameters.effective_default(cls, field)
    show = str(shown) if default is None and shown is not None else default is not None
    choices, limits = parameters.choices_of(hint), parameters.bounds_of(field)
    if choices:
        kind: Any = click.Choice([str(c) for c in choices])
    elif str in kinds:
        kind = click.STRING
    elif (int in kinds or float in kinds) and not limits:
        kind = click.INT if float not in kinds else click.FLOAT
    elif int in kinds or float in kinds:
        kind = (click.IntRange if int in kinds and float not in kinds else click.FloatRange)(
            min=limits.get("ge", limits.get("gt")),
            max=limits.get("le", limits.get("lt")),
            min_open="gt" in limits,
            max_open="lt" in limits,
        )
    else:
        kind = click.STRING
    return click.Option([name], type=kind, default=default, show_default=show, help=text)


def _runner(stage: Stage) -> Callable[..., None]:
    def run(**options: Any) -> None:
        from evoesap.steps import make_params, run_stage
        from evoesap.store.identity import pin

        out, revision = options.pop("out"), options.pop("revision", None)
        inputs: dict[str, Any] = {}
        for item in stage.inputs:
            value = options.pop(item.name)
            inputs[item.name] = list(value) if item.many else pin(value, revision) if item.model else value
        run_stage(stage.name, inputs, make_params(stage.name, options), out)
        if stage.headline is not None and not is_quiet():  # to stderr, beside the logs: stdout stays the URI alone
            click.echo(scrub(load(stage.headline)(out)), err=True)
        echo_uri(out)

    return run
