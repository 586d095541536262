"""A fault-injecting HTTP proxy in front of an S3 endpoint: throttling (503 SlowDown), refusals (403
AccessDenied), dropped connections (before or in the middle of a body) and corrupted bytes, on demand, for the
requests a predicate picks. It forwards everything else verbatim, the Host header included, since SigV4 signs it.
"""

from __future__ import annotations

import http.client
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainyard.local_s3 import LOCAL_ENV

Predicate = Callable[[str, str], bool]
"""``(method, target) -> bool``; ``target`` is the request path and query, percent-decoded."""

FAULTS = ("throttle", "deny", "drop", "drop_mid_body", "corrupt")

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)

# Per connection, not end to end (RFC 9110 7.6.1); the proxy frames each side itself. Expect is
# answered by the proxy (http.server sends "100 Continue"); botocore does not sign it.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_BLOCK = 1 << 16


def matching(method: str | None = None, key: str | None = None) -> Predicate:
    """A predicate: the request's method is ``method`` (any if None) and its path and query
    contain ``key`` (any if None)."""

    def predicate(request_method: str, target: str) -> bool:
        return (method is None or request_method.upper() == method.upper()) and (key is None or key in target)

    return predicate


@dataclass
class _Rule:
    remaining: int
    predicate: Predicate | None


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    rules: dict[str, list[_Rule]] = field(default_factory=lambda: {kind: [] for kind in FAULTS})
    applied: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    requests_seen: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def take(self, kind: str, method: str, target: str) -> bool:
        """Claim one application of a pending ``kind`` fault for this request, if one matches."""
        with self.lock:
            for rule in self.rules[kind]:
                if rule.remaining > 0 and (rule.predicate is None or rule.predicate(method, target)):
                    rule.remaining -= 1
                    self.applied[kind] += 1
                    return True
        return False


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the transfer manager opens 10 connections at once

    def __init__(self, upstream: urllib.parse.SplitResult, state: _State):
        self.upstream = upstream
        self.state = state
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    def handle_error(self, request, client_address):
        # A client hanging up (botocore closing a pooled connection, a test's own drop) is routine.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects
    timeout = 120  # an idle kept-alive client connection is closed after this
    server: _ProxyServer

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass

    def do_GET(self):
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _proxy(self) -> None:
        state = self.server.state
        with state.lock:
            state.requests_seen += 1
            state.in_flight += 1
            state.most_in_flight = max(state.most_in_flight, state.in_flight)
        try:
            self._relay(state)
        finally:
            with state.lock:
                state.in_flight -= 1

    def _relay(self, state: _State) -> None:
        method = self.command
        target = urllib.parse.unquote(self.path)

        def record(outcome: str) -> None:
            with state.lock:
                state.log.append((method, target, outcome))

        for kind, status, reason, body in (
            ("throttle", 503, "Slow Down", SLOW_DOWN),
            ("deny", 403, "Forbidden", ACCESS_DENIED),
        ):
            if state.take(kind, method, target):
                self._drain_body()
                record(kind)
                self.send_response(status, reason)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(body)
                return
        if state.take("drop", method, target):
            self._drain_body()
            record("drop")
            self.close_connection = True  # nothing written: the client sees the connection close
            return

        upstream = self.server.upstream
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
        try:
            try:
                self._send_upstream(conn)
                response = conn.getresponse()
            except OSError as exc:  # upstream unreachable, or the client went away mid-request
                record(f"502 {exc}")
                self.close_connection = True  # the request body may be half read: this connection is done
                body = f"<Error><Code>BadGateway</Code><Message>{exc}</Message></Error>".encode()
                try:
                    self.send_response(502)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass
                return
            self._send_downstream(method, target, response, record)
        finally:
            conn.close()

    def _send_upstream(self, conn: http.client.HTTPConnection) -> None:
        """The request as received: method, path and query, headers (Host verbatim: SigV4 signs
        it) and body; a chunked body is relayed with its chunking and trailers unchanged."""
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                conn.putheader(name, value)
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        if chunked:
            self._relay_chunked(conn.send)
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                block = self.rfile.read(min(_BLOCK, remaining))
                if not block:
                    raise ConnectionError("client closed the connection inside the request body")
                conn.send(block)
                remaining -= len(block)

    def _relay_chunked(self, send: Callable[[bytes], object]) -> None:
        while True:
            line = self.rfile.readline(65537)
            if not line:
                raise ConnectionError("client closed the connection inside a chunked body")
            send(line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                break
            remaining = size + 2  # the data and its CRLF
            while remaining > 0:
                block = self.rfile.read(min(_BLOCK, remaining))
                if not block:
                    raise ConnectionError("client closed the connection inside a chunked body")
                send(block)
                remaining -= len(block)
        while True:  # trailers (botocore's x-amz-checksum-* go here), then the empty line
            line = self.rfile.readline(65537)
            send(line)
            if line in (b"\r\n", b"\n", b""):
                return

    def _drain_body(self) -> None:
        """Read and discard the request body, so the connection stays in step."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._relay_chunked(lambda _: None)
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            block = self.rfile.read(min(_BLOCK, remaining))
            if not block:
                return
            remaining -= len(block)

    def _send_downstream(self, method: str, target: str, response: http.client.HTTPResponse, record) -> None:
        state = self.server.state
        status = response.status
        has_body = method != "HEAD" and status >= 200 and status not in (204, 304)
        length_header = response.getheader("Content-Length")
        length = int(length_header) if length_header is not None else None
        # Faults on served bytes apply to successful GETs that have bytes to spoil.
        eligible = method == "GET" and status in (200, 206) and has_body and (length is None or length > 0)
        cut = eligible and state.take("drop_mid_body", method, target)
        corrupt = eligible and not cut and state.take("corrupt", method, target)
        record("drop_mid_body" if cut else "corrupt" if corrupt else str(status))

        self.send_response_only(status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        chunked_out = has_body and length is None
        if chunked_out:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if not has_body:
            return

        limit = (length // 2 if length is not None else _BLOCK // 2) if cut else None
        flip_at = (length // 2 if length is not None else 0) if corrupt else None
        sent = 0
        try:
            while True:
                want = _BLOCK if limit is None else min(_BLOCK, limit - sent)
                if want <= 0:
                    break
                block = response.read(want)
                if not block:
                    break
                if flip_at is not None and sent <= flip_at < sent + len(block):
                    i = flip_at - sent
                    block = block[:i] + bytes([block[i] ^ 0xFF]) + block[i + 1 :]
                    flip_at = None
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked_out else block)
                sent += len(block)
            if cut:
                self.wfile.flush()
                self.close_connection = True  # part of the body, then the connection goes
                return
            if chunked_out:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True  # the client went away; nothing more to do for it


def _fault(kind: str, doc: str):
    """A ``FaultProxy`` method that applies fault ``kind`` to the next ``n`` matching requests (``FaultProxy._add``)."""

    def add(
        self, n: int, predicate: Predicate | None = None, *, method: str | None = None, key: str | None = None
    ) -> None:
        self._add(kind, n, predicate, method, key)

    add.__name__, add.__doc__ = kind, doc
    return add


class FaultProxy:
    """An HTTP reverse proxy on 127.0.0.1 in front of an S3 endpoint that fails on demand.

    Each fault applies to the next ``n`` requests that match (``predicate``, and/or ``method`` and a
    ``key`` substring of the path and query; all requests if none is given):

    - ``throttle``: 503 ``SlowDown`` instead of forwarding;
    - ``deny``: 403 ``AccessDenied`` instead of forwarding;
    - ``drop``: the connection closes with no response at all;
    - ``drop_mid_body``: a GET's headers and half its body, then the connection closes;
    - ``corrupt``: a GET's body with one byte flipped (same length, headers untouched).

    ``drop_mid_body`` and ``corrupt`` count only successful (200/206) GETs with a body.
    """

    def __init__(self, upstream_url: str, upstream_env: Mapping[str, str] | None = None):
        self.upstream_url = upstream_url.rstrip("/")
        self._upstream = urllib.parse.urlsplit(self.upstream_url)
        if self._upstream.scheme != "http":
            raise ValueError(f"FaultProxy forwards plain http only, not {upstream_url!r}")
        self._state = _State()
        self._server = _ProxyServer(self._upstream, self._state)
        self.port = self._server.server_address[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        credentials = {k: v for k, v in (upstream_env or LOCAL_ENV).items() if k != "AWS_ENDPOINT_URL_S3"}
        self.env = {**credentials, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self._thread: threading.Thread | None = None

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add(self, kind: str, n: int, predicate, method, key) -> None:
        if n < 0:
            raise ValueError("n must be >= 0")
        if method is not None or key is not None:
            by_request = matching(method, key)
            predicate = by_request if predicate is None else _both(predicate, by_request)
        with self._state.lock:
            self._state.rules[kind].append(_Rule(n, predicate))

    # Each fault by name: apply it to the next ``n`` requests that match (``_fault``)
    throttle = _fault("throttle", "Answer the next ``n`` matching requests with 503 SlowDown.")
    deny = _fault("deny", "Answer the next ``n`` matching requests with 403 AccessDenied (a role without the right).")
    drop = _fault("drop", "Close the connection of the next ``n`` matching requests without a response.")
    drop_mid_body = _fault(
        "drop_mid_body", "Send the next ``n`` matching GET responses' headers and half their body, then close."
    )
    corrupt = _fault("corrupt", "Flip one byte in the body of the next ``n`` matching GET responses.")

    def clear_faults(self) -> None:
        """Forget the faults not yet applied (the counters stay)."""
        with self._state.lock:
            for rules in self._state.rules.values():
                rules.clear()

    def pending(self, kind: str) -> int:
        """How many applications of ``kind`` are still waiting for a matching request."""
        with self._state.lock:
            return sum(rule.remaining for rule in self._state.rules[kind])

    @property
    def requests_seen(self) -> int:
        """Requests received, faulted or not."""
        with self._state.lock:
            return self._state.requests_seen

    @property
    def most_in_flight(self) -> int:
        """The most requests it was handling at once."""
        with self._state.lock:
            return self._state.most_in_flight

    @property
    def applied(self) -> dict[str, int]:
        """How many times each fault has been applied."""
        with self._state.lock:
            return dict(self._state.applied)

    @property
    def log(self) -> list[tuple[str, str, str]]:
        """``(method, target, outcome)`` per request: the status forwarded, or the fault's name."""
        with self._state.lock:
            return list(self._state.log)


def _both(a: Predicate, b: Predicate) -> Predicate:
    return lambda method, target: a(method, target) and b(method, target)
