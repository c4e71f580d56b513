"""A loopback HTTP origin for media-fetch tests: every request's path is recorded.

``/good.png`` (a 1x1 PNG), ``/page.html`` (text/html), ``/secret`` (text/plain: stands for
``/metrics`` or any internal page), ``/redirect?to=URL`` (a 302 to URL), ``/loop`` (a 302 to
itself), ``/slow.png`` (a 200 that trickles one byte every 50 ms for 30 s), anything else 404.
"""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlparse

PNG_1X1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
TRICKLE_S = 30.0


@dataclass
class Origin:
    """A running origin: ``url`` is ``http://127.0.0.1:PORT``; ``paths`` what it was asked."""

    port: int
    paths: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    origin: Origin

    def do_GET(self) -> None:
        self.origin.paths.append(self.path)
        parsed = urlparse(self.path)
        if parsed.path == "/good.png":
            self._send(200, "image/png", PNG_1X1)
        elif parsed.path == "/page.html":
            self._send(200, "text/html", b"<html>internal page</html>")
        elif parsed.path == "/secret":
            self._send(200, "text/plain", b"internal metrics")
        elif parsed.path == "/redirect":
            self._redirect(parse_qs(parsed.query)["to"][0])
        elif parsed.path == "/loop":
            self._redirect("/loop")
        elif parsed.path == "/slow.png":
            self._trickle()
        else:
            self._send(404, "text/plain", b"missing")

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            end = time.monotonic() + TRICKLE_S
            while time.monotonic() < end:
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass  # the client gave up

    def _send(self, status: int, mime: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def running_origin() -> Iterator[Origin]:
    """An origin on 127.0.0.1 (a free port), shut down on exit."""
    origin = Origin(0)
    handler = type("Handler", (_Handler,), {"origin": origin})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    origin.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        server.shutdown()
        server.server_close()
