"""Run the pipeline on this machine (kfp.local, the embedded default) or submit it to a cluster."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from evoesap import artifacts
from evoesap.pipeline.config import PipelineConfig
from evoesap.pipeline.dag import build_pipeline, compile_pipeline

log = logging.getLogger(__name__)


def _absolute(uri: str) -> str:
    return str(Path(uri).resolve()) if "://" not in uri else uri


_TASK_LINE = re.compile(r"(Executing task|finished with status|Pipeline .* finished)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _TaskEcho(io.TextIOBase):
    """Everything to the log file; only task start/finish lines to the terminal."""

    def __init__(self, log: TextIO, terminal: TextIO) -> None:
        self.log, self.terminal, self._partial = log, terminal, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if _TASK_LINE.search(line) and not line.startswith(" "):
                self.terminal.write(_ANSI.sub("", line) + "\n")
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()


@contextlib.contextmanager
def _quiet_kfp(log_path: Path | None) -> Iterator[None]:
    """Send kfp.local's streamed task logs to `log_path`, echoing one line per task start and finish."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log_file:
        echo = _TaskEcho(log_file, sys.stderr)
        with contextlib.redirect_stdout(echo):
            yield


def report_uri(outputs: dict[str, Any]) -> str:
    """The storage URI of the report among a pipeline run's outputs."""
    return outputs["report"].metadata["uri"]


def run_local(
    config: PipelineConfig,
    log_path: Path | None = None,
    *,
    build: Callable[[PipelineConfig], Callable] = build_pipeline,
    arguments: dict[str, Any] | None = None,
    kfp_caching: bool = False,
) -> dict[str, Any]:
    """Run the whole DAG here through kfp.local's SubprocessRunner; return the pipeline's outputs
    (`report`, `report_html`, `pruned_models`: KFP artifacts whose metadata says where each is stored).

    Finished stages under `storage_root` are reused, so a run that was interrupted, or re-run with
    another downstream parameter, repeats only what changed. Retries are for transient cluster
    failures; here they would only repeat an error, so local runs have none. With `log_path`, the
    tasks' full logs go there and the terminal shows one line per task. `build` makes another pipeline
    from the configuration (one that uses EvoESAP as a step), called with `arguments`; `kfp_caching`
    turns on kfp.local's own task cache, which EvoESAP's stages never use (their tasks opt out).
    """
    from kfp import local

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
    if "://" in pipeline_root:
        raise ValueError(f"pipeline_root must be a local directory for local runs, got {pipeline_root!r}")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=_absolute(pipeline_root), enable_caching=kfp_caching)
    log.info("running pipeline %s locally; artifacts under %s", config.name, artifacts.redact(config.storage_root))
    with _quiet_kfp(log_path), warnings.catch_warnings():
        # kfp.local warns that cluster-only settings (display names, the stage image) do not apply here
        warnings.filterwarnings("ignore", module=r"kfp\.local\..*")
        task = build(config)(**(arguments or {}))
    return dict(task.outputs)


def submit(
    config: PipelineConfig,
    host: str,
    *,
    experiment: str | None = None,
    run_name: str | None = None,
    client_factory: Callable[..., Any] | None = None,
) -> str:
    """Compile and submit to a Kubeflow Pipelines endpoint; return the run id."""
    import kfp

    factory = client_factory or kfp.Client
    with tempfile.TemporaryDirectory() as tmp:
        spec = compile_pipeline(config, Path(tmp) / "pipeline.yaml")
        client = factory(host=host)
        result = client.create_run_from_pipeline_package(
            str(spec),
            arguments={},
            run_name=run_name,
            experiment_name=experiment or config.name,
            enable_caching=None,  # each task's own setting: off, see pipeline.dag._configure
        )
    return result.run_id
