"""Hand a released model to the Kubeflow Model Registry through its Python client (`model_registry`, the optional
extra `evoesap[kubeflow-registry]`).

The same fields as MLflow's hand-off (`evoesap.release.registry`): a registered model `name`; a version (named
`version`, else one more than the highest numbered version) whose custom properties are the release's lineage; its
model artifact, whose uri is where the release lies and whose model format is the checkpoint's (safetensors, or
compressed-tensors for a quantized release). A re-run finds the version of the same release by its
`evoesap.publish_manifest_sha256` property and sets its properties and artifact again. The server comes from
EVOESAP_KF_REGISTRY_URL, its token from EVOESAP_KF_REGISTRY_TOKEN (else the client's own: a pipeline's or the pod's
service account token), a private CA from EVOESAP_KF_REGISTRY_CA; the token is never logged nor repeated in an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Coroutine
from typing import Any, TypeVar

from evoesap import network
from evoesap.errors import ConfigError, ReleaseError
from evoesap.release import lineage, registry

T = TypeVar("T")

URL_ENV = "EVOESAP_KF_REGISTRY_URL"
TOKEN_ENV = "EVOESAP_KF_REGISTRY_TOKEN"
CA_ENV = "EVOESAP_KF_REGISTRY_CA"  # path of a PEM file: the CA of an https server a private authority signed
AUTHOR = "evoesap"  # the author of each version, and the owner of a registered model it creates
NAMES_VERSIONS = True  # a version's name is the client's to choose
EXTRA = "pip install 'evoesap[kubeflow-registry]'"


def server() -> str:
    """The Kubeflow Model Registry from EVOESAP_KF_REGISTRY_URL: scheme://host[:port], without credentials or a path
    (the client appends its API's path to exactly that)."""
    import urllib.parse

    _client_module()  # refused before the release is read: nothing could send it
    base = registry.http_server(URL_ENV, "the Kubeflow Model Registry", "https://model-registry.example.org:443")
    if urllib.parse.urlsplit(base).path:
        raise ConfigError(
            f"{URL_ENV} {network.redact(base)!r} has a path: the Kubeflow Model Registry's client takes "
            "scheme://host[:port] only; give the server's address without the path"
        )
    return base


def _client_module() -> Any:
    """The `model_registry` package; its absence is one line saying how to install it."""
    try:
        import model_registry
    except ImportError:
        raise ConfigError(f"the Kubeflow Model Registry's Python client (model-registry) is not installed: {EXTRA}") from None
    return model_registry


def hand_off(base: str, name: str, release: lineage.Release, version: str | None, stop: threading.Event) -> registry.Registered:
    """The release as a version of `name` in the Kubeflow Model Registry at `base`; a failure is one scrubbed line."""
    from aiohttp import ClientError
    from model_registry.exceptions import StoreError
    from mr_openapi.exceptions import ApiException

    token = os.environ.get(TOKEN_ENV, "").strip()
    try:
        with warnings.catch_warnings():  # the client warns when it has no token; a plain-http registry may take none
            warnings.simplefilter("ignore")
            client = _connect(base, token, stop)
        return _register(client, name, release, version)
    except ApiException as exc:
        raise ReleaseError(_refused(base, exc, token)) from None
    except StoreError as exc:
        raise ReleaseError(
            f"the Kubeflow Model Registry at {network.redact(base)} refused {name!r}: {network.reply_line(exc, token)}"
            f"{_token_hint(exc)}"
        ) from None
    except (ClientError, OSError, asyncio.TimeoutError) as exc:
        why = network.reply_line(str(exc) or type(exc).__name__, token)
        raise ReleaseError(
            f"the Kubeflow Model Registry at {network.redact(base)} cannot be reached ({why}): check {URL_ENV} and that "
            "the server is up"
        ) from None


def _connect(base: str, token: str, stop: threading.Event) -> Any:
    """The client for `base`; it asks the server for one registered model at once, so an unreachable one fails here."""
    model_registry = _client_module()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        # each call of the client on its own event loop in this (the deadline's worker) thread, so the caller's loop,
        # a notebook's, is never re-entered; none started once the deadline passed
        if stop.is_set():
            coro.close()
            raise registry.abandoned()
        return asyncio.run(asyncio.wait_for(coro, registry.REQUEST_TIMEOUT_S))

    return model_registry.ModelRegistry(
        base,
        author=AUTHOR,
        user_token=token or None,
        custom_ca_envvar=CA_ENV,
        log_level=logging.ERROR,  # its port hints would print on every run against a non-default port
        async_runner=run,
    )


def _register(client: Any, name: str, release: lineage.Release, version: str | None) -> registry.Registered:
    from model_registry.types import ModelArtifact

    fmt, fmt_version = release.model_format
    found, names = None, {}
    if client.get_registered_model(name) is not None:
        for candidate in client.get_model_versions(name):
            held = (candidate.custom_properties or {}).get(registry.IDENTITY_TAG)
            if held == release.manifest_sha256:
                found = candidate
            names[candidate.name] = held
    if found is None:
        if version in names:
            raise ReleaseError(
                f"version {version!r} of {name!r} in the Kubeflow Model Registry holds another release (publish manifest "
                f"{names[version] or 'not an EvoESAP release'}): give another --version, or leave it out for the next number"
            )
        numbers = [int(n) for n in names if n.isdigit()]
        named = version or str(max(numbers, default=0) + 1)
        client.register_model(
            name,
            release.source,
            version=named,
            model_format_name=fmt,
            model_format_version=fmt_version,
            metadata=dict(release.tags),
        )
        return registry.Registered(name, named, release.source, dict(release.tags), True)
    # the same release again: its properties and its artifact set again; an artifact missing (a registration cut
    # off between its version and its artifact) is made now
    found.custom_properties = {**(found.custom_properties or {}), **release.tags}
    client.update(found)
    artifact = client.get_model_artifact(name, found.name)
    if artifact is None:
        made = ModelArtifact(name=name, uri=release.source, model_format_name=fmt, model_format_version=fmt_version)
        client.async_runner(client._api.upsert_model_version_artifact(made, found.id))
    elif (artifact.uri, artifact.model_format_name, artifact.model_format_version) != (release.source, fmt, fmt_version):
        artifact.uri, artifact.model_format_name, artifact.model_format_version = release.source, fmt, fmt_version
        client.update(artifact)
    return registry.Registered(name, found.name, release.source, dict(release.tags), False)


def _refused(base: str, exc: Any, token: str) -> str:
    """One line for an HTTP error answer: the status, the server's own message, and what to check."""
    import json

    message = exc.body or exc.reason or ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):  # a body that is not the API's Error object
        message = json.loads(message).get("message") or message
    status = exc.status or "no status"
    line = f"the Kubeflow Model Registry at {network.redact(base)} refused a request (HTTP {status}): "
    line += network.reply_line(message, token, limit=240)
    if exc.status in (401, 403):
        return f"{line}: check the token in {TOKEN_ENV} (or the service account's)"
    return f"{line}: correct the request, or the registry's settings"


def _token_hint(exc: Exception) -> str:
    if "token" in str(exc).lower():
        return f": set {TOKEN_ENV} (an https registry takes a token)"
    return ""
