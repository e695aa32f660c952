"""`evoesap pipeline submit` against a recording HTTP server on 127.0.0.1 standing in for the KFP API."""

from __future__ import annotations

import email
import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from evoesap.pipeline.config import PipelineConfig
from evoesap.pipeline.submit import Submission, follow, parse_overrides, submit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recording_http import JsonHandler, serving
from remote_config import REMOTE_CONFIG
from tiny_world import quick_world_config

from evoesap.cli import main
from evoesap.errors import ConfigError

CONFIG = {**REMOTE_CONFIG, "name": "nightly-prune"}


class Recorder(JsonHandler):
    """Answers the KFP v2beta1 calls the kfp client makes, recording each (method, path, body): JSON bodies
    parsed, an uploaded pipeline package as its YAML documents."""

    requests: list[tuple[str, str, Any]] = []
    status = 200  # what healthz answers
    pipelines: dict[str, list[str]] = {}  # pipeline display name -> its versions' display names
    states: list[str] = []  # what successive looks at run-1 answer

    def do_GET(self):  # noqa: N802
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        self.requests.append(("GET", url.path, dict(self.headers)))
        if "healthz" in url.path:
            self._reply({"multi_user": False} if self.status == 200 else {"message": "no"}, self.status)
        elif url.path == "/apis/v2beta1/pipelines":  # by name (a filter on display_name)
            name = json.loads(query["filter"][0])["predicates"][0]["stringValue"]
            self._reply({"pipelines": [{"pipeline_id": name, "display_name": name}]} if name in self.pipelines else {})
        elif url.path.endswith("/versions"):
            versions = self.pipelines[url.path.split("/")[-2]]
            if "filter" in query:
                wanted = json.loads(query["filter"][0])["predicates"][0]["stringValue"]
                versions = [v for v in versions if v == wanted]
            self._reply({"pipeline_versions": [{"pipeline_version_id": v, "display_name": v} for v in versions]})
        elif url.path == "/apis/v2beta1/runs/run-1":
            self._reply({"run_id": "run-1", "state": self.states.pop(0)})
        else:  # experiment look-ups: none exists yet
            self._reply({})

    def do_POST(self):  # noqa: N802
        url = urllib.parse.urlparse(self.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        if url.path.endswith(("/upload", "/upload_version")):
            body = {"query": query, "package": _uploaded(self.headers["Content-Type"], raw)}
        else:
            body = json.loads(raw or b"{}")
        self.requests.append(("POST", url.path, body))
        if url.path.endswith("/pipelines/upload"):
            self.pipelines[query["name"]] = [query["name"]]  # the backend names the first version like the pipeline
            self._reply({"pipeline_id": query["name"], "display_name": query["name"]})
        elif url.path.endswith("/pipelines/upload_version"):
            self.pipelines[query["pipelineid"]].append(query["name"])
            self._reply({"pipeline_id": query["pipelineid"], "pipeline_version_id": query["name"]})
        elif url.path.endswith("/experiments"):
            self._reply({**body, "experiment_id": "exp-1"})
        elif url.path.endswith("/recurringruns"):
            self._reply({**body, "recurring_run_id": "rr-1"})
        else:
            self._reply({**body, "run_id": "run-1"})


def _uploaded(content_type: str, raw: bytes) -> list[dict]:
    """The YAML documents of the pipeline package in a multipart upload."""
    message = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + raw)
    (part,) = message.get_payload()
    return list(yaml.safe_load_all(part.get_payload(decode=True)))


@pytest.fixture
def kfp_api() -> Iterator[str]:
    Recorder.requests, Recorder.status, Recorder.pipelines, Recorder.states = [], 200, {}, []
    with serving(Recorder) as url:
        yield url


def _posts() -> dict[str, Any]:
    return {path: body for method, path, body in Recorder.requests if method == "POST"}


def _uploaded_spec() -> dict:
    """The pipeline spec of the last upload (a new pipeline or a new version)."""
    uploads = [body for method, path, body in Recorder.requests if method == "POST" and "/upload" in path]
    return uploads[-1]["package"][0]


