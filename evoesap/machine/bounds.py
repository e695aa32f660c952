"""Sizes a stage cannot be meant to run with, refused in one line before any work.

Three places call it: every stage's parameter dataclass at the end of `__post_init__` (`check_params`:
what the numbers alone rule out), every model stage right after its preflight (`check_stage`: the device
and the checkpoint on this machine), and the search once it knows its space (`check_search`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from evoesap.errors import ConfigError, ResourceError

# numpy and torch take integers (seeds, sizes, counts) as int64, and orchestrators pass them through
# 64-bit protobuf fields: a larger one overflows or is silently rounded somewhere downstream
INT64_MAX = 2**63 - 1
# peak host bytes of one history row (one population slot of one generation) of the level-switch search
# with its checkpoint: the record, its allocation tuple and its share of the whole-history checkpoint JSON
# written each generation; tracemalloc over level_switch_search measured 1.2 KB at 4 MoE layers, 2.0 KB at
# 16 and 3.2 KB at 48, which this bounds from above
HISTORY_ROW_BYTES = 1024
HISTORY_ROW_BYTES_PER_LAYER = 64


def check_params(params: Any) -> None:
    """Refuse integers beyond int64 and negative seeds in a stage's parameter dataclass."""
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if abs(value) > INT64_MAX:
            raise ConfigError(f"{field.name} {value} is beyond the largest 64-bit integer ({INT64_MAX}): give a realistic value")
        if field.name == "seed" and value < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {value}: give e.g. --seed 0")


def check_stage(params: Any, model: str) -> None:
    """Refuse a device this machine lacks and a local checkpoint that cannot load, before any work."""
    from evoesap.machine import runtime

    if hasattr(params, "device"):
        runtime.check_device(params.device)
    if hasattr(params, "gpus") and params.gpus() > 1:
        runtime.check_gpu_count(params.gpus(), "tensor_parallel x pipeline_parallel")
    runtime.check_checkpoint(model)


def check_search(params: Any, num_experts: Sequence[int], space_size: int, free_host: int | None = None) -> None:
    """Refuse a search larger than its space or than this machine's memory.

    `space_size`: the distinct feasible allocations (`allocation.FeasibleSet.size`); a population larger
    than that only repeats allocations (generation 0 already holds every one: the search says so and runs,
    as on a tiny demo world), and an absurd one is refused by the memory bound below. A level-switch step moves
    at least one expert, so neither one transfer nor the steps of one offspring need exceed the model's
    routed experts (`num_experts`, per MoE layer): any allocation is reached from any other within that many.
    The history (one row per population slot and generation, kept in memory and rewritten to the checkpoint
    each generation) must fit in the host memory free now (`free_host`, measured when None).
    """
    experts = sum(num_experts)
    for name in ("max_transfer", "max_steps"):
        if getattr(params, name) > experts:
            raise ConfigError(
                f"{name} {getattr(params, name)} is more than the model's {experts} routed experts, which "
                f"no level-switch search needs: give --{name.replace('_', '-')} {experts} or less"
            )
    rows = params.population * (params.generations + 1)
    need = rows * (HISTORY_ROW_BYTES + HISTORY_ROW_BYTES_PER_LAYER * len(num_experts))
    if free_host is None:
        import torch

        from evoesap.machine.runtime import free_memory_bytes

        free_host = free_memory_bytes(torch.device("cpu"))
    if need > free_host:
        raise ResourceError(
            f"population {params.population} x (generations {params.generations} + 1) is {rows:.3g} history rows, about "
            f"{need / 2**30:.3g} GiB of host memory, but {free_host / 2**30:.3g} GiB is free: lower --generations or "
            "--population"
        )
