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
from evoesap.release.gate import verdict
from evoesap.store import artifacts, jsontext

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
    def active(self) -> bool:
        """Whether any threshold is set (a gate with none has nothing to decide and is left out of the DAG)."""
        return any(getattr(self, name) is not None for name in ("min_heldout_esap", "max_task_drop", "max_previous_drop"))


def read_metrics(uri: str) -> records.MetricsRecord:
    """The metrics of an evaluate artifact, or of a metrics.json file (a previous release's, wherever it is kept)."""
    if not uri.rstrip("/").endswith(".json"):
        return records.read(uri, records.MetricsRecord)
    hint = "give the metrics.json of an evaluate run"
    document = jsontext.loads(artifacts.read_bytes(uri), artifacts.redact(uri), ArtifactError, hint)
    return records.MetricsRecord.from_json(document, artifacts.redact(uri))


def run_gate(
    evaluation: str, full_evaluation: str, params: GateParams, out_uri: str, *, previous: str | None = None
) -> artifacts.Manifest:
    """Write gate.json: the verdict on the model `evaluation` evaluated, against `full_evaluation` (the model it was
    pruned from) and `previous` (the previous release's metrics), by `params`' thresholds."""
    if params.max_previous_drop is not None and previous is None:
        raise ConfigError("gate.max_previous_drop compares with a previous release: give its metrics (--previous)")
    inputs = {"evaluation": evaluation, "full_evaluation": full_evaluation, "previous": previous}
    seen = artifacts.preflight(out_uri, "gate", inputs)
    candidate, full = read_metrics(evaluation), read_metrics(full_evaluation)
    if full.labels.method not in (None, "full"):
        raise ConfigError(
            f"--full-evaluation {artifacts.redact(full_evaluation)} evaluated a {full.labels.method} model: give the "
            "evaluation of the full model"
        )
    before = read_metrics(previous) if previous is not None else None
    record = verdict(params, candidate, full, before, artifacts.redact(previous) if previous else None)
    log.info("%s", record.line())
    with artifacts.stage_output(out_uri, "gate", keyed(params), inputs, seen) as staging:
        records.write(staging, record)
    return artifacts.read_manifest(out_uri)
