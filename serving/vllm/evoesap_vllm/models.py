"""Per-layer-expert-count variants of vLLM's own MoE classes, made by one mechanism for every family.

A variant is a subclass of the stock class whose constructor builds each decoder layer while the
config's expert count is that layer's count (from config.json's per-layer map); after that the config
holds the widest count again, so the stock weight loader maps every expert id a layer can have and
each layer's fused tensors take just its own experts. No vLLM code is copied: the stock class does
all the work. Classes are made on first attribute access (`EvoESAPOlmoeForCausalLM`), which is how
vLLM's registry imports a lazily registered `module:Class`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from evoesap_vllm.families import BY_NAME, PER_LAYER_KEY, ServedFamily


def per_layer_counts(config: Any) -> dict[int, int]:
    """{decoder layer index: expert count} from the config, checked; refuses a config without the map."""
    raw = getattr(config, PER_LAYER_KEY, None)
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(
            f"config.json has no {PER_LAYER_KEY}: this architecture serves non-uniformly pruned EvoESAP "
            "checkpoints; a uniform checkpoint keeps its stock architecture name"
        )
    counts = {int(layer): int(count) for layer, count in raw.items()}
    if any(count < 1 for count in counts.values()):
        raise ValueError(f"config.json {PER_LAYER_KEY} holds a count below 1: {raw}")
    return counts


def refuse_single_count_features(vllm_config: Any) -> None:
    """Expert parallelism and its load balancer (EPLB) shard and move experts assuming one count per layer."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_eplb", False) or getattr(parallel, "enable_expert_parallel", False):
        raise ValueError(
            "a non-uniformly pruned MoE (a different expert count per layer) cannot run with expert "
            "parallelism or EPLB, which assume one count for every layer: drop --enable-expert-parallel "
            "and --enable-eplb (tensor and pipeline parallelism work)"
        )


@contextlib.contextmanager
def _layers_built_with_counts(family: ServedFamily, config: Any, counts: Mapping[int, int]) -> Iterator[None]:
    """While the stock constructor runs, build decoder layer i with `counts[i]` experts in the config.

    The family's module looks up `make_layers` when its model is constructed; it is replaced for that
    time only by a wrapper that sets the count around each layer's factory. Dense layers (not in
    `counts`) see the widest count, as in the stock model.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    module = importlib.import_module(family.make_layers_module)
    stock_make_layers = module.make_layers
    widest = getattr(config, family.num_experts_field)

    def make_layers(num_hidden_layers: int, layer_fn: Callable[..., Any], prefix: str) -> Any:
        def build(prefix: str) -> Any:
            setattr(config, family.num_experts_field, counts.get(extract_layer_index(prefix), widest))
            try:
                return layer_fn(prefix=prefix)
            finally:
                setattr(config, family.num_experts_field, widest)

        return stock_make_layers(num_hidden_layers, build, prefix)

    module.make_layers = make_layers
    try:
        yield
    finally:
        module.make_layers = stock_make_layers


@functools.cache
def variant(name: str) -> type:
    """The per-layer-count subclass of the stock class behind architecture `name` (EvoESAP<Stock>)."""
    family = BY_NAME[name]
    stock = getattr(importlib.import_module(family.module), family.architecture)

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        config = vllm_config.model_config.hf_config
        counts = per_layer_counts(config)
        refuse_single_count_features(vllm_config)
        if max(counts.values()) != getattr(config, family.num_experts_field):
            raise ValueError(
                f"config.json {family.num_experts_field}={getattr(config, family.num_experts_field)} is not the "
                f"widest of {PER_LAYER_KEY} {counts}: the checkpoint was edited by hand or is corrupt"
            )
        with _layers_built_with_counts(family, config, counts):
            stock.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)

    return type(name, (stock,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def __getattr__(name: str) -> type:
    if name in BY_NAME:
        return variant(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
