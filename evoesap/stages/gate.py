"""Stage `gate`: may the evaluated candidate be published? Thresholds in, gate.json (the verdict, check by check) out.

The verdict is an artifact like any other (so a release's lineage shows the gate it passed); the stage itself succeeds
whatever the verdict says. What a failing verdict stops is the pipeline's business: publish runs only on a passing
verdict and refuses a failing one (`evoesap.stages.publish`), and `stop_on_fail` ends the run after the report.
"""

from __future__ import annotations

import dataclasses
import logging

from evoesap import records
from evoesap.errors import ArtifactError, ConfigError
from evoesap.params import StageParams, keyed, param
from evoesap.release.gate import SCORING_PARAMS, candidate_name, verdict
from evoesap.store import artifacts, jsontext, lineage
from evoesap.store.identity import summary

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GateParams(StageParams):
    """The release gate's thresholds; a threshold left unset is not checked."""

    min_heldout_esap: float | None = param(
        None, "Least held-out ESAP (its lower bound) the candidate must reach; needs heldout_data.", gt=0, le=1
    )
    max_task_drop: float | None = param(
        None, "Most each task's primary metric may fall below the full model's (absolute: 0.02 is two points).", ge=0
    )
    max_previous_drop: float | None = param(
        None,
        "With previous_metrics: most each task's primary metric and held-out ESAP may fall below the previous release's.",
        ge=0,
    )
    stop_on_fail: bool = param(
        True,
        "A failing verdict ends the pipeline run (after the report) with its one line; false: the run succeeds, publish "
        "is skipped and the verdict is an output for the caller to act on.",
        keyed=False,
    )

    @property
    def thresholds(self) -> dict[str, float]:
        """The thresholds set, by name (unset ones are not checked)."""
        names = ("min_heldout_esap", "max_task_drop", "max_previous_drop")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def active(self) -> bool:
        """Whether any threshold is set (a gate with none has nothing to decide and is left out of the DAG)."""
        return bool(self.thresholds)


def read_metrics(uri: str) -> records.MetricsRecord:
    """The metrics of an evaluate artifact, or of a metrics.json file (a previous release's, wherever it is kept)."""
    if not uri.rstrip("/").endswith(".json"):
        return records.read(uri, records.MetricsRecord)
    hint = "give the metrics.json of an evaluate run"
    document = jsontext.loads(artifacts.read_bytes(uri), artifacts.redact(uri), ArtifactError, hint)
    return records.MetricsRecord.from_json(document, artifacts.redact(uri))


def _evaluation(uri: str, option: str) -> artifacts.Manifest:
    """The manifest of the evaluate artifact given as `option`: the gate judges evaluations whose lineage it can read."""
    if uri.rstrip("/").endswith(".json"):
        raise ConfigError(
            f"{option} {artifacts.redact(uri)} is a metrics file, whose lineage the gate cannot check: give the evaluate "
            "artifact (only --previous may be a metrics.json)"
        )
    return artifacts.read_manifest(uri, "evaluate")


def check_reference(candidate: artifacts.Manifest, full: artifacts.Manifest, evaluation: str, full_evaluation: str) -> str:
    """Refuse, in one line, a reference that is not the model the candidate was made from, or whose evaluation does not
    compare with the candidate's; the reference's location when it is both. Identity is content: the candidate's
    lineage through prune and quantize artifacts must end at the very model the reference evaluation loaded."""
    origin = lineage.model_origin(candidate.inputs["model"])
    if not origin.through:
        raise ConfigError(
            f"--evaluation {artifacts.redact(evaluation)} evaluated {origin.describe()}, which is not a prune or quantize "
            "artifact, so nothing records the model it was made from: evaluate the pruned checkpoint the prune stage made"
        )
    reference = full.inputs["model"]
    if lineage.identity_of(reference) != origin.identity:
        raise ConfigError(
            f"--full-evaluation {artifacts.redact(full_evaluation)} evaluated {reference['uri']} "
            f"({summary(lineage.identity_of(reference))}), but the candidate was made from {origin.describe()}: give "
            "the evaluation of the model it was pruned from"
        )
    _check_comparable(candidate, full, "--full-evaluation", full_evaluation)
    return str(reference["uri"])


