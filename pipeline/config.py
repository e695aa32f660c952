"""The pipeline's one YAML configuration, validated before anything runs.

One section per stage of the registry (`evoesap.registry`: `calibrate`, `cache_logits`, ...) holds exactly
the parameters of that stage's Python API and CLI, under the same names; they are checked against the
stage's parameter dataclass, so an unknown or invalid key fails here with the valid names listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from evoesap import __version__
from evoesap import registry as stages
from evoesap.errors import ConfigError
from evoesap.scoring.criteria import CRITERIA, Criterion

from .cluster import StageSettings, merged


class Target(BaseModel):
    """`target:` what the sparsity must achieve, instead of naming it (`evoesap.planning.target`): the largest sparsity on the
    granularity grid whose searched allocation keeps held-out ESAP at or above `heldout_esap`, or whose pruned model
    passes the `gate` section's thresholds (`gate: true`), or the least sparsity whose checkpoint fits in `bytes` on
    disk (predicted from the weights' headers, then searched like a given sparsity)."""

    model_config = ConfigDict(extra="forbid")

    heldout_esap: float | None = Field(
        None, description="The least held-out ESAP (the search's held-out value) to keep, in (0, 1)."
    )
    bytes: StrictInt | str | None = Field(
        None,
        description="The most the pruned checkpoint may weigh on disk, every file prune writes counted (in the prune "
        "section's model_dtype): a size such as 24GiB or 1.5GB, or a count of bytes.",
    )
    gate: bool = Field(
        False,
        description="The largest sparsity whose searched, pruned model passes every threshold of the gate section (task "
        "drops included): each probe a search, a prune, an evaluation and a gate, all reused by the run that follows.",
    )
    choose_criterion: bool = Field(
        False,
        description="heldout_esap or gate: answer which of the criteria reaches the largest sparsity (ties: the higher "
        "held-out ESAP), the fan-out that one point. The first criterion bisects the grid; each other one is probed "
        "first at the best sparsity so far and bisects only above it, so a criterion that cannot win costs one search.",
    )
    warm_start: bool = Field(
        False,
        description="heldout_esap only: each probe after the first seeded from the nearest probe's allocation. Better "
        "allocations near the boundary, so the answer can exceed a cold sweep's; off, each probe is the search a sweep makes.",
    )
    rechecks: int = Field(
        default=1,
        ge=0,
        description="heldout_esap only: one-point dips the bracketing looks past (each: one probe, and one more "
        "bisection when the point above a miss meets; 0: plain bisection).",
    )

    @field_validator("heldout_esap")
    @classmethod
    def _reachable(cls, value: float | None) -> float | None:
        from evoesap.planning.target import check_threshold

        return None if value is None else check_threshold(value)

    @field_validator("bytes")
    @classmethod
    def _a_size(cls, value: int | str | None) -> int | str | None:
        from evoesap.machine.sizes import parse_bytes

        if value is not None and parse_bytes(value) <= 0:
            raise ValueError(f"bytes must be a positive size such as 24GiB or a number of bytes, got {value!r}")
        return value

    @property
    def quality(self) -> bool:
        """Whether the sparsity is found by probing (heldout_esap or gate), not computed from sizes (bytes)."""
        return self.heldout_esap is not None or self.gate

    @model_validator(mode="after")
    def _one_target(self) -> Target:
        if [self.heldout_esap is not None, self.bytes is not None, self.gate].count(True) != 1:
            raise ValueError(
                "give one target: heldout_esap (a quality to keep), gate: true (the gate section's thresholds to pass) "
                "or bytes (a size to fit)"
            )
        bracketing = sorted({"warm_start", "rechecks", "choose_criterion"} & self.model_fields_set)
        if self.bytes is not None and bracketing:
            raise ValueError(
                f"target.{bracketing[0]} tunes the probing of heldout_esap or gate; a bytes target is computed: drop it"
            )
        return self


def sparsities_in_range(values: list[float]) -> list[float]:
    """The rule every sparsity of the fan-out meets, given as `sparsities` or as the `grid` parameter's points."""
    bad = [s for s in values if not 0 < s < 1]  # NaN fails the comparison too
    if bad or not values:
        raise ValueError(f"every sparsity must lie in (0, 1), got {bad or values}")
    return values


class ModelWorkspace(BaseModel):
    """The run's KFP workspace (a volume every task of the run may mount) into which a model handed in as an artifact is
    downloaded once, for every stage to read there (`dag.build_subpipeline`; docs/guides/embed.md)."""

    model_config = ConfigDict(extra="forbid")

    size: str = Field(description="The workspace volume's size, a Kubernetes quantity (e.g. 200Gi): the checkpoint's and more.")
    access_modes: list[Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany"]] | None = Field(
        None,
        description="The workspace PVC's access modes, over the cluster's default (KFP's pvcSpecPatch accessModes): "
        "stage pods on several nodes mount it at once, so ReadWriteMany.",
    )
    storage_class: str | None = Field(
        None,
        description="The workspace PVC's storage class, over the cluster's default (pvcSpecPatch storageClassName); "
        "backends before 2.17.0 need one from here or the cluster's default workspace spec.",
    )

    @property
    def pvc_spec_patch(self) -> dict[str, Any]:
        """KFP's pvcSpecPatch: the fields the backend takes there (accessModes and storageClassName only)."""
        patch = {"accessModes": self.access_modes, "storageClassName": self.storage_class}
        return {key: value for key, value in patch.items() if value}

    @field_validator("size")
    @classmethod
    def _a_quantity(cls, value: str) -> str:
        from kfp import dsl

        try:
            dsl.WorkspaceConfig(size=value)  # KFP's own check, the one its compiler applies
        except ValueError:
            raise ValueError(f"size {value!r} is not a Kubernetes quantity: write e.g. 200Gi or 1Ti") from None
        return value


class GridPoint(BaseModel):
    """One point of the pipeline's `grid` parameter (the criterion x sparsity fan-out), as `grid()` writes it."""

    model_config = ConfigDict(extra="forbid")

    criterion: Criterion
    sparsity: float = Field(strict=True)  # a number, not the text of one


class _Settings(BaseModel):
    """Everything one pipeline run needs but the stage sections, which `PipelineConfig` adds from the registry."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("evoesap", description="The run's name: the pipeline's name when compiled or submitted.")
    model: str = Field(description="Local path, fsspec URI or hub name of the full model.")
    revision: str | None = Field(
        None, description="Hub models only: the branch, tag or commit of `model` (default: its default branch)."
    )
    calibration_data: str = Field(description="Data for the importance criteria.")
    search_data: str = Field(description="Data for the teacher cache and the ESAP fitness.")
    heldout_data: str | None = Field(
        None, description="Other samples of the search domain: the search's held-out check, held-out ESAP in evaluate."
    )
    previous_metrics: str | None = Field(
        None, description="The previous release: its evaluate artifact or metrics.json (for gate.max_previous_drop)."
    )
    criteria: list[Criterion] = Field(["reap"], description="The importance criteria: one branch of the grid each.")
    sparsities: list[float] = Field([0.25], description="The sparsities, each in (0, 1): one branch of the grid each.")
    target: Target | None = Field(
        None,
        description="A held-out quality or a size to meet: the sparsity is searched for (evoesap.planning.target), not given.",
    )
    storage_root: str = Field("./runs/artifacts", description="Where every artifact goes: a path, s3://, gs://.")
    pipeline_root: str | None = Field(None, description="kfp.local's own scratch directory (local runs only).")
    registry: str | None = Field(None, description="Where the stage images are (host[:port]/path); every image must lie there.")
    image: str | None = Field(None, description="The stage image, fully qualified; default: <registry>/stage:<version>.")
    retries: int = Field(2, ge=0, strict=True, description="Retries per task, for transient failures.")
    parallelism: int = Field(
        0, ge=0, strict=True, description="Criterion x sparsity points run at once (KFP's ParallelFor); 0: all."
    )
    publish_models: bool = Field(
        False, description="Publish each searched pruned model with its model card (where: the publish section)."
    )
    resources: dict[Literal[("all", *stages.NAMES)], StageSettings] = Field(  # type: ignore[valid-type]
        {}, description="Kubernetes settings per stage (pipeline.cluster.StageSettings); `all` applies to every stage."
    )
    model_workspace: ModelWorkspace | None = Field(
        None,
        description="Embedded only (build_subpipeline): download the model artifact once into the run's KFP workspace "
        "(backend >= 2.15.0), where every stage reads it, instead of once per stage pod.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_credentials_in_urls(cls, data: Any) -> Any:
        """Every value is copied into the compiled spec that a cluster stores and shows: a URL with credentials
        (model, data, storage_root, publish.to, previous_metrics, any stage parameter) is refused at its key."""
        from evoesap.network import refuse_credentials

        for key, value in config_strings(data):
            refuse_credentials(value, key)
        return data

    @field_validator("sparsities")
    @classmethod
    def _sparsities_in_range(cls, values: list[float]) -> list[float]:
        return sparsities_in_range(values)

    @model_validator(mode="after")
    def _target_or_sparsities(self) -> PipelineConfig:
        if self.target is not None and "sparsities" in self.model_fields_set:
            raise ValueError(
                f"target and sparsities {self.sparsities} both choose the sparsity: keep target (the sparsity is then "
                "found on the granularity grid) or sparsities, not both"
            )
        if self.target is not None and self.target.heldout_esap is not None and not self.heldout_data:
            raise ValueError("target.heldout_esap is measured on held-out samples: set heldout_data")
        metric = getattr(self, "search", {}).get("metric", "esap")
        if self.target is not None and self.target.heldout_esap is not None and metric != "esap":
            raise ValueError(f"target.heldout_esap is the search's held-out ESAP: search.metric is {metric!r}; use esap")
        return self

    @model_validator(mode="after")
    def _gate_target(self) -> PipelineConfig:
        if self.target is None or not self.target.gate:
            return self
        from evoesap.steps import make_params

        if not make_params("gate", getattr(self, "gate", {})).active:
            raise ValueError(
                "target.gate asks for the largest sparsity passing the gate section's thresholds, and it sets none: "
                "add e.g. gate: {max_task_drop: 0.05}"
            )
        if getattr(self, "quantize", {}).get("recipe"):
            raise ValueError(
                "target.gate probes the pruned model, but with quantize.recipe the gate judges the quantized one: drop "
                "the recipe to find the sparsity, then quantize at that sparsity (sparsities: [s])"
            )
        return self

    @model_validator(mode="after")
    def _bytes_target_sizes_the_release(self) -> PipelineConfig:
        if self.target is None or self.target.bytes is None:
            return self
        from evoesap.planning.quantized import refusal

        section = getattr(self, "quantize", {})
        refused = refusal(section.get("recipe"), section.get("model_dtype", "auto"))
        if refused:
            raise ValueError(refused)
        return self

    @field_validator("storage_root")
    @classmethod
    def _storage_root_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "storage_root is empty, which would write every artifact into the working directory: "
                "give a directory or URI, e.g. ./runs/artifacts"
            )
        return value

    @field_validator("criteria")
    @classmethod
    def _criteria_non_empty(cls, values: list[str]) -> list[str]:
        if not values:
            raise ValueError(f"give at least one criterion of {', '.join(CRITERIA)}")
        return values

    @model_validator(mode="after")
    def _accelerators_where_a_model_runs(self) -> PipelineConfig:
        from evoesap.components import qualified

        images = {"image": self.image, **{f"resources.{k}.image": v.image for k, v in self.resources.items()}}
        for key, image in images.items():
            if image and not qualified(image):
                raise ValueError(
                    f"{key} {image!r} is not fully qualified: write registry/name:tag "
                    f"(e.g. registry.example.org/evoesap/stage:{__version__})"
                )
            if image and self.registry and not image.startswith(self.registry.rstrip("/") + "/"):
                raise ValueError(
                    f"{key} {image!r} is not in the registry {self.registry!r}: move it there or "
                    "leave it unset (default: <registry>/stage:<version>)"
                )
        shared = self.resources.get("all")
        if shared is not None and shared.image:
            raise ValueError("resources.all.image: set the image of every stage with the top-level `image`")
        if shared is not None and shared.accelerator_count:
            raise ValueError(
                f"resources.all: set accelerators per stage, not for all (stages that can use one: "
                f"{', '.join(stages.MODEL_STAGES)})"
            )
        for stage, settings in self.resources.items():
            job_fields = [
                f
                for f in ("training_runtime", "trainer_version", "suspend")
                if getattr(settings, f) != type(settings).model_fields[f].default
            ]
            if stage not in ("search", "all") and job_fields:
                raise ValueError(
                    f"resources.{stage}.{job_fields[0]}: only the search runs as a multi-worker job; "
                    "set it under resources.search"
                )
            if stage not in (*stages.MODEL_STAGES, "all") and settings.accelerator_count:
                raise ValueError(
                    f"resources.{stage}: {stage} loads no model and cannot use an accelerator (prune works on the "
                    f"checkpoint files); remove its accelerator settings (stages that can: {', '.join(stages.MODEL_STAGES)})"
                )
        for stage in self.resources.keys() - {"all"} if shared is not None else ():  # checked again once merged
            try:
                self.settings(stage)
            except ValidationError as exc:
                problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(f"resources.{stage} with resources.all under it: {problems}") from None
        return self

    @model_validator(mode="after")
    def _storage_outside_the_model(self) -> PipelineConfig:
        if "://" in self.storage_root or "://" in self.model or not Path(self.model).is_dir():
            return self
        model, root = Path(self.model).resolve(), Path(self.storage_root).resolve()
        if root == model or model in root.parents:
            raise ValueError(
                f"storage_root {self.storage_root} lies inside the model directory {self.model}: artifacts "
                "written there would change the model they are made from; choose a storage_root outside it"
            )
        return self

    @property
    def pinned_model(self) -> str:
        """`model` at `revision` (`org/name@revision`, `evoesap.store.identity.pin`), as every stage reads it."""
        from evoesap.store.identity import pin

        return pin(self.model, self.revision)

    def grid(self) -> list[dict[str, Any]]:
        """The fan-out: one point per criterion x sparsity (with a `bytes` target, the sparsity that fits it)."""
        sparsities = self.sparsities
        if self.target is not None and self.target.bytes is not None:
            from .target import memory_sparsity

            sparsities = [memory_sparsity(self)]
        return [{"criterion": c, "sparsity": s} for c in self.criteria for s in sparsities]

    def stage_params(self, stage: str) -> dict[str, Any]:
        """The stage's section as written (the fan-out's parameters are not in it)."""
        return dict(getattr(self, stages.get(stage).section))

    def parsed_params(self, stage: str, point: dict[str, Any] | None = None) -> Any:
        """The stage's parameter dataclass: its section, with the values of a fan-out `point` (default: the
        first) for the parameters the grid sets."""
        from evoesap.steps import make_params

        grid = stages.get(stage).grid
        point = point or self.grid()[0]
        return make_params(stage, {**self.stage_params(stage), **{name: point[name] for name in grid}})

    @property
    def default_image(self) -> str:
        """`image`, else the stage image of this version in `registry` (else in the project's registry)."""
        from evoesap.components import DEFAULT_REGISTRY, stage_image

        return self.image or stage_image(self.registry or DEFAULT_REGISTRY)

    def stage_image(self, stage: str) -> str:
        """The image a stage's pods run: its own `resources.<stage>.image`, else `default_image`."""
        return self.settings(stage).image or self.default_image

    @property
    def search_workers(self) -> int:
        """The search's `workers`: above 1 the pipeline runs it as a Kubeflow Trainer job (`pipeline.trainjob`)."""
        return self.parsed_params("search").workers

    def settings(self, stage: str) -> StageSettings:
        """The stage's Kubernetes settings: its own over `all`."""
        return merged(self.resources.get("all"), self.resources.get(stage))


def _section(stage: stages.Stage) -> Any:
    """A stage's section: a mapping the stage's parameter dataclass validates (`parsed_params`, so its messages are
    the CLI's and the API's), whose JSON schema shows each parameter's type, default, choices and range
    (`params.json_schema`, made when the schema is asked for: no stage code is imported before)."""
    from evoesap.params import json_schema

    def schema(found: dict[str, Any]) -> None:
        found.update(json_schema(stage.params_class(), exclude=stage.grid), description=stage.summary)

    return (dict[str, Any], Field({}, json_schema_extra=schema))


def config_strings(value: Any, key: str = "") -> list[tuple[str, str]]:
    """(dotted key, string) of every string inside a configuration's nested mappings and lists, keys included."""
    if isinstance(value, str):
        return [(key or "<value>", value)]
    if isinstance(value, Mapping):
        found = []
        for k, v in value.items():
            where = f"{key}.{k}" if key else str(k)
            found += [*config_strings(str(k), where), *config_strings(v, where)]
        return found
    if isinstance(value, list | tuple):
        return [found for i, v in enumerate(value) for found in config_strings(v, f"{key}[{i}]")]
    return []


def config_model() -> type[_Settings]:
    """The configuration's model: the settings plus one parameter section per stage of the registry."""
    return create_model(
        "PipelineConfig",
        __base__=_Settings,
        __doc__="Everything one pipeline run needs: inputs, grid, one parameter section per stage, storage and cluster settings.",
        **{stage.section: _section(stage) for stage in stages.STAGES},
    )


PipelineConfig = config_model()


def _check_stage_sections(config: PipelineConfig) -> None:
    for stage in stages.STAGES:
        clash = sorted(set(config.stage_params(stage.name)) & set(stage.grid))
        if clash:
            raise ConfigError(f"set {', '.join(clash)} at the top level (criteria, sparsities), not under {stage.section}")
        params = config.parsed_params(stage.name)
        needed = params.gpus() if hasattr(params, "gpus") else 1
        have = config.resources[stage.name].accelerator_count if stage.name in config.resources else 0
        if needed > max(have, 1):
            raise ConfigError(
                f"{stage.section}: tensor_parallel x pipeline_parallel spans {needed} GPUs but "
                f"resources.{stage.name}.accelerator_count is {have}: give the task {needed} GPUs "
                "(accelerator_type and accelerator_count) or lower them"
            )
    if config.search_workers > 1:
        from .trainjob import check_workers

        check_workers(config.settings("search"), config.search_workers, config.parsed_params("search").gpus_per_worker)
    targets = sorted(k for k in ("to", "repo") if config.stage_params("publish").get(k))
    points = 1 if config.target is not None and config.target.choose_criterion else len(config.grid())
    if config.publish_models and targets and points > 1:
        raise ConfigError(
            f"publish.{targets[0]} is one place, but publish_models publishes {points} models "
            "(criteria x sparsities): publish one point per run, or leave publish.to and publish.repo unset "
            "(each model is then published under storage_root)"
        )


def _check_gate(config: PipelineConfig) -> None:
    """The gate's thresholds need what they compare: held-out ESAP needs heldout_data, a drop against the previous
    release needs previous_metrics (and previous_metrics needs that threshold)."""
    gate = config.parsed_params("gate")
    if gate.min_heldout_esap is not None and not config.heldout_data:
        raise ConfigError("gate.min_heldout_esap needs held-out ESAP: set heldout_data (other samples of the search domain)")
    if (gate.max_previous_drop is None) != (config.previous_metrics is None):
        raise ConfigError(
            "gate.max_previous_drop and previous_metrics go together: set both (the previous release's metrics and the "
            "drop allowed against them) or neither"
        )


def _keys_at(root: Any, loc: tuple) -> list[str]:
    """The keys the mapping at `loc` under the type `root` takes (a model's fields; none for a free mapping)."""
    kind = root
    for part in loc:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = kind.model_fields.get(part)
            kind = field.annotation if field else None
        else:  # an item of a list or a value of a mapping
            kind = (get_args(kind) or (None,))[-1]
        if get_origin(kind) in (Union, UnionType):  # `Scratch | None`
            kind = next((k for k in get_args(kind) if k is not NoneType), None)
    return sorted(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else []


def _problems(exc: ValidationError, root: Any) -> str:
    """Pydantic's errors in one line, each at its key; an unknown key also names the valid ones."""
    problems = []
    for err in exc.errors():
        message = err["msg"]
        valid = _keys_at(root, err["loc"][:-1]) if err["type"] == "extra_forbidden" else []
        if valid:
            message += f" (valid: {', '.join(valid)})"
        where = ".".join(str(p) for p in err["loc"] if p != "[key]")  # pydantic's marker of a refused mapping key
        problems.append(f"{where or '<root>'}: {message}")
    return "; ".join(problems)


RESOURCES = _Settings.model_fields["resources"].annotation  # the `resources` section: stage or `all` -> StageSettings


def with_resources(config: PipelineConfig, overrides: Mapping[str, Any]) -> PipelineConfig:
    """`config` with `overrides` (the `resources` section's schema) merged over its `resources`, as `all` is merged
    under a stage: lists add up, mappings merge, a value set in `overrides` wins. Validated as a file is."""
    try:
        extra = TypeAdapter(RESOURCES).validate_python(overrides)
    except ValidationError as exc:
        raise ConfigError(f"invalid overrides: {_problems(exc, RESOURCES)}") from exc
    resources = {**config.resources, **{key: merged(config.resources.get(key), own) for key, own in extra.items()}}
    data = {
        **config.model_dump(exclude_unset=True),
        "resources": {k: v.model_dump(exclude_unset=True) for k, v in resources.items()},
    }
    try:
        return load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"with the overrides {dict(overrides)}: {exc}") from exc


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
        except RecursionError:
            raise ConfigError(f"{path} nests too deeply to read (more than about a thousand levels)") from None
        where = str(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    from evoesap.network import refuse_credentials

    for key, value in config_strings(data):  # as the model's own check does, without pydantic's prefix on the line
        refuse_credentials(value, f"{where}: {key}")
    try:
        config = PipelineConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {where}: {_problems(exc, PipelineConfig)}") from exc
    config.pinned_model  # noqa: B018 - a revision for a path or URI is refused here, before anything runs
    _check_stage_sections(config)
    _check_gate(config)
    return config


def quality_target(value: Any, where: str = "target") -> Target:
    """A quality target (`target: {heldout_esap: X}` or `{gate: true}`) from plain values, as the configuration's `target:` section is
    validated: the compiled `target_params` input, whether set at compile, at submit or in a run's parameters."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping such as {{heldout_esap: 0.97}}, got {value!r:.80}")
    try:
        target = Target(**value)
    except ValidationError as exc:
        raise ConfigError(f"invalid {where}: {_problems(exc, Target)}") from None
    if not target.quality:
        raise ConfigError(
            f"{where} sets neither heldout_esap nor gate: the pipeline was compiled for a quality target, and a bytes "
            "target's sparsity is computed at compile time: set it in the configuration and compile again"
        )
    return target


def grid_points(value: Any, where: str = "grid") -> list[GridPoint]:
    """The `grid` parameter's points (the criterion x sparsity fan-out), each checked as `criteria` and `sparsities`
    are: a known criterion, a sparsity in (0, 1); at least one, none twice."""
    grid = create_model("Grid", __config__=ConfigDict(extra="forbid"), **{where: (list[GridPoint], ...)})
    try:
        points = getattr(grid(**{where: value}), where)
    except ValidationError as exc:
        raise ConfigError(
            f"invalid {_problems(exc, grid)} (a list of points such as [{{criterion: reap, sparsity: 0.5}}])"
        ) from None
    if not points:
        raise ConfigError(f"{where} is empty: give at least one point such as [{{criterion: reap, sparsity: 0.5}}]")
    try:
        sparsities_in_range([p.sparsity for p in points])
    except ValueError as exc:
        raise ConfigError(f"invalid {where}: {exc}") from None
    seen = [(p.criterion, p.sparsity) for p in points]
    twice = next((point for i, point in enumerate(seen) if point in seen[:i]), None)
    if twice is not None:
        raise ConfigError(f"{where} has criterion {twice[0]} at sparsity {twice[1]} twice: give each point once")
    return points


def with_arguments(config: PipelineConfig, arguments: Mapping[str, Any]) -> PipelineConfig:
    """`config` with a run's pipeline parameter values (`--set` at compile or submit: `model`, the data, `grid`,
    `target_params`, each `<section>_params`) in the places they were compiled from, validated as a configuration
    file is: the same declarations and checks, refused in one line naming what was set."""
    sections = {f"{stage.section}_params": stage.section for stage in stages.STAGES}
    data = config.model_dump(exclude_unset=True)
    for name, value in arguments.items():
        if name == "grid":
            points = grid_points(value)
            data["criteria"] = list(dict.fromkeys(p.criterion for p in points))  # what the checks below count and read
            data["sparsities"] = list(dict.fromkeys(p.sparsity for p in points))
        elif name == "target_params":
            data["target"] = quality_target(value, "target_params").model_dump(exclude_unset=True)
        elif name == "model":  # a hub model's revision rides in it (`pinned_model`)
            data.pop("revision", None)
            data["model"] = value
        elif name == "heldout_data":
            data["heldout_data"] = value or None
        elif name in sections:
            data[sections[name]] = value
        else:
            data[name] = value
    try:
        return load_config(data)
    except ConfigError as exc:
        raise ConfigError(f"with {', '.join(sorted(arguments))} as set: {exc}") from None
