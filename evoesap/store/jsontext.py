"""JSON text in and out of EvoESAP's files, so a reader and a writer each refuse in one line what is not JSON.

Reading: text that is not JSON, or that nests deeper than the parser follows (Python's json raises RecursionError,
a bug's error, past about a thousand levels), is refused as the caller's error class naming the file. Writing: NaN
and infinity, which JSON has not (Python writes `NaN`, `-Infinity`, which other readers refuse), are refused naming
where they sit.
"""

from __future__ import annotations

import json
import math
from typing import Any

from evoesap.errors import ArtifactError, EvoESAPError


def loads(text: str | bytes, where: str, error: type[EvoESAPError] = ArtifactError, hint: str = "") -> Any:
    """`text` parsed as JSON; refused as `error` ("`where`: ...", then `hint`) when it is not JSON, not UTF-8, or nests
    too deeply to parse."""
    tail = f": {hint}" if hint else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where} line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg}){tail}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{where} (byte {exc.start}) is not UTF-8 text{tail}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read (more than about a thousand levels){tail}") from None


def nonfinite(value: Any) -> str | None:
    """Where in `value` (a JSON document as Python values) the first NaN or infinity sits (`checks[0].limit`); None
    when there is none. Walked without recursion, so any depth is fine."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path or "<root>"
        if isinstance(item, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(item.items()))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def dumps(value: Any, where: str, **options: Any) -> str:
    """`value` as JSON text (`json.dumps` `options`); an ArtifactError naming the field when it holds NaN or infinity,
    which JSON has not: nothing is written."""
    found = nonfinite(value)
    if found is not None:
        raise ArtifactError(
            f"{where}: {found} is not a finite number, which JSON cannot hold; nothing was written (a non-finite value "
            "reached a record: check the inputs and parameters that produced it)"
        )
    return json.dumps(value, allow_nan=False, **options)
