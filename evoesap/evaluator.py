"""Scores pruning candidates against the teacher cache: the search's fitness function.

A candidate is the full model with some experts masked out of the routers (`evoesap.moe.masked`);
it runs teacher-forced over the cached samples, and the LM head runs only at scored positions, since
the head and softmax over the vocabulary cost as much as several layers and only answer-predicting
positions count. Each sample is cut after its last scored position (causal attention: later tokens
cannot change earlier logits). Results are memoised per allocation and per sample, so scoring a
subset first (racing) and the full set later re-runs only the missing samples.

The decoder stack runs layer by layer (`evoesap.layerwise`), so that with `prefix_cache_bytes > 0` a
candidate starts at its first MoE layer whose pruned set differs from a cached allocation's, from the
hidden states cached there (`evoesap.prefix`); values equal a forward from scratch up to float
rounding of differently padded batches. `layer_tokens` counts the decoder-layer x token work done,
without padding, for cost figures in full-forward equivalents (`full_forward_tokens`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Mapping, Sequence

import torch

from evoesap import artifacts, fitness
from evoesap.errors import ConfigError
from evoesap.layerwise import LayerRunner
from evoesap.prefix import PrefixCache, Sets
from evoesap.teacher import (
    TeacherCache,
    head_logits,
    iter_batches,
    load_cache,
    model_device,
    pad_right,
)

log = logging.getLogger(__name__)

AllocationKey = tuple[tuple[int, tuple[int, ...]], ...]


def allocation_key(pruned: Mapping[int, Iterable[int]]) -> AllocationKey:
    """A canonical, hashable form of an allocation (layers without pruned experts dropped)."""
    key = []
    for layer, experts in pruned.items():
        ids = tuple(sorted({int(e) for e in experts}))
        if ids:
            key.append((int(layer), ids))
    return tuple(sorted(key))


class CandidateEvaluator:
    """Fitness of pruning allocations: dataset mean of per-sample means of a per-position metric.

    `score` is the search fitness (higher is better: ESAP, SAP, -KL, -NLL); `sample_values` gives the
    raw per-sample metric for held-out checks. With a `topk` cache, ESAP is its exact lower bound and
    `bounds` gives (lower, upper). SAP draws its proposal tokens from uniforms fixed per cached
    position (seeded by `seed`), so every candidate sees the same random numbers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: TeacherCache | str,
        metric: str = "esap",
        batch_size: int = 8,
        *,
        tokenizer: Any = None,
        seed: int = 0,
        verify: bool = True,
        weights_hash: str | None = None,
        prefix_cache_bytes: int = 0,
        keep: int = 4,
    ) -> None:
        """`verify=False` skips the weights check, for scoring a physically pruned checkpoint against
        its full model's cache; `weights_hash` saves re-hashing a model whose hash is already known.
        `prefix_cache_bytes`: budget of the prefix cache (0: every candidate runs from the embeddings);
        `keep`: allocations whose cached states are never evicted (the search's elites)."""
        self.model = model
        self.metric = fitness.metric(metric)
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        cache = load_cache(cache) if isinstance(cache, str) else cache
        if cache.mode == "topk" and self.metric.needs_full_vocab:
            raise ConfigError(
                f"metric {metric!r} needs full-vocabulary teacher log-probabilities but the cache is top-K: "
                "use metric 'esap' or 'nll', or rebuild the cache with --mode full"
            )
        if verify:
            cache.check_model(model, tokenizer, weights_hash=weights_hash)
        else:  # a physically pruned model (held-out ESAP): other weights, same vocabulary
            cache.check_vocab(model)
        self.device = model_device(model)
        self.cache = cache.to(self.device)
        offsets = cache.offsets.tolist()
        positions = cache.positions.tolist()
        # each sample cut after its last scored position: nothing later reaches a scored logit
        self._lengths = [positions[offsets[i + 1] - 1] + 1 for i in range(cache.num_samples)]
        self._full_lengths = [int(ids.numel()) for ids in cache.input_ids]
        self._rows = [torch.arange(offsets[i], offsets[i + 1], device=self.device) for i in range(cache.num_samples)]
        if prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        from evoesap.moe import inspect

        self._runner = LayerRunner(model)
        self._starts = [layer.decoder_index for layer in inspect(model).layers]  # MoE ordinal -> decoder layer
        self.prefix: PrefixCache | None = None
        if prefix_cache_bytes:
            hidden = int(model.config.hidden_size)
            itemsize = next(model.parameters()).element_size()
            boundaries = [a for a in range(len(self._starts)) if a > 0 or self._starts[0] > 0]
            self.prefix = PrefixCache(prefix_cache_bytes, boundaries, sum(self._lengths) * hidden * itemsize, keep)
        self._uniforms = None
        if self.metric.name == "sap":
            gen = torch.Generator().manual_seed(seed)
            self._uniforms = torch.rand(cache.meta.num_positions, generator=gen).to(self.device)  # [P] float32
        # allocation -> (lower [S], upper [S]) float32 on the host, NaN where not computed yet
        self._memo: dict[AllocationKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self.forwards = 0  # samples run through the model, for cost accounting
        self.layer_tokens = 0  # decoder layers x tokens actually run (padding not counted)

    # ---------------------------------------------------------------------------------------------
    # Public API

    def score(self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None) -> float:
        """Search fitness of `pruned` (MoE ordinal -> expert ids) over `samples` (cache indices; all by default)."""
        lower, _ = self.sample_bounds(pruned, samples)
        return self.metric.sign * fitness.dataset_mean(lower)

    def bounds(self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None) -> tuple[float, float]:
        """Dataset-level (lower, upper) of the raw metric; equal except for ESAP on a top-K cache."""
        lower, upper = self.sample_bounds(pruned, samples)
        return fitness.dataset_mean(lower), fitness.dataset_mean(upper)

    def sample_values(self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None) -> torch.Tensor:
        """Raw per-sample metric (mean over each sample's scored positions) -> [len(samples)] float32."""
        return self.sample_bounds(pruned, samples)[0]

    def sample_bounds(
        self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample (lower, upper) -> ([len(samples)], [len(samples)]) float32, memoised."""
        index = self._sample_index(samples)
        key = allocation_key(pruned)
        if key not in self._memo:
            nan = torch.full((self.cache.num_samples,), float("nan"))
            self._memo[key] = (nan.clone(), nan.clone())
        lower, upper = self._memo[key]
        missing = [i for i in index.tolist() if torch.isnan(lower[i])]
        if missing:
            new_lower, new_upper = self._run(key, missing)
            lower[missing], upper[missing] = new_lower, new_upper
        return lower[index].clone(), upper[index].clone()

    @property
    def num_samples(self) -> int:
        return self.cache.num_samples

    def clear(self) -> None:
        """Forget memoised scores and cached states (for example after the model's weights changed)."""
        self._memo.clear()
        if self.prefix is not None:
            self.prefix.clear()

    def full_forward_tokens(self, samples: Sequence[int] | None = None) -> int:
        """Decoder layers x tokens of one plain full forward over `samples`: the unit of `layer_tokens`."""
        index = self._sample_index(samples).tolist()
        return self._runner.num_layers * sum(self._full_lengths[s] for s in index)

    # ---------------------------------------------------------------------------------------------
    # Work

    def _sample_index(self, samples: Sequence[int] | None) -> torch.Tensor:
        if samples is None:
            return torch.arange(self.cache.num_samples)
        index = torch.as_tensor(list(samples), dtype=torch.long)
        if index.numel() == 0:
            raise ConfigError("samples is empty: pass None for all samples or at least one index")
        if bool((index < 0).any()) or bool((index >= self.cache.num_samples).any()):
            raise ConfigError(f"sample indices must be in 0..{self.cache.num_samples - 1}, got {list(samples)}")
        return index

    def _run(self, key: AllocationKey, samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked forward over `samples` -> per-sample (lower, upper) on the host."""
        from evoesap.moe import masked

        pruned = dict(key)
        sets: Sets = tuple(tuple(pruned.get(a, ())) for a in range(len(self._starts)))
        lower = torch.empty(len(samples), device=self.device)  # [S'] float32
        upper = torch.empty(len(samples), device=self.device)
        slot = {s: j for j, s in enumerate(samples)}
        groups: dict[int, list[int]] = {}  # first MoE ordinal to run -> samples starting there
        cached: dict[int, torch.Tensor] = {}
        for s in samples:
            a, state = self.prefix.start(sets, s) if self.prefix is not None else (0, None)
            groups.setdefault(a, []).append(s)
            if state is not None:
                cached[s] = state
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), masked(self.model, pruned):
                for a, group in sorted(groups.items()):
                    for batch in iter_batches([self._lengths[s] for s in group], self.batch_size):
                        chunk = [group[b] for b in batch]
                        hidden = self._hidden(chunk, sets, a, cached)  # [B, T, H]
                        lo, up = self._score_rows(hidden, chunk)  # [B], [B]
                        where = torch.tensor([slot[s] for s in chunk], device=self.device)
                        lower[where], upper[where] = lo, up
                        self.forwards += len(chunk)
        finally:
            self.model.train(was_training)
        lower, upper = lower.cpu(), upper.cpu()
        if self.prefix is not None:
            memo = self._memo[key][0].clone()
            memo[samples] = lower
            self.prefix.commit(sets, self.metric.sign * float(memo[~torch.isnan(memo)].double().mean()))
        return lower, upper

    def _hidden(self, chunk: list[int], sets: Sets, first: int, cached: dict[int, torch.Tensor]) -> torch.Tensor:
        """Hidden states after the last decoder layer (before the final norm) of `chunk`, right-padded -> [B, T, H].

        The forward starts at MoE layer `first` from `cached` states (from the embeddings when 0), and
        offers the states entering later MoE layers to the prefix cache on the way.
        """
        runner = self._runner
        lengths = [self._lengths[s] for s in chunk]
        input_ids, attention_mask = pad_right([self.cache.input_ids[s][:n] for s, n in zip(chunk, lengths)])
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        if first == 0:
            start, hidden = 0, runner.embed(input_ids)  # [B, T, H]
        else:
            start = self._starts[first]
            hidden = torch.zeros((len(chunk), input_ids.shape[1], cached[chunk[0]].shape[-1]),
                                 dtype=cached[chunk[0]].dtype, device=self.device)  # [B, T, H]; padding stays 0
            for row, (s, n) in enumerate(zip(chunk, lengths)):
                hidden[row, :n] = cached[s]
        ctx = runner.context(hidden, attention_mask)
        real = sum(lengths)  # tokens counted as work; padding is a batching artefact, not method cost
        stops = [a for a in (self.prefix.boundaries if self.prefix is not None else ()) if a > first]
        for a in stops:
            hidden = runner.run(hidden, ctx, start, self._starts[a])
            self.layer_tokens += (self._starts[a] - start) * real
            start = self._starts[a]
            for row, (s, n) in enumerate(zip(chunk, lengths)):
                if self.prefix.wants(sets, a, s):
                    self.prefix.put(sets, a, s, hidden[row, :n].clone())  # [T_i, H]
        hidden = runner.run(hidden, ctx, start, runner.num_layers)
        self.layer_tokens += (runner.num_layers - start) * real
        return hidden

    def _score_rows(self, hidden: torch.Tensor, chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """LM head and metric at the scored positions of `chunk` -> per-sample (lower [B], upper [B])."""
        rows = torch.cat([self._rows[s] for s in chunk])  # [P_b] long: cache rows
        owner = torch.cat(
            [torch.full((self._rows[s].numel(),), b, dtype=torch.long, device=self.device) for b, s in enumerate(chunk)]
        )  # [P_b] long: batch row of each cache row
        logits = head_logits(self.model, self._runner.norm(hidden[owner, self.cache.positions[rows]]))  # [P_b, V]
        lower, upper = self._per_position(logits, rows)  # [P_b] float32 each
        n = len(chunk)
        return fitness.per_sample_mean(lower, owner, n), fitness.per_sample_mean(upper, owner, n)

    def _per_position(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, name = self.cache, self.metric.name
        if name == "nll":
            values = fitness.nll(logits, cache.targets[rows])
            return values, values
        if cache.mode == "topk":  # only esap reaches here (checked in __init__)
            return fitness.esap_topk_bounds(
                cache.topk_ids[rows], cache.topk_logprobs[rows], cache.tail_mass[rows], logits
            )
        teacher = cache.logprobs[rows]  # [P_b, V] stored dtype; fitness upcasts
        if name == "esap":
            values = fitness.esap(teacher, logits)
        elif name == "kl":
            values = fitness.kl(teacher, logits)
        else:  # sap
            values = fitness.sap(teacher, logits, uniforms=self._uniforms[rows])
        return values, values


def read_pruned(uri: str) -> dict[int, list[int]]:
    """The pruned sets of an allocation file (or an artifact directory holding allocation.json).

    Format: {"pruned": {"<MoE ordinal>": [expert ids], ...}}; other keys are ignored.
    """
    target = uri
    if not uri.endswith(".json"):
        target = artifacts.join(uri, "allocation.json")
    try:
        data = json.loads(artifacts.read_bytes(target).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{artifacts.redact(target)} is not valid JSON: {exc}") from None
    pruned = data.get("pruned") if isinstance(data, dict) else None
    if not isinstance(pruned, dict):
        raise ConfigError(
            f'{artifacts.redact(target)} has no "pruned" mapping: expected {{"pruned": {{"0": [3, 5], ...}}}} '
            "(MoE layer ordinal -> expert ids)"
        )
    try:
        return {int(layer): [int(e) for e in experts] for layer, experts in pruned.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{artifacts.redact(target)}: pruned must map layer numbers to lists of expert ids") from None


def score_allocation(
    model: str,
    cache: str,
    allocation: str | None = None,
    *,
    metric: str = "esap",
    batch_size: int = 8,
    model_dtype: str = "auto",
    device: str = "auto",
) -> tuple[float, float]:
    """Load the full model and a cache, score one allocation (none: the full model) -> raw (lower, upper)."""
    from evoesap import moe, runtime
    from evoesap.teacher import load_cache

    runtime.check_model_dtype(model_dtype)
    pruned = read_pruned(allocation) if allocation else {}
    loaded_cache = load_cache(cache)
    tokenizer = moe.load_tokenizer(model)
    loaded = runtime.load_model(model, model_dtype, device)
    scorer = CandidateEvaluator(loaded, loaded_cache, metric=metric, batch_size=batch_size, tokenizer=tokenizer)
    return scorer.bounds(pruned)
