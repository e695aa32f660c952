"""The records stages publish for each other, field by field: what each JSON key holds and which may be absent."""

from __future__ import annotations

import dataclasses

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

    recipe: str  # the recipe's name (evoesap.stages.quantize.RECIPES)
    scheme: str  # compressed-tensors preset scheme
    algorithm: str  # rtn, gptq or awq
    calibration_samples: int  # samples the recipe calibrated on (0: uncalibrated)
    architectures: tuple[str, ...] | None  # config.json's architectures, kept from the input
    num_experts_per_layer: dict[int, int] | None  # decoder layer -> experts, of a non-uniform checkpoint; None: uniform
    checkpoint_bytes_before: int  # bytes of the input's safetensors files
    checkpoint_bytes_after: int  # bytes of the quantized safetensors files
    versions: dict[str, str]  # versions of the tools that quantized
