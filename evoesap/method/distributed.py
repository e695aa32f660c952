"""Candidate-parallel search: a generation's candidates scored on N processes, each with its own model replica.

`run_search` with `workers > 1` calls `launch`, which starts N processes through torch.distributed's
elastic launcher (what `torchrun` runs; gloo on the CPU, nccl on GPUs, one GPU per local rank), each
running `evoesap.stages.search_workers` (this module imports no stage). Rank 0, the coordinator, runs the search (`evoesap.method.search`, unchanged) and alone writes
the checkpoint and the artifact; every rank, rank 0 included, scores a share of each batch.

Protocol, one round per batch the search asks for (`score_batch`: a generation's new candidates, or one
racing level's entrants; with statistical racing also `sample_batch`, each candidate's per-sample values on the
race order's first samples): rank 0 broadcasts the batch with each candidate's worker (`assign`), each rank
scores its own candidates in batch order, and an all-gather of one float64 vector per rank gives every
value (per-sample values: a row of them) to rank 0, which takes each candidate's from its worker. The assignment depends only on the batch
and on earlier batches, never on timing, so the search sees the same values in the same order as in
one process: a candidate goes back to the worker that scored it before (its per-sample scores are
memoised there, so a racing survivor runs only the samples it lacks, as in one process), else to the
worker holding the fittest earlier allocation with which it shares the longest run of leading layers
(the parent whose cached hidden states its forward can start from, `evoesap.scoring.prefix`) while
that worker has less than an even share, else to the least-loaded worker.

Failure: a worker that dies (even by kill -9) ends the job: the launcher stops the others and
`launch` raises one error naming the worker, the cause and the generation the checkpoint holds; a
re-run with `resume` continues from there. Collectives also time out after `TIMEOUT`. A signal to the
launcher (SIGTERM, Ctrl-C) is forwarded to the workers, which it waits for, then ends in one such error;
a launcher killed outright takes its workers with it (`evoesap.stages.search_workers`), so none outlives
it to publish beside a re-run. A failure after the coordinator published the artifact is not one: the
artifact, verified, is returned with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from evoesap import errors
from evoesap.method import search
from evoesap.store import artifacts

log = logging.getLogger(__name__)

Allocation = tuple[int, ...]
# a collective waits at most this long: one generation's share of scoring on one worker must fit in it
TIMEOUT = datetime.timedelta(hours=2)


def joined() -> bool:
    """Whether this process is one of several in a torch.distributed group (started by `launch`)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def worker_gpus(gpus_per_worker: int) -> list[int]:
    """The GPUs of this worker's group: local rank r holds GPUs r*g .. r*g+g-1 of its node (one process alone:
    rank 0), so the groups of a node's workers never overlap."""
    first = int(os.environ.get("LOCAL_RANK", "0")) * gpus_per_worker
    return list(range(first, first + gpus_per_worker))


