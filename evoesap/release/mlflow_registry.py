"""Hand a released model to MLflow's model registry through its REST API (no mlflow package needed).

A registered model `name`, one model version per release whose source is where the release lies, and the release's
lineage as version tags (`evoesap.release.lineage`). A re-run finds the version of the same release (by its
`evoesap.publish_manifest_sha256` tag) and sets its tags again instead of adding a version. The server and its token
come from the environment (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD), as MLflow's own client reads them; the token is never logged nor repeated in an error.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from evoesap import network
from evoesap.errors import ReleaseError
from evoesap.release import lineage, registry

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
API = "api/2.0/mlflow"
NAMES_VERSIONS = False  # MLflow numbers a registered model's versions itself
IDENTITY_TAG = registry.IDENTITY_TAG
Registered = registry.Registered


def server() -> str:
    """The MLflow server from MLFLOW_TRACKING_URI: an http(s) URL without credentials in it."""
    return registry.http_server(TRACKING_URI_ENV, "the MLflow server", "https://mlflow.example.org")


def _authorization() -> tuple[dict[str, str], str]:
    """(the Authorization header, the secret in it) from the environment; none without credentials."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return {"Authorization": f"Bearer {token}"}, token
    user, password = os.environ.get(USERNAME_ENV, ""), os.environ.get(PASSWORD_ENV, "")
    if user and password:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}, password
    return {}, ""


class _Client:
    """MLflow's REST API at `base`: one JSON request at a time, each answered within registry.REQUEST_TIMEOUT_S, none sent after
    `stop` (the overall deadline passed); a failure is one scrubbed line."""

    def __init__(self, base: str, stop: threading.Event) -> None:
        self.base, self.stop = base, stop
        self.headers, self.secret = _authorization()

    def call(self, method: str, path: str, body: dict[str, Any], missing_ok: str | None = None) -> dict[str, Any]:
        """The answer to `method` on `path`; with `missing_ok`, an error whose error_code is that answers {} instead."""
        if self.stop.is_set():
            raise registry.abandoned()
        url = f"{self.base}/{API}/{path}"
        data = None
        if method == "GET":
            url += "?" + urllib.parse.urlencode(body)
        else:
            data = json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json", **self.headers}
        )
        try:
            with urllib.request.urlopen(request, timeout=registry.REQUEST_TIMEOUT_S) as answer:  # noqa: S310 - http(s) only (tracking_uri)
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as exc:
            reply = exc.read()
            code = _error_code(reply)
            if missing_ok is not None and code == missing_ok:
                return {}
            raise ReleaseError(self._refused(path, exc.code, code, reply)) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = network.reply_line(getattr(exc, "reason", None) or exc, self.secret)
            raise ReleaseError(
                f"the model registry at {network.redact(self.base)} cannot be reached ({why}): check {TRACKING_URI_ENV} "
                "and that the server is up"
            ) from None

    def _refused(self, path: str, status: int, code: str, reply: bytes) -> str:
        message = _error_message(reply) or reply
        what = f"the model registry at {network.redact(self.base)} refused {path} (HTTP {status}"
        what += f" {code}): " if code else "): "
        what += network.reply_line(message, self.secret, limit=240)
        if status in (401, 403):
            return f"{what}: check the credentials in {TOKEN_ENV} (or {USERNAME_ENV} / {PASSWORD_ENV})"
        return f"{what}: correct the request, or the registry's settings"


def _error_code(reply: bytes) -> str:
    try:
        return str(json.loads(reply).get("error_code") or "")
    except (ValueError, AttributeError):
        return ""


def _error_message(reply: bytes) -> str:
    try:
        return str(json.loads(reply).get("message") or "")
    except (ValueError, AttributeError):
        return ""


def register(published: str, name: str, *, source: str | None = None) -> Registered:
    """Register the release at `published` in MLflow's model registry (`evoesap.release.registry.register`)."""
    return registry.register(published, name, registry="mlflow", source=source)


def hand_off(base: str, name: str, release: lineage.Release, version: str | None, stop: threading.Event) -> Registered:
    """The release as a version of `name` at the MLflow server `base`; `version` is always None (MLflow numbers)."""
    client = _Client(base, stop)
    client.call("POST", "registered-models/create", {"name": name}, missing_ok="RESOURCE_ALREADY_EXISTS")
    query = f"name='{_quoted(name)}' and tags.`{IDENTITY_TAG}`='{release.manifest_sha256}'"
    found = client.call("GET", "model-versions/search", {"filter": query}).get("model_versions") or []
    if found:
        number, created = str(found[0]["version"]), False
    else:
        body = {"name": name, "source": release.source, "tags": [{"key": IDENTITY_TAG, "value": release.manifest_sha256}]}
        number, created = str(client.call("POST", "model-versions/create", body)["model_version"]["version"]), True
    for key, value in release.tags.items():
        client.call("POST", "model-versions/set-tag", {"name": name, "version": number, "key": key, "value": value})
    return Registered(name, number, release.source, dict(release.tags), created)


def _quoted(text: str) -> str:
    """`text` inside a single-quoted string of MLflow's search filter."""
    return text.replace("\\", "\\\\").replace("'", "\\'")
