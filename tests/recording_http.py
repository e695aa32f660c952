"""Recording HTTP servers on 127.0.0.1 that stand in for a cluster's APIs (KFP, Kubernetes) in tests."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A handler that answers JSON and logs nothing; subclasses record requests and choose the answers."""

    def _reply(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free port of 127.0.0.1 while the block runs; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


class DripHandler(BaseHTTPRequestHandler):
    """A server that answers every request one byte each `interval` seconds, an answer that never ends, until `stop`
    is set: every socket read gets a byte in time, so only an overall deadline ends the call (`dripping`)."""

    interval = 0.2
    stop = threading.Event()
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"z" * 100_000

    def _drip(self) -> None:
        for byte in self.answer:
            if self.stop.wait(self.interval):
                return
            with contextlib.suppress(OSError):
                self.wfile.write(bytes([byte]))
                self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _drip  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def dripping() -> Iterator[str]:
    """`DripHandler` on a free port of 127.0.0.1 while the block runs; its answers end with the block."""
    DripHandler.stop = threading.Event()
    with serving(DripHandler) as url:
        try:
            yield url
        finally:
            DripHandler.stop.set()


class EchoHandler(BaseHTTPRequestHandler):
    """A server that refuses every request with HTTP `refusal`, its body `prefix` then the request's headers echoed
    back, as a misconfigured server or proxy does (with an Authorization header of user:password in base64)."""

    refusal = 500
    prefix = b"request refused; you sent: "
    content_type = "text/plain"

    def _echo(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        echoed = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        body = self.prefix + b"Authorization: Basic dXNlcjpodW50ZXIy\r\n" + echoed.encode()
        self.send_response(self.refusal)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _echo  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass
