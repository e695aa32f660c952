"""The six stage components (plus the fan-out plan). Each body imports the library and calls `run_step`.

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


def fan_out(grid: list, scores: str, cache: str, heldout_cache: str) -> list:
    """Each criterion x sparsity point with the upstream artifacts it needs, as one loop item.

    Upstream URIs travel inside the loop items rather than as separate task inputs of the loop, so
    that the same DAG also runs under kfp.local (which binds a loop's task inputs to the item).
    """
    return [{**point, "scores": scores, "cache": cache, "heldout_cache": heldout_cache} for point in grid]


def search(model: str, storage_root: str, params: dict, point: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"model": model, "scores": point["scores"], "cache": point["cache"], "heldout_cache": point["heldout_cache"] or None}
    grid = {"criterion": point["criterion"], "sparsity": point["sparsity"]}
    return run_step("search", storage_root, inputs, {**params, **grid})


def prune(model: str, allocation: str, storage_root: str, params: dict, point: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"model": model, "scores": point["scores"], "allocation": allocation or None}
    grid = {"criterion": point["criterion"], "sparsity": point["sparsity"]}
    return run_step("prune", storage_root, inputs, {**params, **grid})


def evaluate(model: str, cache: str, storage_root: str, params: dict, method: str, point: dict) -> str:
    from evoesap.steps import run_step

    labels = {"method": method, **{k: point[k] for k in ("criterion", "sparsity") if k in point}}
    inputs = {"model": model, "teacher_cache": cache or None}
    return run_step("evaluate", storage_root, inputs, {**params, **labels})


def report(full: str, searched: List[str], uniform: List[str], searches: List[str], storage_root: str, params: dict) -> str:
    from evoesap.steps import run_step

    inputs = {"runs": [full, *uniform, *searched], "searches": list(searches)}
    return run_step("report", storage_root, inputs, params)


STAGE_FUNCTIONS: dict[str, Callable] = {
    "calibrate": calibrate,
    "cache-logits": cache_logits,
    "fan-out": fan_out,
    "search": search,
    "prune": prune,
    "evaluate": evaluate,
    "report": report,
}


@dataclasses.dataclass(frozen=True)
class StageComponents:
    calibrate: Callable
    cache_logits: Callable
    fan_out: Callable
    search: Callable
    prune: Callable
    evaluate: Callable
    report: Callable


def make_components(image: str = DEFAULT_IMAGE) -> StageComponents:
    """The components bound to a stage image; no packages are installed at run time."""
    wrap = dsl.component(base_image=image, install_kfp_package=False)
    return StageComponents(**{name.replace("-", "_"): wrap(fn) for name, fn in STAGE_FUNCTIONS.items()})
