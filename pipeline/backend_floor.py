"""The lowest Kubeflow Pipelines backend that honours every field a compiled spec holds.

`backend_floors.yaml` (beside this module; its header says where each fact comes from) gives, for each field path
of a compiled spec (map keys written `*`, list items at their list's path), the first backend release that honours
it. `spec_floor` walks a compiled spec's documents (the PipelineSpec and the kfp-kubernetes platform spec), looks
every field up, and names the highest floor with the fields that set it; a field the table lacks is reported, not
guessed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from evoesap.errors import ArtifactError

TABLE_FILE = Path(__file__).with_name("backend_floors.yaml")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@dataclass(frozen=True)
class FloorTable:
    """Field path -> first backend release that honours it; `free`: paths whose value is free data (labels, a
    parameter's default), not fields; `maps`: paths whose keys are names (components, tasks, executors)."""

    fields: dict[str, str]
    free: frozenset[str]
    maps: frozenset[str]


@cache
def floor_table(path: Path = TABLE_FILE) -> FloorTable:
    data = yaml.safe_load(path.read_text())
    fields = {str(k): str(v) for k, v in data["fields"].items()}
    maps = frozenset(prefix for p in fields for prefix in _map_prefixes(p))
    return FloorTable(fields=fields, free=frozenset(data["free"]), maps=maps)


def _map_prefixes(path: str) -> Iterable[str]:
    parts = path.split(".")
    return (".".join(parts[:i]) for i, part in enumerate(parts) if part == "*")


@dataclass(frozen=True)
class Floor:
    """What a compiled spec needs of the backend: `version`, set by `because` (each field at that floor, with the
    first place it occurs in the spec); `unknown`: fields the table lacks, whose floor is therefore unknown."""

    version: str
    because: tuple[str, ...]
    unknown: tuple[str, ...] = ()

    def line(self, shown: int = 2) -> str:
        more = len(self.because) - shown
        named = ", ".join(self.because[:shown]) + (f" and {more} more" if more > 0 else "")
        return f"needs a Kubeflow Pipelines backend >= {self.version} (because of {named})"


def used_fields(documents: Iterable[Any], table: FloorTable | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The table paths the documents use, each with the first place (a dotted path, map keys spelled out) it occurs;
    and the paths the table lacks, likewise."""
    table = table or floor_table()
    used: dict[str, str] = {}
    unknown: dict[str, str] = {}

    def walk(value: Any, at: str, where: str) -> None:
        if isinstance(value, list):
            for item in value:
                walk(item, at, where)
            return
        if not isinstance(value, dict) or at in table.free:
            return
        for key, item in value.items():
            if at in table.maps:
                walk(item, f"{at}.*", f"{where}.{key}")
                continue
            path, place = f"{at}.{key}" if at else str(key), f"{where}.{key}" if where else str(key)
            if path not in table.fields:
                unknown.setdefault(path, place)
                continue
            used.setdefault(path, place)
            walk(item, path, place)

    for document in documents:
        walk(document, "", "")
    return used, unknown


def spec_floor(spec: Path | str, table: FloorTable | None = None) -> Floor:
    """The floor of a compiled spec file (every YAML document of it)."""
    table = table or floor_table()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    used, unknown = used_fields(yaml.load_all(Path(spec).read_text(), Loader=loader), table)
    if not used:
        raise ArtifactError(f"{spec} holds no pipeline spec field: give a spec that `evoesap pipeline compile` wrote")
    top = max((table.fields[path] for path in used), key=version_key)
    because: dict[str, str] = {}
    for path, place in used.items():
        if table.fields[path] == top:
            field = path.rsplit(".*.", 1)[-1]  # the field within its named thing (task, executor, artifact)
            because.setdefault(field, place.removesuffix(f".{field}") if place != field else "")
    return Floor(
        version=top, because=tuple((f"{f} in {at}" if at else f) for f, at in because.items()), unknown=tuple(sorted(unknown))
    )
