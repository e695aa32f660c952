"""Which points of the criterion x sparsity fan-out a model can search and prune, known at compile and submit
from its config.json, so that an impossible point is refused in one line instead of failing a run hours in."""

from __future__ import annotations

import logging
from typing import Any

from evoesap.errors import ConfigError, EvoESAPError

log = logging.getLogger(__name__)


def check_grid(model: str, grid: list[dict[str, Any]], search_params: dict[str, Any], prune_params: dict[str, Any]) -> None:
    """Refuse, in one line, a sparsity of the criterion x sparsity fan-out that the model cannot search or
    prune: read from its config.json, as the stages read it, before a run could fail hours in. A model whose
    config cannot be read here (a path only the cluster mounts, a hub model offline) is left to the stages."""
    from evoesap import moe
    from evoesap.machine import runtime
    from evoesap.method import allocation, search
    from evoesap.steps import make_params
    from evoesap.store.artifacts import redact

    try:
        spec = runtime.inspect_checkpoint(model)
    except (EvoESAPError, OSError) as exc:
        log.warning("the fan-out's sparsities are not checked against %s before the run: %s", redact(model), exc)
        return
    for point in grid:
        for stage, section, done in (("search", search_params, "searched"), ("prune", prune_params, "pruned")):
            params = make_params(stage, {**section, **point})
            space = moe.pruning_space(spec, params.granularity)
            try:
                budget = allocation.budget(params.sparsity, space.num_experts, space.min_kept, space.granularity)
                if stage == "search":
                    search.searchable(space.num_experts, space.min_kept, budget, space.granularity)
            except ConfigError as exc:
                raise ConfigError(
                    f"criterion {point['criterion']} at sparsity {point['sparsity']} cannot be {done} on "
                    f"{redact(model)} ({len(spec.layers)} MoE layers, experts {list(space.num_experts)}, at least "
                    f"{list(space.min_kept)} kept, granularity {space.granularity}): {exc}; remove it from sparsities"
                ) from None
