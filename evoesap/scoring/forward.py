"""Forward passes for scoring: batches of cached samples, the decoder stack, the LM head at scored rows.

Samples are grouped by length (`iter_batches`) and right-padded (`pad_right`). The teacher runs the
whole stack at once (`final_hidden`); a candidate runs it half-layer by half-layer (`LayerRunner`), so
that its forward can start mid-model; both end with the LM head at the scored rows only (`head_logits`).

Layer by layer: prefix reuse (`evoesap.scoring.prefix`) resumes a candidate's forward from cached hidden
states; that needs the pieces `XModel.forward` builds once per batch (embeddings, position ids, rotary
position embeddings, causal masks per attention kind) and the decoder layers called in parts.
transformers 5.x writes those pieces the same way in every MoE family (OLMoE, Qwen2/3-MoE, Mixtral,
DeepSeek-V2/V3, ERNIE-4.5-MoE, GPT-OSS, Qwen3-Next); the only difference is the attention kind per layer: a
`layer_types` list in the config (Qwen2-MoE, GPT-OSS, and hybrids, whose `linear_attention` layers take the
2-D padding mask), else sliding for all layers when `config.sliding_window` is set (Mixtral, Qwen3-MoE),
else full causal attention.

Every decoder layer is a pair of residual halves, the token mixer's then the block's (the family table's
`mixers`, e.g. `self_attn` or a hybrid's `linear_attn`, and its `block`, e.g. `mlp`), each
`r * alpha + post_norm(f(norm(h))) * beta` with the parts the table's `mixer_half` / `block_half` name (most
families: `h + mixer(input_layernorm(h))`, `h + block(post_attention_layernorm(h))`; Granite scales each
output, FlexOlmo and AFMoE norm it, MiniMax adds it to the normed input, both weighted), so it runs as two
halves (`attend`, `feed_forward`). A linear-attention or Mamba
mixer keeps a recurrent state only within one call over the whole sequence, so the state between the
halves is still all a later half needs. Pruning experts changes only the
feed-forward half of a layer: the state between the halves is what a candidate can reuse, and the last
layer's feed-forward half, being per token, can run on the scored positions alone. Routers are still
masked by `evoesap.moe.masked`'s hooks, which fire whoever calls the modules.

Work is counted in active multiply-accumulates per token (`half_costs`): the parameters a token passes
through in each half, with an MoE layer's routed experts counted top-k of num-experts. Attention-score
work, which grows with sequence length, is left out, so the figure is hardware- and length-independent.

transformers' masking utilities and `evoesap.moe` are imported when a `LayerRunner` is built, so that
readers of the teacher cache, which use the helpers here, do not pay their seconds of start-up.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from evoesap.errors import ModelError
from evoesap.offload import module_device

if TYPE_CHECKING:
    from evoesap.moe.families import Residual

# per attention kind, the function of transformers.masking_utils that builds its mask; linear attention
# (Gated DeltaNet, Mamba, convolutions) takes the 2-D padding mask, or None for an unpadded batch
_MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
    "linear_attention": "create_recurrent_attention_mask",
    "conv": "create_recurrent_attention_mask",  # LFM2's short-convolution layers
}


# --------------------------------------------------------------------------------------------------
# Batches


def iter_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices grouped into batches of similar length (longest first), to waste little on padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def pad_right(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D long tensors -> (input_ids [B, T], attention_mask [B, T]).

    Right padding under causal attention leaves every real token's hidden state exactly as unpadded.
    """
    length = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()] = s
        mask[row, : s.numel()] = 1
    return ids, mask


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the device its embeddings compute on."""
    return module_device(model.get_input_embeddings())


# --------------------------------------------------------------------------------------------------
# The whole stack at once (the teacher's forward)


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states (after the final norm) of a causal LM -> [B, T, H], without the LM head."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if isinstance(base, torch.nn.Module) and base is not model:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
    return out.hidden_states[-1]


# --------------------------------------------------------------------------------------------------
# The stack half-layer by half-layer (a candidate's forward)


@dataclasses.dataclass(frozen=True)
class BatchContext:
    """What every decoder layer of one padded batch receives besides the hidden states."""

    position_ids: torch.Tensor  # [1, T] long
    position_embeddings: object  # rotary: (cos, sin), each [1, T, D], or one complex tensor (DeepSeek-V2); None without
    masks: tuple[object, ...]  # per decoder layer: the 4-D mask, a BlockMask or None (is_causal)


class LayerRunner:
    """Embeddings, decoder-layer halves and final norm of `model`'s base model, called separately."""

    def __init__(self, model: torch.nn.Module) -> None:
        from evoesap.moe.families import family_of

        family = family_of(getattr(getattr(model, "config", None), "model_type", None))
        where = family.layers.rpartition(".")[0]  # the base model is what holds the decoder layers
        try:
            base = operator.attrgetter(where)(model) if where else model
        except AttributeError:
            base = None
        if not isinstance(base, torch.nn.Module):
            raise ModelError(f"{type(model).__name__} has no base model at .{where}")
        for part in ("layers", family.final_norm):  # no rotary embedding: positions come from elsewhere or nowhere
            if not hasattr(base, part):
                raise ModelError(f"{type(base).__name__} has no .{part}: layer-wise forwards need a decoder stack")
        self.model, self.base, self.config, self.family = model, base, base.config, family
        self.block = family.block  # the feed-forward half's module (an MoE block or an MLP)
        self.layers = list(base.layers[: self.config.num_hidden_layers])
        halves = (family.mixer_half, family.block_half)
        parts = [p for half in halves for p in (half.norm, half.post_norm, half.scale, half.residual_scale) if p]
        parts += [self.block, *family.block_beside]
        self.mixers: list[str] = []  # per decoder layer: the attribute holding its token mixer
        for index, layer in enumerate(self.layers):
            mixer = next((name for name in family.mixers if getattr(layer, name, None) is not None), None)
            missing = [part for part in parts if not hasattr(layer, part)] + ([] if mixer else ["mixer"])
            if missing:
                raise ModelError(
                    f"decoder layer {index} ({type(layer).__name__}) of a {family.model_type} model has no "
                    f"{', '.join(missing)}: the family table says its layers hold {', '.join(parts)} and one of "
                    f"{', '.join(family.mixers)}; is this checkpoint of another model_type?"
                )
            self.mixers.append(mixer)
        kinds = getattr(self.config, "layer_types", None)
        if kinds is None:
            sliding = getattr(self.config, "sliding_window", None) is not None
            kinds = ["sliding_attention" if sliding else "full_attention"] * len(self.layers)
        unknown = sorted(set(kinds) - set(_MASKS))
        if unknown:
            raise ModelError(f"attention kinds {unknown} are not supported layer by layer; known: {sorted(_MASKS)}")
        self.kinds = tuple(kinds[: len(self.layers)])
        from transformers import masking_utils

        self._masks = {kind: getattr(masking_utils, _MASKS[kind]) for kind in set(self.kinds)}
        self.devices = [module_device(layer) for layer in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] long -> [B, T, H] model dtype, times the family's embedding multipliers."""
        embeds = self.base.get_input_embeddings()(input_ids)  # [B, T, H]
        if self.family.embedding_scale:
            embeds = embeds * getattr(self.config, self.family.embedding_scale)
        if self.family.embedding_sqrt_when and getattr(self.config, self.family.embedding_sqrt_when, False):
            embeds = embeds * (self.config.hidden_size**0.5)
        return embeds

    def context(self, embeds: torch.Tensor, attention_mask: torch.Tensor) -> BatchContext:
        """Position ids, rotary embeddings and per-layer masks of a right-padded batch ([B, T, H], [B, T])."""
        position_ids = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)  # [1, T]
        built = {
            kind: mask(
                config=self.config,
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                cache=None,
                position_ids=position_ids,
            )
            for kind, mask in self._masks.items()
        }
        rotary_emb = getattr(self.base, self.family.rotary, None)
        rotary = rotary_emb(embeds, position_ids) if rotary_emb is not None else None
        return BatchContext(position_ids, rotary, tuple(built[kind] for kind in self.kinds))

    def attend(self, index: int, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """The attention half of decoder layer `index`: [B, T, H] -> [B, T, H] on that layer's device."""
        layer, device = self.layers[index], self.devices[index]
        hidden = hidden.to(device)  # a model sharded over GPUs (device_map): the halves bypass the layer's hooks
        half = self.family.mixer_half
        normed = getattr(layer, half.norm)(hidden) if half.norm else hidden
        arguments = dict(
            hidden_states=normed,
            attention_mask=_to(ctx.masks[index], device),
            position_ids=ctx.position_ids.to(device),
            position_embeddings=_to(ctx.position_embeddings, device),
            cache=None,
            use_cache=False,
        )
        mixer = getattr(layer, self.mixers[index])
        if self.mixers[index] != "self_attn":  # linear attention, Mamba: only the arguments it names (its **kwargs
            named = inspect.signature(mixer.forward).parameters  # reach kernels that refuse the others)
            arguments = {k: v for k, v in arguments.items() if k in named}
        out = mixer(**arguments)
        if isinstance(out, tuple):  # attention also returns its weights
            out = out[0]
        return _residual(layer, half, hidden, normed, out)

    def feed_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The feed-forward half of decoder layer `index`, per token: [..., T, H] -> [..., T, H] on its device."""
        layer, half = self.layers[index], self.family.block_half
        hidden = hidden.to(self.devices[index])
        normed = getattr(layer, half.norm)(hidden) if half.norm else hidden
        out = getattr(layer, self.block)(normed)
        if isinstance(out, tuple):  # GPT-OSS also returns its router scores, Llama 4 its router logits
            out = out[0]
        out = out.reshape(hidden.shape)  # Llama 4's MoE block returns its tokens flattened: [N, H]
        for name in self.family.block_beside:  # a dense MLP beside the block (Granite), None where configured off
            beside = getattr(layer, name)
            if beside is not None:
                out = out + beside(normed)
        return _residual(layer, half, hidden, normed, out)

    def run(self, hidden: torch.Tensor, ctx: BatchContext, start: int, stop: int) -> torch.Tensor:
        """Decoder layers start..stop-1 on [B, T, H] -> [B, T, H]."""
        for index in range(start, stop):
            hidden = self.feed_forward(index, self.attend(index, hidden, ctx))
        return hidden

    def half_costs(self) -> list[tuple[int, int]]:
        """Per decoder layer: active multiply-accumulates per token of (attention half, feed-forward half)."""
        from evoesap import moe

        routed = {block.decoder_index: block for block in moe.moe_blocks(self.model)}
        spec = {layer.decoder_index: layer for layer in moe.inspect(self.model).layers}
        costs = []
        mixer_half, block_half = self.family.mixer_half, self.family.block_half
        for index, layer in enumerate(self.layers):
            attention = _numel(layer, self.mixers[index], mixer_half.norm, mixer_half.post_norm)
            feed_forward = _numel(layer, self.block, *self.family.block_beside, block_half.norm, block_half.post_norm)
            if index in routed:  # a token passes through top-k of the routed experts
                experts, info = _params(routed[index].experts), spec[index]
                feed_forward -= experts - experts * info.top_k // info.num_experts
            costs.append((attention, feed_forward))
        return costs

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm, per token, so it may run on the scored rows only: [..., H] -> [..., H]."""
        norm = getattr(self.base, self.family.final_norm)
        return norm(hidden.to(module_device(norm)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The whole stack, layer by layer: equals the base model's last_hidden_state -> [B, T, H]."""
        embeds = self.embed(input_ids)
        return self.norm(self.run(embeds, self.context(embeds, attention_mask), 0, self.num_layers))


def _residual(
    layer: torch.nn.Module, half: Residual, hidden: torch.Tensor, normed: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """A residual half's sum, `r * residual_scale + post_norm(out) * scale` (r: `hidden`, or `normed` where the
    residual is the normed input), each factor applied in the order the family's own layer applies it."""
    if half.post_norm:
        out = getattr(layer, half.post_norm)(out)
    if half.scale:
        out = out * getattr(layer, half.scale)
    residual = normed if half.normed_residual else hidden
    if half.residual_scale:
        residual = residual * getattr(layer, half.residual_scale)
    return residual + out


def _params(module: torch.nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _numel(layer: torch.nn.Module, *parts: str | None) -> int:
    """Parameters of the named parts of `layer` (None names and None modules count nothing)."""
    return sum(_params(getattr(layer, part)) for part in parts if part)


def _to(value: object, device: torch.device) -> object:
    """Tensors (also inside tuples) moved to `device`; anything else (None, a BlockMask) as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


# --------------------------------------------------------------------------------------------------
# The LM head


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head (and the family's logit scaling or final soft-capping) on [P, H] -> [P, V]."""
    from evoesap.moe.families import FAMILIES

    head = model.get_output_embeddings()
    logits = head(hidden.to(module_device(head)))  # [P, V] model dtype
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is not None and family.logits_divisor:  # Granite's logits_scaling, as its own forward divides
        logits = logits / getattr(model.config, family.logits_divisor)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
