"""What a hostile user tries on the newer surfaces (publish, quantize, placement, multi-worker search, the pipeline
commands): credentials and secrets in places that print, absurd sizes, endpoints and pythons that never answer,
inputs that vanish mid-run. Each ends in one clear line, before expensive work, with nothing published and no secret
printed or recorded."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import yaml
from test_publish import TOKEN, HubRecorder

from evoesap import data
from evoesap.cli import main
from evoesap.errors import ConfigError, DataError, EvoESAPError, ResourceError
from evoesap.machine import runtime, side_env
from evoesap.stages.evaluate import EvaluateParams

SECRET = "pa55w0rd-do-not-print"


def one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def publish_command(world: dict[str, str], out: Path, *options: str) -> list[str]:
    return ["publish", "--pruned", world["pruned"], "--evaluations", world["evaluated"], "--out", str(out), *options]


class BusyOnceHub(HubRecorder):
    """The Hub stand-in, answering its first request 503 (busy) so that huggingface_hub retries with a warning
    naming the URL."""

    busy = True

    def do_GET(self):  # noqa: N802
        if BusyOnceHub.busy:
            BusyOnceHub.busy = False
            self._reply({"error": "busy"}, 503)
            return
        super().do_GET()


@pytest.fixture
def busy_hub():
    from http.server import ThreadingHTTPServer

    HubRecorder.requests, HubRecorder.repos, HubRecorder.fail_commit, BusyOnceHub.busy = [], {}, False, True
    server = ThreadingHTTPServer(("127.0.0.1", 0), BusyOnceHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_credentials_in_the_hub_endpoint_are_refused_printed_nowhere_and_sent_nowhere(tiny_artifacts, busy_hub, tmp_path):
    out = tmp_path / "published"
    endpoint = f"http://user:{SECRET}@127.0.0.1:{busy_hub}"
    command = publish_command(tiny_artifacts, out, "--repo", "team/x", "--endpoint", endpoint, "--token-env", "HUB_T")
    env = {**os.environ, "HUB_T": TOKEN, "HF_HUB_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-m", "evoesap", "-q", *command], capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"endpoint 'http://127.0.0.1:{busy_hub}' has credentials inside it" in line, line
    assert "kubeflow-secrets.md" in line and SECRET not in done.stdout + done.stderr and TOKEN not in line
    assert HubRecorder.requests == [] and not out.exists()


def test_debug_keeps_library_loggers_at_warning_and_no_secret_value_is_printed(tmp_path):
    script = """