def _check_comparable(candidate: artifacts.Manifest, other: artifacts.Manifest, option: str, uri: str) -> None:
    """Refuse an evaluation made with other scoring settings (tasks, limit, thinking, ...) than the candidate's."""
    differ = [
        f"{name} {candidate.params.get(name)!r} vs {other.params.get(name)!r}"
        for name in SCORING_PARAMS
        if candidate.params.get(name) != other.params.get(name)
    ]
    ours, theirs = candidate.inputs.get("teacher_cache"), other.inputs.get("teacher_cache")
    if ours and theirs and lineage.identity_of(ours) != lineage.identity_of(theirs):
        differ.append(f"held-out teacher cache {ours['uri']} vs {theirs['uri']}")
    if differ:
        raise ConfigError(
            f"{option} {artifacts.redact(uri)} does not compare with the candidate's evaluation: "
            f"{'; '.join(differ)}: evaluate both with the same settings"
        )


def _check_previous(candidate: artifacts.Manifest, previous: str) -> None:
    """A previous release's evaluate artifact must compare with the candidate's; a bare metrics.json its example limit."""
    if not previous.rstrip("/").endswith(".json"):
        _check_comparable(candidate, artifacts.read_manifest(previous, "evaluate"), "--previous", previous)
        return
    ours, theirs = candidate.params.get("limit"), read_metrics(previous).limit
    if ours != theirs:
        raise ConfigError(
            f"--previous {artifacts.redact(previous)} was evaluated with limit {theirs!r}, the candidate with {ours!r}: "
            "evaluate both with the same settings"
        )


def pruned_as(evaluation: artifacts.Manifest) -> str | None:
    """The evaluated candidate's name from its lineage (`candidate_name`): the prune artifact's criterion, sparsity and
    method (searched when it pruned by an allocation), and the recipe of a quantize artifact on the way; None when
    the model is no prune artifact's (the evaluation's labels then name it)."""
    entry, recipe = evaluation.inputs.get("model", {}), None
    while "manifest_sha256" in entry:  # check_reference has followed this lineage by content already
        manifest = artifacts.read_manifest(entry["uri"])
        if manifest.stage == "quantize":
            recipe = manifest.params.get("recipe")
        elif manifest.stage == "prune":
            method = "searched" if manifest.inputs.get("allocation") else "uniform"
            return candidate_name(manifest.params.get("criterion"), manifest.params.get("sparsity"), method, recipe)
        else:
            return None
        entry = manifest.inputs.get("model", {})
    return None


def run_gate(
    evaluation: str, full_evaluation: str, params: GateParams, out_uri: str, *, previous: str | None = None
) -> artifacts.Manifest:
    """Write gate.json: the verdict on the model `evaluation` evaluated, against `full_evaluation` (the model it was
    pruned from) and `previous` (the previous release's metrics), by `params`' thresholds."""
    if not params.active:
        raise ConfigError(
            "the gate has no thresholds, so it would pass any model: set at least one of min_heldout_esap, "
            "max_task_drop, max_previous_drop"
        )
    if params.max_previous_drop is not None and previous is None:
        raise ConfigError("gate.max_previous_drop compares with a previous release: give its metrics (--previous)")
    inputs = {"evaluation": evaluation, "full_evaluation": full_evaluation, "previous": previous}
    seen = artifacts.preflight(out_uri, "gate", inputs)
    judged = _evaluation(evaluation, "--evaluation")
    reference = check_reference(judged, _evaluation(full_evaluation, "--full-evaluation"), evaluation, full_evaluation)
    if previous is not None:
        _check_previous(judged, previous)
    candidate, full = read_metrics(evaluation), read_metrics(full_evaluation)
    if full.labels.method not in (None, "full"):
        raise ConfigError(
            f"--full-evaluation {artifacts.redact(full_evaluation)} evaluated a {full.labels.method} model: give the "
            "evaluation of the full model"
        )
    before = read_metrics(previous) if previous is not None else None
    name = pruned_as(judged)
    record = verdict(params, candidate, full, before, artifacts.redact(previous) if previous else None, name)
    record = dataclasses.replace(record, reference=reference)
    log.info("%s", record.line())
    with artifacts.stage_output(out_uri, "gate", keyed(params), inputs, seen) as staging:
        records.write(staging, record)
    return artifacts.read_manifest(out_uri)
