"""A tiny HTTP/1.1 forwarding proxy that injects faults: 503/SlowDown answers, delays, connection resets.

Why a proxy: it exercises the real SDK error paths (status parsing, reconnects,
re-sent bodies) against a real server, without patching any client code.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class Rule:
    method: str | None = None          # e.g. "PUT"
    path_re: str | None = None         # regex searched in the request path (with query)
    status: int = 0                    # answer with this status instead of forwarding (0: forward)
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0                 # sleep before acting
    delay_after: float = 0.0           # forward first, then sleep before answering (a slow store)
    reset: bool = False                # drop the connection without an answer
    corrupt: bool = False              # forward the request with one byte of its body flipped (damage in transit)
    rewrite: Any = None                # bytes -> bytes: applied to the upstream's answer body (a hostile store)
    count: int = 1                     # how many requests this rule hits (-1: unlimited)
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.count == 0:
            return False
        if self.method and self.method != method:
            return False
        return not self.path_re or re.search(self.path_re, path) is not None


@dataclass
class Recorded:
    """One forwarded request as the client sent it, and the upstream's answer."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes          # as the client sent it (before any corruption)
    status: int
    answer: bytes
    corrupted: bool      # the upstream got it with a byte flipped


S3_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
               b"<Message>Please reduce your request rate.</Message></Error>")
AZURE_BUSY = (b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
              b"<Message>The server is currently unable to receive requests.</Message></Error>")
GCS_503 = b'{"error": {"code": 503, "message": "Backend Error"}}'


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.requests = 0
        self.injected = 0
        self.inflight = 0
        self.seen: list[str] = []  # "METHOD path" of every request (debugging)
        self.record: str | None = None  # regex: requests whose "METHOD path" matches are kept in ``recorded``
        self.recorded: list[Recorded] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                with proxy.lock:
                    proxy.inflight += 1
                try:
                    self._handle_one()
                finally:
                    with proxy.lock:
                        proxy.inflight -= 1

            def _handle_one(self) -> None:
                body = self._body()
                rule = proxy._match(self.command, self.path)
                with proxy.lock:
                    proxy.requests += 1
                    proxy.seen.append(f"{self.command} {self.path}")
                if rule is not None:
                    if rule.delay:
                        time.sleep(rule.delay)
                    if rule.reset:
                        with proxy.lock:
                            proxy.injected += 1
                        self.close_connection = True
                        try:
                            self.connection.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                        return
                    if rule.status:
                        with proxy.lock:
                            proxy.injected += 1
                        self.send_response(rule.status)
                        for k, v in rule.headers.items():
                            self.send_header(k, v)
                        self.send_header("Content-Length", str(len(rule.body)))
                        self.end_headers()
                        if self.command != "HEAD":
                            self.wfile.write(rule.body)
                        return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                sent = body
                if rule is not None and rule.corrupt and body:
                    damaged = bytearray(body)
                    damaged[len(damaged) // 2] ^= 0x01
                    body = bytes(damaged)
                    with proxy.lock:
                        proxy.injected += 1
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                for attempt in (1, 2):  # the upstream may have closed an idle keep-alive connection
                    conn = getattr(proxy._local, "conn", None)
                    if conn is None:
                        conn = proxy._local.conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                        data = resp.read()
                        break
                    except (OSError, http.client.HTTPException):
                        proxy._local.conn = None
                        conn.close()
                        if attempt == 2:
                            raise
                if rule is not None and rule.delay_after:
                    time.sleep(rule.delay_after)
                if rule is not None and rule.rewrite is not None and 200 <= resp.status < 300:
                    data = rule.rewrite(data)
                if proxy.record and re.search(proxy.record, f"{self.command} {self.path}"):
                    with proxy.lock:
                        proxy.recorded.append(Recorded(self.command, self.path, dict(self.headers.items()), sent,
                                                       resp.status, data, body is not sent))
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() in HOP or (k.lower() == "content-length" and self.command != "HEAD"):
                        continue
                    self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._local = threading.local()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _match(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for r in self.rules:
                if r.matches(method, path):
                    r.hits += 1
                    if r.count > 0:
                        r.count -= 1
                    return r
        return None

    def add(self, **kw: Any) -> Rule:
        rule = Rule(**kw)
        with self.lock:
            self.rules.append(rule)
        return rule

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is being handled (late requests of a killed client included)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.inflight == 0:
                    return
            time.sleep(0.05)
        raise TimeoutError("proxy still busy")

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
