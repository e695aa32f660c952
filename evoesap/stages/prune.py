"""Stage `prune`: cut experts out of the checkpoint, by a searched allocation or uniformly.

With an `allocation` (a search artifact) the per-layer pruned sets are taken from its
allocation.json; without one, the uniform allocation of the same budget is pruned in the
criterion's order. Either way the output is a safetensors checkpoint that `load_pruned` (and, when
uniform, stock `AutoModelForCausalLM.from_pretrained`) loads without remote code.
"""

from __future__ import annotations

import dataclasses
import logging

from evoesap import records
from evoesap.machine import bounds, runtime
from evoesap.method import allocation as alloc
from evoesap.moe.spec import MoESpec
from evoesap.params import ModelDtype, StageParams, keyed, param
from evoesap.scoring.criteria import Criterion
from evoesap.store import artifacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PruneParams(StageParams):
    """Which experts go: the criterion's order within each layer, the allocation's (or uniform) counts."""

    criterion: Criterion = param(
        "reap", "Importance criterion whose pruning order decides which experts go (must match the allocation's)."
    )
    sparsity: float = param(0.25, "Global share of routed experts removed (must match the allocation's).", gt=0, lt=1)
    granularity: int = param(1, "Every per-layer count is a multiple of this (expert parallelism).", ge=1)
    model_dtype: ModelDtype = param("auto", "Dtype the checkpoint is written in: auto is its own.")


def planned_pruning(
    scores_uri: str, params: PruneParams, spec: MoESpec, allocation: str | None
) -> tuple[str, list[int], dict[int, list[int]]]:
    """(method, removal counts, pruned expert ids per MoE layer) for this run."""
    from evoesap import moe
    from evoesap.scoring.importance import model_orders, read_scores

    if allocation is not None:
        counts, pruned = records.allocation_counts(
            records.read(allocation, records.AllocationRecord),
            allocation,
            spec,
            criterion=params.criterion,
            sparsity=params.sparsity,
        )
        return "searched", counts, pruned
    space = moe.pruning_space(spec, params.granularity)
    budget = alloc.budget(params.sparsity, space.num_experts, space.min_kept, space.granularity)
    counts = list(alloc.uniform(space.num_experts, space.min_kept, budget, space.granularity))
    orders = model_orders(read_scores(scores_uri), params.criterion, spec)
    return "uniform", counts, alloc.pruned_sets(counts, orders)


def run_prune(model: str, scores: str, params: PruneParams, out_uri: str, allocation: str | None = None) -> artifacts.Manifest:
    """Physically prune `model` and publish the checkpoint with a pruning.json summary.

    The checkpoint's files are rewritten shard by shard (`moe.prune_checkpoint`): memory stays at a
    copy step, whatever the model's size; nothing is loaded onto a device.
    """
    from evoesap import moe

    inputs = {"model": model, "scores": scores, "allocation": allocation}
    seen = artifacts.preflight(out_uri, "prune", inputs)
    bounds.check_stage(params, model)
    artifacts.verify(scores, "calibrate")  # a clear error before reading anything else
    if allocation is not None:
        artifacts.verify(allocation, "search")
    spec = runtime.inspect_checkpoint(model)
    method, counts, pruned = planned_pruning(scores, params, spec, allocation)  # refused before any weight is read
    dtype = runtime.MODEL_DTYPES[params.model_dtype]
    with artifacts.stage_output(out_uri, "prune", keyed(params), inputs, seen) as staging:
        result = moe.prune_checkpoint(model, pruned, staging, dtype=None if dtype == "auto" else dtype)
        summary = records.PruningRecord(
            method=method,
            criterion=params.criterion,
            sparsity=params.sparsity,
            removal_counts=tuple(counts),
            pruned={layer: tuple(ids) for layer, ids in pruned.items()},
            num_experts=tuple(result.num_experts),
            parameter_bytes_full=result.bytes_full,
            parameter_bytes_pruned=result.bytes_pruned,
        )
        records.write(staging, summary)
    log.info("pruned %s (%s): %d experts removed", artifacts.redact(model), method, sum(counts))
    return artifacts.read_manifest(out_uri)
