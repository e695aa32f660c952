"""What an MoE model looks like (its MoE layers in model order) and which pruned sets it admits."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence

from torch import nn

from evoesap.errors import ConfigError, ModelError
from evoesap.moe.families import Family, family_of
from evoesap.moe.routing import GROUP_AWARE, GROUP_SCORE_TOP

Pruned = Mapping[int, Iterable[int]]
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One MoE layer as the search and the stages see it."""

    ordinal: int  # 0..L-1 over MoE layers only
    decoder_index: int  # position among all decoder layers, dense ones included
    num_experts: int  # routed experts (shared experts are never pruned)
    top_k: int
    routing: str  # routing kind, see `evoesap.moe.families`
    shared_experts: bool
    n_group: int = 1  # expert groups of group-limited routing; 1 when routing is not group-limited
    topk_group: int = 1  # groups each token may route into


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The MoE layers of a model, in model order."""

    family: str
    layers: tuple[LayerSpec, ...]

    @property
    def num_experts(self) -> tuple[int, ...]:
        return tuple(layer.num_experts for layer in self.layers)

    @property
    def top_k(self) -> tuple[int, ...]:
        return tuple(layer.top_k for layer in self.layers)


@dataclasses.dataclass(frozen=True)
class MoEBlock:
    """The live modules of one MoE layer."""

    ordinal: int
    decoder_index: int
    block: nn.Module  # the decoder layer's MoE MLP
    router: nn.Module
    experts: nn.Module
    layer: nn.Module | None = None  # the decoder layer holding the block (and any shared MLP beside it)


def meta_model(config: object) -> nn.Module:
    """The model a checkpoint's config describes, on the meta device (no memory): the stock class of its family's
    auto class, so a multimodal checkpoint builds whole. An unsupported model_type is refused first."""
    import torch

    cls = family_of(config.model_type).model_class(config)
    with torch.device("meta"):
        return cls(config)


def model_family(model: nn.Module) -> Family:
    """The family row of a loaded model, from `model.config.model_type`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, nn.Module) or not model_type:
        raise ModelError(f"{type(model).__name__} is not a transformers model (no config.model_type)")
    return family_of(model_type)


def get_path(module: nn.Module, path: str) -> object:
    """`module.a.b` for path "a.b"."""
    return operator.attrgetter(path)(module)


def expert_tensors(block: MoEBlock, family: Family) -> Iterator[tuple[nn.Module, str, int]]:
    """(owning module, attribute name, expert axis) of every tensor of `block` indexed by expert."""
    owners = ((block.router, family.router_tensors), (block.experts, family.expert_tensors), (block.block, family.block_tensors))
    for module, tensors in owners:
        for path, axis in tensors:
            if module is block.block and not has_path(module, path):  # a config may switch a block's bias off (LFM2)
                continue
            *parents, name = path.split(".")
            yield module.get_submodule(".".join(parents)), name, axis


