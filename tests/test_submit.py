"""`evoesap pipeline submit` against a recording HTTP server on 127.0.0.1 standing in for the KFP API."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from evoesap.cli import main
from evoesap.errors import ConfigError
from evoesap.pipeline.config import PipelineConfig
from evoesap.pipeline.submit import Submission, parse_overrides, submit

CONFIG = dict(model="/models/full", calibration_data="/data/code.jsonl", search_data="/data/math.jsonl",
              criteria=["reap"], sparsities=[0.5], storage_root="s3://bucket/runs", name="nightly-prune")


class Recorder(BaseHTTPRequestHandler):
    """Answers the KFP v2beta1 calls the kfp client makes, recording each (method, path, JSON body)."""

    requests: list[tuple[str, str, Any]] = []
    status = 200  # what healthz answers

    def _reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.requests.append(("GET", self.path, dict(self.headers)))
        if "healthz" in self.path:
            self._reply({"multi_user": False} if self.status == 200 else {"message": "no"}, self.status)
        else:  # experiment look-ups: none exists yet
            self._reply({})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.requests.append(("POST", self.path.split("?")[0], body))
        if self.path.endswith("/experiments"):
            self._reply({**body, "experiment_id": "exp-1"})
        elif self.path.endswith("/recurringruns"):
            self._reply({**body, "recurring_run_id": "rr-1"})
        else:
            self._reply({**body, "run_id": "run-1"})

    def log_message(self, *args):
        pass


@pytest.fixture
def kfp_api() -> Iterator[str]:
    Recorder.requests, Recorder.status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _posts() -> dict[str, Any]:
    return {path: body for method, path, body in Recorder.requests if method == "POST"}


def test_run_with_name_overrides_and_experiment(kfp_api):
    submission = Submission(host=kfp_api, experiment="release", run_name="nightly-2026-11-26",
                            overrides=parse_overrides(["search_params.generations=7", "search_params.racing=true",
                                                       "storage_root=s3://other/runs"]))
    assert submit(PipelineConfig(**CONFIG), submission) == "run-1"
    posts = _posts()
    assert posts["/apis/v2beta1/experiments"]["display_name"] == "release"
    run = posts["/apis/v2beta1/runs"]
    assert run["display_name"] == "nightly-2026-11-26"
    assert run["experiment_id"] == "exp-1"
    assert run["runtime_config"]["parameters"] == {"search_params": {"generations": 7, "racing": True},
                                                   "storage_root": "s3://other/runs"}
    assert run["pipeline_spec"]["pipelineInfo"]["name"] == "nightly-prune"
    assert "exec-search" in run["pipeline_spec"]["deploymentSpec"]["executors"]


def test_recurring_run_with_a_cron_schedule_no_catchup_and_one_at_a_time(kfp_api):
    submission = Submission(host=kfp_api, run_name="nightly", schedule="0 3 * * *")
    assert submit(PipelineConfig(**CONFIG), submission) == "rr-1"
    job = _posts()["/apis/v2beta1/recurringruns"]
    assert job["display_name"] == "nightly"
    assert job["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"  # KFP's cron has seconds first
    assert job["max_concurrency"] == "1" or job["max_concurrency"] == 1
    assert job["no_catchup"] is True
    assert job["experiment_id"] == "exp-1"
    assert "/apis/v2beta1/runs" not in _posts()


def test_recurring_run_on_an_interval(kfp_api):
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, interval_seconds=86400, max_concurrency=2, catchup=True))
    job = _posts()["/apis/v2beta1/recurringruns"]
    assert int(job["trigger"]["periodic_schedule"]["interval_second"]) == 86400
    assert int(job["max_concurrency"]) == 2 and job["no_catchup"] is False


@pytest.mark.parametrize("caching", [None, False])
def test_no_task_is_submitted_with_kfp_caching_on(kfp_api, caching):
    """By default the compiled settings go (KFP caching off: our reuse checks storage); --no-cache says so too."""
    submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, caching=caching))
    tasks = _posts()["/apis/v2beta1/runs"]["pipeline_spec"]["root"]["dag"]["tasks"]
    assert tasks and all(task.get("cachingOptions", {}).get("enableCache") is not True for task in tasks.values())


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
    with pytest.raises(ConfigError, match="revision 'v1' applies to hub models"):  # /models/full is a path
        submit(PipelineConfig(**CONFIG), Submission(host=kfp_api, overrides={"revision": "v1"}))
    assert not _posts()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_host_is_one_line_naming_it_before_compiling(monkeypatch):
    compiled = []
    monkeypatch.setattr("evoesap.pipeline.submit.compile_pipeline", lambda *a: compiled.append(a))
    host = f"http://127.0.0.1:{_unused_port()}"
    with pytest.raises(ConfigError, match=f"cannot reach the Kubeflow Pipelines API at {host}.*reachable from this machine"):
        submit(PipelineConfig(**CONFIG), Submission(host=host))
    assert not compiled


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
        "a": 0.5, "b": True, "c": ["reap", "frequency"], "d": "text"}
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["generations"])
