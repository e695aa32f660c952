"""The records stages publish for each other, field by field: what each JSON key holds and which may be absent."""

from __future__ import annotations

import dataclasses
import math

from evoesap.records.typed import Record

ALLOCATION_FILE = "allocation.json"  # search: the chosen removal counts, pruned expert ids, fitness, checks
PRUNING_FILE = "pruning.json"  # prune: method, counts and parameter bytes of the checkpoint
METRICS_FILE = "metrics.json"  # evaluate: every task metric, memory, expert counts, labels
QUANTIZATION_FILE = "quantization.json"  # quantize: recipe, scheme, checkpoint bytes before and after, tool versions


@dataclasses.dataclass(frozen=True)
class Candidate(Record):
    """One allocation the search scored on its full search set."""

    removal_counts: tuple[int, ...]  # experts removed per MoE layer
    fitness: float  # the search metric, oriented so that higher is better


@dataclasses.dataclass(frozen=True)
class HeldoutCheck(Record):
    """Paired comparison of the searched allocation against uniform on held-out samples (higher is better)."""

    samples: int  # held-out samples compared
    searched: float | None  # mean fitness of the searched allocation; None without samples
    uniform: float | None  # mean fitness of uniform; None without samples
    difference: float | None  # mean of searched - uniform per sample; None without samples
    stderr: float | None  # standard error of that mean; None below two samples
    beats_uniform: bool  # the difference exceeds two standard errors
    searched_stderr: float | None = None  # standard error of the searched mean; None below two samples or not recorded

    def warning(self, metric: str, fallback: bool) -> str:
        """The warning for a check the searched allocation failed: headline, numbers, what to do. The search
        records it; the report rebuilds it for searches made before warnings were recorded."""
        stderr = "n/a" if self.stderr is None else f"{self.stderr:.2e}"
        action = (
            "falling back to uniform"
            if fallback
            else "the search set may be too small or saturated (consider more or longer samples, or fallback_to_uniform)"
        )
        return (
            f"searched allocation does not beat uniform on held-out samples: {metric} {self.searched:.4f} vs "
            f"uniform {self.uniform:.4f} (difference {self.difference:.2e}, stderr {stderr}); {action}"
        )


@dataclasses.dataclass(frozen=True)
class SearchWork(Record):
    """The work a search did, in full-forward equivalents (FFE: active multiply-accumulates run / those of one plain
    forward over the search samples; `evoesap.stages.search.search_work`), and how racing cut it. The search
    artifact's manifest holds it as `run.cost` (with how the run ran), not allocation.json: a resumed or
    multi-worker search does other work for the same result, and its allocation.json must equal an undisturbed
    run's, byte for byte."""

    full_forward_equivalents: float  # the whole search's work, before the held-out check
    full_forward_equivalents_per_candidate: float  # that over `candidates`
    candidates: int  # distinct allocations scored, on the full set or on a racing subset
    full_set_evaluations: int  # distinct allocations scored on the full search set
    stopped_early: int  # race stops after scoring some samples: a candidate stopped in two generations counts twice
    stopped_at: dict[int, int]  # samples scored at the stop -> race stops there
    racing: str  # off, schedule or statistical
    racing_delta: float | None = None  # statistical racing's declared error rate; None otherwise
    racing_tolerance: float | None = None  # statistical racing's tolerance in fitness; None otherwise
    resumed: bool = False  # the search was resumed: FFE count only the work after the resume
    screened: int = 0  # statistical racing's stops before any forward (its model's screen), not in stopped_early


@dataclasses.dataclass(frozen=True)
class AllocationRecord(Record):
    """allocation.json. What prune needs is required; the search's account of itself may be absent (an allocation
    written by hand), and `warnings` is absent in searches made before warnings were recorded."""

    FILE = ALLOCATION_FILE
    STAGE = "search"

    criterion: str  # importance criterion whose per-layer order the counts take experts from
    sparsity: float  # global share of routed experts removed
    removal_counts: tuple[int, ...]  # the chosen allocation: experts removed per MoE layer
    pruned: dict[int, tuple[int, ...]]  # MoE layer ordinal -> the expert ids removed there
    granularity: int = 1  # every count is a multiple of this
    metric: str | None = None  # the search's fitness metric (esap, kl, sap)
    budget: int | None = None  # experts removed in all
    num_experts: tuple[int, ...] | None = None  # routed experts per MoE layer of the full model
    top_k: tuple[int, ...] | None = None  # router top-k per MoE layer
    min_kept: tuple[int, ...] | None = None  # fewest experts each MoE layer may keep
    fitness: float | None = None  # full-search-set fitness of the chosen allocation
    searched: Candidate | None = None  # the search's best allocation
    uniform: Candidate | None = None  # uniform allocation of the same budget
    fallback_applied: bool | None = None  # uniform was chosen because the searched one did not generalise
    heldout: HeldoutCheck | None = None  # None: no held-out samples
    warnings: tuple[str, ...] | None = None  # what the search warned of; None: not recorded
    evaluations: int | None = None  # candidates the search scored
    search_samples: int | None = None  # samples the search scored on
    heldout_samples: int | None = None  # samples held out for the check