def threads_per_worker(workers: int) -> int:
    """CPU threads per worker: the cores this process may use, split evenly (at least one), so that the
    workers' thread pools do not oversubscribe the cores and spin-wait on each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def common_prefix(a: Allocation, b: Allocation) -> int:
    """Leading layers on which two allocations agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assign(
    batch: Sequence[Allocation], owners: Mapping[Allocation, int], anchors: Sequence[Allocation], workers: int
) -> list[int]:
    """The worker of each allocation of `batch` (see the module docstring); `anchors`: earlier allocations,
    fittest first, whose cached states a child may start from."""
    share = -(-len(batch) // workers)  # an even share, rounded up
    load = [0] * workers
    out = []
    for r in batch:
        worker = owners.get(r)
        if worker is None:
            near = max(anchors, key=lambda a: common_prefix(a, r), default=None)  # first (fittest) on ties
            if near is not None and common_prefix(near, r) > 0 and load[owners[near]] < share:
                worker = owners[near]
            else:
                worker = min(range(workers), key=lambda w: (load[w], w))
        load[worker] += 1
        out.append(worker)
    return out


class Coordinator:
    """Rank 0's side of the protocol: the search's `score_batch` and the workers' cost totals."""

    def __init__(self, scoring: Any, device: Any) -> None:
        import torch.distributed as dist

        self.scoring = scoring
        self.device = device
        self.workers = dist.get_world_size()
        self.keep = max(1, scoring.evaluator.prefix.keep if scoring.evaluator.prefix is not None else 1)
        self.owners: dict[Allocation, int] = {}
        self.fitness: dict[Allocation, float] = {}  # full-set fitness of every allocation scored so far

    def score_batch(self, rs: Sequence[Allocation], level: int | None, generation: int) -> list[float]:
        batch = [tuple(int(x) for x in r) for r in rs]
        anchors = sorted(self.fitness, key=lambda a: -self.fitness[a])[: self.keep]  # stable: first seen on ties
        ranks = assign(batch, self.owners, anchors, self.workers)
        _broadcast(("score", batch, level, generation, ranks))
        values = _score_share(self.scoring, batch, level, generation, ranks, self.device)
        self.owners.update(zip(batch, ranks))
        if level is None:
            self.fitness.update(zip(batch, values))
        return values

    def sample_batch(self, rs: Sequence[Allocation], count: int | None) -> list[Any]:
        """Per-sample fitness on the race order's first `count` samples (statistical racing), assigned as `score_batch`."""
        batch = [tuple(int(x) for x in r) for r in rs]
        anchors = sorted(self.fitness, key=lambda a: -self.fitness[a])[: self.keep]
        ranks = assign(batch, self.owners, anchors, self.workers)
        _broadcast(("samples", batch, count, ranks))
        values = _sample_share(self.scoring, batch, count, ranks, self.device)
        self.owners.update(zip(batch, ranks))
        return values

    def totals(self) -> dict[str, int]:
        """The search's cost summed over the workers (the prefix cache's budget and peak: the largest one's)."""
        _broadcast(("totals",))
        every = _gather_totals(self.scoring, self.device)
        summed = {key: sum(t[key] for t in every) for key in ("work", "forwards", "workers")}
        return {**summed, **{key: max(t[key] for t in every) for key in ("prefix_budget", "prefix_peak")}}

    def close(self) -> None:
        _broadcast(("stop",))


@contextlib.contextmanager
def scorer(scoring: Any) -> Iterator[Any]:
    """The search's scorer: `scoring` itself in one process, the coordinator in a group (rank 0 only)."""
    if not joined():
        yield scoring
        return
    coordinator = Coordinator(scoring, _device())
    yield coordinator
    coordinator.close()  # not after an error: the launcher stops the workers when this process fails


def serve(scoring: Any) -> None:
    """A worker's loop (ranks > 0): score this rank's share of every batch until rank 0 says stop."""
    device = _device()
    while True:
        message = _broadcast(None)
        if message[0] == "stop":
            return
        if message[0] == "totals":
            _gather_totals(scoring, device)
        elif message[0] == "samples":
            _, batch, count, ranks = message
            _sample_share(scoring, batch, count, ranks, device)
        else:
            _, batch, level, generation, ranks = message
            _score_share(scoring, batch, level, generation, ranks, device)


def _device() -> Any:
    """Where this rank's collectives run: its GPU with nccl, the host with gloo."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast(message: Any) -> Any:
    import torch.distributed as dist

    box = [message]
    with _collective():
        dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _collective() -> Iterator[None]:
    """A failed collective is the consequence of another worker's end (or silence): raised as `WorkerLost`, so the
    launcher names the worker that ended, not this one, when both fail within the same poll."""
    try:
        yield
    except RuntimeError as exc:  # what gloo and nccl raise (torch's DistError included) when a member is gone
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise errors.WorkerLost(f"a collective of the search group failed ({detail[:300]})") from exc


def _score_share(
    scoring: Any, batch: list[Allocation], level: int | None, generation: int, ranks: list[int], device: Any
) -> list[float]:
    """Score this rank's candidates of `batch` in batch order; every rank's values, each from its worker."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = torch.zeros(len(batch), dtype=torch.float64)  # [n] float64: a float's bits survive the round trip
    for i, (r, w) in enumerate(zip(batch, ranks)):
        if w == rank:
            mine[i] = scoring.score(r, level, generation)
    every = [torch.empty(len(batch), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    with _collective():
        dist.all_gather(every, mine.to(device))
    table = torch.stack(every).cpu()  # [workers, n]
    return [float(table[w, i]) for i, w in enumerate(ranks)]


def _sample_share(scoring: Any, batch: list[Allocation], count: int | None, ranks: list[int], device: Any) -> list[Any]:
    """`_score_share` for per-sample values: a [n, count] float64 table per rank, each row from its worker."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    width = len(scoring.race_order) if count is None else count
    mine = torch.zeros((len(batch), width), dtype=torch.float64)  # [n, count] float64
    for i, (r, w) in enumerate(zip(batch, ranks)):
        if w == rank:
            mine[i] = torch.from_numpy(scoring.samples(r, count))
    every = [torch.empty((len(batch), width), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    with _collective():
        dist.all_gather(every, mine.to(device))
    table = torch.stack(every).cpu()  # [workers, n, count]
    return [table[w, i].numpy() for i, w in enumerate(ranks)]


def _gather_totals(scoring: Any, device: Any) -> list[dict[str, int]]:
    import torch
    import torch.distributed as dist

    keys = ("work", "forwards", "workers", "prefix_budget", "prefix_peak")
    own = scoring.totals()
    mine = torch.tensor([own[k] for k in keys], dtype=torch.float64, device=device)  # [5] exact below 2**53
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with _collective():
        dist.all_gather(every, mine)
    return [dict(zip(keys, (int(v) for v in t.cpu().tolist()))) for t in every]


# -------------------------------------------------------------------------------------------------
# Launching (the calling process) and the workers' entry point


def launch(entry: str, inputs: Mapping[str, Any], params: Any, out_uri: str, checkpoint: str) -> artifacts.Manifest:
    """Run `python -m <entry> SPEC` on `params.workers` processes (torch.distributed's elastic launcher, as
    torchrun); return the manifest they publish, or raise one error naming the worker that failed (or the
    signal that stopped the launcher) and why and how far `checkpoint` got."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    before = artifacts.occupant(out_uri, "search")
    spec = {**worker_spec(inputs, params, out_uri), "launcher": os.getpid()}
    threads = str(threads_per_worker(params.workers))
    log.info("search on %d workers, %s CPU threads each", params.workers, threads)
    try:
        with (
            _signals_stop_the_workers(SignalException),
            artifacts.owned_tempdir("search") as tmp,  # a killed launcher's: removed by the next run
            _quiet_launcher(),
            _environment(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads),
        ):
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=params.workers,
                run_id=f"evoesap-search-{uuid.uuid4().hex[:8]}",
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",  # torchrun --standalone: a free local port
                max_restarts=0,
                monitor_interval=0.1,
                start_method="spawn",
                logs_specs=DefaultLogsSpecs(log_dir=str(tmp / "logs")),  # the workers' error files; else a TMPDIR leak
            )
            path = tmp / "search.json"
            path.write_text(json.dumps(spec))
            elastic_launch(config, sys.executable)("-m", entry, str(path))
    except (ChildFailedError, SignalException) as exc:
        published = _published(out_uri, inputs, params, before)
        if published is None:
            raise _failure(exc, params, checkpoint) from None
        log.warning(
            "%s after the artifact was published at %s; it is complete (every file checked against its manifest)",
            _event(exc, params),
            artifacts.redact(out_uri),
        )
        search.remove_checkpoint(checkpoint)  # the coordinator removes it after the publish, unless stopped first
        return published
    return artifacts.read_manifest(out_uri)


def _published(out_uri: str, inputs: Mapping[str, Any], params: Any, before: str) -> artifacts.Manifest | None:
    """The artifact this launch's coordinator published at `out_uri` (not what was there `before`), with every
    file checked against its manifest and made from these parameters and inputs; None when there is none."""
    from evoesap.params import keyed

    try:
        if artifacts.occupant(out_uri, "search") == before:
            return None
        manifest = artifacts.verify(out_uri, "search")
        key = artifacts.cache_key("search", keyed(params), artifacts.describe_inputs(inputs))
    except errors.EvoESAPError:
        return None
    return manifest if manifest.cache_key == key else None


def worker_spec(inputs: Mapping[str, Any], params: Any, out_uri: str) -> dict[str, Any]:
    """What every worker reads (`evoesap.stages.search_workers`): the stage's inputs, parameters and output, and
    this process's logging, the same whether `launch` or a cluster job (`evoesap.pipeline.trainjob`) starts them."""
    from evoesap.progress import is_quiet

    return {
        "inputs": dict(inputs),
        "params": dataclasses.asdict(params),
        "out_uri": out_uri,
        "log_level": logging.getLogger().getEffectiveLevel(),
        "quiet": is_quiet(),
    }


def _failure(exc: Any, params: Any, checkpoint: str) -> errors.EvoESAPError:
    """One error for a failed worker or a signal to the launcher: which, why, and how far the checkpoint got."""
    if not hasattr(exc, "failures"):  # torch's SignalException: the launcher stopped the workers, which have ended
        return errors.Interrupted(
            f"{_event(exc, params)} and nothing was published{_progress(params, checkpoint) or '; re-run to start again'}",
            int(exc.sigval),
        )
    rank, failure = root_failure(exc.failures)
    message = _message(failure)
    kind, _, detail = message.partition(": ")
    cls = getattr(errors, kind, None)
    if failure.exitcode > 0 and isinstance(cls, type) and issubclass(cls, errors.EvoESAPError) and cls is not errors.Interrupted:
        return cls(f"search worker {rank} of {params.workers}: {detail.splitlines()[0] if detail else message}")
    return errors.EvoESAPError(f"{_event(exc, params)}, which stopped the search{_progress(params, checkpoint)}")


def _event(exc: Any, params: Any) -> str:
    """What ended the launch, in a few words: the worker that failed and how, or the signal the launcher got."""
    if not hasattr(exc, "failures"):
        return f"search interrupted by {signal.Signals(exc.sigval).name}: its {params.workers} workers were stopped"
    rank, failure = root_failure(exc.failures)
    message = _message(failure)
    cause = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else (f"failed ({message.splitlines()[0] if message else f'exit code {failure.exitcode}'})")
    )
    return f"search worker {rank} of {params.workers} {cause}"


def _message(failure: Any) -> str:
    return failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)


