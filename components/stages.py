"""The six stage components. Each body imports the library and calls `run_step`, nothing else.

Components return the URI of the artifact they made (or found finished) under `storage_root`; with
an s3:// or gs:// root the stage reads and writes object storage itself, so the same components run
under `kfp.local` and on a cluster.
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
import dataclasses
from typing import Callable, List

from kfp import dsl

from evoesap import __version__

DEFAULT_IMAGE = f"evoesap/stage:{__version__}"  # built from images/Dockerfile; push it to your registry


def calibrate(model: str, data: str, storage_root: str, params: dict) -> str:
    from evoesap.steps import run_step

    return run_step("calibrate", storage_root, {"model": model, "data": data}, params)


def cache_logits(model: str, data: str, storage_root: str, params: dict) -> str:
    from evoesap.steps import run_step

    return run_step("cache-logits", storage_root, {"model": model, "data": data}, params)


def search(model: str, scores: str, cache: str, storage_root: str, params: dict, point: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"model": model, "scores": scores, "cache": cache}
    return run_step("search", storage_root, inputs, {**params, **point})


def prune(model: str, scores: str, allocation: str, storage_root: str, params: dict, point: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"model": model, "scores": scores, "allocation": allocation or None}
    return run_step("prune", storage_root, inputs, {**params, **point})


def evaluate(model: str, cache: str, storage_root: str, params: dict, method: str, point: dict) -> str:
    from evoesap.steps import run_step

    labels = {"method": method, **point}
    return run_step("evaluate", storage_root, {"model": model, "teacher_cache": cache}, {**params, **labels})


def report(full: str, searched: List[str], uniform: List[str], searches: List[str], storage_root: str, params: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"runs": [full, *uniform, *searched], "searches": list(searches)}
    return run_step("report", storage_root, inputs, params)


STAGE_FUNCTIONS: dict[str, Callable] = {
    "calibrate": calibrate,
    "cache-logits": cache_logits,
    "search": search,
    "prune": prune,
    "evaluate": evaluate,
    "report": report,
}


@dataclasses.dataclass(frozen=True)
class StageComponents:
    calibrate: Callable
    cache_logits: Callable
    search: Callable
    prune: Callable
    evaluate: Callable
    report: Callable


def make_components(image: str = DEFAULT_IMAGE) -> StageComponents:
    """The components bound to a stage image; no packages are installed at run time."""
    wrap = dsl.component(base_image=image, install_kfp_package=False)
    return StageComponents(**{name.replace("-", "_"): wrap(fn) for name, fn in STAGE_FUNCTIONS.items()})