@dataclasses.dataclass(frozen=True)
class PruningRecord(Record):
    """pruning.json: what was cut out of the checkpoint and what it weighs before and after."""

    FILE = PRUNING_FILE
    STAGE = "prune"

    method: str  # searched (an allocation artifact) or uniform
    criterion: str  # importance criterion whose order decided which experts went
    sparsity: float  # global share of routed experts removed
    removal_counts: tuple[int, ...]  # experts removed per MoE layer
    pruned: dict[int, tuple[int, ...]]  # MoE layer ordinal -> the expert ids removed there
    num_experts: tuple[int, ...]  # experts kept per MoE layer
    parameter_bytes_full: int  # parameter bytes of the input checkpoint
    parameter_bytes_pruned: int  # parameter bytes of the pruned checkpoint


@dataclasses.dataclass(frozen=True)
class Labels(Record):
    """How the report names an evaluated run; None where the run was not labelled."""

    criterion: str | None = None  # the criterion the model was pruned with
    sparsity: float | None = None  # the sparsity it was pruned at
    method: str | None = None  # full, uniform, searched, frequency, ...


@dataclasses.dataclass(frozen=True)
class TaskMetric(Record):
    """One `metric,filter` value lm-eval gave for a task."""

    task: str  # lm-eval task (or group) name
    domain: str  # the suite it belongs to (mc, math, code, or the task directory's)
    metric: str  # lm-eval metric name
    filter: str  # lm-eval filter name
    value: float  # the metric's value
    stderr: float | None = None  # its standard error; None where lm-eval gave none (or a non-finite one)
    samples: int | None = None  # samples the task was scored on, where lm-eval said
    primary: bool = False  # the metric the report and the card show for the task


@dataclasses.dataclass(frozen=True)
class Memory(Record):
    """The evaluated model's footprint."""

    parameters: int  # parameter count, tied weights once
    parameter_bytes: int  # parameter bytes as loaded
    bf16_bytes: int  # load size with every floating tensor at 2 bytes
    checkpoint_bytes: int | None = None  # the safetensors files as stored; None: not at hand (or not yet recorded)


@dataclasses.dataclass(frozen=True)
class Experts(Record):
    """The evaluated model's MoE layers, read off the model itself."""

    family: str  # model family (olmoe, qwen3_moe, ...)
    num_experts: tuple[int, ...]  # routed experts per MoE layer
    top_k: tuple[int, ...]  # router top-k per MoE layer
    decoder_index: tuple[int, ...]  # decoder layer of each MoE layer


@dataclasses.dataclass(frozen=True)
class HeldoutEsap(Record):
    """ESAP of the pruned model against its full model's teacher cache on held-out samples."""

    esap: float  # lower bound of the mean ESAP
    esap_upper: float  # upper bound of the mean ESAP
    samples: int  # samples scored


@dataclasses.dataclass(frozen=True)
class Quantized(Record):
    """How the evaluated weights are quantized."""

    recipe: str | None  # the quantize stage's recipe; None: a quantized checkpoint not of our making
    scheme: str  # compressed-tensors scheme, or the quantization method its config names


@dataclasses.dataclass(frozen=True)
class MetricsRecord(Record):
    """metrics.json: one evaluated model."""

    FILE = METRICS_FILE
    STAGE = "evaluate"

    schema: int  # version of this layout
    model: str  # the evaluated checkpoint's URI (credentials redacted) or hub name
    records: tuple[TaskMetric, ...]  # every metric of every task
    memory: Memory  # the model's footprint
    experts: Experts  # the model's MoE layers
    labels: Labels = Labels()  # how the report names the run
    heldout_esap: HeldoutEsap | None = None  # None: no teacher cache given
    limit: float | None = None  # examples per task lm-eval was limited to (a smoke run); None: all
    quantization: Quantized | None = None  # None: unquantized weights

    def primary(self) -> tuple[TaskMetric, ...]:
        """Each task's primary metric, in the order lm-eval gave them."""
        return tuple(r for r in self.records if r.primary)