def _progress(params: Any, checkpoint: str) -> str:
    """How far the checkpoint got, and how to continue from there ("" without one)."""
    if not artifacts.exists(checkpoint):
        return ""
    generation = json.loads(artifacts.read_bytes(checkpoint).decode("utf-8"))["generation"]
    return f"; the checkpoint holds generation {generation} of {params.generations}: re-run with resume to continue"


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that stopped the job, not the ones it caused: once one worker fails the launcher
    SIGTERMs the rest, and its timestamps are whole seconds, so the earliest (torch's own choice) often
    names a bystander. A failure other than SIGTERM comes first, and of those one that is not a lost worker's
    consequence (`WorkerLost`); then the earliest, then the lowest rank."""
    sigterm = -int(signal.SIGTERM)
    lost = f"{errors.WorkerLost.__name__}:"

    def order(r: int) -> tuple[bool, bool, int, int]:
        failure = failures[r]
        return (failure.exitcode == sigterm, _message(failure).startswith(lost), failure.timestamp, r)

    rank = min(failures, key=order)
    return rank, failures[rank]


SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torch's launcher forwards to the workers


@contextlib.contextmanager
def _signals_stop_the_workers(exception: type[BaseException]) -> Iterator[None]:
    """While the launcher runs: a signal raises `exception` (torch's `SignalException`, what its launcher raises
    once it has forwarded the signal to the workers and waited for them), from the start, before the launcher
    installs its own handlers; after, this process's handlers as they were (the launcher leaves its own)."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise exception(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    previous = {sig: signal.getsignal(sig) for sig in (getattr(signal, name) for name in SIGNALS)}
    for sig in previous:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher's own logging off while it runs: `launch` reports a failure in one line."""
    loggers = [
        logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict) if name.startswith("torch.distributed")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Variables the workers inherit, unless the user set them."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
