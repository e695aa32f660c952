"""Shared fixtures: the trained demo world (its shipped weights), built once and cached across test sessions."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from venv_support import venv_python

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Every model the tests build is tiny: one intra-op thread, as evoesap.machine.runtime chooses for tiny models
    (two threads spin-wait for each other whenever other processes hold the cores)."""
    from evoesap.machine import runtime

    runtime.use_cpu_threads(parameters=0)
    # the weights' digests (`evoesap.store.digest_cache`) of this session's stage processes, never the user's own cache
    os.environ.setdefault("EVOESAP_DIGEST_CACHE", str(REPO / ".cache" / "digests.sqlite"))


def needs_world(item: pytest.Item) -> bool:
    return "demo_world" in getattr(item, "fixturenames", ())


GROUPS = ("unit", "stages", "orchestration", "system")  # the folders under tests/, each a marker (`pytest -m unit`)
# a test module may reuse another's helpers (test_serving imports test_moe's): importable from every folder
sys.path[:0] = [str(Path(__file__).parent / group) for group in GROUPS]
SIDE_ENV_MODULES = {"test_quantize", "test_serving", "test_serving_demo", "test_register"}  # every test runs a tool's own venv
SIDE_ENV_CALLS = ("quantize_python()", "vllm_python()", "venv_python(")  # a test that asks for one (venv_support.py)


def uses_side_env(item: pytest.Item) -> bool:
    """Whether the test runs vLLM, llm-compressor or MLflow from their own venvs: by its module, its quantized-model
    fixture, or a call for one of those pythons in its body."""
    import inspect

    if item.module.__name__ in SIDE_ENV_MODULES or {"tiny_quantized", "mlflow_server"} & set(getattr(item, "fixturenames", ())):
        return True
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return False
    return any(call in source for call in SIDE_ENV_CALLS)


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its folder's group, and `side_env` when it runs vLLM, llm-compressor or MLflow from their own
    venvs. Tests that need the demo world run last: under pytest-xdist (`make test` runs two workers) the world
    trains meanwhile in a process of its own (`pytest_sessionstart`), so no worker waits for it."""
    for item in items:
        group = Path(str(item.fspath)).parent.name
        if group in GROUPS:
            item.add_marker(group)
        if isinstance(item, pytest.Function) and uses_side_env(item):
            item.add_marker("side_env")
    items.sort(key=needs_world)  # stable: each part keeps its order


DEMO_WORLD = {"seed": 0, "profile": "default"}  # the world the tests use, built by the fixture or in the background
_WORLD_BUILD: list = []  # the controller's background build of the demo world, when pytest-xdist runs


def pytest_sessionstart(session):
    """With xdist workers, start building the demo world at once, in the background (seconds from its shipped
    weights; minutes of training where the code no longer builds the recorded world): its file lock makes a
    worker that reaches `demo_world` first wait, then reuse it."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import subprocess
    import sys

    code = f"import sys; from evoesap.demo import build_demo_world; build_demo_world(sys.argv[1], **{DEMO_WORLD!r})"
    _WORLD_BUILD.append(
        subprocess.Popen(
            [sys.executable, "-c", code, str(demo_cache_dir())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    )


def pytest_sessionfinish(session):
    """A build still running when the session ends (an aborted run) is stopped; its staging is left for the
    next build to replace. Its failures surface in the `demo_world` fixture, which builds again."""
    for build in _WORLD_BUILD:
        if build.poll() is None:
            build.terminate()
            build.wait(timeout=60)


def demo_cache_dir() -> Path:
    """EVOESAP_DEMO_CACHE (when set and not empty), else <repo>/.cache/demo-world (gitignored), so local reruns
    reuse the build."""
    return Path(os.environ.get("EVOESAP_DEMO_CACHE") or REPO / ".cache" / "demo-world")


@pytest.fixture(scope="session")
def demo_world():
    """The default demo world (seed 0); the first session on a machine builds it, later ones reuse it."""
    from evoesap.demo import build_demo_world

    return build_demo_world(demo_cache_dir(), **DEMO_WORLD)


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """One artifact of every stage from a tiny random OLMoE (tests/tiny_artifacts.py), built once per session."""
    from tiny_artifacts import build

    return build(tmp_path_factory.mktemp("tiny-artifacts"))


@pytest.fixture(scope="session")
def released(tiny_artifacts, tmp_path_factory) -> dict[str, str]:
    """The tiny artifacts plus the full model's evaluation, a passing verdict, and the searched model published
    with it and pushed to an fsspec URI (the release's location for others): what a model registry is handed."""
    from tiny_artifacts import evaluate_params

    from evoesap.stages.evaluate import run_evaluate
    from evoesap.stages.gate import GateParams, run_gate
    from evoesap.stages.publish import PublishParams, run_publish

    root = tmp_path_factory.mktemp("released")
    out = dict(tiny_artifacts)
    out["evaluated_full"], out["gate"], out["published"] = (str(root / n) for n in ("evaluated_full", "gate", "published"))
    out["to"] = f"memory://releases-{root.name}/olmoe-pruned"
    run_evaluate(out["model"], evaluate_params(out["tasks"], method="full"), out["evaluated_full"])
    run_gate(out["evaluated"], out["evaluated_full"], GateParams(max_task_drop=1.0), out["gate"])
    run_publish(out["pruned"], [out["evaluated"], out["evaluated_full"]], PublishParams(to=out["to"]), out["published"],
                search=out["search_out"], gate=out["gate"])  # fmt: skip
    return out


@pytest.fixture(scope="session")
def tiny_quantized(tiny_artifacts, tmp_path_factory):
    """The tiny artifacts plus the full model's evaluation, the searched pruned model quantized (fp8-dynamic, by
    llm-compressor from .venv-quantize) and its evaluation, and a report of the three evaluations."""
    from tiny_artifacts import quantized_build

    return quantized_build(tiny_artifacts, tmp_path_factory.mktemp("tiny-quantized"))


@pytest.fixture
def s3(monkeypatch):
    """A real S3 endpoint (moto's threaded server on loopback) that a test can stop and start again, keeping its data."""
    import socket

    import fsspec
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    # the server's data lives in this process, shared by every test: a bucket name of its own (a port is reused)
    bucket = f"evoesap-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    try:
        yield server, fs, bucket
    finally:
        fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
        server.stop()


STARTUP_S = 300  # the first start creates the SQLite schema; on a busy machine that takes a while


def mlflow_python() -> str:
    return venv_python("EVOESAP_MLFLOW_PYTHON", ".venv-mlflow", "mlflow-venv", "MLflow", "mlflow")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """A real MLflow tracking server with its model registry on SQLite, on a free port; yields its URL."""
    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [mlflow_python(), "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready, output = threading.Event(), []

    def watch() -> None:  # the server says when it listens; no polling
        for line in server.stdout:
            output.append(line)
            if "Uvicorn running on" in line or "Listening at" in line:
                ready.set()
        ready.set()  # it ended

    threading.Thread(target=watch, daemon=True).start()
    try:
        if not ready.wait(STARTUP_S) or server.poll() is not None:
            pytest.fail(f"mlflow server did not start: {''.join(output)[-2000:]}")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and the uvicorn worker it starts
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture
def s3_bucket(monkeypatch):
    """A real S3 endpoint (moto_server on loopback) with one bucket, used through s3fs."""
    moto_server = Path(sys.executable).with_name("moto_server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [str(moto_server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
        }.items():
            monkeypatch.setenv(name, value)
        import fsspec

        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("evoesap-test")
        yield "s3://evoesap-test"
    finally:
        import fsspec

        fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
        server.terminate()
        server.wait()
