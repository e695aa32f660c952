"""Run any stage of the registry (`evoesap.registry`) by name, reusing a finished output made from the same inputs and parameters.

`run_stage` runs a stage into a given output URI unless the manifest there records the same stage,
parameters and inputs (the CLI's entry). Orchestrators (the KFP components, `evoesap pipeline run`)
call `run_step`, which picks the URI itself: `<storage_root>/<stage>/<key>`, the key hashing the
stage, its parameters and its inputs' content identities (an artifact's: its stage, cache key and payload
files' sha256, never where it or its inputs lay), so a stage whose inputs and parameters are unchanged is
found finished and skipped, even when an upstream artifact was made again at another URI.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from evoesap import params as parameters
from evoesap import registry as stages
from evoesap.errors import ConfigError
from evoesap.store import artifacts

log = logging.getLogger(__name__)


def params_class(stage: str) -> type:
    """The frozen dataclass of a stage's parameters."""
    return stages.get(stage).params_class()


def make_params(stage: str, values: Mapping[str, Any]) -> Any:
    """The stage's parameter dataclass from plain values (`evoesap.params.make`)."""
    return parameters.make(params_class(stage), values, stage)


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
    key = artifacts.cache_key(stage, parameters.keyed(params), described)
    return artifacts.join(storage_root, stage, key[:24])


def run_stage(stage: str, inputs: Mapping[str, Any], params: Any, out_uri: str) -> artifacts.Manifest:
    """Run `stage` (parameters as its dataclass) into `out_uri`, or return the manifest already there when
    it records the same stage, parameters and inputs."""
    function = stages.get(stage).function()
    artifacts.preflight(out_uri, stage, _flat_inputs(inputs))  # before any work: never destroy, inputs exist
    done = artifacts.cached(out_uri, stage, parameters.keyed(params), _flat_inputs(inputs))
    if done is not None:
        log.info("%s: reusing the finished artifact at %s", stage, artifacts.redact(out_uri))
        return done
    from evoesap.planning import plan

    plan.check_stage(stage, dict(inputs), params)  # refuses a stage that would not fit, before any work
    return function(**inputs, params=params, out_uri=out_uri)


def run_step(stage: str, storage_root: str, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """Run `stage` under `storage_root` at its content-addressed URI (see the module docstring); return that URI."""
    if not isinstance(storage_root, str) or not storage_root.strip():  # a run's parameter, not only the checked config's
        raise ConfigError(
            f"storage_root {storage_root!r} is empty, which would put the artifacts at the file system's root: give a "
            "directory or URI, e.g. ./runs/artifacts"
        )
    parsed = make_params(stage, params)
    out = output_uri(stage, storage_root, inputs, parsed)
    run_stage(stage, inputs, parsed, out)
    return out
