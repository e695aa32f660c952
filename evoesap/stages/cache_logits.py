"""The cache-logits stage: the full model's next-token distributions on the search samples -> teacher cache."""

from __future__ import annotations

import dataclasses
import logging

from evoesap import artifacts, bounds, runtime
from evoesap.data import FieldMap
from evoesap.errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheLogitsParams:
    """What to cache and how; validated on construction, before any model is loaded."""

    mode: str | None = None  # full: whole-vocabulary log-probabilities; topk: top-K + tail mass (ESAP bounds); None: full where it fits (plan.default_cache_mode)
    top_k: int = 64  # K for mode topk
    dtype: str = "float16"  # storage of log-probabilities: float16 (half the bytes) or float32 (exact)
    samples: int | None = 64  # search samples drawn from the data (None: all)
    max_length: int = 2048  # tokens per sample, truncated from the end
    batch_size: int = 8
    seed: int = 42  # which samples are drawn
    split: str = "train"
    subset: str | None = None  # hub dataset configuration
    messages_field: str = "messages"
    prompt_field: str | None = None
    response_field: str | None = None
    text_field: str | None = None
    enable_thinking: bool = False  # chat template switch for reasoning models
    model_dtype: str = "auto"  # dtype the teacher runs in
    device: str = "auto"  # auto: cuda when available
    device_map: str | None = None  # "auto" spreads a large model over several GPUs

    def __post_init__(self) -> None:
        from evoesap.scoring.teacher import DTYPES, MODES

        if self.mode is not None and self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "topk" and int(self.top_k) < 1:
            raise ConfigError(f"top_k must be at least 1 for mode topk, got {self.top_k}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.samples is not None and int(self.samples) < 1:
            raise ConfigError(f"samples must be at least 1 (or None for all), got {self.samples}")
        if int(self.max_length) < 2:
            raise ConfigError(f"max_length must be at least 2, got {self.max_length}")
        if int(self.batch_size) < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        runtime.check_model_dtype(self.model_dtype)
        for name in ("top_k", "max_length", "batch_size", "seed"):  # configs may deliver ints as floats
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.samples is not None:
            object.__setattr__(self, "samples", int(self.samples))
        self.fields  # noqa: B018 - field combinations are checked here, not after the model has loaded
        bounds.check_params(self)

    @property
    def fields(self) -> FieldMap:
        return FieldMap(
            messages=self.messages_field, prompt=self.prompt_field, response=self.response_field, text=self.text_field
        )


def run_cache_logits(model: str, data: str, params: CacheLogitsParams, out_uri: str) -> artifacts.Manifest:
    """Cache the teacher (`model`, a checkpoint URI or hub name) on `data` samples and publish it at `out_uri`."""
    from evoesap import plan
    from evoesap.data import check_vocab
    from evoesap.scoring import teacher

    inputs = {"model": model, "data": data}
    seen = artifacts.preflight(out_uri, "cache-logits", inputs)
    bounds.check_stage(params, model)
    runtime.inspect_checkpoint(model)  # a dense or already pruned model is refused before any work
    tokenizer, tokenized = runtime.tokenized_samples(model, data, params)
    mode = plan.cache_mode(model, params, sum(len(s.input_ids) for s in tokenized))  # the manifest keeps params as asked
    log.info("loading %s", artifacts.redact(model))
    loaded = runtime.load_model(model, params.model_dtype, params.device, params.device_map)
    check_vocab(tokenizer, loaded)
    with artifacts.stage_output(out_uri, "cache-logits", dataclasses.asdict(params), inputs, seen) as staging:
        teacher.write_cache(
            loaded,
            tokenized,
            staging,
            mode=mode,
            top_k=params.top_k if mode == "topk" else None,
            dtype=params.dtype,
            batch_size=params.batch_size,
            tokenizer=tokenizer,
        )
    return artifacts.read_manifest(out_uri)
