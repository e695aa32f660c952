"""Hand a released model to a model registry: MLflow's (the default) or the Kubeflow Model Registry.

Both take the same fields, read once by `evoesap.release.lineage`: a registered model `name`, one version per release
whose model is where the release lies for others, its format, and the release's lineage (`evoesap.*`) as the version's
tags or custom properties. A re-run finds the version of the same release (by its `evoesap.publish_manifest_sha256`)
and sets its fields again instead of adding a version. Each registry is a module with `server()` (its URL from the
environment, refused before any request when missing or malformed) and `hand_off(server, name, release, version,
stop)`, which sends no request once `stop` is set (the hand-off's deadline, EVOESAP_REGISTRY_DEADLINE_S, passed).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import os
import urllib.parse

from evoesap import network
from evoesap.errors import ConfigError, ReleaseError
from evoesap.release import lineage

log = logging.getLogger(__name__)

REGISTRIES = {"mlflow": "evoesap.release.mlflow_registry", "kubeflow": "evoesap.release.kubeflow_registry"}
DEFAULT = "mlflow"
DEADLINE_ENV = "EVOESAP_REGISTRY_DEADLINE_S"  # seconds the whole hand-off may take, however slowly the server answers
DEADLINE_S = 120.0
REQUEST_TIMEOUT_S = 30.0  # one request silent this long: the server is down
IDENTITY_TAG = lineage.PREFIX + "publish_manifest_sha256"


@dataclasses.dataclass(frozen=True)
class Registered:
    """A model version in the registry: the release's."""

    name: str
    version: str
    source: str
    tags: dict[str, str]
    created: bool  # False: the release was registered before, and its fields were set again


def target(registry: str):  # noqa: ANN201 - a module (mlflow_registry or kubeflow_registry)
    """The module that speaks to `registry`; an unknown name is refused with the nearest known one."""
    if registry not in REGISTRIES:
        near = difflib.get_close_matches(registry, REGISTRIES, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"unknown model registry {registry!r}: {hint}choose one of {', '.join(REGISTRIES)}")
    return importlib.import_module(REGISTRIES[registry])


def register(
    published: str,
    name: str,
    *,
    registry: str = DEFAULT,
    source: str | None = None,
    version: str | None = None,
) -> Registered:
    """Register the release at `published` (a publish artifact) as a version of the registered model `name` in
    `registry` (mlflow or kubeflow), its lineage as the version's tags. `source`: where others read it, in place of
    where it was pushed (`lineage.read`); `version`: the version's name, where the registry lets the client name it
    (kubeflow; MLflow numbers its versions itself)."""
    module = target(registry)
    if not name.strip():
        raise ConfigError("--name is empty: give the registered model's name")
    if version is not None and not version.strip():
        raise ConfigError("--version is empty: give the version's name, or leave it out for the next number")
    if version is not None and not module.NAMES_VERSIONS:
        raise ConfigError(
            f"--version {version!r} cannot be given to {registry}: it numbers its versions itself; leave --version out"
        )
    base = module.server()
    release = lineage.read(published, source)  # refused before any request: a release not readable from elsewhere
    seconds = network.deadline_s(DEADLINE_ENV, DEADLINE_S)
    registered = network.call(
        lambda stop: module.hand_off(base, name, release, version, stop),
        seconds=seconds,
        what=f"registering {name} at {network.redact(base)}",
        knob=DEADLINE_ENV,
        error=ReleaseError,
    )
    log.info(
        "%s %s version %s (source %s) at %s",
        "registered" if registered.created else "found already registered, fields set again:",
        name,
        registered.version,
        registered.source,
        network.redact(base),
    )
    return registered


def abandoned() -> network.Stopped:
    """What a client raises instead of sending a request after the hand-off's deadline."""
    return network.Stopped(f"a request to the model registry abandoned at its deadline ({DEADLINE_ENV})")


def http_server(variable: str, what: str, example: str) -> str:
    """The environment variable `variable`: the http(s) URL of `what` (a registry's server), without credentials."""
    uri = os.environ.get(variable, "").strip()
    if not uri:
        raise ConfigError(f"no model registry: set {variable} to {what}'s URL ({example})")
    network.refuse_credentials(uri, variable)
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{variable} {network.redact(uri)!r} is not the http(s):// URL of {what}: the hand-off speaks its REST API"
        )
    return uri.rstrip("/")
