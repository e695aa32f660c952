"""Stage `calibrate`: one observer pass over calibration samples -> scores.parquet (all four criteria)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from evoesap import artifacts
from evoesap.data import FieldMap
from evoesap.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    dtype: str = "auto"  # model dtype; scores accumulate in float64 regardless
    device: str = "auto"  # "auto": cuda when available, else cpu

    def __post_init__(self) -> None:
        for name in ("samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be at least 2, got {self.max_length}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        self.fields  # noqa: B018 - raises ConfigError on an inconsistent field mapping

    @property
    def fields(self) -> FieldMap:
        return FieldMap(messages=self.messages_field, prompt=self.prompt_field, response=self.response_field, text=self.text_field)


def run_calibrate(model: str, data: str, params: CalibrateParams, out_uri: str) -> artifacts.Manifest:
    """Score every expert of `model` on `data` and publish scores.parquet (stage-cached)."""
    inputs = {"model": model, "data": data}
    done = artifacts.cached(out_uri, "calibrate", dataclasses.asdict(params), inputs)
    if done is not None:
        log.info("calibrate: reusing %s", artifacts.redact(out_uri))
        return done

    import torch
    from transformers import AutoTokenizer

    from evoesap import data as data_mod
    from evoesap import importance, moe

    samples = data_mod.load_samples(data, split=params.split, subset=params.subset, fields=params.fields, n=params.samples, seed=params.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if params.device == "auto" else params.device)
    with artifacts.stage_output(out_uri, "calibrate", dataclasses.asdict(params), inputs) as staging:
        with _model_source(model) as source:
            tokenizer = AutoTokenizer.from_pretrained(source)
            net = moe.load_pruned(source, dtype=params.dtype if params.dtype == "auto" else getattr(torch, params.dtype))
        net.to(device).eval()
        data_mod.check_vocab(tokenizer, net)
        tokenized = data_mod.tokenize_samples(
            samples, tokenizer, max_length=params.max_length, enable_thinking=params.enable_thinking, pack=params.pack
        )
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        scores = importance.observe(net, tokenized, params.batch_size, pad_id=pad_id)
        scores.to_parquet(staging / importance.SCORES_FILE, index=False)
    log.info("calibrate: %d samples scored into %s", len(samples), artifacts.redact(out_uri))
    return artifacts.read_manifest(out_uri)


@contextlib.contextmanager
def _model_source(model: str) -> Iterator[str]:
    """What from_pretrained accepts: a local directory (remote artifacts downloaded) or a hub name."""
    if "://" in model:
        with artifacts.local_copy(model) as path:
            yield str(path)
    else:
        yield model
