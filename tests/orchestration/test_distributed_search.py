"""Candidate-parallel search (evoesap.method.distributed): gloo workers under torchrun's launcher give the one-process
artifact; a killed worker ends the job in one line and a resumed run finishes to the same result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_world import make_tiny_inputs, search_command

from evoesap.method.distributed import assign, common_prefix, root_failure
from evoesap.stages.cache_logits import CacheLogitsParams, run_cache_logits
from evoesap.stages.calibrate import CalibrateParams, run_calibrate
from evoesap.stages.search import SearchParams, run_search
from evoesap.store import artifacts

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(criterion="reap", sparsity=0.5, population=6, elites=2, generations=2, batch_size=8)
RACING = dict(racing=True, racing_mode="schedule", racing_schedule="0.25,0.5:0.5", racing_min_samples=2, racing_min_positions=8)
STATISTICAL = dict(racing=True, racing_mode="statistical", racing_delta=0.3, racing_min_samples=2)
MODES = {"exact": {}, "racing": RACING, "statistical": STATISTICAL}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    files = make_tiny_inputs(root)
    inputs = {"model": files["model"], "scores": str(root / "scores"), "cache": str(root / "cache")}
    run_calibrate(files["model"], files["calibration"], CalibrateParams(samples=16, max_length=256), inputs["scores"])
    run_cache_logits(
        files["model"], files["search"], CacheLogitsParams(samples=12, max_length=256, dtype="float32"), inputs["cache"]
    )
    return root, inputs


def _one_process(world, name: str, params: SearchParams) -> str:
    root, inputs = world
    out = str(root / f"one-{name}")
    if not Path(out).exists():
        run_search(**inputs, params=params, out_uri=out)
    return out


def _cli(world, out: str, params: SearchParams, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`evoesap -q search ... --workers N` in a fresh process, one CPU thread per worker (`env`: more variables)."""
    _, inputs = world
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    return subprocess.Popen(
        [*search_command(inputs, out, params), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(run: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """stdout and stderr of a launched search once it ended. One still running after `timeout` s is made to print
    every thread's stack (faulthandler, on SIGABRT) into the failure, so that a hang shows where it waits."""
    try:
        return run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGABRT)
        try:
            stdout, err = run.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            run.kill()
            stdout, err = run.communicate()
        pytest.fail(f"the search did not end within {timeout} s (stdout {stdout[-300:]!r}); its stacks:\n{err[-8000:]}")


def _documents(out: str) -> tuple[dict, pd.DataFrame]:
    return json.loads(Path(out, "allocation.json").read_text()), pd.read_parquet(Path(out, "history.parquet"))


@pytest.mark.slow  # each launch starts N fresh interpreters: about 35 s on a shared 2-core machine
@pytest.mark.parametrize("workers, mode", [(2, "exact"), (3, "racing"), (2, "statistical")])
def test_workers_without_prefix_reuse_give_the_one_process_artifact_bit_for_bit(world, tmp_path, workers, mode):
    """Every candidate's forwards run as in one process (same memo, same batches): equal to the last bit,
    the search's cost included (in the manifest, where only the number of workers differs)."""
    params = SearchParams(**SMALL, **MODES[mode], prefix_reuse=False)
    reference = _one_process(world, f"{mode}-scratch", params)
    run = _cli(world, str(tmp_path / "out"), SearchParams(**{**vars(params), "workers": workers}))
    _, err = _finish(run, 170)
    assert run.returncode == 0, err
    (doc, history), (ref_doc, ref_history) = _documents(str(tmp_path / "out")), _documents(reference)
    assert doc == ref_doc
    assert mode != "statistical" or artifacts.read_manifest(str(tmp_path / "out")).run["cost"]["racing"] == "statistical"
    pd.testing.assert_frame_equal(history, ref_history, check_exact=True)
    cost, ref_cost = (artifacts.read_manifest(out).run["cost"] for out in (str(tmp_path / "out"), reference))
    assert (cost.pop("workers"), ref_cost.pop("workers")) == (workers, 1) and cost == ref_cost


@pytest.mark.slow
@pytest.mark.parametrize("workers, mode", [(3, "exact"), (2, "racing")])
def test_workers_with_prefix_reuse_find_the_one_process_search(world, tmp_path, workers, mode):
    """Workers' prefix caches hold other states than the one process's: the same candidates, elites and
    result, fitness equal up to prefix reuse's float rounding (1e-6, as tests/unit/test_scoring_prefix.py)."""
    params = SearchParams(**SMALL, **MODES[mode])
    reference = _one_process(world, mode, params)
    run = _cli(world, str(tmp_path / "out"), SearchParams(**{**vars(params), "workers": workers}))
    _, err = _finish(run, 170)
    assert run.returncode == 0, err
    (doc, history), (ref_doc, ref_history) = _documents(str(tmp_path / "out")), _documents(reference)
    assert doc["removal_counts"] == ref_doc["removal_counts"]
    assert doc["searched"]["fitness"] == pytest.approx(ref_doc["searched"]["fitness"], abs=1e-6)
    pd.testing.assert_frame_equal(history, ref_history, check_exact=False, atol=1e-6, rtol=0)
    assert history[["allocation", "elite"]].equals(ref_history[["allocation", "elite"]])


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
def test_a_killed_worker_ends_the_job_in_one_line_and_resume_finishes_to_the_same_result(world, tmp_path):
    params = SearchParams(**{**SMALL, "generations": 5}, prefix_reuse=False, workers=2)
    reference = _one_process(world, "exact-long", SearchParams(**{**vars(params), "workers": 1}))
    out = str(tmp_path / "out")
    run = _cli(world, out, params)
    checkpoint = Path(f"{out}.checkpoint.json")
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polls a file another process writes; nothing to wait on instead
    assert checkpoint.exists(), run.communicate()[1]
    victim = [pid for pid in _children(run.pid) if _rank_of(pid) == 1]
    assert len(victim) == 1
    os.kill(victim[0], signal.SIGKILL)
    stdout, err = _finish(run, 60)
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert run.returncode == 1 and stdout == ""
    assert len(lines) == 1, err
    assert lines[0].startswith("error: search worker 1 of 2 was killed by SIGKILL") and "resume" in lines[0], lines
    assert not Path(out, "allocation.json").exists()

    again = _cli(world, out, params, "--resume")
    _, err = _finish(again, 170)
    assert again.returncode == 0, err
    (doc, history), (ref_doc, ref_history) = _documents(out), _documents(reference)
    assert doc == ref_doc
    work, ref_work = (artifacts.read_manifest(str(o)).run["cost"] for o in (out, reference))
    assert work["resumed"] and not ref_work["resumed"]  # the manifest's work: a resumed search counts only its own
    pd.testing.assert_frame_equal(history, ref_history, check_exact=True)


class Hooks:
    """The test's end of tests/hooks/sitecustomize.py: a Unix socket each search worker connects to, saying its
    rank and pid, then the moments it reaches (and, where asked, holding there until the connection closes)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="evoesap-hooks-"))  # short: a socket path has 107 bytes at most
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(self.folder / "s"))
        self.server.listen(4)
        self.server.settimeout(170)
        self.links: dict[int, tuple[socket.socket, object, int]] = {}

    def env(self, hooks: str, tmp: Path) -> dict[str, str]:
        tmp.mkdir(exist_ok=True)
        return {
            "PYTHONPATH": f"{ROOT / 'tests' / 'hooks'}{os.pathsep}{ROOT}",
            "EVOESAP_TEST_SOCKET": str(self.folder / "s"),
            "EVOESAP_TEST_HOOKS": hooks,
            "TMPDIR": str(tmp),
        }

    def accept(self, workers: int) -> None:
        for _ in range(workers):
            link, _ = self.server.accept()
            link.settimeout(60)
            reader = link.makefile("r")
            _, rank, _, pid = reader.readline().split()
            self.links[int(rank)] = (link, reader, int(pid))

    def expect(self, rank: int, event: str) -> None:
        assert self.links[rank][1].readline().strip() == event

    def pid(self, rank: int) -> int:
        return self.links[rank][2]

    def ended(self, rank: int) -> bool:
        """Whether worker `rank`'s process has ended (its connection closed) within the links' timeout."""
        try:
            return self.links[rank][1].read() == ""
        except OSError:  # timed out: still running
            return False

    def close(self) -> None:
        for link, reader, pid in self.links.values():
            if Path(f"/proc/{pid}").exists():  # a worker that outlived its launcher (the defect a test catches)
                os.kill(pid, signal.SIGKILL)
            reader.close()
            link.close()
        self.server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def hooks():
    hooks = Hooks()
    yield hooks
    hooks.close()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]


FAST = SearchParams(**{**SMALL, "population": 4, "elites": 1, "generations": 1}, prefix_reuse=False, workers=2)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_its_workers_ends_in_one_line_and_resume_finishes(world, tmp_path, hooks):
    reference = _one_process(world, "fast", SearchParams(**{**vars(FAST), "workers": 1}))
    out, tmp = str(tmp_path / "out"), tmp_path / "tmp"
    run = _cli(world, out, FAST, env=hooks.env("pause-at-generation", tmp))
    hooks.accept(2)
    hooks.expect(0, "generation 1")  # both workers inside the search, generation 0 checkpointed
    run.send_signal(signal.SIGTERM)
    stdout, err = _finish(run, 120)
    assert (run.returncode, stdout) == (128 + signal.SIGTERM, ""), err
    assert _error_lines(err) == [
        "error: search interrupted by SIGTERM: its 2 workers were stopped and nothing was published; the checkpoint "
        "holds generation 0 of 1: re-run with resume to continue"
    ], err
    assert hooks.ended(0) and hooks.ended(1)  # the launcher waited for them: gone before it exited
    assert not Path(out).exists() and list(tmp.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []

    again = _cli(world, out, FAST, "--resume")
    _, err = _finish(again, 170)
    assert again.returncode == 0, err
    (doc, history), (ref_doc, ref_history) = _documents(out), _documents(reference)
    assert doc == ref_doc
    pd.testing.assert_frame_equal(history, ref_history, check_exact=True)


@pytest.mark.slow
def test_a_launcher_killed_outright_takes_its_workers_with_it_and_the_next_run_cleans_up(world, tmp_path, hooks):
    """kill -9 leaves the launcher no moment to stop its workers (they run in sessions of their own): they must
    not go on searching, and publish, beside the run that follows."""
    reference = _one_process(world, "fast", SearchParams(**{**vars(FAST), "workers": 1}))
    out, tmp = str(tmp_path / "out"), tmp_path / "tmp"
    run = _cli(world, out, FAST, env=hooks.env("pause-at-generation", tmp))
    hooks.accept(2)
    hooks.expect(0, "generation 1")
    run.kill()
    _finish(run, 60)
    assert hooks.ended(0) and hooks.ended(1), "a search worker outlived its launcher"
    assert [p.name.startswith("evoesap-search-") for p in tmp.iterdir()] == [True]  # the launcher's, for the next run

    again = _cli(world, out, FAST, "--resume", env={"TMPDIR": str(tmp)})
    _, err = _finish(again, 170)
    assert again.returncode == 0, err
    assert list(tmp.iterdir()) == []
    assert _documents(out)[0] == _documents(reference)[0]


@pytest.mark.slow
def test_a_worker_killed_after_the_artifact_was_published_leaves_a_finished_run_with_a_warning(world, tmp_path, hooks):
    out = str(tmp_path / "out")
    run = _cli(world, out, FAST, env=hooks.env("hold-after-serve", tmp_path / "tmp"))
    hooks.accept(2)
    hooks.expect(0, "published")
    hooks.expect(1, "served")  # rank 0 said stop; rank 1 holds before it exits
    os.kill(hooks.pid(1), signal.SIGKILL)
    stdout, err = _finish(run, 120)
    assert (run.returncode, stdout.strip()) == (0, out), err
    lines = _error_lines(err)
    assert len(lines) == 1 and "search worker 1 of 2 was killed by SIGKILL after the artifact was published" in lines[0], err
    assert "complete" in lines[0]
    artifacts.verify(out, "search")  # every payload file against its manifest


@pytest.mark.slow
def test_a_worker_ends_without_the_interpreters_finalization(world, tmp_path, hooks):
    """A worker whose finalization would abort (a gloo thread releasing a collective's tensors then) still ends a
    finished search cleanly: its process ends once its work is done, without finalizing."""
    reference = _one_process(world, "fast", SearchParams(**{**vars(FAST), "workers": 1}))
    out = str(tmp_path / "out")
    run = _cli(world, out, FAST, env=hooks.env("abort-at-exit", tmp_path / "tmp"))
    hooks.accept(2)
    stdout, err = _finish(run, 170)
    assert (run.returncode, stdout.strip(), _error_lines(err)) == (0, out, []), err
    assert _documents(out)[0] == _documents(reference)[0]


def test_assignment_keeps_owners_follows_the_nearest_parent_and_balances():
    owners = {(2, 2, 0): 1, (0, 2, 2): 0}
    anchors = [(2, 2, 0), (0, 2, 2)]  # fittest first
    batch = [(2, 0, 2), (0, 2, 2), (2, 1, 1), (0, 1, 3), (1, 1, 2), (2, 2, 0)]
    ranks = assign(batch, owners, anchors, 2)
    assert ranks[1] == 0 and ranks[5] == 1  # scored before: back to their workers
    assert ranks[0] == 1 and ranks[2] == 1  # share layer 0 with (2, 2, 0), on worker 1
    assert ranks[3] == 0  # shares layer 0 with (0, 2, 2)
    assert ranks[4] == 0  # no common prefix with any anchor: the least-loaded worker
    assert max(ranks.count(w) for w in (0, 1)) == 3  # an even share each
    assert assign(batch, owners, anchors, 2) == ranks  # a function of its inputs only
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2 and common_prefix((1,), (2,)) == 0


@settings(max_examples=200, deadline=None)
@given(
    workers=st.integers(2, 8),
    data=st.data(),
    culprit_exit=st.sampled_from([-int(signal.SIGKILL), -int(signal.SIGSEGV), 1, 2]),
)
def test_the_failure_named_is_the_one_that_stopped_the_job_not_the_sigterms_it_caused(workers, data, culprit_exit):
    # the launcher SIGTERMs every other worker after the first failure, and a worker in a collective fails with
    # the group (WorkerLost), possibly in the launcher's same poll; its timestamps are whole seconds
    culprit = data.draw(st.integers(0, workers - 1))
    stamps = data.draw(st.lists(st.integers(0, 2), min_size=workers, max_size=workers))
    stamps[culprit] = min(stamps)  # the culprit died first, possibly in the same second as the rest
    lost = data.draw(st.lists(st.booleans(), min_size=workers, max_size=workers))
    culprit_message = "" if culprit_exit < 0 else "ModelError: the model broke"

    def bystander(rank: int) -> SimpleNamespace:
        if lost[rank]:
            return SimpleNamespace(exitcode=1, timestamp=stamps[rank], message="WorkerLost: a collective ... failed")
        return SimpleNamespace(exitcode=-int(signal.SIGTERM), timestamp=stamps[rank], message="")

    failures = {
        rank: SimpleNamespace(exitcode=culprit_exit, timestamp=stamps[rank], message=culprit_message)
        if rank == culprit
        else bystander(rank)
        for rank in range(workers)
    }
    assert root_failure(failures)[0] == culprit
    only_sigterms = {
        rank: SimpleNamespace(exitcode=-int(signal.SIGTERM), timestamp=stamps[rank], message="") for rank in range(workers)
    }
    earliest = min(stamps)
    assert root_failure(only_sigterms)[0] == stamps.index(earliest)  # no other cause: the earliest, then rank
