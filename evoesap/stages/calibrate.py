"""Stage `calibrate`: one observer pass over calibration samples -> scores.parquet (all four criteria)."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from evoesap.machine import bounds, runtime
from evoesap.params import PlacementParams, SampleParams, keyed, param
from evoesap.store import artifacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CalibrateParams(PlacementParams, SampleParams):
    """Which calibration samples are observed and how; scores accumulate in float64 whatever the model dtype."""

    DEFAULT_SAMPLES: ClassVar[int] = 1024

    pack: bool = param(False, "Concatenate samples into max_length sequences.")


def run_calibrate(model: str, data: str, params: CalibrateParams, out_uri: str) -> artifacts.Manifest:
    """Score every expert of `model` on `data` and publish scores.parquet."""
    inputs = {"model": model, "data": data}
    seen = artifacts.preflight(out_uri, "calibrate", inputs)
    bounds.check_stage(params, model)

    from evoesap import data as data_mod
    from evoesap.scoring import importance

    tokenizer, tokenized = runtime.tokenized_samples(model, data, params, pack=params.pack)
    with artifacts.stage_output(out_uri, "calibrate", keyed(params), inputs, seen) as staging:
        net = runtime.load_model(model, params.model_dtype, **params.placement)
        data_mod.check_vocab(tokenizer, net)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        scores = importance.observe(net, tokenized, params.batch_size, pad_id=pad_id)
        scores.to_parquet(staging / importance.SCORES_FILE, index=False)
    log.info("calibrate: %d sequences scored into %s", len(tokenized), artifacts.redact(out_uri))
    return artifacts.read_manifest(out_uri)
