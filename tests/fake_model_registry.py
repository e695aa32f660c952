"""A Kubeflow Model Registry in memory, served on 127.0.0.1 (`recording_http.serving`): the REST endpoints of its API
(api/model_registry/v1) that the `model_registry` client calls to register a model, find and update a version and its
model artifact. Each request body is parsed with the generated OpenAPI model of that endpoint (`mr_openapi.models`),
as the server's own schema would check it, and each answer has the shape the client's models parse: a call the real
server would refuse is refused here too (HTTP 400 with the parser's message)."""

from __future__ import annotations

import itertools
import json
import threading
import urllib.parse
from typing import Any, ClassVar

from recording_http import JsonHandler

API = "/api/model_registry/v1"


class FakeModelRegistry(JsonHandler):
    """Registered models, versions and model artifacts by id; `requests` records (method, path, Authorization)."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    objects: ClassVar[dict[str, dict[str, dict[str, Any]]]] = {}
    requests: ClassVar[list[tuple[str, str, str | None]]] = []
    ids: ClassVar[itertools.count] = itertools.count(1)
    refuse: ClassVar[tuple[int, str] | None] = None  # answer every request with this status and message

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.objects = {"registered_models": {}, "model_versions": {}, "model_artifacts": {}}
            cls.requests, cls.ids, cls.refuse = [], itertools.count(1), None

    # what the client reads back ----------------------------------------------------------------------------------
    @classmethod
    def versions(cls, name: str) -> list[dict[str, Any]]:
        """The versions of the registered model `name`, oldest first."""
        models = [m for m in cls.objects["registered_models"].values() if m["name"] == name]
        if not models:
            return []
        return [v for v in cls.objects["model_versions"].values() if v["registeredModelId"] == models[0]["id"]]

    @classmethod
    def artifacts(cls, version_id: str) -> list[dict[str, Any]]:
        return [a for a in cls.objects["model_artifacts"].values() if a["parent"] == version_id]

    # HTTP ----------------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        with self.lock:
            self.requests.append((method, url.path, self.headers.get("Authorization")))
            if self.refuse is not None:
                status, message = self.refuse
                return self._reply({"code": "refused", "message": message.format(auth=self.headers.get("Authorization"))}, status)
            if not url.path.startswith(API + "/"):
                return self._error(404, f"no route {url.path}")
            parts = url.path[len(API) + 1 :].split("/")
            try:
                answer = self._route(method, parts, query, body)
            except ValueError as exc:  # a body the API's schema refuses
                return self._error(400, " ".join(str(exc).split()))
        if answer is None:
            return self._error(404, f"not found: {url.path}?{url.query}")
        self._reply(*answer) if isinstance(answer, tuple) else self._reply(answer)

    def _error(self, status: int, message: str) -> None:
        self._reply({"code": str(status), "message": message}, status)

    def _route(self, method: str, parts: list[str], query: dict[str, str], body: Any) -> Any:
        from mr_openapi import models

        store = self.objects
        match method, parts:
            case "GET", ["registered_models"]:
                return _page(list(store["registered_models"].values()), query)
            case "GET", ["registered_model"]:
                return _find(store["registered_models"], name=query.get("name"))
            case "POST", ["registered_models"]:
                made = models.RegisteredModelCreate.from_dict(body).to_dict()
                if _find(store["registered_models"], name=made["name"]):
                    return {"code": "409", "message": f"registered model {made['name']} exists"}, 409
                return self._store("registered_models", made), 201
            case "GET", ["registered_models", model_id, "versions"]:
                found = [v for v in store["model_versions"].values() if v["registeredModelId"] == model_id]
                return _page(found, query)
            case "GET", ["model_version"]:
                return _find(store["model_versions"], name=query.get("name"), registeredModelId=query.get("parentResourceId"))
            case "POST", ["model_versions"]:
                made = models.ModelVersionCreate.from_dict(body).to_dict()
                if made["registeredModelId"] not in store["registered_models"]:
                    return {"code": "404", "message": f"no registered model {made['registeredModelId']}"}, 404
                if _find(store["model_versions"], name=made["name"], registeredModelId=made["registeredModelId"]):
                    return {"code": "409", "message": f"version {made['name']} exists"}, 409
                return self._store("model_versions", made), 201
            case "PATCH", ["model_versions", version_id]:
                return self._update("model_versions", version_id, models.ModelVersionUpdate.from_dict(body).to_dict())
            case "POST", ["model_versions", version_id, "artifacts"]:
                if version_id not in store["model_versions"]:
                    return None
                made = models.Artifact.from_dict(body).to_dict()
                if made.get("artifactType") != "model-artifact":
                    raise ValueError(f"artifactType {made.get('artifactType')!r} is not model-artifact")
                return self._store("model_artifacts", {**made, "parent": version_id}), 201
            case "GET", ["model_artifact"]:
                return _find(store["model_artifacts"], name=query.get("name"), parent=query.get("parentResourceId"))
            case "PATCH", ["model_artifacts", artifact_id]:
                return self._update("model_artifacts", artifact_id, models.ModelArtifactUpdate.from_dict(body).to_dict())
        return None

    def _store(self, kind: str, made: dict[str, Any]) -> dict[str, Any]:
        now = "1700000000000"
        made = {**made, "id": str(next(self.ids)), "createTimeSinceEpoch": now, "lastUpdateTimeSinceEpoch": now}
        self.objects[kind][made["id"]] = made
        return _public(made)

    def _update(self, kind: str, object_id: str, changes: dict[str, Any]) -> Any:
        if object_id not in self.objects[kind]:
            return None
        self.objects[kind][object_id].update(changes)  # a field given replaces the stored one, customProperties whole
        return _public(self.objects[kind][object_id])


def _public(made: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in made.items() if k != "parent"}


def _find(objects: dict[str, dict[str, Any]], **fields: str | None) -> dict[str, Any] | None:
    for made in objects.values():
        if all(made.get(k) == v for k, v in fields.items() if v is not None):
            return _public(made)
    return None


def _page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """All items in one page: the client's pager stops when the next page token comes back as it started."""
    items = [_public(i) for i in items]
    return {"nextPageToken": "", "pageSize": int(query.get("pageSize") or len(items) or 1), "size": len(items), "items": items}