def test_run_with_name_overrides_and_experiment(kfp_api):
    submission = Submission(
        host=kfp_api,
        experiment="release",
        run_name="nightly-2026-11-26",
        overrides=parse_overrides(["search_params.generations=7", "search_params.racing=true", "storage_root=s3://other/runs"]),
    )
    assert submit(PipelineConfig(**CONFIG), submission) == "run-1"
    posts = _posts()
    assert posts["/apis/v2beta1/experiments"]["display_name"] == "release"
    run = posts["/apis/v2beta1/runs"]
    assert run["display_name"] == "nightly-2026-11-26"
    assert run["experiment_id"] == "exp-1"
    assert run["runtime_config"]["parameters"] == {
        "search_params": {"generations": 7, "racing": True},
        "storage_root": "s3://other/runs",
    }
    assert run["pipeline_version_reference"] == {"pipeline_id": "nightly-prune", "pipeline_version_id": "nightly-prune"}
    assert "pipeline_spec" not in run  # the run refers to the uploaded version
    spec = _uploaded_spec()
    assert spec["pipelineInfo"]["name"] == "nightly-prune"
    assert "exec-search" in spec["deploymentSpec"]["executors"]


def test_a_run_overrides_quantize_parameters_when_the_dag_quantizes(kfp_api):
    """quantize_params is a pipeline input like every stage's, generated from the registry: a run sets the recipe's
    samples and the quantize task reads the input, not a constant compiled into it."""
    config = PipelineConfig(**{**CONFIG, "quantize": {"recipe": "w4a16-gptq", "samples": 64}})
    overrides = parse_overrides(["quantize_params.samples=32", "quantize_params.recipe=fp8-dynamic"])
    assert submit(config, Submission(host=kfp_api, overrides=overrides)) == "run-1"
    parameters = _posts()["/apis/v2beta1/runs"]["runtime_config"]["parameters"]
    assert parameters == {"quantize_params": {"recipe": "fp8-dynamic", "samples": 32}}
    spec = _uploaded_spec()
    assert spec["root"]["inputDefinitions"]["parameters"]["quantize_params"]["defaultValue"] == {
        "recipe": "w4a16-gptq",
        "samples": 64,
    }
    loop_inputs = json.dumps(spec["components"])
    assert '"componentInputParameter": "pipelinechannel--quantize_params"' in loop_inputs
    with pytest.raises(ConfigError, match="unknown parameter.*recipes.*for stage 'quantize'"):
        submit(config, Submission(host=kfp_api, overrides={"quantize_params.recipes": "x"}))


def test_without_a_quantize_step_there_is_no_quantize_input_to_set(kfp_api):
    with pytest.raises(ConfigError, match="--set quantize_params.samples: the pipeline has no such parameter"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"quantize_params.samples": 32}))


def test_pipeline_is_uploaded_once_and_each_distinct_spec_is_one_version(kfp_api):
    """First submission: the pipeline with its first version; a changed spec: a new version named by its
    sha256; the same spec again: that version, nothing uploaded."""
    config = PipelineConfig(**CONFIG)
    submit(config, Submission(host=kfp_api))
    changed = PipelineConfig(**{**CONFIG, "sparsities": [0.25]})
    submit(changed, Submission(host=kfp_api))
    submit(changed, Submission(host=kfp_api))
    uploads = [(path, body["query"]) for method, path, body in Recorder.requests if method == "POST" and "/upload" in path]
    assert [path for path, _ in uploads] == ["/apis/v2beta1/pipelines/upload", "/apis/v2beta1/pipelines/upload_version"]
    version = uploads[1][1]["name"]
    assert uploads[1][1]["pipelineid"] == "nightly-prune" and re.fullmatch(r"nightly-prune-[0-9a-f]{12}", version)
    assert _uploaded_spec()["root"]["inputDefinitions"]["parameters"]["grid"]["defaultValue"] == [
        {"criterion": "reap", "sparsity": 0.25}
    ]
    runs = [body for method, path, body in Recorder.requests if method == "POST" and path == "/apis/v2beta1/runs"]
    assert [r["pipeline_version_reference"]["pipeline_version_id"] for r in runs] == ["nightly-prune", version, version]


def test_service_account_goes_with_the_run(kfp_api):
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, service_account="evoesap-runner"))
    assert _posts()["/apis/v2beta1/runs"]["service_account"] == "evoesap-runner"


