"""Scores pruning candidates against the teacher cache: the search's fitness function.

A candidate is the full model with some experts masked out of the routers (`evoesap.moe.masked`);
it runs teacher-forced over the cached samples, and the LM head runs only at scored positions, since
the head and softmax over the vocabulary cost as much as several layers and only answer-predicting
positions count; it runs over chunks of scored rows, so that the [rows, V] float32 temporaries stay
in a CPU's cache and within bounds on a GPU. Each sample is cut after its last scored position
(causal attention: later tokens cannot change earlier logits). Results are memoised per allocation and per sample, so scoring a
subset first (racing) and the full set later re-runs only the missing samples.

The decoder stack runs in half-layers (`evoesap.scoring.forward`), so that with `prefix_cache_bytes > 0` a
candidate starts at the MoE block of its first MoE layer whose pruned set differs from a cached
allocation's, from the hidden states cached there (`evoesap.scoring.prefix`), and the last layer's
feed-forward half runs on scored positions only; values equal a forward from scratch up to float
rounding of differently padded batches. `work` counts the active multiply-accumulates done, without
padding, for cost figures in full-forward equivalents (`full_forward_work`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from evoesap import records
from evoesap.errors import ConfigError
from evoesap.scoring import metrics
from evoesap.scoring.forward import LayerRunner, head_logits, iter_batches, model_device, pad_right
from evoesap.scoring.prefix import PrefixCache, Sets
from evoesap.scoring.teacher import TeacherCache, load_cache
from evoesap.store import artifacts

log = logging.getLogger(__name__)

AllocationKey = tuple[tuple[int, tuple[int, ...]], ...]
# The default prefix-cache budget holds the states of this many allocations per elite (plus one): 160 with
# the paper's 4 elites, about five generations of offspring, so that reuse stays as with an unbounded cache
# (a default demo search: 0.375 FFE per candidate; 0.481 with 8) while a small model's search does not
# take half of a machine's free memory. Large models hit the half-of-free-memory bound first.
AUTO_ALLOCATIONS_PER_ELITE = 32
# [rows, V] float32 bytes per LM-head chunk of scored rows: ~8 MiB fit a CPU's cache; 256 MiB on a GPU
HEAD_CHUNK_BYTES = {"cpu": 1 << 23, "gpu": 1 << 28}


def auto_prefix_budget(free: int, keep: int, boundaries: int, boundary_bytes: int) -> int:
    """The prefix cache's automatic budget: half the memory `free` on the model's device, at most room for every
    boundary of AUTO_ALLOCATIONS_PER_ELITE x (keep + 1) allocations (the planner sizes the search by it too)."""
    return min(max(0, free) // 2, AUTO_ALLOCATIONS_PER_ELITE * (keep + 1) * boundaries * boundary_bytes)


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
        prefix_cache_bytes: int | None = 0,
        keep: int = 4,
        cache_device_bytes: int | None = None,
    ) -> None:
        """`verify=False` skips the weights check, for scoring a physically pruned checkpoint against
        its full model's cache; `weights_hash` saves re-hashing a model whose hash is already known.
        `prefix_cache_bytes`: budget of the prefix cache (0: every candidate runs from the embeddings; None:
        room for every boundary of AUTO_ALLOCATIONS_PER_ELITE x (keep + 1) allocations, at most half the
        memory still free on the model's device once the model and the teacher cache are there);
        `keep`: allocations whose cached states are never evicted (the search's elites).
        `cache_device_bytes`: the most the teacher cache's [P, W] columns may take on a GPU (None: half the
        free memory there; 0: never); a larger cache stays on the host and streams batch by batch."""
        self.model = model
        self.metric = metrics.metric(metric)
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
        self.cache = cache.to(self.device, heavy=self._cache_fits(cache, cache_device_bytes))
        offsets = cache.offsets.tolist()
        positions = cache.positions.tolist()
        # each sample cut after its last scored position: nothing later reaches a scored logit
        self._lengths = [positions[offsets[i + 1] - 1] + 1 for i in range(cache.num_samples)]
        self._full_lengths = [int(ids.numel()) for ids in cache.input_ids]
        self._rows = [torch.arange(offsets[i], offsets[i + 1], device=self.device) for i in range(cache.num_samples)]
        from evoesap.moe import inspect

        self._runner = LayerRunner(model)
        self._costs = self._runner.half_costs()
        self._starts = [layer.decoder_index for layer in inspect(model).layers]  # MoE ordinal -> decoder layer
        boundaries = list(range(len(self._starts)))
        boundary_bytes = sum(self._lengths) * int(self._runner.config.hidden_size) * next(model.parameters()).element_size()
        if prefix_cache_bytes is None:
            from evoesap.machine.runtime import free_memory_bytes

            prefix_cache_bytes = auto_prefix_budget(free_memory_bytes(self.device), keep, len(boundaries), boundary_bytes)
            log.info("prefix cache budget: %.2f GiB on %s", prefix_cache_bytes / 2**30, self.device)
        if prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        self.prefix: PrefixCache | None = None
        if prefix_cache_bytes:
            self.prefix = PrefixCache(prefix_cache_bytes, boundaries, boundary_bytes, keep)
        chunk_bytes = HEAD_CHUNK_BYTES["cpu" if self.device.type == "cpu" else "gpu"]
        self._head_rows = max(1, chunk_bytes // (4 * int(model.get_output_embeddings().weight.shape[0])))
        self._uniforms = None
        if self.metric.name == "sap":
            gen = torch.Generator().manual_seed(seed)
            self._uniforms = torch.rand(cache.meta.num_positions, generator=gen).to(self.device)  # [P] float32
        # allocation -> (lower [S], upper [S]) float32 on the host, NaN where not computed yet
        self._memo: dict[AllocationKey, tuple[torch.Tensor, torch.Tensor]] = {}
        # per sample: shortfall from the metric's best summed over the allocations scored on every sample [S] float64
        self._shortfall_sum = torch.zeros(cache.num_samples, dtype=torch.float64)
        self._complete = 0
        self.forwards = 0  # samples run through the model, for cost accounting
        self.work = 0  # active multiply-accumulates actually run (`LayerRunner.half_costs`; padding not counted)

    # ---------------------------------------------------------------------------------------------
    # Public API

    def score(
        self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None, floor: float | None = None
    ) -> float:
        """Search fitness of `pruned` (MoE ordinal -> expert ids) over `samples` (cache indices; all by default).

        With `floor`, batches of samples run only while the fitness could still reach `floor`, counting every
        sample not scored yet at the metric's best value; once it cannot, the return is that upper bound, below
        `floor`, and the rest is left unscored (a later call finishes it). A fitness at or above `floor` comes
        back exactly as without one: the same batches run, only their order is checked in between."""
        index = self._sample_index(samples)
        lower = self._fill(allocation_key(pruned), index, floor)[0][index]
        if floor is not None and bool(torch.isnan(lower).any()):
            return self._upper(lower)
        return self.metric.sign * metrics.dataset_mean(lower)

    def bounds(self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None) -> tuple[float, float]:
        """Dataset-level (lower, upper) of the raw metric; equal except for ESAP on a top-K cache."""
        lower, upper = self.sample_bounds(pruned, samples)
        return metrics.dataset_mean(lower), metrics.dataset_mean(upper)

    def sample_values(self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None) -> torch.Tensor:
        """Raw per-sample metric (mean over each sample's scored positions) -> [len(samples)] float32."""
        return self.sample_bounds(pruned, samples)[0]

    def sample_bounds(
        self, pruned: Mapping[int, Iterable[int]], samples: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample (lower, upper) -> ([len(samples)], [len(samples)]) float32, memoised."""
        index = self._sample_index(samples)
        lower, upper = self._fill(allocation_key(pruned), index)
        return lower[index].clone(), upper[index].clone()

    @property
    def num_samples(self) -> int:
        return self.cache.num_samples

    def clear(self) -> None:
        """Forget memoised scores and cached states (for example after the model's weights changed)."""
        self._memo.clear()
        self._shortfall_sum.zero_()
        self._complete = 0
        if self.prefix is not None:
            self.prefix.clear()

    def full_forward_work(self, samples: Sequence[int] | None = None) -> int:
        """The work of one plain full forward over `samples` (every layer, every token): the unit of `work`."""
        index = self._sample_index(samples).tolist()
        return sum(a + f for a, f in self._costs) * sum(self._full_lengths[s] for s in index)

    # ---------------------------------------------------------------------------------------------
    # Work

    def _fill(self, key: AllocationKey, index: torch.Tensor, floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score the samples of `index` that `key` lacks -> its memo (lower [S], upper [S]) float32, NaN where not
        scored; with `floor`, stop once the fitness over `index` provably lies below it (`score`)."""
        if key not in self._memo:
            nan = torch.full((self.cache.num_samples,), float("nan"))
            self._memo[key] = (nan.clone(), nan.clone())
        lower, upper = self._memo[key]
        missing = [i for i in index.tolist() if torch.isnan(lower[i])]
        if missing and floor is None:
            self._run(key, missing)
        elif missing:  # the samples where scored allocations fall shortest of the best first: the bound drops fastest
            self._run(key, missing, lambda: self._upper(lower[index]) < floor, self._shortfall.tolist())
        return lower, upper

    @property
    def _shortfall(self) -> torch.Tensor:
        """Mean shortfall per sample over the allocations scored in full so far -> [S] float64 (zeros before any)."""
        return self._shortfall_sum / max(1, self._complete)

    def _upper(self, lower: torch.Tensor) -> float:
        """Fitness bound from per-sample values ([n] float32, NaN where not scored: counted at the metric's best)."""
        signed = self.metric.sign * lower.double()
        return float(torch.where(torch.isnan(signed), self.metric.sign * self.metric.best, signed).mean())

    def _cache_fits(self, cache: TeacherCache, budget: int | None) -> bool:
        """Whether the teacher columns go to the model's device (always, when that is the host)."""
        if self.device.type == "cpu":
            return True
        if budget is None:
            from evoesap.machine.runtime import free_memory_bytes

            budget = free_memory_bytes(self.device) // 2
        fits = cache.heavy_bytes <= budget
        log.info(
            "teacher cache (%.2f GiB) %s",
            cache.heavy_bytes / 2**30,
            f"on {self.device}" if fits else f"streamed from the host: over the {budget / 2**30:.2f} GiB budget",
        )
        return fits

    def _sample_index(self, samples: Sequence[int] | None) -> torch.Tensor:
        if samples is None:
            return torch.arange(self.cache.num_samples)
        index = torch.as_tensor(list(samples), dtype=torch.long)
        if index.numel() == 0:
            raise ConfigError("samples is empty: pass None for all samples or at least one index")
        if bool((index < 0).any()) or bool((index >= self.cache.num_samples).any()):
            raise ConfigError(f"sample indices must be in 0..{self.cache.num_samples - 1}, got {list(samples)}")
        return index

    def _run(
        self,
        key: AllocationKey,
        samples: list[int],
        stop: Callable[[], bool] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        """Masked forward over `samples`, batch by batch into `key`'s memo; `stop` is asked before every batch
        (samples scored earlier, by a racing level, may settle it at once), and a true answer leaves the rest unscored. `weights` (per cache sample)
        orders the batches, heaviest first; the batches themselves are the same whatever their order."""
        from evoesap.moe import masked

        pruned = dict(key)
        sets: Sets = tuple(tuple(pruned.get(a, ())) for a in range(len(self._starts)))
        lower, upper = self._memo[key]  # [S] float32 on the host
        complete = not bool(torch.isnan(lower).any())
        batches = list(iter_batches([self._lengths[s] for s in samples], self.batch_size))
        if weights is not None:
            batches.sort(key=lambda batch: -sum(weights[samples[b]] for b in batch))
        starts = {s: self.prefix.start(sets, s) if self.prefix is not None else (-1, None) for s in samples}
        stopped = False
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.inference_mode(), masked(self.model, pruned):
                for batch in batches:
                    if stop is not None and stop():
                        stopped = True
                        break
                    order, lo, up = self._forward([samples[b] for b in batch], sets, starts)
                    lower[order], upper[order] = lo.cpu(), up.cpu()  # one transfer per batch
                    self.forwards += len(order)
        finally:
            if was_training:
                self.model.train()
        if not complete and not bool(torch.isnan(lower).any()):
            self._shortfall_sum += self.metric.sign * self.metric.best - self.metric.sign * lower.double()
            self._complete += 1
        if self.prefix is not None:  # an allocation stopped early ranks by its bound, below every elite's fitness
            done = lower[~torch.isnan(lower)]
            self.prefix.commit(sets, self._upper(lower) if stopped else self.metric.sign * float(done.double().mean()))

    def _forward(
        self, chunk: list[int], sets: Sets, starts: Mapping[int, tuple[int, torch.Tensor | None]]
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """One batch through the candidate -> (its samples in row order, lower [B], upper [B]).

        Rows start where their cached state lies (`starts`: MoE ordinal and state, -1 for the
        embeddings) and join the batch there; states at the prefix cache's boundaries are offered on the
        way. The last decoder layer's feed-forward half, the final norm and the LM head run on the
        scored positions only.
        """
        runner = self._runner
        order = sorted(chunk, key=lambda s: starts[s][0])  # rows join in start order: the active rows are a prefix
        lengths = [self._lengths[s] for s in order]
        input_ids, attention_mask = pad_right([self.cache.input_ids[s][:n] for s, n in zip(order, lengths)])
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        first = starts[order[0]][0]
        active = sum(1 for s in order if starts[s][0] == first)
        if first < 0:
            hidden, point = runner.embed(input_ids[:active]), None  # [b, T, H]
        else:
            hidden, point = self._stack([starts[s][1] for s in order[:active]], input_ids.shape[1]), self._starts[first]
        ctx = None  # masks and rotary embeddings of the active rows, built when an attention half first needs them
        stations = sorted(
            {a for a in (self.prefix.boundaries if self.prefix is not None else ()) if a > first}
            | {starts[s][0] for s in order[active:]}
        )
        for a in stations:
            ctx = ctx or runner.context(hidden, attention_mask[:active])
            hidden = self._advance(hidden, ctx, point, self._starts[a], sum(lengths[:active]))
            point = self._starts[a]
            for row, (s, n) in enumerate(zip(order[:active], lengths)):
                if self.prefix.wants(sets, a, s):
                    self.prefix.put(sets, a, s, hidden[row, :n].clone())  # [T_i, H]
            joining = [s for s in order[active:] if starts[s][0] == a]
            if joining:
                joined = self._stack([starts[s][1] for s in joining], hidden.shape[1]).to(hidden.device)
                hidden = torch.cat([hidden, joined])
                active += len(joining)
                ctx = None
        last = runner.num_layers - 1
        if point != last:
            ctx = ctx or runner.context(hidden, attention_mask[:active])
            hidden = self._advance(hidden, ctx, point, last, sum(lengths))
        return order, *self._score_rows(hidden, order)

    def _advance(self, hidden: torch.Tensor, ctx: Any, point: int | None, target: int, tokens: int) -> torch.Tensor:
        """From the state between the halves of decoder layer `point` (None: the embeddings) to that of
        `target` > `point`: [b, T, H] -> [b, T, H]; counts the work on `tokens` real tokens."""
        runner, costs = self._runner, self._costs
        begin = 0 if point is None else point + 1
        if point is not None:
            hidden = runner.feed_forward(point, hidden)
            self.work += costs[point][1] * tokens
        hidden = runner.attend(target, runner.run(hidden, ctx, begin, target), ctx)
        self.work += (sum(a + f for a, f in costs[begin:target]) + costs[target][0]) * tokens
        return hidden

    def _stack(self, states: list[torch.Tensor], length: int) -> torch.Tensor:
        """Cached per-sample states ([T_i, H] each) right-padded with zeros -> [b, length, H]."""
        hidden = torch.zeros((len(states), length, states[0].shape[-1]), dtype=states[0].dtype, device=self.device)
        for row, state in enumerate(states):
            hidden[row, : state.shape[0]] = state
        return hidden

    def _score_rows(self, hidden: torch.Tensor, chunk: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """From the state between the last layer's halves ([B, T, H], rows in `chunk` order): that layer's
        feed-forward, the final norm, LM head and metric at the scored positions -> (lower [B], upper [B])."""
        rows = torch.cat([self._rows[s] for s in chunk])  # [P_b] long: cache rows
        owner = torch.cat(
            [torch.full((self._rows[s].numel(),), b, dtype=torch.long, device=self.device) for b, s in enumerate(chunk)]
        )  # [P_b] long: batch row of each cache row
        last = self._runner.num_layers - 1
        at = hidden.device  # the last layer's, when the model is sharded over GPUs
        rows_at = hidden[owner.to(at), self.cache.positions[rows].to(at)]  # [P_b, H]
        picked = self._runner.feed_forward(last, rows_at.unsqueeze(0))[0]  # [P_b, H]
        self.work += self._costs[last][1] * rows.numel()
        normed = self._runner.norm(picked)  # [P_b, H]
        lower, upper = torch.empty(rows.numel(), device=self.device), torch.empty(rows.numel(), device=self.device)
        step = self._head_rows
        for i in range(0, rows.numel(), step):  # [step, V] temporaries: cache-sized on a CPU, bounded on a GPU
            logits = head_logits(self.model, normed[i : i + step]).to(self.device)  # [step, V]
            lower[i : i + step], upper[i : i + step] = self._per_position(logits, rows[i : i + step])
        n = len(chunk)
        return metrics.per_sample_mean(lower, owner, n), metrics.per_sample_mean(upper, owner, n)

    def _per_position(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, name = self.cache, self.metric.name
        if name == "nll":
            values = metrics.nll(logits, cache.targets[rows])
            return values, values
        if cache.mode == "topk":  # only esap reaches here (checked in __init__)
            return metrics.esap_topk_bounds(
                cache.column_rows("topk_ids", rows, self.device),
                cache.column_rows("topk_logprobs", rows, self.device),
                cache.tail_mass[rows],
                logits,
            )
        teacher = cache.column_rows("logprobs", rows, self.device)  # [P_b, V] stored dtype; the metrics upcast
        if name == "esap":
            values = metrics.esap(teacher, logits)
        elif name == "kl":
            values = metrics.kl(teacher, logits)
        else:  # sap
            values = metrics.sap(teacher, logits, uniforms=self._uniforms[rows])
        return values, values


def read_pruned(uri: str) -> dict[int, list[int]]:
    """The pruned sets of an allocation file (or an artifact directory holding allocation.json).

    Format: {"pruned": {"<MoE ordinal>": [expert ids], ...}}; other keys are ignored.
    """
    target = uri
    if not uri.endswith(".json"):
        target = artifacts.join(uri, records.ALLOCATION_FILE)
    try:
        data = json.loads(artifacts.read_bytes(target).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{artifacts.redact(target)} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{artifacts.redact(target)}: JSON nested too deeply to read") from None
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
    from evoesap import moe
    from evoesap.machine import runtime

    runtime.check_model_dtype(model_dtype)
    if allocation and artifacts.exists(artifacts.join(allocation, artifacts.MANIFEST)):  # a search artifact: checked
        record = records.read(allocation, records.AllocationRecord)
        _, pruned = records.allocation_counts(record, allocation, runtime.inspect_checkpoint(model))
    else:
        pruned = read_pruned(allocation) if allocation else {}
    loaded_cache = load_cache(cache)
    tokenizer = moe.load_tokenizer(model)
    loaded = runtime.load_model(model, model_dtype, device)
    scorer = CandidateEvaluator(loaded, loaded_cache, metric=metric, batch_size=batch_size, tokenizer=tokenizer)
    return scorer.bounds(pruned)
