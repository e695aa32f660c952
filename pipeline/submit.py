"""Submit the compiled DAG to a Kubeflow Pipelines cluster: one run, or a recurring run on a schedule.

The endpoint is checked before the (slow) compile, so a wrong URL or a refused token costs one clear
line, not a compile and the kfp client's retry loop. Parameter overrides are checked against the
compiled pipeline's own parameters and types. Credentials: `token` (a bearer token), else whatever the
kfp client finds in its standard settings (KF_PIPELINES_SA_TOKEN_PATH, the kube context, IAP or Dex
variables); no token is ever printed or written into the spec.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from evoesap.artifacts import redact
from evoesap.errors import ConfigError
from evoesap.identity import pin
from evoesap.stages import NAMES
from evoesap.steps import make_params

from .config import PipelineConfig
from .dag import compile_pipeline

HEALTHZ = "/apis/v2beta1/healthz"
# KFP parameter types -> the Python types a value may have
_PARAMETER_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "NUMBER_INTEGER": (int,),
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "LIST": (list,),
    "STRUCT": (dict,),
}


@dataclasses.dataclass(frozen=True)
class Submission:
    """Where and how to submit; `schedule` (cron) or `interval_seconds` makes it a recurring run."""

    host: str
    experiment: str | None = None  # default: the config's name
    run_name: str | None = None  # default: the config's name
    namespace: str | None = None  # multi-user clusters: the profile namespace
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # pipeline parameters
    caching: bool | None = None  # None: the compiled settings (KFP caching off, our reuse decides); False: off
    token: str | None = None  # bearer token; None: the kfp client's own credential discovery
    schedule: str | None = None  # cron, 5 fields (minute first) or KFP's 6 (seconds first)
    interval_seconds: int | None = None
    max_concurrency: int = 1  # recurring runs allowed at once
    catchup: bool = False  # backfill missed intervals after a pause

    def __post_init__(self) -> None:
        if self.schedule and self.interval_seconds:
            raise ConfigError("give either --schedule or --interval, not both")
        if self.interval_seconds is not None and self.interval_seconds < 1:
            raise ConfigError(f"--interval must be a positive number of seconds, got {self.interval_seconds}")
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.schedule is not None:
            fields = self.schedule.split()
            if len(fields) not in (5, 6):
                raise ConfigError(
                    f"--schedule {self.schedule!r} is not a cron expression: give 5 fields "
                    "(minute hour day month weekday, e.g. '0 3 * * *') or KFP's 6 (seconds first)"
                )

    @property
    def recurring(self) -> bool:
        return bool(self.schedule or self.interval_seconds)

    @property
    def cron(self) -> str | None:
        """KFP's six-field cron (seconds first)."""
        if not self.schedule:
            return None
        fields = self.schedule.split()
        return " ".join(["0", *fields] if len(fields) == 5 else fields)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs (`key` may be `<stage>_params.field`); values read as YAML (`0.5`, `true`, `[a, b]`)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r} is not key=value (e.g. --set search_params.generations=100)")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {pair!r}: the value is not valid YAML ({exc.problem})") from None
    return out


def check_endpoint(host: str, token: str | None = None, timeout: float = 10.0) -> None:
    """One request to the API's health endpoint; a clear ConfigError when it cannot be used."""
    if not host.startswith(("http://", "https://")):
        raise ConfigError(f"--host {redact(host)!r} is not an http(s) URL of the Kubeflow Pipelines API")
    request = urllib.request.Request(host.rstrip("/") + HEALTHZ)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise ConfigError(
                f"the Kubeflow Pipelines API at {redact(host)} refused the request (HTTP {exc.code}): pass a valid "
                "token (--token or EVOESAP_KFP_TOKEN) or set up the kfp client's credentials "
                "(KF_PIPELINES_SA_TOKEN_PATH, kube context)"
            ) from None
        if exc.code == 404:
            raise ConfigError(
                f"no Kubeflow Pipelines v2 API at {redact(host)} ({HEALTHZ} answered 404): check that --host is the "
                "pipelines API endpoint (for a port-forward of ml-pipeline-ui: http://localhost:8080)"
            ) from None
        raise ConfigError(f"the Kubeflow Pipelines API at {redact(host)} answered HTTP {exc.code}: {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(
            f"cannot reach the Kubeflow Pipelines API at {redact(host)} ({reason}): check the URL, that the "
            "endpoint is reachable from this machine (port-forward, ingress, VPN) and any proxy settings"
        ) from None


