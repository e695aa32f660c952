"""Run the pipeline on this machine (kfp.local, the embedded default); `pipeline.submit` sends it to a cluster."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from evoesap.store import artifacts
from evoesap.errors import ConfigError, EvoESAPError
from evoesap.pipeline.config import PipelineConfig
from evoesap.pipeline.dag import build_pipeline
from evoesap.pipeline.files import LOG_HEADER, claim_output_file
from evoesap.store.identity import is_uri

log = logging.getLogger(__name__)


def _absolute(uri: str) -> str:
    return str(Path(uri).resolve()) if not is_uri(uri) else uri


_TASK_LINE = re.compile(r"(Executing task|finished with status|Pipeline .* finished)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STARTED = re.compile(r"Executing task '([^']+)'")
_RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt)): (.+)$")  # a traceback's last line
_FAILED = re.compile(r"Inner task failed: '([^']+)'")


class _TaskEcho(io.TextIOBase):
    """kfp.local's output: with a log, everything to the log and only task start/finish lines to the terminal;
    without, everything to the terminal. Either way it keeps each task's last raised error (`raised`)."""

    def __init__(self, log: TextIO | None, terminal: TextIO) -> None:
        self.log, self.terminal, self._partial = log, terminal, ""
        self.task: str | None = None
        self.raised: dict[str, str] = {}

    def write(self, text: str) -> int:
        (self.log or self.terminal).write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            plain = _ANSI.sub("", line)
            if self.log is not None and _TASK_LINE.search(line) and not line.startswith(" "):
                self.terminal.write(plain + "\n")
            started, raised = _STARTED.search(plain), _RAISED.match(plain.strip())
            if started:
                self.task = started.group(1)
            elif raised and self.task:
                self.raised[self.task] = f"{raised.group(1)}: {raised.group(2)}"
        return len(text)

    def flush(self) -> None:
        (self.log or self.terminal).flush()
        self.terminal.flush()


@contextlib.contextmanager
def _quiet_kfp(log_path: Path | None) -> Iterator[_TaskEcho]:
    """Send kfp.local's streamed task logs to `log_path`, echoing one line per task start and finish (all of
    them to the terminal without a log); yields the echo, which knows each task's error."""
    if log_path is None:
        echo = _TaskEcho(None, sys.stdout)
        with contextlib.redirect_stdout(echo):
            yield echo
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log_file:
        if log_file.tell() == 0:
            log_file.write(LOG_HEADER)
        echo = _TaskEcho(log_file, sys.stderr)
        with contextlib.redirect_stdout(echo):
            yield echo


def _failure(name: str, exc: RuntimeError, echo: _TaskEcho, log_path: Path | None) -> Exception:
    """kfp.local's "Pipeline ... FAILURE" as one line: which task failed and the error it raised."""
    failed = _FAILED.search(_ANSI.sub("", str(exc)))
    if failed is None:
        return exc
    task = failed.group(1)
    where = f"; the tasks' full logs are in {log_path}" if log_path else ""
    cause = echo.raised.get(task, "no error line found in its log")
    return EvoESAPError(f"pipeline {name!r} failed at task {task!r}: {cause}{where}")


def _check_mounted(config: PipelineConfig, root: Path) -> None:
    """With the docker runner, refuse local paths outside `pipeline_root` (the containers would not see them)."""
    paths = {
        "model": config.model,
        "calibration_data": config.calibration_data,
        "search_data": config.search_data,
        "heldout_data": config.heldout_data,
        "storage_root": config.storage_root,
    }
    for name, value in paths.items():
        if not value or is_uri(value) or (name == "model" and not Path(value).exists()):  # a URI or a hub name
            continue
        if not Path(value).resolve().is_relative_to(root):
            raise ConfigError(
                f"{name} {value} lies outside pipeline_root {root}: the docker runner mounts only pipeline_root into "
                "the stage containers; put it under pipeline_root or set pipeline_root to a folder holding it"
            )


def report_uri(outputs: dict[str, Any]) -> str:
    """The storage URI of the report among a pipeline run's outputs."""
    return outputs["report"].metadata["uri"]


RUNNERS = ("subprocess", "docker")


def run_local(
    config: PipelineConfig,
    log_path: Path | None = None,
    *,
    runner: str = "subprocess",
    build: Callable[[PipelineConfig], Callable] = build_pipeline,
    arguments: dict[str, Any] | None = None,
    kfp_caching: bool = False,
) -> dict[str, Any]:
    """Run the whole DAG here through kfp.local; return the pipeline's outputs (`report`,
    `report_html`: KFP artifacts whose metadata says where each is stored; `pruned_models`: the stored
    checkpoints, each a `dsl.Model` whose URI is where it is stored).

    `runner`: "subprocess" runs each stage in a process of this environment; "docker" runs each in its
    own container of the stage image (`image`) through a Docker-compatible API (DOCKER_HOST), as the
    current user; kfp mounts only `pipeline_root` into the containers, so every local input and the
    storage root must lie under it. Finished stages under `storage_root` are reused, so a run that was
    interrupted, or re-run with another downstream parameter, repeats only what changed. Retries are for
    transient cluster failures; here they would only repeat an error, so local runs have none. With
    `log_path`, the tasks' full logs go there and the terminal shows one line per task. `build` makes
    another pipeline from the configuration (one that uses EvoESAP as a step), called with `arguments`;
    `kfp_caching` turns on kfp.local's own task cache, which EvoESAP's stages never use (their tasks opt out).
    """
    from kfp import local

    if log_path is not None:
        claim_output_file(log_path, "--log", LOG_HEADER)
    config = config.model_copy(
        update={
            "model": _absolute(config.model) if Path(config.model).exists() else config.model,
            "calibration_data": _absolute(config.calibration_data),
            "search_data": _absolute(config.search_data),
            "heldout_data": _absolute(config.heldout_data) if config.heldout_data else None,
            "storage_root": _absolute(config.storage_root),
            "retries": 0,
        }
    )
    pipeline_root = config.pipeline_root or str(Path(tempfile.gettempdir()) / "evoesap-kfp-local")
    if is_uri(pipeline_root):
        raise ValueError(f"pipeline_root must be a local directory for local runs, got {pipeline_root!r}")
    pipeline_root = _absolute(pipeline_root)
    if runner == "docker":
        _check_mounted(config, Path(pipeline_root))
        chosen: Any = local.DockerRunner(user=f"{os.getuid()}:{os.getgid()}")
    elif runner == "subprocess":
        if config.stage_params("quantize").get("recipe"):  # its step runs llm-compressor from its own venv: checked now
            from evoesap.release.quantize_env import quantize_python

            quantize_python()
        chosen = local.SubprocessRunner(use_venv=False)
    else:
        raise ConfigError(f"unknown runner {runner!r}; choose one of {', '.join(RUNNERS)}")
    local.init(runner=chosen, pipeline_root=pipeline_root, enable_caching=kfp_caching)
    log.info("running pipeline %s locally; artifacts under %s", config.name, artifacts.redact(config.storage_root))
    with _quiet_kfp(log_path) as echo, warnings.catch_warnings():
        # kfp.local warns that cluster-only settings (display names, the stage image) do not apply here
        warnings.filterwarnings("ignore", module=r"kfp\.local\..*")
        try:
            task = build(config)(**(arguments or {}))
        except RuntimeError as exc:
            raise _failure(config.name, exc, echo, log_path) from None
    return dict(task.outputs)