def test_recurring_run_with_a_cron_schedule_no_catchup_and_one_at_a_time(kfp_api):
    submission = Submission(host=kfp_api, run_name="nightly", schedule="0 3 * * *")
    assert submit(PipelineConfig(**CONFIG), submission) == "rr-1"
    job = _posts()["/apis/v2beta1/recurringruns"]
    assert job["display_name"] == "nightly"
    assert job["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"  # KFP's cron has seconds first
    assert job["max_concurrency"] == "1" or job["max_concurrency"] == 1
    assert job["no_catchup"] is True
    assert job["experiment_id"] == "exp-1"
    assert job["pipeline_version_reference"]["pipeline_id"] == "nightly-prune"
    assert "/apis/v2beta1/runs" not in _posts()


def test_recurring_run_on_an_interval(kfp_api):
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, interval_seconds=86400, max_concurrency=2, catchup=True))
    job = _posts()["/apis/v2beta1/recurringruns"]
    assert int(job["trigger"]["periodic_schedule"]["interval_second"]) == 86400
    assert int(job["max_concurrency"]) == 2 and job["no_catchup"] is False


def test_no_task_is_submitted_with_kfp_caching_on(kfp_api):
    """KFP caching is off in the uploaded spec for every task, sub-pipeline ones included: our reuse checks storage."""
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api))
    spec = _uploaded_spec()
    dags = [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]
    tasks = [task for dag in dags for task in dag["tasks"].values()]
    assert len(tasks) > 5 and all(task.get("cachingOptions", {}).get("enableCache") is not True for task in tasks)


def test_submit_logs_the_lowest_backend_the_uploaded_spec_needs(kfp_api, caplog):
    volume = {"pvc": "hf-cache", "mount_path": "/cache", "sub_path": "hub"}
    config = PipelineConfig(**{**CONFIG, "resources": {"search": {"volumes": [volume]}}})
    with caplog.at_level(logging.INFO, logger="evoesap.pipeline.submit"):
        submit(config, Submission(host=kfp_api))
    floors = [r.getMessage() for r in caplog.records if "Kubeflow Pipelines backend" in r.getMessage()]
    assert len(floors) == 1 and "needs a Kubeflow Pipelines backend >= 2.16.0 (because of pvcMount.subPath in " in floors[0]


def test_token_is_sent_to_the_api_and_never_into_the_spec(kfp_api):
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, token="tok-s3cr3t"))
    health = next(headers for method, path, headers in Recorder.requests if "healthz" in path)
    assert health["Authorization"] == "Bearer tok-s3cr3t"
    assert "tok-s3cr3t" not in json.dumps(_posts())


def test_unknown_or_mistyped_override_is_refused_before_anything_is_created(kfp_api):
    with pytest.raises(ConfigError, match="no such parameter; it has .*search_params"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"serch_params.generations": 7}))
    with pytest.raises(ConfigError, match="unknown parameter.*generatons.*for stage 'search'"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"search_params.generatons": 7}))
    with pytest.raises(ConfigError, match="--set heldout_data: the pipeline has no such parameter"):  # none configured
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"heldout_data": "/data/h.jsonl"}))
    with pytest.raises(ConfigError, match="grid='all'.*takes list"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"grid": "all"}))
    with pytest.raises(ConfigError, match="--set revision: the pipeline has no such parameter"):  # it rides in `model`
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"revision": "v1"}))
    assert not _posts()


