"""Which MoE model_types of the installed transformers this package prunes, and why not the others.

Generated from transformers itself: every config class whose defaults declare an expert count (one of
`EXPERT_COUNT_FIELDS`, directly, in a nested dict or config such as DBRX's `ffn_config`, or in a sub-config of a
multimodal model) is listed, as supported (it has a row in `evoesap.moe.families`) or with a one-line reason: a
known one from `families.UNSUPPORTED`, else a reason read off the config (no causal-LM class, a multimodal
wrapper), else a generic one. A model_type transformers adds later shows up here without a change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from evoesap.moe.families import FAMILIES, UNSUPPORTED, Family

# Config attributes that hold a routed-expert count, in the spellings transformers' MoE configs use.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
GENERIC_REASON = "its router and experts have not been checked against masking = removal"


@dataclasses.dataclass(frozen=True)
class Coverage:
    """One MoE model_type of the installed transformers and whether EvoESAP prunes it."""

    model_type: str
    status: str  # SUPPORTED or NOT_SUPPORTED
    experts_field: str  # where its config keeps the expert count ("text_config.num_experts" for a wrapper)
    reason: str  # a supported family's notes, or why it is not supported


def _expert_field(config: Any, prefix: str = "", depth: int = 0) -> str | None:
    """The dotted path of the first expert-count attribute of `config` (or of a nested config or dict), if any."""
    if depth > 2 or config is None:
        return None
    read = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    for name in EXPERT_COUNT_FIELDS:
        value = read(name)
        if isinstance(value, (int, list)) and not isinstance(value, bool) and value:
            return prefix + name
    names = list(config) if isinstance(config, dict) else list(vars(config))
    for name in names:
        value = read(name)
        if isinstance(value, dict) or hasattr(value, "to_dict"):
            found = _expert_field(value, f"{prefix}{name}.", depth + 1)
            if found:
                return found
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Default configs of some families log warnings about their own defaults; the scan is not the place for them."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _default_config(config_class: type) -> Any | None:
    with _quiet():
        try:
            return config_class()
        except Exception:  # noqa: BLE001 - a config that cannot build from its defaults is simply not listed
            return None


def coverage() -> list[Coverage]:
    """Every MoE model_type of the installed transformers, supported or with its reason, sorted by name."""
    return list(_scan())


@functools.cache  # a scan builds every config class once; the installed transformers does not change in a process
def _scan() -> tuple[Coverage, ...]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows: dict[str, Coverage] = {}
    for model_type in CONFIG_MAPPING.keys():  # noqa: SIM118 - a lazy mapping: its keys() lists without importing
        with contextlib.suppress(Exception):  # a model_type whose module fails to import is not listed
            config = _default_config(CONFIG_MAPPING[model_type])
            field = _expert_field(config) if config is not None else None
            if field is None and model_type not in FAMILIES:
                continue
            rows[model_type] = _row(
                model_type, field or FAMILIES[model_type].num_experts_field, model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            )
    for model_type, family in FAMILIES.items():  # a row whose config no longer builds from its defaults still shows
        rows.setdefault(model_type, Coverage(model_type, SUPPORTED, family.num_experts_field, supported_notes(family)))
    return tuple(rows[name] for name in sorted(rows))


def supported_notes(family: Family) -> str:
    """What a user of a supported family should know: its routing, its notes and its multi-token-prediction layers."""
    notes = [family.routing, family.notes]
    if family.mtp_field:
        notes.append(
            f"multi-token-prediction layers ({family.mtp_field}) are not built by transformers and never pruned: "
            "a streamed prune copies them as stored, an in-memory save leaves them out"
        )
    return "; ".join(n for n in notes if n)


def _row(model_type: str, field: str, causal_lm: bool) -> Coverage:
    if model_type in FAMILIES:
        return Coverage(model_type, SUPPORTED, FAMILIES[model_type].num_experts_field, supported_notes(FAMILIES[model_type]))
    if model_type in UNSUPPORTED:
        why, nearest, differs = UNSUPPORTED[model_type]
        return Coverage(model_type, NOT_SUPPORTED, field, f"{why} (nearest: {nearest}, {differs})")
    if "text_config." in field and not causal_lm:
        return Coverage(model_type, NOT_SUPPORTED, field, "multimodal: its language model (text_config) holds the experts")
    if not causal_lm:
        return Coverage(
            model_type, NOT_SUPPORTED, field, "no causal-LM class in transformers (encoder, encoder-decoder or a part)"
        )
    return Coverage(model_type, NOT_SUPPORTED, field, GENERIC_REASON)


def format_table(rows: list[Coverage]) -> str:
    """`rows` as the plain-text table `evoesap families` prints, supported ones first."""
    ordered = sorted(rows, key=lambda r: (r.status != SUPPORTED, r.model_type))
    widths = [
        max(len(getattr(r, f)) for r in ordered + [Coverage("model_type", "status", "expert count", "")])
        for f in ("model_type", "status", "experts_field")
    ]
    lines = [f"{'model_type':<{widths[0]}}  {'status':<{widths[1]}}  {'expert count':<{widths[2]}}  notes / reason"]
    for r in ordered:
        lines.append(f"{r.model_type:<{widths[0]}}  {r.status:<{widths[1]}}  {r.experts_field:<{widths[2]}}  {r.reason}".rstrip())
    supported = sum(r.status == SUPPORTED for r in rows)
    lines.append(f"\n{supported} of {len(rows)} MoE model_types of the installed transformers are supported")
    return "\n".join(lines)
