"""Run the pipeline on this machine (kfp.local, the embedded default) or submit it to a cluster."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from evoesap import artifacts
from pipeline.config import PipelineConfig
from pipeline.dag import build_pipeline, compile_pipeline

log = logging.getLogger(__name__)


def _absolute(uri: str) -> str:
    return str(Path(uri).resolve()) if "://" not in uri else uri


def run_local(config: PipelineConfig) -> str:
    """Run the whole DAG here through kfp.local's SubprocessRunner; return the report artifact URI.

    Finished stages under `storage_root` are reused, so a run that was interrupted, or re-run with
    another downstream parameter, repeats only what changed. Retries are for transient cluster
    failures; here they would only repeat an error, so local runs have none.
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
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=_absolute(pipeline_root))
    log.info("running pipeline %s locally; artifacts under %s", config.name, artifacts.redact(config.storage_root))
    task = build_pipeline(config)()
    return task.output


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
            enable_caching=True,
        )
    return result.run_id