def test_a_sparsity_the_model_cannot_search_is_refused_before_anything_is_created(kfp_api, tmp_path):
    model = quick_world_config(tmp_path / "quick")
    config = PipelineConfig(**{**CONFIG, "model": str(model), "sparsities": [0.25]})
    grid = parse_overrides(["grid=[{criterion: reap, sparsity: 0.5}]"])
    with pytest.raises(ConfigError, match="criterion reap at sparsity 0.5 cannot be searched on .*single allocation"):
        submit(config, Submission(host=kfp_api, overrides=grid))
    with pytest.raises(ConfigError, match="at sparsity 0.25 cannot be searched on .*cannot be met in multiples of granularity 4"):
        submit(config, Submission(host=kfp_api, overrides={"search_params.granularity": 4}))
    assert not _posts()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_url_is_refused_in_one_line_before_the_configuration_torch_or_kfp_load(tmp_path):
    """The whole command, as a user runs it: under 5 s, and nothing heavy imported (the configuration's stage
    parameters import torch; compiling imports kfp)."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(CONFIG))
    probe = (
        "import sys; from evoesap.cli import main; rc = main(sys.argv[1:]); "
        "heavy = sorted({'torch', 'kfp', 'evoesap.pipeline.dag'} & set(sys.modules)); "
        "print('heavy:', heavy); sys.exit(rc)"
    )
    for host in (f"http://127.0.0.1:{_unused_port()}", "kfp.example.org"):
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", probe, "pipeline", "submit", str(config), "--host", host],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - start
        assert done.returncode == 1 and elapsed < 5, (elapsed, done.stderr)
        assert done.stdout.strip() == "heavy: []", done.stdout
        (line,) = done.stderr.splitlines()
        assert line.startswith("error: ") and host in line, line


def test_unreachable_host_is_one_line_naming_it(monkeypatch):
    host = f"http://127.0.0.1:{_unused_port()}"
    with pytest.raises(ConfigError, match=f"cannot reach the Kubeflow Pipelines API at {host}.*reachable from this machine"):
        submit(PipelineConfig(**CONFIG), Submission(host=host))


def test_wait_follows_the_run_to_its_final_state(kfp_api):
    Recorder.states = ["PENDING", "RUNNING", "RUNNING", "SUCCEEDED", "FAILED"]
    submission = Submission(host=kfp_api, wait=True, poll_seconds=0)
    assert follow(submission, submit(PipelineConfig(**CONFIG), submission)) == "SUCCEEDED"
    assert Recorder.states == ["FAILED"]  # stopped at the first final state
    with pytest.raises(ConfigError, match="--wait follows one run"):
        Submission(host=kfp_api, wait=True, schedule="0 3 * * *")


@pytest.mark.parametrize(("state", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("CANCELED", 1)])
def test_cli_wait_exits_with_the_run_s_final_state_in_one_line(kfp_api, tmp_path, capsys, state, code):
    Recorder.states = [state]
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(CONFIG))
    assert main(["pipeline", "submit", str(config), "--host", kfp_api, "--wait"]) == code
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"run run-1 {state}"], captured.out


def test_refused_token_names_the_host_and_what_to_check(kfp_api):
    Recorder.status = 401
    with pytest.raises(ConfigError, match=r"refused the request \(HTTP 401\).*token"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, token="bad"))
    assert not _posts()


def test_cli_submit_prints_one_line_for_an_unreachable_host(tmp_path, capsys):
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(CONFIG))
    host = f"http://127.0.0.1:{_unused_port()}"
    assert main(["pipeline", "submit", str(config), "--host", host, "--run-name", "x"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach") and host in lines[0], lines


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "0 3 * * *", "interval_seconds": 60}, "either --schedule or --interval"),
        ({"schedule": "nightly"}, "not a cron expression"),
        ({"interval_seconds": 0}, "positive number of seconds"),
        ({"max_concurrency": 0}, "max-concurrency must be >= 1"),
    ],
)
def test_bad_schedule_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Submission(host="http://127.0.0.1:1", **kwargs)


def test_overrides_are_read_as_yaml_values():
    assert parse_overrides(["a=0.5", "b=true", "c=[reap, frequency]", "d=text"]) == {
        "a": 0.5,
        "b": True,
        "c": ["reap", "frequency"],
        "d": "text",
    }
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["generations"])


# ---------------------------------------------------------------- hostile endpoints: credentials, echoes, drips, bytes


def test_credentials_in_a_url_of_the_configuration_are_refused_and_never_reach_a_spec(tmp_path, capsys):
    """An s3://key:secret@ storage root (or model) was compiled into the spec twice, in plain text, and uploaded."""
    for key in ("storage_root", "model", "calibration_data"):
        config = tmp_path / f"{key}.yaml"
        config.write_text(json.dumps({**CONFIG, key: "s3://AKIAIOSFODNN7EXAMPLE:s3cr3tvalue@bucket/x"}))
        out = tmp_path / f"{key}-spec.yaml"
        assert main(["pipeline", "compile", str(config), "-o", str(out)]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {config}: {key} 's3://bucket/x' has credentials inside it"), line
        assert "s3cr3tvalue" not in line and "kubeflow-secrets.md" in line and not out.exists()
    with pytest.raises(ConfigError, match="publish.to 's3://b/x' has credentials"):
        from evoesap.pipeline.config import load_config

        load_config({**CONFIG, "publish": {"to": "s3://k:s3cr3tvalue@b/x"}})


def test_credentials_in_the_host_or_a_set_value_are_refused_before_anything_is_sent(kfp_api):
    with pytest.raises(ConfigError, match="--host 'http://127.0.0.1:[0-9]+' has credentials inside it") as raised:
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api.replace("http://", "http://u:s3cr3tvalue@")))
    assert "s3cr3tvalue" not in str(raised.value)
    with pytest.raises(ConfigError, match="--set model 's3://b/m' has credentials inside it"):
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"model": "s3://k:s3cr3tvalue@b/m"}))
    assert not _posts() and not [r for r in Recorder.requests if "healthz" not in r[1]]


