"""The processes of a multi-worker search (`python -m evoesap.stages.search_workers SPEC`, started by
`evoesap.method.distributed.launch` under torch's elastic launcher, or by `torchrun -m` in the pods of a Kubeflow Trainer
job, `evoesap.pipeline.trainjob`): join the group, then rank 0 runs the search stage and the other ranks serve its
batches. SPEC is a JSON file, or the JSON itself (a job's pods share no file). Kept apart from
`evoesap.method.distributed` (the protocol), which imports no stage."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from evoesap import errors
from evoesap.method import distributed

log = logging.getLogger(__name__)
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath


def main(argv: Sequence[str] | None = None) -> None:
    """One worker: an error is recorded for the launcher, which reports it in one line."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    (source,) = sys.argv[1:] if argv is None else argv
    spec = json.loads(source if source.lstrip().startswith("{") else Path(source).read_text())
    try:
        _die_with(spec.get("launcher"))
        _run(spec)
    except BaseException as exc:  # noqa: BLE001 (recorded, then this process exits non-zero)
        ErrorHandler().record_exception(exc)
        _termination_message(exc)
        log.debug("worker failed", exc_info=True)
        sys.exit(1)


def _die_with(launcher: int | None) -> None:
    """Started by `evoesap.method.distributed.launch` (process `launcher`): end when it ends, even killed -9, when it
    cannot stop its workers itself (they run in sessions of their own), so none outlives it to publish
    beside a re-run. Linux only (elsewhere a killed launcher's workers end at their collectives' timeout)."""
    if launcher is None or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:  # it ended before the line above
        raise errors.EvoESAPError(f"the search launcher (process {launcher}) ended before this worker started")


PR_SET_PDEATHSIG = 1


def _termination_message(exc: BaseException) -> None:
    """In a Kubernetes pod, this worker's one-line error where the pod's status shows it (and the job launcher
    reads it): the container's termination message file, when there is one."""
    path = Path(TERMINATION_LOG)
    rank = os.environ.get("RANK", "?")
    text = str(exc).strip().splitlines()
    try:
        if path.exists():
            path.write_text(f"search worker {rank}: {type(exc).__name__}: {text[0] if text else ''}"[:4000])
    except OSError:
        pass


def _run(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from evoesap.machine import runtime
    from evoesap.progress import set_quiet
    from evoesap.stages.search import SearchParams, prepare_scoring, run_search

    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=spec["log_level"] if rank == 0 else max(logging.WARNING, spec["log_level"]),
        format=f"%(levelname)s %(name)s [worker {rank}]: %(message)s",
    )
    set_quiet(spec["quiet"] or rank > 0)
    params = SearchParams(**spec["params"])
    gpu = runtime.resolve_device(params.device).startswith("cuda")
    if gpu:  # "cuda" below means this rank's GPU, the first of its group
        torch.cuda.set_device(distributed.worker_gpus(params.gpus_per_worker)[0])
    torch.set_num_threads(
        distributed.threads_per_worker(params.workers)
        if "OMP_NUM_THREADS" not in os.environ
        else int(os.environ["OMP_NUM_THREADS"])
    )
    dist.init_process_group("nccl" if gpu else "gloo", timeout=distributed.TIMEOUT)
    try:
        inputs = spec["inputs"]
        if rank == 0:
            run_search(**inputs, params=params, out_uri=spec["out_uri"])
        else:
            distributed.serve(
                prepare_scoring(inputs["model"], inputs["scores"], inputs["cache"], params, inputs["heldout_cache"], judge=False)
            )
    finally:
        dist.destroy_process_group()


def _end(code: int) -> NoReturn:
    """End this worker process without the interpreter's finalization. Gloo's threads may still drop the last
    collective's tensors, whose Python objects need the interpreter lock; a thread that asks for it while the
    interpreter finalizes is ended in a way that aborts the process (`terminate called without an active exception`,
    SIGABRT), and the launcher would report a finished worker as killed and stop the search. Nothing is left to
    finalize: the artifact is published, the group destroyed, an error recorded; the logs and streams are flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        _end(stop.code if isinstance(stop.code, int) else 1)
    _end(0)
