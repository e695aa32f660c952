"""Submit the compiled DAG to a Kubeflow Pipelines cluster: one run, or a recurring run on a schedule.

The endpoint is checked first, with a short timeout, before the configuration (whose stage parameters
import torch) and kfp are loaded, so a wrong URL or a refused token costs one clear line in about a
second. The compiled spec is uploaded as a version of the pipeline named like the configuration (one
version per distinct spec, named by its sha256), and the run or recurring run refers to that version, so
the cluster's UI lists what ran under one pipeline. Parameter overrides are checked against the compiled
pipeline's own parameters and types. Credentials: `token` (a bearer token), else whatever the kfp client
finds in its standard settings (KF_PIPELINES_SA_TOKEN_PATH, the kube context, IAP or Dex variables); no
token is ever printed or written into the spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from evoesap import network
from evoesap.errors import ConfigError
from evoesap.network import redact
from evoesap.registry import NAMES
from evoesap.steps import make_params

from .config import PipelineConfig, config_strings, load_config, with_arguments
from .feasibility import check_grid

log = logging.getLogger(__name__)

HEALTHZ = "/apis/v2beta1/healthz"
HEALTHZ_TIMEOUT = 3.0  # seconds: healthz answers at once; longer means a wrong or unreachable host
DEADLINE_ENV = "EVOESAP_KFP_DEADLINE_S"  # seconds one exchange with the API may take in all (however slowly it answers)
DEFAULT_DEADLINE_S = 120.0  # the health check, the spec's upload and the run's creation, or one look at a followed run
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED")  # a run's V2beta1RuntimeState once it has ended
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
    token: str | None = None  # bearer token; None: the kfp client's own credential discovery
    schedule: str | None = None  # cron, 5 fields (minute first) or KFP's 6 (seconds first)
    interval_seconds: int | None = None
    max_concurrency: int = 1  # recurring runs allowed at once
    catchup: bool = False  # backfill missed intervals after a pause
    service_account: str | None = None  # the Kubernetes service account the run's pods use (default: the cluster's)
    wait: bool = False  # follow the run until it ends (not for recurring runs)
    poll_seconds: float = 30.0  # between two looks at a followed run

    def __post_init__(self) -> None:
        if self.schedule and self.interval_seconds:
            raise ConfigError("give either --schedule or --interval, not both")
        if self.wait and self.recurring:
            raise ConfigError("--wait follows one run; a recurring run (--schedule/--interval) has no final state")
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


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")  # a parameter, or one field of a struct one


def check_key(key: str) -> str:
    """A `--set` key: a pipeline parameter's name, or `<stage>_params.field`; anything else refused in one line."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ConfigError(
            f"--set {key!r}: a key is a pipeline parameter or <parameter>.<field>, letters, digits and _ "
            "(e.g. --set search_params.generations=100)"
        )
    return key


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs (`key` may be `<stage>_params.field`); values read as YAML (`0.5`, `true`, `[a, b]`), each one
    JSON can carry (a KFP parameter is JSON): no dates, sets or binary, no NaN or infinity."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r} is not key=value (e.g. --set search_params.generations=100)")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            why = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line, however PyYAML wraps it
            raise ConfigError(f"--set {pair!r}: the value is not valid YAML ({why})") from None
        except RecursionError:
            raise ConfigError(f"--set {key.strip()!r}: the value nests too deeply to read: flatten it") from None
        _check_json_value(check_key(key.strip()), value)
        out[key.strip()] = value
    return out


def _check_json_value(key: str, value: Any) -> None:
    """Refuse a value a KFP parameter (JSON) cannot carry, naming the offending part."""
    stack = [value]
    while stack:  # no recursion: a deeply nested value is walked as easily as a flat one
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"--set {key}: {item} is not a finite number")
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), None)
            if bad is not None:
                raise ConfigError(f"--set {key}: the key {bad!r} is not text: quote it")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, (str, int, float, bool, type(None))):
            raise ConfigError(f"--set {key}: {item!r:.60} reads as a {type(item).__name__}, which JSON has not: quote it")


