"""Test hooks in the processes of a multi-worker search (tests/orchestration/test_distributed_search.py puts this directory on
PYTHONPATH): each worker connects to the test's Unix socket EVOESAP_TEST_SOCKET, says its rank and pid, then
reports the moments a test waits for and, where EVOESAP_TEST_HOOKS asks, holds there until the test closes
the connection. Events, not sleeps: the test knows exactly where each worker is when it strikes.

    pause-at-generation  rank 0 says "generation 1" before scoring generation 1 (generation 0 checkpointed), holds
    hold-after-serve     rank 0 says "published" once run_search has returned; rank 1 says "served" once rank 0
                         said stop, and holds
    abort-at-exit        every worker aborts (SIGABRT) if the interpreter's finalization runs, as one does when a
                         gloo thread asks for the interpreter lock then
"""

import os
import socket

if os.environ.get("EVOESAP_TEST_SOCKET") and "RANK" in os.environ:  # a search worker, not the launcher
    RANK = int(os.environ["RANK"])
    HOOKS = os.environ.get("EVOESAP_TEST_HOOKS", "")
    _link = socket.socket(socket.AF_UNIX)
    _link.connect(os.environ["EVOESAP_TEST_SOCKET"])
    _link.sendall(f"rank {RANK} pid {os.getpid()}\n".encode())

    def _say(event: str, hold: bool) -> None:
        _link.sendall(f"{event}\n".encode())
        while hold and _link.recv(1):  # until the test closes the connection (or kills this process)
            pass

    from evoesap.method import distributed

    if HOOKS == "abort-at-exit":
        import atexit

        atexit.register(os.abort)  # atexit handlers run at the start of the interpreter's finalization

    if HOOKS == "pause-at-generation" and RANK == 0:
        _score_batch = distributed.Coordinator.score_batch

        def score_batch(self, rs, level, generation):
            if generation == 1 and not getattr(self, "_paused", False):
                self._paused = True
                _say("generation 1", hold=True)
            return _score_batch(self, rs, level, generation)

        distributed.Coordinator.score_batch = score_batch

    if HOOKS == "hold-after-serve":
        if RANK == 0:
            from evoesap.stages import search

            _run_search = search.run_search

            def run_search(*args, **kwargs):
                manifest = _run_search(*args, **kwargs)
                _say("published", hold=False)
                return manifest

            search.run_search = run_search
        else:
            _serve = distributed.serve

            def serve(scoring):
                _serve(scoring)
                _say("served", hold=True)

            distributed.serve = serve