import logging, os, sys
from evoesap.cli import main
main(["--debug", "pipeline", "compile", "--help"])
token = os.environ["AWS_SESSION_TOKEN"]
logging.getLogger("botocore.endpoint").debug("Sending http request: x-amz-security-token=%s", token)
logging.getLogger("urllib3.connectionpool").debug("https://s3 GET with %s", os.environ["AWS_ACCESS_KEY_ID"])
logging.getLogger("s3fs").warning("retrying with token %s", token)
logging.getLogger("evoesap.stages").debug("ours, in debug: s3://key:%s@bucket/x", os.environ["AWS_SECRET_ACCESS_KEY"])
"""
    secrets = {"AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLESESSION", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID",
               "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIEXAMPLEKEY"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, **secrets}, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    for value in secrets.values():
        assert value not in done.stderr + done.stdout, value
    assert "Sending http request" not in done.stderr and "connectionpool" not in done.stderr  # kept at WARNING
    assert "WARNING s3fs: retrying with token ***" in done.stderr  # a warning still shows, scrubbed
    assert "DEBUG evoesap.stages: ours, in debug: s3://bucket/x" in done.stderr  # --debug still shows our debug logs


@pytest.fixture
def silent_endpoint():
    """A TCP endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_hub_endpoint_that_never_answers_fails_in_one_line(tiny_artifacts, silent_endpoint, tmp_path, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import _http

    monkeypatch.setenv("HUB_T", TOKEN)
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    monkeypatch.setattr(_http.time, "sleep", lambda seconds: None)  # huggingface_hub's back-off between its retries
    out = tmp_path / "published"
    result: list[int] = []
    command = publish_command(tiny_artifacts, out, "--repo", "team/x", "--endpoint", silent_endpoint, "--token-env", "HUB_T")
    worker = threading.Thread(target=lambda: result.append(main(["-q", *command])), daemon=True)
    try:
        worker.start()
        worker.join(120)  # without a timeout it waits forever
        assert result == [1], "publish still waiting on an endpoint that never answers"
    finally:
        huggingface_hub.set_client_factory(_http.default_client_factory)
    line = one_line(capsys)
    assert line.startswith("error: reading the Hub repository team/x failed") and "no answer within 1 s" in line
    assert "HF_HUB_DOWNLOAD_TIMEOUT" in line and not out.exists()


def test_a_side_python_that_never_answers_is_refused_and_stopped(tmp_path, monkeypatch):
    from evoesap.release.quantize_env import PYTHON_ENV, quantize_python

    pid_file = tmp_path / "pid"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    python.chmod(0o755)
    monkeypatch.setenv(PYTHON_ENV, str(python))
    monkeypatch.setattr(side_env, "CHECK_TIMEOUT_S", 0.5)
    with pytest.raises(ConfigError, match=f"{PYTHON_ENV}=.* did not answer within 0.5 s"):
        quantize_python()
    with pytest.raises(ProcessLookupError):  # stopped, not left behind
        os.kill(int(pid_file.read_text()), 0)


def test_search_workers_beyond_the_cpu_cores_are_refused_before_any_work(tiny_artifacts, tmp_path, capsys, monkeypatch):
    from evoesap.method import distributed

    def launch(*args, **kwargs):
        raise AssertionError("a billion workers were launched")

    monkeypatch.setattr(distributed, "launch", launch)
    out = tmp_path / "search"
    w = tiny_artifacts
    code = main(["-q", "search", "--model", w["model"], "--scores", w["scores"], "--cache", w["cache"], "--out", str(out),
                 "--criterion", "reap", "--sparsity", "0.5", "--device", "cpu", "--workers", "1000000000"])  # fmt: skip
    line = one_line(capsys)
    assert code == 1 and line.startswith("error: workers = 1000000000 processes on the CPU"), line
    assert f"at most {runtime.CPU_OVERSUBSCRIPTION * len(os.sched_getaffinity(0))}" in line and not out.exists()


def test_a_jsonl_line_over_the_bound_is_refused_by_its_number_without_holding_the_file(tmp_path):
    source = tmp_path / "data.jsonl"
    ok = json.dumps({"text": "a short sample"})
    with open(source, "w") as f:
        f.write(ok + "\n" + json.dumps({"text": "x" * (2 * data.MAX_LINE_BYTES)}) + "\n" + ok + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"data.jsonl line 2 is longer than 16 MiB"):
            data.load_samples(str(source), fields=data.FieldMap(text="text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * data.MAX_LINE_BYTES  # bounded by the line bound (readline's copies), not by the 32 MiB line


@pytest.mark.parametrize(
    "row,message",
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 50_000},
         "100000 messages, more than the 1024"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * (5 << 20)}]},
         "5242881 characters, more than the 4194304"),
        ({"text": "t" * (5 << 20)}, "5242880 characters, more than the 4194304"),
    ],
)  # fmt: skip
def test_a_sample_of_absurd_turns_or_length_is_refused_before_tokenising(tmp_path, row, message):
    source = tmp_path / "data.json"  # one JSON document: no line bound applies
    source.write_text(json.dumps([row]))
    fields = data.FieldMap(text="text") if "text" in row else data.FieldMap()
    with pytest.raises(DataError, match=f"data.json row 0: {message}"):
        data.load_samples(str(source), fields=fields)


def test_compile_output_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("a user's file\n")
    config = Path(__file__).parents[2] / "examples" / "demo.yaml"
    assert main(["pipeline", "compile", str(config), "-o", str(afile / "x")]) == 1
    line = one_line(capsys)
    assert line.startswith("error: --output") and f"lies under {afile}, which is a file" in line
    assert afile.read_text() == "a user's file\n"


