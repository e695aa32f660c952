"""What every call to a server shares: an overall deadline, a tolerant decode of its reply, and a scrub of what it echoes.

A socket timeout bounds one read, so an endpoint that sends one byte a second never trips it; `call` bounds the
whole exchange instead (the call runs in a worker thread that is abandoned, and told to stop, at the deadline).
`scrub` is the one filter for text a server sent back (an error body, a header echo) and for log lines: whatever
reaches an error line or a log passes through it. Imports nothing heavy: `pipeline submit` uses it before torch.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from evoesap.errors import ConfigError, EvoESAPError

T = TypeVar("T")

SECRETS_GUIDE = "docs/guides/kubeflow-secrets.md"
HUB_DEADLINE_ENV = "EVOESAP_HUB_DEADLINE_S"  # one exchange with the Hub (evoesap.release.hub, a revision's resolution)
HUB_DEADLINE_S = 300.0
_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.-]*://"
# user[:password]@ of a URL; a password may hold '/' (AWS secret keys do), a port may not be taken for one
_USERINFO = re.compile(rf"({_SCHEME})(?:[^/@\s]*@|[^/:@\s]*:(?!\d+(?:/|$))[^@\s]*@)")
_ADDRESS_USERINFO = ("az://", "abfs://", "abfss://")  # container@account is the address there, not a credential

# the value of an Authorization header however it is echoed: raw (`Authorization: Basic x`), JSON, a Python dict
_AUTH_HEADER = re.compile(r"""((?:proxy-)?authorization['"]?\s*[:=]\s*)(['"]?)[^'"\r\n]*""", re.IGNORECASE)
_BEARER = re.compile(r"\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_BASIC = re.compile(r"\b(basic)\s+([A-Za-z0-9+/=]{4,})", re.IGNORECASE)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")
# signed-URL and API credentials in a query string: AWS (SigV4 and V2), Azure SAS, GCS, generic tokens
_QUERY_SECRET = re.compile(
    r"([?&;](?:x-amz-(?:signature|credential|security-token)|awsaccesskeyid|signature|sig|x-goog-signature|"
    r"x-goog-credential|token|access_token|api_key|apikey|password|secret)=)[^&\s'\"#;]*",
    re.IGNORECASE,
)
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|ACCESS_KEY|API_KEY|CREDENTIAL|SESSION_KEY", re.IGNORECASE)
_SECRET_MIN = 8  # shorter environment values would mask ordinary words
MASK = "***"


def redact(text: Any) -> str:
    """`text` (a URI, or a message holding URIs) without any user:password@ part or signed query value, for logs and
    records."""
    text = _USERINFO.sub(lambda m: m.group(0) if _is_address(m) else m.group(1), str(text))
    return _QUERY_SECRET.sub(rf"\1{MASK}", text)


def _is_address(match: re.Match[str]) -> bool:
    return match.group(1).lower() in _ADDRESS_USERINFO and ":" not in match.group(0)[len(match.group(1)) :]


def has_credentials(text: Any) -> bool:
    """True when `text` holds a URL with user:password@ (or a token as its user) or a signed query (a signature, a
    key, a token): what `redact` removes."""
    return redact(text) != str(text)


def refuse_credentials(value: Any, what: str = "the URL") -> None:
    """Refuse, in one line naming `what` and the URL without them, credentials written into a URL: they would be
    copied into pipeline specs, manifests and logs. They are given through the environment instead."""
    if value is not None and has_credentials(value):
        raise ConfigError(
            f"{what} {redact(value)!r} has credentials inside it, which are refused (they would be copied into "
            "pipeline specs, manifests and logs): remove them and give them through the environment "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, HF_TOKEN), fsspec's configuration, or on Kubeflow a "
            f"Kubernetes secret (resources.<stage>.secrets); see {SECRETS_GUIDE}"
        )


def scrub(text: Any, *secrets: str | None) -> str:
    """`text` (a server's reply, an exception's message, a log line) without credentials: Authorization and
    Proxy-Authorization header values, bearer and basic credentials, hf_ tokens, AWS key ids, user:password@ in URLs,
    signatures and keys in query strings, the `secrets` given and the value of every secret-named environment
    variable (a token, a password, an access key)."""
    text = redact(str(text))
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, MASK)
    text = _AUTH_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _BEARER.sub(rf"\1 {MASK}", text)
    text = _BASIC.sub(lambda m: f"{m.group(1)} {MASK}" if _is_basic_credential(m.group(2)) else m.group(0), text)
    text = _HF_TOKEN.sub(f"hf_{MASK}", text)
    text = _AWS_KEY_ID.sub(MASK, text)
    text = _QUERY_SECRET.sub(rf"\1{MASK}", text)
    for name, value in os.environ.items():
        if len(value) >= _SECRET_MIN and _SECRET_NAME.search(name) and value in text:
            text = text.replace(value, MASK)
    return text


def _is_basic_credential(word: str) -> bool:
    """True when `word` is base64 of user:password (so `Basic authentication` stays readable)."""
    try:
        return b":" in base64.b64decode(word + "=" * (-len(word) % 4), validate=True)
    except (binascii.Error, ValueError):
        return False


def decode(data: Any) -> str:
    """A server's reply as text, whatever bytes it sent (invalid UTF-8 is replaced, never raised)."""
    if data is None:
        return ""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data).decode("utf-8", errors="replace")
    return str(data)


def reply_line(data: Any, *secrets: str | None, limit: int = 300) -> str:
    """A server's reply (bytes or text) as one scrubbed line of at most `limit` characters, for an error message."""
    return " ".join(scrub(decode(data), *secrets).split())[:limit]


def deadline_s(variable: str, default: float) -> float:
    """Seconds from the environment variable `variable` (a positive number), else `default`."""
    text = os.environ.get(variable, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{variable}={text!r} is not a positive number of seconds")
    return value


class DeadlineExceeded(EvoESAPError):
    """A call to a server did not finish within its overall deadline."""


def call(
    fn: Callable[[threading.Event], T],
    *,
    seconds: float,
    what: str,
    knob: str,
    error: type[EvoESAPError] = DeadlineExceeded,
) -> T:
    """`fn(stop)` finished within `seconds` in all (however slowly the server sends), else `error` naming `what` (an
    endpoint, without credentials) and the `knob` that sets the deadline.

    `fn` runs in a daemon thread; at the deadline `stop` is set (a client checks it before each new request, so an
    abandoned call sends nothing more) and the thread is left to end with its connection.
    """
    done = threading.Event()
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = fn(stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name=f"deadline:{what}"[:60], daemon=True).start()
    if not done.wait(seconds):
        stop.set()
        raise error(
            f"{scrub(what)} did not finish within {seconds:g} s (the server is stalled or too slow): check it, or set "
            f"{knob} to allow longer"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class Stopped(EvoESAPError):
    """Raised inside an abandoned call (`call`'s `stop` set) so its client sends no further request."""
