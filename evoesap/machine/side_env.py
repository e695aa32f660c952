"""Environments of their own: tools whose pins clash with ours (vLLM, llm-compressor) run from another
venv's python, named by an environment variable and checked before any work."""

from __future__ import annotations

import os
import signal
import subprocess

from evoesap.errors import ConfigError

CHECK_TIMEOUT_S = 60.0  # a python answers these checks in well under a second; one that does not never will


def side_python(variable: str, modules: tuple[str, ...], needed_by: str, holding: str, fix: str) -> str:
    """The python named by `variable`, checked to find `modules` (found, not imported: importing them
    takes seconds). `needed_by` starts the error when it is unset, `holding` says what its environment
    has, `fix` how to add what it lacks."""
    python = os.environ.get(variable)
    if not python:
        raise ConfigError(f"{needed_by} needs {variable}: the python of an environment with {holding}")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ConfigError(f"{variable}={python} is not an executable python; point it at the environment with {holding}")
    check = f"import importlib.util as u, sys; sys.exit(', '.join(m for m in {modules!r} if u.find_spec(m) is None) or None)"
    done = ask(python, check, variable, holding)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        if not said:  # not a python (`false`, a wrapper that exits): it printed nothing
            raise ConfigError(f"{variable}={python} is not a python (it exited {done.returncode}, saying nothing); {fix}")
        raise ConfigError(f"{variable}={python} lacks {said[-1]}; {fix}")
    return python


def ask(python: str, code: str, variable: str, holding: str) -> subprocess.CompletedProcess:
    """`python -c code`, its output captured; refused when it has not answered within `CHECK_TIMEOUT_S` (a wrapper
    script that waits, a python stuck on a network mount), its whole process group stopped."""
    with subprocess.Popen(
        [python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            out, err = child.communicate(timeout=CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise ConfigError(
                f"{variable}={python} did not answer within {CHECK_TIMEOUT_S:g} s: point it at the python of the "
                f"environment with {holding}"
            ) from None
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)
