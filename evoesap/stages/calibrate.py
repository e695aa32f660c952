"""Stage `calibrate`: one observer pass over calibration samples -> scores.parquet (all four criteria)."""

from __future__ import annotations

import dataclasses
import logging

from evoesap import artifacts, bounds, runtime
from evoesap.data import FieldMap
from evoesap.errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CalibrateParams:
    samples: int = 1024  # calibration samples drawn from the data source
    max_length: int = 2048  # tokens per sample (or per packed sequence)
    batch_size: int = 8  # sequences per forward
    seed: int = 0  # which samples are drawn
    split: str = "train"  # dataset split (hub datasets, or a JSON object keyed by split)
    subset: str | None = None  # hub dataset configuration name
    messages_field: str = "messages"  # chat turns [{"role", "content"}]
    prompt_field: str | None = None  # with response_field: one user and one assistant turn
    response_field: str | None = None
    text_field: str | None = None  # plain text corpus: every token counts
    enable_thinking: bool = False  # passed to the chat template
    pack: bool = False  # concatenate samples into max_length sequences
    model_dtype: str = "auto"  # scores accumulate in float64 whatever the model dtype
    device: str = "auto"  # "auto": cuda when available, else cpu
    device_map: str | None = None  # "auto" spreads a large model over several GPUs

    def __post_init__(self) -> None:
        for name in ("samples", "max_length", "batch_size", "seed"):
            object.__setattr__(self, name, int(getattr(self, name)))  # configs may deliver ints as floats
        for name in ("samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be at least 2, got {self.max_length}")
        runtime.check_model_dtype(self.model_dtype)
        self.fields  # noqa: B018 - raises ConfigError on an inconsistent field mapping
        bounds.check_params(self)

    @property
    def fields(self) -> FieldMap:
        return FieldMap(messages=self.messages_field, prompt=self.prompt_field, response=self.response_field, text=self.text_field)


def run_calibrate(model: str, data: str, params: CalibrateParams, out_uri: str) -> artifacts.Manifest:
    """Score every expert of `model` on `data` and publish scores.parquet."""
    inputs = {"model": model, "data": data}
    seen = artifacts.preflight(out_uri, "calibrate", inputs)
    bounds.check_stage(params, model)

    from evoesap import data as data_mod
    from evoesap import importance

    tokenizer, tokenized = runtime.tokenized_samples(model, data, params, pack=params.pack)
    with artifacts.stage_output(out_uri, "calibrate", dataclasses.asdict(params), inputs, seen) as staging:
        net = runtime.load_model(model, params.model_dtype, params.device, params.device_map)
        data_mod.check_vocab(tokenizer, net)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        scores = importance.observe(net, tokenized, params.batch_size, pad_id=pad_id)
        scores.to_parquet(staging / importance.SCORES_FILE, index=False)
    log.info("calibrate: %d sequences scored into %s", len(tokenized), artifacts.redact(out_uri))
    return artifacts.read_manifest(out_uri)