class EchoingKFP(Recorder):
    """The API, refusing every upload with a body that echoes the request's headers (its token among them)."""

    def do_POST(self):  # noqa: N802
        from recording_http import EchoHandler

        EchoHandler._echo(self)


EchoingKFP.refusal, EchoingKFP.prefix, EchoingKFP.content_type = 500, b"upstream error; you sent: ", "text/plain"


def test_what_the_api_echoes_back_is_scrubbed_from_the_error_line(kfp_api):
    Recorder.status = 200
    with serving(EchoingKFP) as url, pytest.raises(ConfigError) as raised:
        submit(PipelineConfig(**CONFIG), Submission(host=url, token="kfp-t0ken-s3cr3t"))
    line = str(raised.value)
    assert line.startswith(f"the Kubeflow Pipelines API at {url} refused the submission (HTTP 500: upstream error"), line
    assert "kfp-t0ken-s3cr3t" not in line and "dXNlcjpodW50ZXIy" not in line and "\n" not in line
    assert "Authorization: ***" in line


class NotText(Recorder):
    """The API's health check answers; everything else answers bytes that are not UTF-8 (another service, a proxy)."""

    def do_GET(self):  # noqa: N802
        if "healthz" in self.path:
            return super().do_GET()
        self._bytes(b"\xff\xfe\x00\x81 not text \xc3")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._bytes(b"\xff\xfe\x00\x81 not text \xc3", NotText.post_status)

    def _bytes(self, data: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize("status", [200, 500])
def test_an_api_answering_bytes_that_are_not_utf8_is_one_clear_line_not_an_internal_error(tmp_path, capsys, status):
    NotText.status, NotText.post_status = 200, status
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(CONFIG))
    with serving(NotText) as url:
        code = main(["pipeline", "submit", str(config), "--host", url])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and line.startswith(f"error: the Kubeflow Pipelines API at {url} "), line
    assert "not UTF-8 text" in line or "\ufffd" in line, line


def test_an_api_dripping_one_byte_at_a_time_ends_at_the_deadline_naming_the_host_and_the_knob(monkeypatch):
    from recording_http import dripping

    monkeypatch.setenv("EVOESAP_KFP_DEADLINE_S", "0.5")
    with dripping() as url:
        start = time.monotonic()
        with pytest.raises(ConfigError) as raised:
            submit(PipelineConfig(**CONFIG), Submission(host=url))
        elapsed = time.monotonic() - start
    assert elapsed < 3, elapsed
    assert str(raised.value) == (
        f"the health check at the Kubeflow Pipelines API {url} did not finish within 0.5 s (the server is stalled or "
        "too slow): check it, or set EVOESAP_KFP_DEADLINE_S to allow longer"
    )


TARGET_CONFIG = {**REMOTE_CONFIG, "heldout_data": "/data/h.jsonl", "target": {"heldout_esap": 0.9}}
TARGET_CONFIG.pop("sparsities")


class _Specs(dict):
    def __repr__(self) -> str:  # hypothesis shows its arguments: not the specs' text
        return f"<compiled specs {sorted(self)}>"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[PipelineConfig, str]]:
    """A sparsities configuration and a quality-target one, each with its compiled spec's text (compiled once)."""
    from evoesap.pipeline.dag import compile_pipeline

    out = _Specs()
    for name, data in (("grid", CONFIG), ("target", TARGET_CONFIG)):
        config = PipelineConfig(**data)
        out[name] = (config, compile_pipeline(config, tmp_path_factory.mktemp(name) / "spec.yaml").read_text())
    return out


def _bake(compiled, tmp_path, which: str, pairs: list[str]) -> str:
    from evoesap.pipeline.submit import bake_defaults

    config, text = compiled[which]
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    bake_defaults(path, parse_overrides(pairs), config)
    return path.read_text()


