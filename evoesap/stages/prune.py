"""Stage `prune`: cut experts out of the checkpoint, by a searched allocation or uniformly.

With an `allocation` (a search artifact) the per-layer pruned sets are taken from its
allocation.json; without one, the uniform allocation of the same budget is pruned in the
criterion's order. Either way the output is a safetensors checkpoint that `load_pruned` (and, when
uniform, stock `AutoModelForCausalLM.from_pretrained`) loads without remote code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from evoesap import allocation as alloc
from evoesap import artifacts, bounds, runtime
from evoesap.errors import ArtifactError, ConfigError
from evoesap.moe.spec import MoESpec

log = logging.getLogger(__name__)

ALLOCATION_FILE = "allocation.json"
PRUNING_FILE = "pruning.json"


@dataclasses.dataclass(frozen=True)
class PruneParams:
    criterion: str = "reap"  # whose pruning order decides which experts go
    sparsity: float = 0.25  # global share of routed experts removed
    granularity: int = 1  # every per-layer count is a multiple of this (expert parallelism)
    model_dtype: str = "auto"  # dtype the checkpoint is loaded and written in

    def __post_init__(self) -> None:
        from evoesap.importance import CRITERIA

        if self.criterion not in CRITERIA:
            raise ConfigError(f"criterion {self.criterion!r} is not one of {', '.join(CRITERIA)}")
        if not 0 < self.sparsity < 1:
            raise ConfigError(f"sparsity must lie in (0, 1), got {self.sparsity}")
        object.__setattr__(self, "granularity", int(self.granularity))  # configs may deliver ints as floats
        if self.granularity < 1:
            raise ConfigError(f"granularity must be >= 1, got {self.granularity}")
        runtime.check_model_dtype(self.model_dtype)
        bounds.check_params(self)


def read_allocation(uri: str) -> dict:
    """allocation.json of a search artifact, checked against its manifest."""
    manifest = artifacts.read_manifest(uri, "search")
    try:
        return json.loads(artifacts.read_payload(uri, ALLOCATION_FILE, manifest))
    except ValueError as exc:
        raise ArtifactError(
            f"{artifacts.redact(uri)}: {ALLOCATION_FILE} is not JSON ({exc}): rebuild it with `evoesap search`"
        ) from None


def check_allocation(doc: Any, uri: str, spec: MoESpec, params: PruneParams | None = None) -> tuple[list[int], dict[int, list[int]]]:
    """(removal counts, pruned ids per MoE layer) of a search's allocation.json, refused unless they fit
    `spec` and meet the budget of its sparsity, every layer is present and the lists agree with the counts.
    With `params`, its criterion and sparsity must be the ones searched."""
    from evoesap import moe

    where = f"{artifacts.redact(uri)}/{ALLOCATION_FILE}"
    hint = "rebuild it with `evoesap search`"
    try:
        counts = [alloc.as_int("removal_counts", c) for c in doc["removal_counts"]]
        pruned = {int(layer): [alloc.as_int("expert id", e) for e in ids] for layer, ids in doc["pruned"].items()}
        sparsity, granularity = float(doc["sparsity"]), int(doc.get("granularity", 1))
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
        raise ArtifactError(f"{where} is malformed ({type(exc).__name__}: {exc}): {hint}") from None
    for key in ("criterion", "sparsity") if params is not None else ():
        if doc.get(key) != getattr(params, key):
            raise ConfigError(
                f"allocation at {artifacts.redact(uri)} was searched with {key}={doc.get(key)!r}, "
                f"but prune was asked for {key}={getattr(params, key)!r}: pass the matching value"
            )
    space = moe.pruning_space(spec, granularity)
    if sorted(pruned) != list(range(len(spec.layers))):
        raise ArtifactError(f"{where} has pruned lists for MoE layers {sorted(pruned)}, the model has "
                            f"0..{len(spec.layers) - 1}: {hint}")
    try:
        budget = alloc.budget(sparsity, space.num_experts, space.min_kept, space.granularity)
        alloc.check(counts, space.num_experts, space.min_kept, budget, space.granularity)
        moe.check_pruned(spec, pruned)
    except ConfigError as exc:
        raise ArtifactError(f"{where} does not fit this model at sparsity {sparsity}: {exc}: {hint}") from None
    disagree = [layer for layer, ids in sorted(pruned.items()) if len(ids) != counts[layer]]
    if disagree:
        layer = disagree[0]
        raise ArtifactError(f"{where}: MoE layer {layer} lists {len(pruned[layer])} pruned experts but its removal "
                            f"count is {counts[layer]}: {hint}")
    return counts, pruned


def planned_pruning(scores_uri: str, params: PruneParams, spec: MoESpec, allocation: str | None) -> tuple[str, list[int], dict[int, list[int]]]:
    """(method, removal counts, pruned expert ids per MoE layer) for this run."""
    from evoesap import moe
    from evoesap.importance import model_orders, read_scores

    if allocation is not None:
        counts, pruned = check_allocation(read_allocation(allocation), allocation, spec, params)
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
    with artifacts.stage_output(out_uri, "prune", dataclasses.asdict(params), inputs, seen) as staging:
        result = moe.prune_checkpoint(model, pruned, staging, dtype=None if dtype == "auto" else dtype)
        summary = {
            "method": method,
            "criterion": params.criterion,
            "sparsity": params.sparsity,
            "removal_counts": counts,
            "pruned": {str(layer): ids for layer, ids in sorted(pruned.items())},
            "num_experts": list(result.num_experts),
            "parameter_bytes_full": result.bytes_full,
            "parameter_bytes_pruned": result.bytes_pruned,
        }
        (staging / PRUNING_FILE).write_text(json.dumps(summary, indent=2))
    log.info("pruned %s (%s): %d experts removed", artifacts.redact(model), method, sum(counts))
    return artifacts.read_manifest(out_uri)