def decoder_layers(model: nn.Module, family: Family) -> nn.ModuleList | None:
    """The decoder layers of a causal-LM model, at its family's `layers` path (None where there are none)."""
    try:
        return get_path(model, family.layers)
    except AttributeError:
        return None


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The MoE blocks of a model in model order; dense layers are skipped."""
    family = model_family(model)
    layers = decoder_layers(model, family)
    if layers is None:
        raise ModelError(f"{type(model).__name__} has no decoder layers at {family.layers}")
    blocks: list[MoEBlock] = []
    for index, layer in enumerate(layers):
        block = getattr(layer, family.block, None)
        router = getattr(block, family.router, None)
        experts = getattr(block, family.experts, None)
        if router is not None and experts is not None:
            blocks.append(MoEBlock(len(blocks), index, block, router, experts, layer))
    if not blocks:
        raise ModelError(
            f"this {family.model_type} model has no MoE layers; check its config fields "
            f"{', '.join(family.dense_layer_fields) or family.num_experts_field}"
        )
    return blocks


def _groups(family: Family, config: object) -> tuple[int, int]:
    if family.group_fields is None:
        return 1, 1
    if family.group_when is not None:
        field, value = family.group_when
        if getattr(config, field, None) != value:
            return 1, 1
    n_group, topk_group = (getattr(config, f, None) or 1 for f in family.group_fields)
    return int(n_group), int(topk_group)


def inspect(model: nn.Module) -> MoESpec:
    """The MoE layers of `model`; expert counts are read from the modules, so pruned models work."""
    family = model_family(model)
    config = family.expert_config(model.config)
    n_group, topk_group = _groups(family, config)
    layers = tuple(
        LayerSpec(
            ordinal=b.ordinal,
            decoder_index=b.decoder_index,
            num_experts=int(b.experts.num_experts),
            top_k=top_k(family, config, b.decoder_index),
            routing=family.routing,
            shared_experts=any(has_path(b.layer, path) for path in family.shared_experts),
            n_group=n_group,
            topk_group=topk_group,
        )
        for b in moe_blocks(model)
    )
    return MoESpec(family.model_type, layers)


def top_k(family: Family, config: object, decoder_index: int) -> int:
    """Experts each token reaches in one MoE layer: the config's top-k, or its entry for the layer where a family
    (Hunyuan) may give one per decoder layer."""
    value = getattr(config, family.top_k_field)
    return int(value[decoder_index] if isinstance(value, (list, tuple)) else value)


def has_path(module: nn.Module | None, path: str) -> bool:
    """Whether `module` holds something (not None) at dotted `path`."""
    try:
        return get_path(module, path) is not None
    except AttributeError:
        return False


def _as_int(value: object, what: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{what} must be an integer, got {value!r}") from None


def check_pruned(spec: MoESpec, pruned: Pruned) -> dict[int, tuple[int, ...]]:
    """Validated pruned sets (ordinal -> sorted expert ids), refused before anything changes.

    ConfigError for unknown layers or experts, duplicates, or fewer than top-k experts left;
    ModelError where removal would route differently from masking (group-limited routing).
    """
    if not isinstance(pruned, Mapping):
        raise ConfigError(f"pruned must map MoE layer ordinal to expert ids, got {type(pruned).__name__}")
    sets: dict[int, tuple[int, ...]] = {}
    for key, ids in pruned.items():
        ordinal = _as_int(key, "MoE layer ordinal")
        if not 0 <= ordinal < len(spec.layers):
            raise ConfigError(
                f"unknown MoE layer {ordinal}: this {spec.family} model has {len(spec.layers)} MoE "
                f"layers, ordinals 0..{len(spec.layers) - 1} (dense layers are not counted)"
            )
        layer = spec.layers[ordinal]
        experts = [_as_int(e, f"expert id in MoE layer {ordinal}") for e in ids]
        bad = sorted(e for e in experts if not 0 <= e < layer.num_experts)
        if bad:
            raise ConfigError(f"unknown expert ids {bad} in MoE layer {ordinal}, which has experts 0..{layer.num_experts - 1}")
        duplicates = sorted(e for e, n in collections.Counter(experts).items() if n > 1)
        if duplicates:
            raise ConfigError(f"duplicate expert ids {duplicates} in MoE layer {ordinal}")
        if len(experts) > layer.num_experts - layer.top_k:
            raise ConfigError(
                f"MoE layer {ordinal} would lose {len(experts)} of its {layer.num_experts} experts; at most "
                f"{layer.num_experts - layer.top_k} may go so that top-k={layer.top_k} experts remain"
            )
        _check_groups(spec.family, layer, experts)
        sets[ordinal] = tuple(sorted(experts))
    return sets


def _min_kept_per_group(layer: LayerSpec) -> int:
    """Experts each group of a group-limited layer must keep: its best two score the group, and the
    `topk_group` chosen groups must hold top-k experts between them."""
    return max(GROUP_SCORE_TOP, -(-layer.top_k // layer.topk_group))


def _check_groups(family: str, layer: LayerSpec, experts: list[int]) -> None:
    """Group-limited routing survives removal only when every group loses the same experts count."""
    if layer.n_group == 1 or not experts:
        return
    where = f"MoE layer {layer.ordinal} of this {family} model routes group-limited ({layer.n_group} groups)"
    if layer.routing not in GROUP_AWARE:
        raise ModelError(f"{where}; its routing cannot be reproduced after removal: prune nothing in it")
    size = layer.num_experts // layer.n_group
    removed = collections.Counter(e // size for e in experts)
    per_group = sorted({removed.get(g, 0) for g in range(layer.n_group)})
    if len(per_group) != 1:
        raise ModelError(
            f"{where}; removal must take the same number of experts from every group of {size}, "
            f"got {dict(sorted(removed.items()))} removed per group"
        )
    kept = size - per_group[0]
    if kept < _min_kept_per_group(layer):
        raise ModelError(
            f"{where}; keeping {kept} experts per group leaves too few to score groups "
            f"(need {GROUP_SCORE_TOP}) or to fill top-k={layer.top_k} from {layer.topk_group} groups"
        )


@dataclasses.dataclass(frozen=True)
class PruningSpace:
    """The removal counts a model admits: per layer at most `num_experts - min_kept`, in multiples of `granularity`."""

    num_experts: tuple[int, ...]
    min_kept: tuple[int, ...]  # top-k; more under group-limited routing (every group must keep enough to be scored)
    granularity: int  # the asked granularity, raised to a multiple of the group count where routing is group-limited


def pruning_space(spec: MoESpec, granularity: int = 1) -> PruningSpace:
    """What an allocation may remove from `spec`'s layers, so that every pruned set passes `check_pruned`.

    A group-limited layer (DeepSeek-V3 with n_group > 1) must lose the same number of experts from each
    group, so its counts are multiples of n_group, and each group must keep enough experts to be
    scored and to fill top-k; a group-limited layer whose routing cannot be recomputed keeps all.
    """
    kept, g = [], int(granularity)
    for layer in spec.layers:
        if layer.n_group == 1:
            kept.append(layer.top_k)
        elif layer.routing not in GROUP_AWARE:
            kept.append(layer.num_experts)
        else:
            kept.append(max(layer.top_k, layer.n_group * _min_kept_per_group(layer)))
            g = math.lcm(g, layer.n_group)
    if g != granularity:
        log.warning(
            "granularity %d raised to %d: this %s model routes group-limited, so every layer must lose "
            "the same number of experts from each group",
            granularity,
            g,
            spec.family,
        )
    return PruningSpace(spec.num_experts, tuple(kept), g)


def admissible_order(order: Sequence[int], layer: LayerSpec) -> list[int]:
    """A layer's pruning order (least important first), rearranged for group-limited routing.

    Round j takes the j-th least important expert of every group, the rounds in order and the experts
    of a round least important first, so that any prefix of n_group x m experts removes m from each
    group. Layers without groups keep their order.
    """
    if layer.n_group == 1:
        return list(order)
    size = layer.num_experts // layer.n_group
    rank = {expert: i for i, expert in enumerate(order)}
    groups = [[e for e in order if e // size == g] for g in range(layer.n_group)]
    return [e for j in range(size) for e in sorted((group[j] for group in groups), key=rank.__getitem__)]
