"""Environments of their own: tools whose pins clash with ours (vLLM, llm-compressor) run from another
venv's python, named by an environment variable and checked before any work."""

from __future__ import annotations

import os
import subprocess

from evoesap.errors import ConfigError


def side_python(variable: str, modules: tuple[str, ...], needed_by: str, holding: str, fix: str) -> str:
    """The python named by `variable`, checked to find `modules` (found, not imported: importing them
    takes seconds). `needed_by` starts the error when it is unset, `holding` says what its environment
    has, `fix` how to add what it lacks."""
    python = os.environ.get(variable)
    if not python:
        raise ConfigError(f"{needed_by} needs {variable}: the python of an environment with {holding}")
    if not os.access(python, os.X_OK):
        raise ConfigError(f"{variable}={python} is not an executable python; point it at the environment with {holding}")
    check = f"import importlib.util as u, sys; sys.exit(', '.join(m for m in {modules!r} if u.find_spec(m) is None) or None)"
    done = subprocess.run([python, "-c", check], capture_output=True, text=True)
    if done.returncode != 0:
        missing = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"{variable}={python} lacks {missing}; {fix}")
    return python