@pytest.mark.parametrize("label", ["a/b", "../../etc", "<script>", "", "x" * 65, "searched run"])
def test_a_report_label_outside_the_safe_characters_is_refused(label):
    for name in ("method", "criterion"):
        with pytest.raises(ConfigError, match=f"{name} label"):
            EvaluateParams(tasks=("mc",), **{name: label})
    assert EvaluateParams(tasks=("mc",), method="searched", criterion="frequency-heuristic_2.0+x").method == "searched"


@pytest.mark.parametrize("device_map", ["foo", "/tmp", "cuda:0", "cpu", ""])
def test_a_device_map_that_is_not_a_placement_strategy_is_refused(device_map):
    with pytest.raises(ConfigError, match="device_map .* is not one of auto, balanced"):
        EvaluateParams(tasks=("mc",), device_map=device_map)


def test_a_gpu_memory_budget_on_a_machine_without_gpus_is_refused_not_sent_to_the_disk():
    with pytest.raises(ResourceError, match="max_memory 1B caps what each GPU holds, but this machine shows no GPU"):
        runtime.placement_kwargs("cpu", "auto", "1B", free={"cpu": 1 << 30})
    offloaded = runtime.placement_kwargs("cpu", "auto", "1B", offload=True, free={"cpu": 1 << 30})
    assert offloaded == {"device_map": "auto", "max_memory": {"cpu": 1 << 30}}  # the host holds it: it loads


@pytest.mark.parametrize("when", ["before loading", "once loaded"])
def test_evaluate_while_its_model_directory_is_deleted_fails_in_one_line(tiny_artifacts, tmp_path, capsys, monkeypatch, when):
    from evoesap import moe

    model = tmp_path / "model"
    shutil.copytree(tiny_artifacts["pruned"], model)
    target, name = (moe, "load_pruned") if when == "before loading" else (runtime, "load_model")
    original = getattr(target, name)

    def deleting(*args, **kwargs):
        if when == "before loading":  # checked and verified, then its weights vanish
            for weights in model.glob("*.safetensors"):
                weights.unlink()
            return original(*args, **kwargs)
        loaded = original(*args, **kwargs)
        shutil.rmtree(model)
        return loaded

    monkeypatch.setattr(target, name, deleting)
    out = tmp_path / "evaluated"
    code = main(["-q", "evaluate", "--model", str(model), "--tasks", tiny_artifacts["tasks"], "--limit", "2",
                 "--device", "cpu", "--out", str(out)])  # fmt: skip
    line = one_line(capsys)
    assert code == 1 and line.startswith("error: ") and str(model) in line, line
    assert not out.exists()


def test_a_failed_pipeline_run_names_the_task_and_its_own_error_in_one_line(tiny_artifacts, tmp_path, capsys):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.run import run_local
    from kfp import dsl

    def check_input(value: str):
        raise ValueError(f"the input {value} is not usable")

    check_input.__annotations__ = {"value": str}  # kfp reads the types, not this module's postponed strings
    check_input = dsl.component(check_input, base_image="python:3.11", install_kfp_package=False)

    @dsl.pipeline(name="breaks")
    def breaks():
        check_input(value="x-1")

    w = tiny_artifacts
    config = {"name": "tiny", "model": w["model"], "calibration_data": w["calibration"], "search_data": w["search"],
              "storage_root": str(tmp_path / "artifacts"), "pipeline_root": str(tmp_path / "kfp")}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "pipeline.log"
    with pytest.raises(EvoESAPError) as raised:
        run_local(load_config(tmp_path / "c.yaml"), log_path=log, build=lambda _: breaks)
    message = str(raised.value)
    assert message == (
        f"pipeline 'tiny' failed at task 'check-input': ValueError: the input x-1 is not usable; the tasks' full "
        f"logs are in {log}"
    )
    assert "\x1b" not in capsys.readouterr().err


