"""Expert importance: one observer pass scoring Frequency, SEER, EAN and REAP, and per-layer pruning orders.

Per MoE layer and expert i over the calibration tokens (A_i = tokens routed to i, g_i(x) = the gate
weight the model applies to expert i's output, f_i(x) = expert i's unweighted output):
Frequency = |A_i|, SEER = sum g_i(x), EAN = sum ||f_i(x)||_2, REAP = mean g_i(x) * ||f_i(x)||_2 (0 when
A_i is empty). Every non-padding token counts, prompt and answer alike. The routing and expert outputs
come from `evoesap.moe.observe_routing`, which computes experts only on routed tokens, so the pass costs
about one forward instead of E/k of them. Sums accumulate in float64 on each MoE layer's device; the host
sees them once, at the end.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from evoesap import moe
from evoesap.data import TokenizedSample, batches
from evoesap.errors import ConfigError, DataError
from evoesap.offload import module_device
from evoesap.progress import progress
from evoesap.scoring.criteria import CRITERIA
from evoesap.scoring.forward import model_device
from evoesap.store import artifacts

log = logging.getLogger(__name__)

COLUMNS: tuple[str, ...] = ("layer", "expert", "frequency", "seer", "ean", "reap", "tokens")
SCORES_FILE = "scores.parquet"


class _Sums:
    """Per-layer running sums on the model's device: counts, gate weights, norms, weighted norms."""

    def __init__(self, num_experts: Sequence[int], devices: Sequence[torch.device]) -> None:
        self.sums = [torch.zeros(e, 4, dtype=torch.float64, device=d) for e, d in zip(num_experts, devices)]  # [E, 4]
        self.tokens = [0] * len(num_experts)  # host ints: token counts come from the batches, no sync
        self.real: torch.Tensor | None = None  # [B*T] float64: 1 on the current batch's tokens, 0 on padding
        self.real_count = 0

    def __call__(self, ordinal: int, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        real = self.real
        if real is None or real.numel() != index.shape[0]:
            raise RuntimeError(f"observer saw {index.shape[0]} tokens outside a calibration batch")
        real = real.to(index.device, non_blocking=True)  # a no-op unless the model spans several devices
        norms = torch.linalg.vector_norm(out.float(), dim=-1).double()  # [T, k] float64
        gates = weights.double()  # [T, k]
        keep = real.unsqueeze(1).expand_as(gates)  # [T, k]: padding rows add zeros, no boolean indexing
        rows = torch.stack((keep, gates * keep, norms * keep, gates * norms * keep), dim=-1)  # [T, k, 4]
        self.sums[ordinal].index_add_(0, index.reshape(-1), rows.reshape(-1, 4))
        self.tokens[ordinal] += self.real_count

    def table(self) -> pd.DataFrame:
        frames = []
        for layer, sums in enumerate(self.sums):
            count, gate, norm, gated = sums.cpu().unbind(dim=1)  # [E] float64 each
            reap = torch.where(count > 0, gated / count.clamp(min=1), torch.zeros_like(gated))
            frames.append(
                pd.DataFrame(
                    {
                        "layer": layer,
                        "expert": range(count.numel()),
                        "frequency": count.round().long().numpy(),  # exact: float64 counts below 2**53
                        "seer": gate.numpy(),
                        "ean": norm.numpy(),
                        "reap": reap.numpy(),
                        "tokens": self.tokens[layer],
                    }
                )
            )
        out = pd.concat(frames, ignore_index=True)
        return out.astype({"layer": "int64", "expert": "int64", "frequency": "int64", "tokens": "int64"})


def observe(
    model: torch.nn.Module,
    tokenized: Sequence[TokenizedSample],
    batch_size: int = 8,
    *,
    pad_id: int = 0,
) -> pd.DataFrame:
    """Scores of every expert of every MoE layer over `tokenized`: columns `COLUMNS`, one row per expert."""
    if not tokenized:
        raise DataError("no calibration samples to observe")
    spec = moe.inspect(model)
    device = model_device(model)
    layer_devices = [module_device(block.experts) for block in moe.moe_blocks(model)]  # device_map
    sums = _Sums([layer.num_experts for layer in spec.layers], layer_devices)
    bar = progress(total=len(tokenized), desc="calibrate", unit="sample")
    with torch.inference_mode(), moe.observe_routing(model, sums), bar:
        for batch in batches(tokenized, batch_size, pad_id):
            attention = batch.attention_mask.to(device)  # [B, T] long
            sums.real = attention.reshape(-1).double()  # [B*T]
            sums.real_count = int(batch.attention_mask.sum())  # host tensor: no device sync
            model(input_ids=batch.input_ids.to(device), attention_mask=attention, use_cache=False, logits_to_keep=1)
            bar.update(len(batch.sample_ids))
    sums.real = None
    log.info("observed %d samples over %d MoE layers", len(tokenized), len(spec.layers))
    return sums.table()


def check_scores(scores: pd.DataFrame, where: str, num_experts: Sequence[int] | None = None) -> None:
    """Refuse scores that would silently mis-rank experts: a missing column, a non-finite score, a layer
    whose expert rows are not exactly 0..n-1 (n from `num_experts` when known)."""
    hint = "rebuild it with `evoesap calibrate`"
    missing = [c for c in ("layer", "expert", *CRITERIA) if c not in scores.columns]
    if missing:
        raise DataError(f"{where} has no column {missing[0]!r}: {hint}")
    values = scores[list(CRITERIA)].to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        layer, expert = scores["layer"].iloc[row], scores["expert"].iloc[row]
        raise DataError(f"{where}: {CRITERIA[col]} of layer {layer} expert {expert} is {values[row, col]}: {hint}")
    for layer, group in scores.groupby("layer", sort=True):
        n = num_experts[int(layer)] if num_experts is not None and 0 <= int(layer) < len(num_experts) else None
        experts = sorted(group["expert"].astype(int).tolist())
        expected = list(range(n if n is not None else max(experts) + 1))
        if experts != expected:
            missing_ids = sorted(set(expected) - set(experts))
            problem = f"no row for expert(s) {missing_ids[:5]}" if missing_ids else "duplicate or extra expert rows"
            raise DataError(f"{where}: layer {layer} has {problem} of its {len(expected)} experts: {hint}")


def pruning_order(scores: pd.DataFrame | pa.Table, criterion: str) -> list[list[int]]:
    """Per MoE layer (by ordinal), expert ids from least to most important; ties go to the lower id."""
    if criterion not in CRITERIA:
        raise ConfigError(f"unknown criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    df = scores.to_pandas() if isinstance(scores, pa.Table) else scores
    layers = sorted(df["layer"].unique().tolist())
    if layers != list(range(len(layers))):
        raise DataError(f"scores must cover MoE layers 0..L-1, got layers {layers}")
    ordered = df.sort_values(["layer", criterion, "expert"], kind="mergesort")
    return [ordered.loc[ordered["layer"] == layer, "expert"].astype(int).tolist() for layer in layers]


def model_orders(scores: pd.DataFrame | pa.Table, criterion: str, spec: moe.MoESpec) -> list[list[int]]:
    """`pruning_order` for `spec`'s MoE layers, rearranged where group-limited routing needs it
    (`evoesap.moe.admissible_order`), so that the first r experts of a layer are a removable set."""
    df = scores.to_pandas() if isinstance(scores, pa.Table) else scores
    check_scores(df, "scores", [layer.num_experts for layer in spec.layers])
    orders = pruning_order(df, criterion)
    if len(orders) != len(spec.layers):
        raise ConfigError(f"scores cover {len(orders)} MoE layers but the model has {len(spec.layers)}: calibrate this model")
    return [moe.admissible_order(order, layer) for order, layer in zip(orders, spec.layers)]


def read_scores(uri: str) -> pd.DataFrame:
    """scores.parquet of a finished calibrate artifact, checked against its manifest: one finite row per expert."""
    manifest = artifacts.read_manifest(uri, "calibrate")
    scores = pd.read_parquet(io.BytesIO(artifacts.read_payload(uri, SCORES_FILE, manifest)))
    check_scores(scores, f"{artifacts.redact(uri)}/{SCORES_FILE}")
    return scores