@pytest.mark.parametrize(
    ("which", "pair", "problem"),
    [
        ("target", "target_params.heldout_esap=5", "target_params: heldout_esap: .*unreachable"),
        ("target", "target_params.heldout_esap=-3", "target_params: heldout_esap: .*unreachable"),
        ("target", "target_params.heldout_esap=.nan", "target_params.heldout_esap: nan is not a finite number"),
        (
            "target",
            "target_params.warm_up=true",
            r"target_params: warm_up: Extra inputs .*\(valid: bytes, choose_criterion, gate, heldout_esap",
        ),
        ("target", "target_params={bytes: 1GB}", "target_params sets neither heldout_esap nor gate"),
        ("target", "target_params.heldout_esap\ninjected: 1=0.5", "a key is a pipeline parameter or <parameter>.<field>"),
        ("target", "heldout_data=", "target.heldout_esap is measured on held-out samples: set heldout_data"),
        ("grid", "grid=[0.25, .nan]", "--set grid: nan is not a finite number"),
        ("grid", "grid=[0.25]", r"grid.0: Input should be a valid dictionary"),
        ("grid", 'grid=["a"]', r"grid.0: Input should be a valid dictionary"),
        ("grid", "grid=[]", "grid is empty"),
        ("grid", "grid=[{criterion: reap, sparsity: 1.5}]", r"every sparsity must lie in \(0, 1\), got \[1.5\]"),
        ("grid", "grid=[{criterion: rap, sparsity: 0.5}]", "grid.0.criterion: Input should be"),
        ("grid", "grid=[{criterion: reap, sparsity: '0.5'}]", "grid.0.sparsity: Input should be a valid number"),
        ("grid", "grid=[{criterion: reap, sparsity: 0.5}, {criterion: reap, sparsity: 0.5}]", "twice"),
        ("grid", "storage_root= ", "storage_root is empty"),
        ("grid", "search_params.device=2024-01-01", "reads as a date, which JSON has not: quote it"),
        ("grid", "search_params.device=7", "search.device must be a string, got 7"),
        ("grid", "gate_params.max_task_drop=0.1", "no such parameter"),  # no threshold configured: no gate input
        ("grid", "search_params.heldout_fraction=.inf", "--set search_params.heldout_fraction: inf is not a finite"),
        ("grid", "storage_root=\x1b", "the value is not valid YAML"),
    ],
)
def test_compile_time_values_go_through_the_configuration_s_own_checks(compiled, tmp_path, which, pair, problem):
    with pytest.raises(ConfigError, match=problem) as refused:
        _bake(compiled, tmp_path, which, [pair])
    assert "\n" not in str(refused.value)
    assert (tmp_path / "spec.yaml").read_text() == compiled[which][1]  # nothing baked


def test_compile_time_values_the_configuration_takes_are_baked(compiled, tmp_path):
    text = _bake(compiled, tmp_path, "target", ["target_params.heldout_esap=0.8", "target_params.rechecks=2"])
    spec = next(yaml.safe_load_all(text))
    assert spec["root"]["inputDefinitions"]["parameters"]["target_params"]["defaultValue"] == {
        "heldout_esap": 0.8, "gate": False, "choose_criterion": False, "warm_start": False, "rechecks": 2,
    }  # fmt: skip
    grid = [{"criterion": "reap", "sparsity": 0.25}, {"criterion": "ean", "sparsity": 0.5}]
    spec = next(yaml.safe_load_all(_bake(compiled, tmp_path, "grid", [f"grid={json.dumps(grid)}"])))
    assert spec["root"]["inputDefinitions"]["parameters"]["grid"]["defaultValue"] == grid


def test_cli_compile_refuses_an_out_of_range_target_in_one_line_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump(TARGET_CONFIG))
    out = tmp_path / "spec.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(out), "--set", "target_params.heldout_esap=5"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "target_params: heldout_esap" in line and not out.exists()


_KEYS = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["grid", "model", "storage_root", "heldout_data", "target_params", "search_params"]).flatmap(
        lambda name: st.text(max_size=20).map(lambda field: f"{name}.{field}")
    ),
)
_VALUES = st.one_of(
    st.text(max_size=40),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
        max_leaves=8,
    ).map(json.dumps),
)


@given(which=st.sampled_from(["grid", "target"]), key=_KEYS, value=_VALUES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_key_and_value_is_baked_or_refused_in_one_line_never_injected(compiled, tmp_path, which, key, value):
    """Whatever is set: a ConfigError of one line, or a spec whose documents and top-level keys are the compiled
    ones, every header line a comment."""
    from evoesap.errors import EvoESAPError

    try:
        text = _bake(compiled, tmp_path, which, [f"{key}={value}"])
    except EvoESAPError as exc:
        assert isinstance(exc, ConfigError) and "\n" not in str(exc), exc
        return
    before = list(yaml.safe_load_all(compiled[which][1]))
    after = list(yaml.safe_load_all(text))
    assert [list(doc) for doc in after] == [list(doc) for doc in before]
    header = text[: text.index("components:")].splitlines()
    assert all(line.startswith("#") for line in header), header
