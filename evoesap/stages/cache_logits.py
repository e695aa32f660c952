"""The cache-logits stage: the full model's next-token distributions on the search samples -> teacher cache."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar, Literal

from evoesap.errors import ConfigError
from evoesap.machine import bounds, runtime
from evoesap.params import PlacementParams, SampleParams, check_declared, keyed, param
from evoesap.scoring.teacher import DTYPES, MODES
from evoesap.store import artifacts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheLogitsParams(PlacementParams, SampleParams):
    """What to cache and how; validated on construction, before any model is loaded."""

    DEFAULT_SAMPLES: ClassVar[int] = 64

    seed: int = param(42, "Seed of the sample selection: which samples are drawn.")
    mode: Literal[MODES] | None = param(  # the teacher cache's own names (scoring.teacher)
        None,
        "full (whole-vocabulary log-probabilities) or topk (top-K + tail mass: ESAP bounds); unset: full where "
        "a search on this machine could hold it, else topk.",
    )
    top_k: int = param(64, "K for mode topk.")
    dtype: Literal[tuple(DTYPES)] = param("float16", "Storage of log-probabilities: float16 (half the bytes) or float32 (exact).")

    def __post_init__(self) -> None:
        check_declared(self)  # mode's choices first: the rule below reads it
        if self.mode == "topk" and self.top_k < 1:
            raise ConfigError(f"top_k must be at least 1 for mode topk, got {self.top_k}")
        super().__post_init__()


def run_cache_logits(model: str, data: str, params: CacheLogitsParams, out_uri: str) -> artifacts.Manifest:
    """Cache the teacher (`model`, a checkpoint URI or hub name) on `data` samples and publish it at `out_uri`."""
    from evoesap.data import check_vocab
    from evoesap.planning import footprint
    from evoesap.scoring import teacher

    inputs = {"model": model, "data": data}
    seen = artifacts.preflight(out_uri, "cache-logits", inputs)
    bounds.check_stage(params, model)
    runtime.inspect_checkpoint(model)  # a dense or already pruned model is refused before any work
    tokenizer, tokenized = runtime.tokenized_samples(model, data, params)
    mode = footprint.cache_mode(model, params, sum(len(s.input_ids) for s in tokenized))  # the manifest keeps params as asked
    log.info("loading %s", artifacts.redact(model))
    loaded = runtime.load_model(model, params.model_dtype, **params.placement)
    check_vocab(tokenizer, loaded)
    with artifacts.stage_output(out_uri, "cache-logits", keyed(params), inputs, seen) as staging:
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
