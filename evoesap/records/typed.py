"""Frozen dataclasses as JSON documents: each field's annotation says what its JSON value must be, so one walk
checks a parsed document (naming the first bad field) and writes a record back as the very same JSON."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from evoesap.errors import ArtifactError
from evoesap.store import artifacts

R = TypeVar("R", bound="Record")


class _Misfit(Exception):
    """A JSON value that does not fit its annotation: where it sits (`heldout.samples`) and what was wanted."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path, self.problem = path, problem


@dataclasses.dataclass(frozen=True)
class Record:
    """A JSON object with typed fields. Top-level records name the file they are and the stage that writes it;
    fields with a default may be absent (documents written before the field existed)."""

    FILE: ClassVar[str | None] = None
    STAGE: ClassVar[str | None] = None

    def to_json(self) -> dict[str, Any]:
        """The document: tuples as lists, integer keys as strings, every number as the type it was given."""
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[R], doc: Any, where: str) -> R:
        """The record of a parsed document; `where` (the file) names it in the ArtifactError that refuses a
        missing or mistyped field, with the stage that rebuilds it. Keys it does not know are ignored."""
        try:
            return _decode(cls, doc, "")
        except _Misfit as misfit:
            field = f": field {misfit.path!r}" if misfit.path else ""
            raise ArtifactError(f"{where}{field} {misfit.problem}: {artifacts.rebuild_hint(cls.STAGE)}") from None


def _encode(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}  # str keys sort as the JSON text always did
    return value


@functools.cache
def _fields(cls: type[Record]) -> tuple[tuple[str, Any, bool], ...]:
    """(name, annotation, may be absent) of each field, annotations resolved once per class."""
    hints = get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )


def _decode(kind: Any, value: Any, path: str) -> Any:
    """`value` as `kind`: int, float (an int stays an int), str, bool, X | None, tuple[X, ...], dict[str | int, X]
    or a Record; _Misfit otherwise."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, path)
    if isinstance(kind, type) and issubclass(kind, Record):
        if not isinstance(value, dict):
            raise _Misfit(path, f"must be a JSON object, got {_shown(value)}")
        prefix = f"{path}." if path else ""
        present = {}
        for name, annotation, optional in _fields(kind):
            if name in value:
                present[name] = _decode(annotation, value[name], prefix + name)
            elif not optional:
                raise _Misfit(prefix + name, "is missing")
        return kind(**present)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Misfit(path, f"must be a list, got {_shown(value)}")
        return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _Misfit(path, f"must be a JSON object, got {_shown(value)}")
        return {_key(args[0], k, path): _decode(args[1], v, f"{path}.{k}") for k, v in value.items()}
    wanted = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}[kind]
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, wanted):
        raise _Misfit(path, f"must be {'a' if kind is not int else 'an'} {kind.__name__}, got {_shown(value)}")
    return value


def _key(kind: type, key: str, path: str) -> Any:
    if kind is int:
        try:
            return int(key)
        except ValueError:
            raise _Misfit(path, f"keys must be integers, got {key!r}") from None
    return key


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