def resolve_overrides(spec: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run's parameter values from `--set` pairs, checked against the compiled pipeline.

    `name=value` sets a pipeline parameter (type-checked); `<stage>_params.field=value` sets one field of a
    stage's parameters on top of the compiled defaults, checked by that stage's own parameter class.
    """
    parameters = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    arguments: dict[str, Any] = {}
    for key, value in overrides.items():
        name, _, field = key.partition(".")
        if name not in parameters:
            raise ConfigError(f"--set {key}: the pipeline has no such parameter; it has {', '.join(sorted(parameters))}")
        kind = parameters[name].get("parameterType", "STRING")
        if field:
            if kind != "STRUCT":
                raise ConfigError(f"--set {key}: {name} is a single value, set it as --set {name}=...")
            struct = arguments.setdefault(name, dict(parameters[name].get("defaultValue") or {}))
            struct[field] = value
            continue
        allowed = _PARAMETER_TYPES.get(kind, (object,))
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise ConfigError(f"--set {key}={value!r}: the parameter takes {kind.lower().replace('_', ' ')}")
        arguments[name] = value
    for name, value in arguments.items():
        stage = name.removesuffix("_params").replace("_", "-")
        if name.endswith("_params") and stage in NAMES:
            make_params(stage, value)  # unknown fields and bad values: the stage's own one-line error
    if {"model", "revision"} & set(arguments):
        model, revision = (arguments.get(k, parameters.get(k, {}).get("defaultValue")) for k in ("model", "revision"))
        pin(model, revision or None)  # a revision for a model that is not a hub name: refused now, not in the run
    return arguments


def _token() -> str | None:
    """The token the precheck sends when none is given: the service-account file the kfp client would use."""
    path = os.environ.get("KF_PIPELINES_SA_TOKEN_PATH")
    return Path(path).read_text().strip() if path and Path(path).is_file() else None


def submit(config: PipelineConfig, submission: Submission, client_factory: Callable[..., Any] | None = None) -> str:
    """Compile and submit; return the run id (or the recurring run id)."""
    check_endpoint(submission.host, submission.token or _token())
    import kfp
    from kfp_server_api.exceptions import ApiException

    name = config.name
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(config, Path(tmp) / "pipeline.yaml")
        arguments = resolve_overrides(yaml.safe_load(package.read_text()), submission.overrides)
        options: dict[str, Any] = {"host": submission.host, "existing_token": submission.token}
        if submission.namespace:
            options["namespace"] = submission.namespace
        try:
            client = (client_factory or kfp.Client)(**options)
            if submission.recurring:
                experiment = client.create_experiment(submission.experiment or name, namespace=submission.namespace)
                result = client.create_recurring_run(
                    experiment_id=experiment.experiment_id,
                    job_name=submission.run_name or name,
                    cron_expression=submission.cron,
                    interval_second=submission.interval_seconds,
                    max_concurrency=submission.max_concurrency,
                    no_catchup=not submission.catchup,
                    params=arguments,
                    pipeline_package_path=str(package),
                    enable_caching=submission.caching,
                )
                return result.recurring_run_id
            result = client.create_run_from_pipeline_package(
                str(package),
                arguments=arguments,
                run_name=submission.run_name or name,
                experiment_name=submission.experiment or name,
                namespace=submission.namespace,
                enable_caching=submission.caching,
            )
            return result.run_id
        except ApiException as exc:
            detail = _api_message(exc.body)
            raise ConfigError(
                f"the Kubeflow Pipelines API at {redact(submission.host)} refused the submission "
                f"(HTTP {exc.status}{': ' + detail if detail else ''})"
            ) from None


def _api_message(body: Any) -> str:
    try:
        return str(json.loads(body).get("message", ""))[:300]
    except (TypeError, ValueError, AttributeError):
        return ""
