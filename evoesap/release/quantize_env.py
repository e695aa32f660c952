"""llm-compressor's own Python environment, where the quantize stage runs `oneshot` (`evoesap.release.quantize_worker`).

llm-compressor 0.14 pins transformers <= 5.17 and this package needs >= 5.23, so it cannot share its
environment: the worker script runs in a subprocess with the python named by EVOESAP_QUANTIZE_PYTHON
(`make quantize-venv` builds .venv-quantize/bin/python). The request and the result travel as JSON files.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from evoesap.store import artifacts
from evoesap.errors import ConfigError, EvoESAPError
from evoesap.machine.side_env import ask, side_python

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


# The tools whose versions decide what the quantize stage makes: llm-compressor (the algorithms) and
# compressed-tensors (the checkpoint's format). They are keyed as the environment actually used reports them,
# not as a pin says: EVOESAP_QUANTIZE_PYTHON may name any environment, and keying on the pin (the Makefile's
# LLMCOMPRESSOR, a lock) would reuse an artifact another llm-compressor made.
KEYED_TOOLS = ("llmcompressor", "compressed-tensors")


def tool_versions() -> dict[str, str]:
    """The versions of `KEYED_TOOLS` in the quantize environment (part of the quantize stage's reuse key)."""
    return dict(_versions(quantize_python()))


@functools.lru_cache(maxsize=8)
def _versions(python: str) -> tuple[tuple[str, str], ...]:
    """Asked of `python` once per process: package metadata only, nothing imported (well under a second)."""
    script = f"import importlib.metadata as m, json; print(json.dumps({{n: m.version(n) for n in {KEYED_TOOLS!r}}}))"
    done = ask(python, script, PYTHON_ENV, "llm-compressor installed")
    try:
        versions = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        versions = None
    if not isinstance(versions, dict) or set(versions) != set(KEYED_TOOLS):
        raise ConfigError(
            f"{PYTHON_ENV}={python} did not report the versions of {', '.join(KEYED_TOOLS)} "
            f"({failure(done.stderr or done.stdout)}): rebuild it with `make quantize-venv`"
        )
    return tuple(sorted((name, str(version)) for name, version in versions.items()))


def device_env(device: str) -> dict[str, str]:
    """The environment that shows llm-compressor (which takes the first accelerator it sees) only `device`."""
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if device.startswith("cuda:"):
        return {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]}
    return {}


def run_worker(python: str, request: dict[str, Any], device: str = "auto", threads: int | None = None) -> dict[str, Any]:
    """Run `oneshot` as `request` says in the quantize environment, on `device` (with `threads` CPU threads, else
    torch's own count); the worker's result."""
    with artifacts.owned_tempdir("quantize") as tmp:  # locked: a concurrent quantize stage's clean-up leaves it
        request_file, result_file = tmp / "request.json", tmp / "result.json"
        request_file.write_text(json.dumps(request))
        log.info("llm-compressor oneshot (%s): %s", python, request["recipe"]["name"])
        done = subprocess.run(
            [python, str(WORKER), str(request_file), str(result_file)],
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **device_env(device),
                 **({"OMP_NUM_THREADS": str(threads)} if threads else {})}, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise EvoESAPError(f"llm-compressor oneshot failed (exit {done.returncode}): {failure(done.stderr)}")
        return json.loads(result_file.read_text())


def failure(stderr: str) -> str:
    """The one line that says what went wrong: the last exception the worker raised, else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return (causes or lines or ["(no output)"])[-1]
