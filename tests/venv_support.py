"""The pythons of the tools' own venvs (vLLM, llm-compressor) that `make test` builds beside .venv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def venv_python(variable: str, venv: str, target: str, tool: str, installed: str) -> str:
    """`variable` when set, else the repository's `venv` (`make target`); a test fails (never skips) when it
    is missing: `tool` names the environment, `installed` what a python set instead must hold."""
    python = os.environ.get(variable) or str(REPO / venv / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.fail(
            f"no {tool} environment at {python}: `make test` builds {venv} (make {target}), or set "
            f"{variable} to a python with {installed} installed"
        )
    return python
