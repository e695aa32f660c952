"""The quality target in the DAG: the task that finds each criterion's sparsity before the fan-out.

With `target: {heldout_esap: X}` the sparsities are not known when the pipeline compiles. This task bisects the
granularity grid (`evoesap.pipeline.target.decide`: every probe an ordinary search artifact under the storage root,
each decision a target artifact whose manifest lists its probes) and returns the fan-out, one point per criterion at
its chosen sparsity. The point's own search then finds the chosen probe finished and reuses it. Its `decisions` output
names every criterion's target artifact, which the report shows; a criterion that misses the target gets no point, and
`check_targets`, after the report, ends the run with its reason. Only when no criterion meets it does the run end here,
with nothing to fan out over.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
from typing import Callable

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output


def find_sparsities(
    model: Input[Model],
    scores: Input[Dataset],
    cache: Input[Dataset],
    heldout_cache: Input[Dataset],
    storage_root: str,
    criteria: list,
    target: dict,
    decisions: Output[Artifact],
    params: dict = {},
    full_evaluation: Input[Dataset] = None,
    previous: str = "",
    prune_params: dict = {},
    evaluate_params: dict = {},
    gate_params: dict = {},
    workspace: str = "",
) -> list:
    """Find, per criterion, the largest grid sparsity whose searched allocation keeps the target's held-out ESAP, or
    whose pruned model passes the gate; with choose_criterion, the one criterion that reaches the largest.

    Args:
        model: The full model.
        scores: The calibrate stage's scores.
        cache: The teacher cache of the search samples.
        heldout_cache: The teacher cache of the held-out samples: the probes' held-out check.
        storage_root: Where the probes' search artifacts and the target artifacts are kept.
        criteria: The criteria to find a sparsity for.
        target: The configuration's `target` section: heldout_esap (the least held-out ESAP the chosen sparsity's
            search must keep) or gate, choose_criterion, warm_start, rechecks.
        params: The search stage's parameters (the configuration's `search` section).
        full_evaluation: A gate target's: the full model's evaluation the gate compares each probe's with.
        previous: A gate target's: the previous release's metrics (gate.max_previous_drop); "" for none.
        prune_params: A gate target's: the prune stage's parameters, as the run's own prune tasks take them (so
            they reuse every probe's artifacts).
        evaluate_params: A gate target's: the evaluate stage's parameters, likewise.
        gate_params: A gate target's: the gate's thresholds, likewise.
        workspace: The run's KFP workspace when the model was copied there (evoesap.components.workspace); "" for none.

    Returns:
        decisions: target.json of every criterion (probes, held-out values, the choice); metadata: chosen, targets,
            choose_criterion.
        Output: The fan-out: a {criterion, sparsity} point per criterion that meets the target (with
            choose_criterion, the chosen one).
    """
    import json
    from pathlib import Path

    from evoesap.components.kfp_artifacts import source
    from evoesap.components.workspace import share_digests
    from evoesap.pipeline.config import quality_target
    from evoesap.pipeline.target import Gating, decide, fan_out, unmet

    from evoesap.store import artifacts

    share_digests(workspace)
    inputs = {"model": source(model), "scores": source(scores), "cache": source(cache), "heldout_cache": source(heldout_cache)}
    goal = quality_target(target, "target_params")
    gating = (
        None
        if full_evaluation is None
        else Gating(
            source(full_evaluation), previous or None, {"prune": prune_params, "evaluate": evaluate_params, "gate": gate_params}
        )
    )
    found = decide(inputs, storage_root, criteria, goal, params, gating)
    Path(decisions.path).write_text(json.dumps([record.to_json() for _, record in found], indent=1))
    decisions.metadata.update(
        chosen={record.criterion: record.chosen for _, record in found},
        targets={record.criterion: artifacts.redact(uri) for uri, record in found},
        choose_criterion=goal.choose_criterion,  # for the check after the report: only a choice with no winner misses
    )
    points = fan_out(found, goal.choose_criterion)
    missed = unmet(found, goal.choose_criterion)
    if missed is not None and not points:
        raise missed
    return points


def check_targets(decisions: Input[Artifact]) -> None:
    """End the run when some criterion missed the quality target, with each missed one's reason in one line (the report
    showing every decision exists by then).

    Args:
        decisions: The target finder's decisions: target.json of every criterion.
    """
    import json
    from pathlib import Path

    from evoesap.pipeline.target import unmet

    from evoesap import records

    found = [(None, records.TargetRecord.from_json(doc, "decisions")) for doc in json.loads(Path(decisions.path).read_text())]
    missed = unmet(found, bool(decisions.metadata.get("choose_criterion")))
    if missed is not None:
        raise missed


def make_target_finder(image: str) -> Callable:
    """`find_sparsities` in the stage image (nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(find_sparsities)


def make_target_check(image: str) -> Callable:
    """`check_targets` in the stage image (nothing is installed at run time)."""
    return dsl.component(base_image=image, install_kfp_package=False)(check_targets)