@dataclasses.dataclass(frozen=True)
class QuantizationRecord(Record):
    """quantization.json: how a checkpoint was quantized and what its weights weigh before and after."""

    FILE = QUANTIZATION_FILE
    STAGE = "quantize"

    recipe: str  # the recipe's name (evoesap.release.quantize_recipes.RECIPES)
    scheme: str  # compressed-tensors preset scheme
    algorithm: str  # rtn, gptq or awq
    calibration_samples: int  # samples the recipe calibrated on (0: uncalibrated)
    architectures: tuple[str, ...] | None  # config.json's architectures, kept from the input
    num_experts_per_layer: dict[int, int] | None  # decoder layer -> experts, of a non-uniform checkpoint; None: uniform
    checkpoint_bytes_before: int  # bytes of the input's safetensors files
    checkpoint_bytes_after: int  # bytes of the quantized safetensors files
    versions: dict[str, str]  # versions of the tools that quantized


GATE_FILE = "gate.json"  # gate: the release verdict, check by check


@dataclasses.dataclass(frozen=True)
class GateCheck(Record):
    """One threshold of the release gate and what the candidate showed against it."""

    name: str  # what was checked: heldout_esap, task <name> vs full, task <name> vs previous, ...
    value: float | None  # the candidate's value; None: the candidate has no such value (the check fails)
    reference: float | None  # what it is compared with (the full model's or the previous release's value); None: none
    limit: float  # the least value allowed: the threshold itself, or the reference less the allowed drop
    passed: bool  # value >= limit

    def line(self) -> str:
        """The check in words, with its numbers."""
        digits = _deciding_digits(self.value, self.limit)
        value = "missing" if self.value is None else f"{self.value:.{digits}f}"
        against = "" if self.reference is None else f" (reference {self.reference:.{digits}f})"
        return f"{self.name} {value} {'>=' if self.passed else '<'} {self.limit:.{digits}f}{against}"


def _deciding_digits(value: float | None, limit: float) -> int:
    """Decimals that show why a check went its way: 4, or as many as tell `value` from `limit` (0.99942 < 0.99945)."""
    if value is None:
        return 4
    return next((d for d in range(4, 10) if f"{value:.{d}f}" != f"{limit:.{d}f}"), 4)


@dataclasses.dataclass(frozen=True)
class GateRecord(Record):
    """gate.json: whether the evaluated candidate may be published, and every check that decided it."""

    FILE = GATE_FILE
    STAGE = "gate"

    passed: bool  # every check passed
    candidate: str  # the evaluated candidate's model URI (redacted)
    checks: tuple[GateCheck, ...]  # every threshold the gate applied, in order
    previous: str | None = None  # the previous release's metrics the gate compared with (redacted); None: none
    reference: str | None = None  # the model the candidate was made from, checked by content; None: an unchecked verdict
    name: str | None = None  # the candidate by criterion, sparsity and method (`reap at sparsity 0.2500 (searched)`);
    # None: unknown (an unlabelled evaluation outside a pipeline, or a verdict made before names), the URI stands in

    def line(self) -> str:
        """The verdict in one line, naming the candidate: the failing checks with their numbers, or that every check
        passed."""
        failed = [c.line() for c in self.checks if not c.passed]
        who = self.name or self.candidate
        if failed:
            return f"release gate failed for {who}: " + "; ".join(failed)
        return f"release gate passed for {who} ({len(self.checks)} checks)"


TARGET_FILE = "target.json"  # target: the sparsity chosen for a quality target, with every probe
NOISE_STDERRS = 2  # a held-out value this many standard errors from the threshold or nearer is not told apart from it


@dataclasses.dataclass(frozen=True)
class Probe(Record):
    """One search the bracketing made, and what it showed."""

    sparsity: float  # the grid point searched
    budget: int  # experts removed
    search: str  # the search artifact (redacted URI), reusable like any other
    removal_counts: tuple[int, ...]  # the searched allocation
    fitness: float | None  # its fitness on the search set
    heldout: float | None  # its held-out value (the search's held-out check); None: no held-out samples
    stderr: float | None  # standard error of that held-out mean
    meets: bool  # heldout >= the target; a gate target: the gate passed the model its search prunes to
    warm_start: tuple[int, ...] | None = None  # the seed it was warm-started from; None: a cold search (or the first)
    samples: int | None = None  # held-out samples behind `heldout`; absent from records made before it was kept
    gate: str | None = None  # a gate target: the gate artifact (verdict) on the pruned model's evaluation
    failing: str | None = None  # a gate target: the checks that failed, with their numbers; None: it passed

    def value(self) -> str:
        """What decided it, as the target's line shows it: the gate's outcome (a gate target) or the held-out value
        with its standard error."""
        if self.gate is not None:
            return "every check passed" if self.failing is None else f"failed: {self.failing}"
        if self.heldout is None:
            return "no held-out value"
        return f"{self.heldout:.4f}" + ("" if self.stderr is None else f" +/- {self.stderr:.4f}")

    def within_noise(self, threshold: float | None) -> bool:
        """Whether its held-out value lies within NOISE_STDERRS standard errors of `threshold`: its meets could flip
        with other held-out samples (never for a gate target: no threshold on the held-out value)."""
        if threshold is None or self.heldout is None or self.stderr is None:
            return False
        return abs(self.heldout - threshold) <= NOISE_STDERRS * self.stderr

    def samples_to_decide(self, threshold: float) -> int | None:
        """About how many held-out samples would put its value NOISE_STDERRS standard errors clear of `threshold` (the
        standard error falls as one over the root of the samples); None: unknown, or no count would (on the line)."""
        gap = abs((self.heldout or 0.0) - threshold)
        if self.samples is None or self.stderr is None or gap == 0:
            return None
        return max(self.samples + 1, math.ceil(self.samples * (NOISE_STDERRS * self.stderr / gap) ** 2))


