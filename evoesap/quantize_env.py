"""llm-compressor's own Python environment, where the quantize stage runs `oneshot` (`evoesap.quantize_worker`).

llm-compressor 0.14 pins transformers <= 5.17 and this package needs >= 5.23, so it cannot share its
environment: the worker script runs in a subprocess with the python named by EVOESAP_QUANTIZE_PYTHON
(`make quantize-venv` builds .venv-quantize/bin/python). The request and the result travel as JSON files.
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
from evoesap.side_env import side_python

log = logging.getLogger(__name__)

PYTHON_ENV = "EVOESAP_QUANTIZE_PYTHON"
WORKER = Path(__file__).with_name("quantize_worker.py")


def quantize_python() -> str:
    """The quantize environment's python, checked to hold llm-compressor."""
    return side_python(
        PYTHON_ENV,
        ("llmcompressor", "compressed_tensors", "transformers"),
        "the quantize stage",
        "llm-compressor installed (`make quantize-venv` builds .venv-quantize/bin/python)",
        "build it with `make quantize-venv`",
    )


def device_env(device: str) -> dict[str, str]:
    """The environment that shows llm-compressor (which takes the first accelerator it sees) only `device`."""
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if device.startswith("cuda:"):
        return {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]}
    return {}


def run_worker(python: str, request: dict[str, Any], device: str = "auto") -> dict[str, Any]:
    """Run `oneshot` as `request` says in the quantize environment, on `device`; the worker's result."""
    with tempfile.TemporaryDirectory(prefix="evoesap-quantize-") as tmp:
        request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_file.write_text(json.dumps(request))
        log.info("llm-compressor oneshot (%s): %s", python, request["recipe"]["name"])
        done = subprocess.run(
            [python, str(WORKER), str(request_file), str(result_file)],
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **device_env(device)}, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise EvoESAPError(f"llm-compressor oneshot failed (exit {done.returncode}): {failure(done.stderr)}")
        return json.loads(result_file.read_text())


def failure(stderr: str) -> str:
    """The one line that says what went wrong: the last exception the worker raised, else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return (causes or lines or ["(no output)"])[-1]
