"""Push a finished artifact to a Hub model repository in one commit, through huggingface_hub's API.

One commit is all or nothing on the Hub's side: a push that fails leaves the repository's files as they
were. The token is read from an environment variable (a secret), passed to huggingface_hub and never
logged, recorded or repeated in an error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from evoesap import network
from evoesap.errors import ArtifactError, ConfigError

log = logging.getLogger(__name__)

KEPT = frozenset({".gitattributes"})  # what a new repository holds; a push leaves it


def token(variable: str) -> str:
    """The Hub token from the environment variable `variable`; refused, naming the variable, when unset."""
    value = os.environ.get(variable, "").strip()
    if not value:
        raise ConfigError(f"no Hub token: set the environment variable {variable} (or name another with --token-env)")
    return value


TIMEOUT_ENV = "HF_HUB_DOWNLOAD_TIMEOUT"  # huggingface_hub's own name for how long a request may wait
DEFAULT_TIMEOUT_S = 60.0  # an endpoint silent this long is down (an upload's chunks each answer far sooner)
DEADLINE_ENV = network.HUB_DEADLINE_ENV  # seconds one exchange with the Hub may take in all, however slowly it answers
DEFAULT_DEADLINE_S = network.HUB_DEADLINE_S  # reading a repository, resolving a revision, a card; a push gets more
UPLOAD_FLOOR_BYTES_S = 1 << 20  # a push is given one more second per MiB it sends: slower than this, it is stalled


def timeout_s() -> float:
    """Seconds a Hub request may wait for the endpoint: $HF_HUB_DOWNLOAD_TIMEOUT, else `DEFAULT_TIMEOUT_S`."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds")
    return value


def deadline_s() -> float:
    """Seconds one exchange with the Hub may take in all: $EVOESAP_HUB_DEADLINE_S, else `DEFAULT_DEADLINE_S`."""
    return network.deadline_s(DEADLINE_ENV, DEFAULT_DEADLINE_S)


def push_deadline_s(size: int) -> float:
    """A push's deadline: `deadline_s()` plus one second per MiB of `size` bytes it uploads."""
    return deadline_s() + size / UPLOAD_FLOOR_BYTES_S


def bounded(fn: Any, what: str, seconds: float | None = None) -> Any:
    """`fn(stop)` within `seconds` (default `deadline_s()`), else one ArtifactError naming `what` and the knob."""
    return network.call(fn, seconds=seconds or deadline_s(), what=what, knob=DEADLINE_ENV, error=ArtifactError)


def _api(endpoint: str | None, secret: str, stop: Any = None) -> Any:
    """huggingface_hub's API whose requests give up after `timeout_s()`: its client waits forever, and many of its
    calls pass that explicitly, so each request's own timeout is bounded as it is sent. Once `stop` is set (its call
    passed its deadline) no further request is sent."""
    from huggingface_hub import HfApi, set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    network.refuse_credentials(endpoint, "endpoint")
    seconds = timeout_s()

    def bound(request: Any) -> None:
        if stop is not None and stop.is_set():
            raise network.Stopped(f"a Hub request abandoned at its deadline ({DEADLINE_ENV})")
        limits = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: seconds if v is None else min(v, seconds) for k, v in limits.items()} or {
            k: seconds for k in ("connect", "read", "write", "pool")
        }

    def client() -> Any:
        made = default_client_factory()
        made.event_hooks = {**made.event_hooks, "request": [*made.event_hooks["request"], bound]}
        return made

    set_client_factory(client)  # closes a client made before (with another bound)
    return HfApi(endpoint=endpoint, token=secret)


def _check_settings(endpoint: str | None) -> None:
    """The endpoint and the timeouts refused in their own line, before any request (not as a failed call's cause)."""
    network.refuse_credentials(endpoint, "endpoint")
    timeout_s(), deadline_s()


def _where(repo: str, endpoint: str | None) -> str:
    return f"the Hub repository {repo} at {network.redact(endpoint or os.environ.get('HF_ENDPOINT') or 'huggingface.co')}"


def _failure(what: str, repo: str, exc: Exception, secret: str) -> ArtifactError:
    if isinstance(exc, ArtifactError):  # the deadline's own line
        return exc
    detail = network.reply_line(exc, secret)
    if "Timeout" in type(exc).__name__:
        detail = f"no answer within {timeout_s():g} s; set {TIMEOUT_ENV} to wait longer"
    return ArtifactError(f"{what} the Hub repository {repo} failed ({type(exc).__name__}: {detail})")


def check_target(repo: str, files: Iterable[str], *, endpoint: str | None, secret: str) -> None:
    """Refuse, before any work, a repository holding files this push would not replace (a stale shard would
    break the checkpoint); a repository that does not exist yet is fine (the push creates it)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    _check_settings(endpoint)

    def read(stop: Any) -> set[str]:
        return set(_api(endpoint, secret, stop).list_repo_files(repo))

    try:
        present = bounded(read, f"reading {_where(repo, endpoint)}")
    except RepositoryNotFoundError:
        return
    except Exception as exc:  # noqa: BLE001 - a refused token, an unreachable endpoint: one line, before work
        raise _failure("reading", repo, exc, secret) from None
    stale = sorted(present - set(files) - KEPT)
    if stale:
        shown = ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else "")
        raise ConfigError(
            f"--repo {repo} holds files this publish would not replace ({shown}): delete them or publish to a new repository"
        )


def push(staging: Path, repo: str, *, endpoint: str | None, secret: str, private: bool, message: str) -> str:
    """Create `repo` if needed and commit every file under `staging` to it in one commit; the commit's URL."""
    from huggingface_hub import CommitOperationAdd

    _check_settings(endpoint)
    files = sorted(p for p in staging.rglob("*") if p.is_file())

    def send(stop: Any) -> Any:
        api = _api(endpoint, secret, stop)
        api.create_repo(repo, private=private, exist_ok=True)
        return api.create_commit(
            repo,
            [CommitOperationAdd(path_in_repo=p.relative_to(staging).as_posix(), path_or_fileobj=str(p)) for p in files],
            commit_message=message,
        )

    size = sum(p.stat().st_size for p in files)
    try:
        commit = bounded(send, f"pushing to {_where(repo, endpoint)}", push_deadline_s(size))
    except ArtifactError as exc:  # the deadline: its requests stop, a commit already sent may still land
        raise ArtifactError(
            f"{exc}; no further request is sent and nothing is published here: re-run `evoesap publish` (its commit "
            "replaces the repository's files as a whole)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - every failure means the same: no commit was made
        raise ArtifactError(
            f"{_failure('pushing to', repo, exc, secret)}: no commit was made, its files are as they "
            "were; fix the cause and re-run `evoesap publish`"
        ) from None
    log.info("pushed %d files to %s", len(files), commit.commit_url)
    return str(commit.commit_url)