@dataclasses.dataclass(frozen=True)
class TargetRecord(Record):
    """target.json: the decision (which sparsity meets the target) and its evidence, probe by probe."""

    FILE = TARGET_FILE
    STAGE = "target"

    criterion: str  # whose pruning order the probes searched
    metric: str  # the held-out quantity the target bounds (held-out ESAP: the search's held-out value), or "gate"
    threshold: float | None  # the least value a chosen sparsity must reach; None: a gate target (`gate`)
    grid: tuple[float, ...]  # every searchable sparsity, ascending
    max_probes: int  # the most probes the bracketing could need (re-checks included), stated in advance
    probes: tuple[Probe, ...]  # in the order they ran
    chosen: float | None  # the largest grid sparsity found to meet the threshold; None: none does
    chosen_search: str | None  # its search artifact
    warm_start: bool = True  # probes after the first warm-started (target.warm_start); False: each the cold search a
    # sweep makes at that sparsity. Absent from records made before cold probes were the default: those were warm
    rechecks: int = 0  # one-point dips the bracketing could look past (target.rechecks); absent from records made before
    gate: str | None = None  # a gate target: the gate's thresholds in words; each probe pruned, evaluated and gated
    start: float | None = None  # choosing the criterion: the best sparsity another criterion had reached, probed first
    # (only sparsities from it up can win); None: the whole grid

    def goal(self) -> str:
        """What a chosen sparsity must achieve, in words."""
        return f"the gate ({self.gate})" if self.metric == "gate" else f"{self.metric} >= {self.threshold}"

    def line(self) -> str:
        """The decision in one line: what was probed (bisection leaves grid points unprobed, taken to follow quality
        falling with sparsity), and whether a deciding probe lies within the noise of the threshold."""
        goal = self.goal()
        probed = f"{len(self.probes)} of the grid's {len(self.grid)} points probed"
        if self.chosen is None and self.start is not None:  # a challenger that cannot reach the best so far
            first = self.probes[0]
            return (
                f"misses {goal} at {first.sparsity:.4f} ({first.value()}), the largest sparsity another criterion "
                "meets: not chosen" + self._noise([first])
            )
        if self.chosen is None:  # the lowest probe missed too (bracketing stops only there)
            lowest = min(self.probes, key=lambda p: p.sparsity, default=None)
            seen = f" (the lowest sparsity tried, {lowest.sparsity:.4f}: {lowest.value()}; {probed})" if lowest else ""
            line = f"no probed sparsity meets {goal}{seen}: lower the target or improve the search (more samples, generations)"
            return line + self._noise([lowest] if lowest else [])
        chosen = next(p for p in self.probes if p.sparsity == self.chosen)
        above = [s for s in self.grid if s > self.chosen]
        line = (
            f"sparsity {self.chosen:.4f} meets {goal} ({chosen.value()}), the largest of {probed} "
            f"({'warm-started' if self.warm_start else 'cold'} searches, at most {self.max_probes})"
        )
        if not above:
            return line + ": the grid's last point" + self._noise([chosen])
        miss = next((p for p in self.probes if p.sparsity == above[0]), None)
        unprobed = sum(1 for s in above if all(p.sparsity != s for p in self.probes))
        if miss is not None:
            line += f": the next point up, {miss.sparsity:.4f}, misses ({miss.value()})"
        if unprobed:
            line += f"; {unprobed} point(s) above {self.chosen:.4f} not probed, taken to miss as quality falls with sparsity"
        return line + self._noise([chosen] + ([miss] if miss else []))

    def _noise(self, deciding: list[Probe]) -> str:
        """What the line must add when a probe that decided the answer is within the noise of the threshold."""
        close = [p for p in deciding if p.within_noise(self.threshold)]
        if not close:
            return ""
        parts = []
        for p in close:
            need = p.samples_to_decide(self.threshold)
            more = (
                f"about {need} held-out samples (now {p.samples}) would decide it"
                if need
                else "more held-out samples would decide it"
            )
            parts.append(f"{p.sparsity:.4f}'s {p.value()} is within {NOISE_STDERRS} standard errors of {self.threshold}: {more}")
        return "; within the noise: " + "; ".join(parts)