def check_endpoint(host: str, token: str | None = None, timeout: float = HEALTHZ_TIMEOUT) -> None:
    """One request to the API's health endpoint; a clear ConfigError when it cannot be used. `timeout` bounds each
    socket read; the whole exchange ends within $EVOESAP_KFP_DEADLINE_S (an endpoint that drips bytes)."""
    network.refuse_credentials(host, "--host")
    if not host.startswith(("http://", "https://")):
        raise ConfigError(f"--host {redact(host)!r} is not an http(s) URL of the Kubeflow Pipelines API")
    request = urllib.request.Request(host.rstrip("/") + HEALTHZ)
    if token:
        request.add_header("Authorization", f"Bearer {token}")

    def ask(stop: Any) -> None:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            while response.read(1 << 16) and not stop.is_set():
                pass

    try:
        _bounded(ask, host, "the health check")
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
        raise ConfigError(
            f"the Kubeflow Pipelines API at {redact(host)} answered HTTP {exc.code}: {network.reply_line(exc.reason, token)}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = network.reply_line(getattr(exc, "reason", exc), token)
        raise ConfigError(
            f"cannot reach the Kubeflow Pipelines API at {redact(host)} ({reason}): check the URL, that the "
            "endpoint is reachable from this machine (port-forward, ingress, VPN) and any proxy settings"
        ) from None


def _bounded(fn: Callable[[Any], Any], host: str, what: str) -> Any:
    """`fn(stop)` within the deadline of one exchange with the API ($EVOESAP_KFP_DEADLINE_S); a reply that is not
    UTF-8 text, which the kfp client cannot decode, is one line naming the host."""
    seconds = network.deadline_s(DEADLINE_ENV, DEFAULT_DEADLINE_S)
    try:
        return network.call(fn, seconds=seconds, what=f"{what} at the Kubeflow Pipelines API {host}", knob=DEADLINE_ENV,
                            error=ConfigError)  # fmt: skip
    except UnicodeDecodeError as exc:
        status = getattr(exc.__context__, "status", None)
        raise ConfigError(
            f"the Kubeflow Pipelines API at {redact(host)} answered {what} with bytes that are not UTF-8 text"
            f"{f' (HTTP {status})' if status else ''}: check that --host is the pipelines API endpoint, not another "
            "service or a proxy's page"
        ) from None


def resolve_overrides(spec: Mapping[str, Any], overrides: Mapping[str, Any], config: PipelineConfig) -> dict[str, Any]:
    """The run's parameter values from `--set` pairs, checked against the compiled pipeline and, in their places in
    `config` (the configuration it was compiled from), as a configuration file is (`config.with_arguments`).

    `name=value` sets a pipeline parameter (type-checked); `<stage>_params.field=value` sets one field of a
    stage's parameters on top of the compiled defaults.
    """
    parameters = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    for where, text in config_strings(dict(overrides)):  # a value goes into the run, the spec's defaults: no credentials
        network.refuse_credentials(text, f"--set {where}")
    arguments: dict[str, Any] = {}
    for key, value in overrides.items():
        name, _, field = check_key(key).partition(".")
        _check_json_value(key, value)
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
    if arguments:
        with_arguments(config, arguments)  # the configuration's own checks, with these values in their places

    def value(name: str) -> Any:
        return arguments.get(name, parameters.get(name, {}).get("defaultValue"))

    if {"model", "grid", "search_params", "prune_params"} & set(arguments):
        # a sparsity the model cannot search or prune: refused now, not hours into the run
        check_grid(value("model"), value("grid"), value("search_params"), value("prune_params"))
    return arguments


def bake_defaults(path: Path, overrides: Mapping[str, Any], config: PipelineConfig) -> None:
    """Rewrite the spec at `path`, compiled from `config`, with `--set` values (checked as a run's are,
    `resolve_overrides`) as its parameters' defaults; its header comment names what was set (kfp's list of inputs
    would be stale)."""
    text = path.read_text()
    spec, *platform = yaml.safe_load_all(text)
    arguments = resolve_overrides(spec, overrides, config)
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    for name, value in arguments.items():
        parameters[name]["defaultValue"] = value
    comments = [line for line in text.splitlines(keepends=True) if line.startswith("#")]
    kept = [line for line in comments[: next((i for i, c in enumerate(comments) if c.startswith("# Inputs:")), len(comments))]]
    baked = "".join(f"# --set {key}={json.dumps(value, allow_nan=False)}\n" for key, value in overrides.items())
    path.write_text("".join(kept) + baked + yaml.safe_dump_all([spec, *platform], sort_keys=False))


def _token() -> str | None:
    """The token the precheck sends when none is given: the service-account file the kfp client would use."""
    path = os.environ.get("KF_PIPELINES_SA_TOKEN_PATH")
    return Path(path).read_text().strip() if path and Path(path).is_file() else None


def submit(config: PipelineConfig | str | Path, submission: Submission, client_factory: Callable[..., Any] | None = None) -> str:
    """Check the endpoint, then load (given a path), compile, upload a pipeline version and start it; return the
    run id (or the recurring run id)."""
    check_endpoint(submission.host, submission.token or _token())
    if not isinstance(config, PipelineConfig):
        config = load_config(config)  # after the endpoint check: its stage parameters import torch
    from kfp_server_api.exceptions import ApiException

    from .backend_floor import spec_floor
    from .dag import compile_pipeline

    name = config.name
    with tempfile.TemporaryDirectory() as tmp:
        package = compile_pipeline(config, Path(tmp) / "pipeline.yaml")
        log.info("the spec of %s %s", config.name, spec_floor(package).line())
        arguments = resolve_overrides(next(yaml.safe_load_all(package.read_text())), submission.overrides, config)

        def exchange(stop: Any) -> str:
            client = _client(submission, client_factory)
            with _quiet_client():
                pipeline_id, version_id = upload_version(client, package, name, submission.namespace)
                _go_on(stop)
                experiment = client.create_experiment(submission.experiment or name, namespace=submission.namespace)
                common = dict(
                    experiment_id=experiment.experiment_id,
                    job_name=submission.run_name or name,
                    params=arguments,
                    pipeline_id=pipeline_id,
                    version_id=version_id,
                    service_account=submission.service_account,
                )
                _go_on(stop)
                if submission.recurring:
                    return client.create_recurring_run(
                        **common,
                        cron_expression=submission.cron,
                        interval_second=submission.interval_seconds,
                        max_concurrency=submission.max_concurrency,
                        no_catchup=not submission.catchup,
                    ).recurring_run_id
                return client.run_pipeline(**common).run_id

        try:
            return _bounded(exchange, submission.host, "the submission")
        except ApiException as exc:
            raise _refused(submission.host, "the submission", exc, submission.token) from None


def _go_on(stop: Any) -> None:
    """Stop an exchange abandoned at its deadline before its next request (no run is created after the error)."""
    if stop.is_set():
        raise network.Stopped("abandoned at its deadline")


def upload_version(client: Any, package: Path, name: str, namespace: str | None) -> tuple[str, str]:
    """(pipeline id, version id) of the compiled spec under the pipeline `name`: the pipeline is created with
    its first upload; a later spec becomes a version named `<name>-<sha256[:12]>` of the spec, reused when that
    version exists already (a resubmission of the same spec adds no version)."""
    pipeline_id = client.get_pipeline_id(name)
    if pipeline_id is None:
        pipeline_id = client.upload_pipeline(str(package), pipeline_name=name, namespace=namespace).pipeline_id
        (first,) = client.list_pipeline_versions(pipeline_id, page_size=1).pipeline_versions
        return pipeline_id, first.pipeline_version_id
    version = f"{name}-{hashlib.sha256(package.read_bytes()).hexdigest()[:12]}"
    same = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": version}]})
    existing = client.list_pipeline_versions(pipeline_id, filter=same).pipeline_versions
    if existing:
        return pipeline_id, existing[0].pipeline_version_id
    return pipeline_id, client.upload_pipeline_version(str(package), version, pipeline_id=pipeline_id).pipeline_version_id


def follow(submission: Submission, run_id: str, client_factory: Callable[..., Any] | None = None) -> str:
    """Look at the run every `poll_seconds` until it ends; return its final state (SUCCEEDED, FAILED, ...)."""
    from kfp_server_api.exceptions import ApiException

    client = _client(submission, client_factory)
    while True:
        try:
            state = str(_bounded(lambda stop: client.get_run(run_id).state, submission.host, f"a look at run {run_id}") or "")
        except ApiException as exc:
            raise _refused(submission.host, f"a look at run {run_id}", exc, submission.token) from None
        if state in FINAL_STATES:
            return state
        log.info("run %s: %s", run_id, state or "pending")
        time.sleep(submission.poll_seconds)


def _client(submission: Submission, client_factory: Callable[..., Any] | None) -> Any:
    import kfp

    options: dict[str, Any] = {"host": submission.host, "existing_token": submission.token}
    if submission.namespace:
        options["namespace"] = submission.namespace
    return (client_factory or kfp.Client)(**options)


@contextlib.contextmanager
def _quiet_client() -> Any:
    """The kfp client prints links to stdout; the library only logs (the CLI prints its own one line)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    for line in buffer.getvalue().splitlines():
        log.info("%s", line)


def _refused(host: str, what: str, exc: Any, token: str | None = None) -> ConfigError:
    detail = network.reply_line(_api_message(exc.body) or exc.reason or "", token)
    return ConfigError(
        f"the Kubeflow Pipelines API at {redact(host)} refused {what} (HTTP {exc.status}{': ' + detail if detail else ''})"
    )


def _api_message(body: Any) -> str:
    """The `message` of the API's JSON error body, else the body itself (a proxy's page): decoded whatever its bytes."""
    text = network.decode(body)
    try:
        return str(json.loads(text).get("message", ""))
    except (TypeError, ValueError, AttributeError):
        return text