def test_the_quick_demo_profile_offers_only_points_it_can_search_and_quantize(tmp_path):
    from evoesap.pipeline.dag import compile_pipeline
    from evoesap.pipeline.demo import demo_config
    from tiny_world import quick_world_config

    from evoesap.demo.world import DemoWorld
    from evoesap.stages.quantize import RECIPES, check_widths

    model = quick_world_config(tmp_path / "quick")
    root = tmp_path / "world"
    world = DemoWorld(root=root, model_dir=model, data_dir=root / "data", tasks_dir=root / "tasks", generative_tasks=(),
                      multiple_choice_tasks=(), tag="", seed=0, profile="quick", key="", info={})  # fmt: skip
    config = demo_config(world, tmp_path / "demo")
    compile_pipeline(config, tmp_path / "spec.yaml")  # every criterion x sparsity is checked against config.json here
    recipe = RECIPES[config.stage_params("quantize")["recipe"]]
    check_widths(json.loads((model / "config.json").read_text()), recipe, str(model))  # as the quantize stage does


@pytest.mark.parametrize(
    "python,message",
    [("/tmp", "is not an executable python"), ("/bin/false", "is not a python (it exited 1, saying nothing)")],
)
def test_a_side_python_that_is_a_directory_or_not_a_python_is_refused_in_one_line(monkeypatch, python, message):
    from evoesap.release.quantize_env import PYTHON_ENV, quantize_python

    monkeypatch.setenv(PYTHON_ENV, python)
    with pytest.raises(ConfigError, match=f"{PYTHON_ENV}={python} {re.escape(message)}"):
        quantize_python()


@pytest.mark.parametrize("device", ["xla", "meta", "hpu"])
def test_a_device_torch_names_but_the_stages_do_not_run_on_is_refused(device):
    with pytest.raises(ConfigError, match=f"device '{device}' is not supported"):
        runtime.check_device(device)


@pytest.mark.parametrize("endpoint", ["file:///etc/passwd", "notaurl", "http://u:p@", "ftp://hub.example.org"])
def test_a_hub_endpoint_that_is_not_an_http_url_is_refused_without_its_credentials(endpoint):
    from evoesap.stages.publish import PublishParams

    with pytest.raises(ConfigError, match="is not an http\\(s\\):// URL of a Hub") as raised:
        PublishParams(repo="team/x", endpoint=endpoint)
    assert "u:p@" not in str(raised.value)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan"])
def test_a_hub_timeout_that_is_not_a_positive_number_is_refused_before_any_request(value, monkeypatch):
    from evoesap.release import hub

    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", value)
    with pytest.raises(ConfigError, match=f"HF_HUB_DOWNLOAD_TIMEOUT='{value}' is not a positive number of seconds"):
        hub.check_target("team/x", [], endpoint="http://127.0.0.1:9", secret=TOKEN)


def test_gpus_per_worker_on_the_cpu_is_refused_before_anything_is_sized(tiny_artifacts, tmp_path, capsys):
    w = tiny_artifacts
    code = main(["-q", "search", "--model", w["model"], "--scores", w["scores"], "--cache", w["cache"], "--out",
                 str(tmp_path / "s"), "--criterion", "reap", "--sparsity", "0.5", "--device", "cpu", "--device-map",
                 "auto", "--gpus-per-worker", "1000000000"])  # fmt: skip
    line = one_line(capsys)  # it built a list of 10^9 GPU numbers (all host memory) before
    assert code == 1 and line.startswith("error: gpus_per_worker=1000000000 spreads each worker's replica over GPUs")


def test_an_output_the_file_system_refuses_is_one_line_not_an_internal_error(tiny_artifacts, capsys):
    w = tiny_artifacts
    code = main(["-q", "prune", "--model", w["model"], "--scores", w["scores"], "--out", "/proc/evoesap-x",
                 "--criterion", "reap", "--sparsity", "0.5"])  # fmt: skip
    line = one_line(capsys)
    assert code == 1 and line.startswith("error: /proc/") and "give a place this user can read and write" in line
