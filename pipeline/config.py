"""The pipeline's one YAML configuration, validated before anything runs.

Stage sections (`calibrate`, `cache_logits`, `search`, `prune`, `evaluate`, `report`) hold exactly the
parameters of that stage's Python API and CLI, under the same names; they are checked against the
stage's parameter dataclass, so an unknown or invalid key fails here with the valid names listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evoesap.errors import ConfigError

from .cluster import MODEL_STAGES, StageSettings, merged

CRITERIA = ("frequency", "seer", "ean", "reap")
STAGES = ("calibrate", "cache-logits", "search", "prune", "evaluate", "report")


class PipelineConfig(BaseModel):
    """Everything one pipeline run needs: inputs, grid, stage parameters, storage and cluster settings."""

    model_config = ConfigDict(extra="forbid")

    name: str = "evoesap"
    model: str  # local path, fsspec URI or hub name of the full model
    revision: str | None = None  # hub models only: the branch, tag or commit of `model` (default: its default branch)
    calibration_data: str  # data for the importance criteria
    search_data: str  # data for the teacher cache and the ESAP fitness
    heldout_data: str | None = None  # other samples of the search domain: the search's held-out check, held-out ESAP in evaluate
    criteria: list[Literal["frequency", "seer", "ean", "reap"]] = ["reap"]
    sparsities: list[float] = [0.25]
    storage_root: str = "./runs/artifacts"  # where every artifact goes: a path, s3://, gs://
    pipeline_root: str | None = None  # kfp.local's own scratch directory (local runs only)
    image: str | None = None  # the stage image; default: the project's image of this version
    retries: int = Field(2, ge=0, strict=True)  # per task, for transient failures
    calibrate: dict[str, Any] = {}
    cache_logits: dict[str, Any] = {}
    search: dict[str, Any] = {}
    prune: dict[str, Any] = {}
    evaluate: dict[str, Any] = {}
    report: dict[str, Any] = {}
    # Kubernetes settings per stage (pipeline.cluster.StageSettings); `all` applies to every stage
    resources: dict[Literal["all", "calibrate", "cache-logits", "search", "prune", "evaluate", "report"], StageSettings] = {}

    @field_validator("sparsities")
    @classmethod
    def _sparsities_in_range(cls, values: list[float]) -> list[float]:
        bad = [s for s in values if not 0 < s < 1]
        if bad or not values:
            raise ValueError(f"every sparsity must lie in (0, 1), got {bad or values}")
        return values

    @field_validator("storage_root")
    @classmethod
    def _storage_root_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("storage_root is empty, which would write every artifact into the working directory: "
                             "give a directory or URI, e.g. ./runs/artifacts")
        return value

    @field_validator("criteria")
    @classmethod
    def _criteria_non_empty(cls, values: list[str]) -> list[str]:
        if not values:
            raise ValueError(f"give at least one criterion of {', '.join(CRITERIA)}")
        return values

    @model_validator(mode="after")
    def _accelerators_where_a_model_runs(self) -> "PipelineConfig":
        shared = self.resources.get("all")
        if shared is not None and shared.accelerator_count:
            raise ValueError(f"resources.all: set accelerators per stage, not for all (stages that can use one: "
                             f"{', '.join(MODEL_STAGES)})")
        for stage, settings in self.resources.items():
            if stage not in (*MODEL_STAGES, "all") and settings.accelerator_count:
                raise ValueError(
                    f"resources.{stage}: {stage} loads no model and cannot use an accelerator (prune works on the "
                    f"checkpoint files); remove its accelerator settings (stages that can: {', '.join(MODEL_STAGES)})"
                )
        return self

    @model_validator(mode="after")
    def _storage_outside_the_model(self) -> "PipelineConfig":
        if "://" in self.storage_root or "://" in self.model or not Path(self.model).is_dir():
            return self
        model, root = Path(self.model).resolve(), Path(self.storage_root).resolve()
        if root == model or model in root.parents:
            raise ValueError(f"storage_root {self.storage_root} lies inside the model directory {self.model}: artifacts "
                             "written there would change the model they are made from; choose a storage_root outside it")
        return self

    @property
    def pinned_model(self) -> str:
        """`model` at `revision` (`org/name@revision`, `evoesap.identity.pin`), as every stage reads it."""
        from evoesap.identity import pin

        return pin(self.model, self.revision)

    def grid(self) -> list[dict[str, Any]]:
        """The fan-out: one point per criterion x sparsity."""
        return [{"criterion": c, "sparsity": s} for c in self.criteria for s in self.sparsities]

    def stage_params(self, stage: str) -> dict[str, Any]:
        return dict(getattr(self, stage.replace("-", "_")))

    def settings(self, stage: str) -> StageSettings:
        """The stage's Kubernetes settings: its own over `all`."""
        return merged(self.resources.get("all"), self.resources.get(stage))


def _check_stage_sections(config: PipelineConfig) -> None:
    from evoesap.steps import make_params

    point = config.grid()[0]
    make_params("calibrate", config.calibrate)
    make_params("cache-logits", config.cache_logits)
    make_params("search", {**config.search, **point})
    make_params("prune", {**config.prune, **point})
    make_params("evaluate", {**config.evaluate, "method": "full"})
    make_params("report", config.report)
    for stage in ("search", "prune"):
        clash = sorted(set(config.stage_params(stage)) & {"criterion", "sparsity"})
        if clash:
            raise ConfigError(f"set {', '.join(clash)} at the top level (criteria, sparsities), not under {stage}")


def load_config(source: str | Path | dict[str, Any]) -> PipelineConfig:
    """Read and validate a pipeline configuration (a YAML path or a dict)."""
    if isinstance(source, dict):
        data, where = source, "configuration"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"configuration file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        where = str(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    try:
        config = PipelineConfig(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid {where}: {problems}") from exc
    config.pinned_model  # noqa: B018 - a revision for a path or URI is refused here, before anything runs
    _check_stage_sections(config)
    return config
