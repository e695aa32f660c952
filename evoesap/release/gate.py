"""The release gate as a pure function: thresholds and typed metrics records in, a verdict record out.

Each threshold becomes one or more checks (`records.GateCheck`), every check is kept in the verdict, and the verdict
passes only when every check does. Task checks compare each task's primary metric (higher is better, as everywhere in
the report); a task the reference has and the candidate lacks fails its check rather than being skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from evoesap import records
from evoesap.errors import EvoESAPError

# the evaluate parameters that decide what a task scores: the gate compares two evaluations only when these agree
SCORING_PARAMS = ("tasks", "limit", "allow_code_execution", "enable_thinking", "think_end_token", "max_length", "backend")


class Thresholds(Protocol):
    """The gate's thresholds (`evoesap.stages.gate.GateParams`); None: not checked."""

    min_heldout_esap: float | None
    max_task_drop: float | None
    max_previous_drop: float | None


class GateFailed(EvoESAPError):
    """The release gate refused the candidate: its message is the verdict's one line."""


RESOLUTION = 1e-9  # metrics are fractions of at most millions of examples: closer than this is the same value


def at_least(value: float | None, limit: float) -> bool:
    """value >= limit to the metrics' resolution: 0.7 meets 0.8 - 0.1 although the float difference is 1e-16 short."""
    return value is not None and value - limit >= -RESOLUTION


def _task_checks(
    candidate: records.MetricsRecord, reference: records.MetricsRecord, max_drop: float, against: str
) -> list[records.GateCheck]:
    """One check per primary metric of `reference`: the candidate's value may fall at most `max_drop` below it."""
    mine = {(r.task, r.metric, r.filter): float(r.value) for r in candidate.primary()}
    checks = []
    for r in reference.primary():
        value, limit = mine.get((r.task, r.metric, r.filter)), float(r.value) - max_drop
        checks.append(
            records.GateCheck(
                name=f"{r.task} {r.metric} vs {against} (max drop {max_drop:g})",
                value=value,
                reference=float(r.value),
                limit=limit,
                passed=at_least(value, limit),
            )
        )
    return checks


def _esap(metrics: records.MetricsRecord) -> float | None:
    return None if metrics.heldout_esap is None else float(metrics.heldout_esap.esap)


def verdict(
    params: Thresholds,
    candidate: records.MetricsRecord,
    full: records.MetricsRecord,
    previous: records.MetricsRecord | None = None,
    previous_uri: str | None = None,
) -> records.GateRecord:
    """The gate's verdict on `candidate` (the model a release would publish) against the `full` model it was pruned
    from and, when given, the `previous` release's metrics."""
    checks: list[records.GateCheck] = []
    if params.min_heldout_esap is not None:
        value = _esap(candidate)
        checks.append(
            records.GateCheck(
                name="held-out ESAP",
                value=value,
                reference=None,
                limit=params.min_heldout_esap,
                passed=at_least(value, params.min_heldout_esap),
            )
        )
    if params.max_task_drop is not None:
        checks += _task_checks(candidate, full, params.max_task_drop, "full model")
    if previous is not None and params.max_previous_drop is not None:
        checks += _task_checks(candidate, previous, params.max_previous_drop, "previous release")
        before, now = _esap(previous), _esap(candidate)
        if before is not None:
            limit = before - params.max_previous_drop
            checks.append(
                records.GateCheck(
                    name=f"held-out ESAP vs previous release (max drop {params.max_previous_drop:g})",
                    value=now,
                    reference=before,
                    limit=limit,
                    passed=at_least(now, limit),
                )
            )
    return records.GateRecord(
        passed=all(c.passed for c in checks), candidate=candidate.model, checks=tuple(checks), previous=previous_uri
    )


def raise_on_failed(verdict_uris: Sequence[str]) -> None:
    """Raise GateFailed with the one line of each failing verdict among the gate artifacts at `verdict_uris`."""
    outcome(verdict_uris, stop_on_fail=True)


def outcome(verdict_uris: Sequence[str], stop_on_fail: bool) -> str:
    """The gate's sum over the verdicts at `verdict_uris`: "pass" when every one passed, else "fail"; with
    `stop_on_fail`, a failing one raises GateFailed with the one line of each failing verdict instead."""
    failed = [v.line() for v in (records.read(uri, records.GateRecord) for uri in verdict_uris) if not v.passed]
    if failed and stop_on_fail:
        raise GateFailed(" | ".join(failed))
    return "fail" if failed else "pass"
