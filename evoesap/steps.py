"""The stage registry: run any stage by name, reusing a finished output made from the same inputs and parameters.

`run_stage` runs a stage into a given output URI unless the manifest there records the same stage,
parameters and inputs (the CLI's entry). Orchestrators (the KFP components, `evoesap pipeline run`)
call `run_step`, which picks the URI itself: `<storage_root>/<stage>/<key>`, the key hashing the
stage, its parameters and its inputs' manifests, so a stage whose inputs and parameters are unchanged
is found finished and skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import typing
from typing import Any, Mapping, Sequence

from evoesap import artifacts
from evoesap.errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Step:
    module: str  # evoesap.stages.<module>
    function: str  # run_<stage>
    params_class: str  # frozen dataclass of the stage's parameters


STEPS: dict[str, Step] = {
    "calibrate": Step("calibrate", "run_calibrate", "CalibrateParams"),
    "cache-logits": Step("cache_logits", "run_cache_logits", "CacheLogitsParams"),
    "search": Step("search", "run_search", "SearchParams"),
    "prune": Step("prune", "run_prune", "PruneParams"),
    "evaluate": Step("evaluate", "run_evaluate", "EvaluateParams"),
    "report": Step("report", "run_report", "ReportParams"),
}


def _stage(name: str) -> tuple[Any, type]:
    if name not in STEPS:
        raise ConfigError(f"unknown stage {name!r}; stages are {', '.join(STEPS)}")
    step = STEPS[name]
    module = importlib.import_module(f"evoesap.stages.{step.module}")
    return getattr(module, step.function), getattr(module, step.params_class)


def params_class(stage: str) -> type:
    """The frozen dataclass of a stage's parameters."""
    return _stage(stage)[1]


def make_params(stage: str, values: Mapping[str, Any]) -> Any:
    """The stage's parameter dataclass from plain values, with unknown names refused clearly."""
    _, params_class = _stage(stage)
    fields = {f.name for f in dataclasses.fields(params_class)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"unknown parameter(s) {', '.join(unknown)} for stage {stage!r}; valid: {', '.join(sorted(fields))}"
        )
    _check_types(stage, params_class, values)
    try:
        return params_class(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid parameters for stage {stage!r}: {exc}") from exc


def _check_types(stage: str, params_class: type, values: Mapping[str, Any]) -> None:
    """Refuse values a config would otherwise coerce silently: 2.7 or true for an integer, "yes" for a switch.

    A whole float (2.0) stays accepted for an integer: some orchestrators deliver every number as a float.
    """
    hints = typing.get_type_hints(params_class)
    for name, value in values.items():
        allowed = set(typing.get_args(hints[name])) or {hints[name]}
        if value is None and type(None) in allowed or str in allowed and isinstance(value, str):
            continue
        if bool in allowed:
            ok, what = isinstance(value, bool), "true or false"
        elif int in allowed and float not in allowed:
            ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
            what = "an integer"
        elif float in allowed:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        else:
            continue
        if not ok:
            raise ConfigError(f"{stage}.{name} must be {what}, got {value!r}")


def _flat_inputs(inputs: Mapping[str, str | Sequence[str] | None]) -> dict[str, str | None]:
    flat: dict[str, str | None] = {}
    for name, value in inputs.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{name}.{i}": v for i, v in enumerate(value)})
        else:
            flat[name] = value
    return flat


def output_uri(stage: str, storage_root: str, inputs: Mapping[str, Any], params: Any) -> str:
    """Content-addressed output location of a stage run."""
    described = artifacts.describe_inputs(_flat_inputs(inputs))
    key = artifacts.cache_key(stage, dataclasses.asdict(params), described)
    return artifacts.join(storage_root, stage, key[:24])


def run_stage(stage: str, inputs: Mapping[str, Any], params: Any, out_uri: str) -> artifacts.Manifest:
    """Run `stage` (parameters as its dataclass) into `out_uri`, or return the manifest already there when
    it records the same stage, parameters and inputs."""
    function, _ = _stage(stage)
    artifacts.preflight(out_uri, stage, _flat_inputs(inputs))  # before any work: never destroy, inputs exist
    done = artifacts.cached(out_uri, stage, dataclasses.asdict(params), _flat_inputs(inputs))
    if done is not None:
        log.info("%s: reusing the finished artifact at %s", stage, artifacts.redact(out_uri))
        return done
    from evoesap import plan

    plan.check_stage(stage, dict(inputs), params)  # refuses a stage that would not fit, before any work
    return function(**inputs, params=params, out_uri=out_uri)


def run_step(stage: str, storage_root: str, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """Run `stage` under `storage_root` at its content-addressed URI (see the module docstring); return that URI."""
    parsed = make_params(stage, params)
    out = output_uri(stage, storage_root, inputs, parsed)
    run_stage(stage, inputs, parsed, out)
    return out
