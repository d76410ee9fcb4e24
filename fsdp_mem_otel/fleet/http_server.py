"""The one HTTP(S) server behind every /metrics endpoint: a stuck client cannot freeze it.

Used by the per-rank endpoint (``PrometheusExporter``) and the sidecar (``fsdp-mem-otel serve``).
What a client gets to hold, and for how long, is bounded:

- One thread accepts and waits, with a selector, until a connection has sent something; only
  then does a pool of ``max_workers`` threads handle it (TLS handshake, request, answer), each
  with a socket timeout of ``client_timeout`` seconds. A client that connects and sends nothing
  costs a file descriptor, no thread, and is closed after ``client_timeout``; one that stalls
  mid-handshake or mid-request holds one worker for at most that long. Scrapes that do send keep
  being served meanwhile.
- At most ``max_idle`` connections wait to send; beyond that the oldest is closed (``dropped``
  counts them), so a thousand idle clients cost neither a thousand threads nor unbounded memory.
- The listen backlog is 128, not ``socketserver``'s 5, so a burst of scrapers is queued by the
  kernel instead of reset.
- ``stop(timeout)`` returns within ``timeout`` seconds whatever clients do: it stops accepting,
  closes every connection and leaves busy (daemon) workers behind.

Standard library only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds a client gets to send its request (and its TLS handshake), and to read the answer
DEFAULT_CLIENT_TIMEOUT = 5.0
DEFAULT_MAX_WORKERS = 4
DEFAULT_MAX_IDLE = 256
BACKLOG = 128


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: nothing to keep open

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server: MetricsServer = self.server  # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = server.render()
            except Exception as exc:  # noqa: BLE001
                logger.exception("fsdp_mem_otel: building /metrics failed")
                self._send(500, f"scrape failed: {type(exc).__name__}\n".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, CONTENT_TYPE)
        elif path == "/":
            self._send(200, server.banner, "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found; metrics at /metrics\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("fsdp_mem_otel http: " + format, *args)


class MetricsServer:
    """Serves ``render()`` at ``/metrics`` (see the module docstring for the bounds).

    Args:
        render: builds the exposition (called per scrape, on a worker thread).
        addr, port: where to listen (port 0: any free one; ``port`` says which after binding).
        ssl_context: serve HTTPS (a server-side context; with ``CERT_REQUIRED``, mutual TLS).
        banner: what ``/`` answers (a readiness probe).
    """

    def __init__(self, render: Callable[[], bytes], addr: str, port: int, *,
                 ssl_context: ssl.SSLContext | None = None, banner: bytes = b"metrics at /metrics\n",
                 client_timeout: float = DEFAULT_CLIENT_TIMEOUT, max_workers: int = DEFAULT_MAX_WORKERS,
                 max_idle: int = DEFAULT_MAX_IDLE) -> None:
        self.render = render
        self.banner = banner
        self.ssl_context = ssl_context
        self.client_timeout = client_timeout
        self.max_idle = max_idle
        self.dropped = 0  # idle connections closed to stay within max_idle
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((addr, port))
            self.socket.listen(BACKLOG)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="fsdp-mem-otel-http")
        self._selector = selectors.DefaultSelector()
        self._idle: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()  # -> deadline
        self._busy: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    # -- the accept thread ---------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept and dispatch until ``stop()`` (``start()`` runs this on a daemon thread)."""
        self._selector.register(self.socket, selectors.EVENT_READ)
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                conn = key.fileobj
                if conn is self.socket:
                    self._accept()
                elif isinstance(conn, socket.socket):  # a waiting client sent something
                    self._selector.unregister(conn)
                    self._idle.pop(conn, None)
                    with self._lock:
                        self._busy.add(conn)
                    self._pool.submit(self._serve_one, conn)
            now = time.monotonic()
            while self._idle:
                conn, deadline = next(iter(self._idle.items()))
                if deadline > now:
                    break
                self._drop(conn)  # connected and said nothing for client_timeout

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            if len(self._idle) >= self.max_idle:
                self.dropped += 1
                self._drop(next(iter(self._idle)))
            self._idle[conn] = time.monotonic() + self.client_timeout
            self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self._idle.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    # -- a worker ------------------------------------------------------------------------------
    def _serve_one(self, conn: socket.socket) -> None:
        stream: Any = conn
        try:
            conn.setblocking(True)
            conn.settimeout(self.client_timeout)
            if self.ssl_context is not None:
                stream = self.ssl_context.wrap_socket(conn, server_side=True)
            _Handler(stream, stream.getpeername(), self)  # type: ignore[arg-type]  # it reads render/banner only
        except (OSError, ssl.SSLError, ValueError) as exc:  # timeouts, resets, failed handshakes
            logger.debug("fsdp_mem_otel http: client dropped: %r", exc)
        except Exception:  # noqa: BLE001 - one client must not take the server down
            logger.exception("fsdp_mem_otel http: serving a client failed")
        finally:
            with self._lock:
                self._busy.discard(conn)
            try:
                stream.close()
            except OSError:
                pass

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> threading.Thread:
        """Serve on a daemon thread (stop with ``stop()``)."""
        self._thread = threading.Thread(target=self.serve_forever, name="fsdp-mem-otel-http-accept", daemon=True)
        self._thread.start()
        return self._thread

    def shutdown(self) -> None:
        """Ask the accept loop to end (from any thread, a signal handler included)."""
        self._stopping.set()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop within ``timeout`` seconds: no new connections, every open one closed. Safe twice."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            busy = list(self._busy)
        for conn in busy:  # unblock workers stuck reading from or writing to a client
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in list(self._idle):
            self._drop(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._selector.close()
        except (OSError, ValueError):
            pass
        self.socket.close()


def ssl_context(certfile: str, keyfile: str, client_cafile: str | None = None) -> ssl.SSLContext:
    """Server TLS context; with ``client_cafile``, clients must present a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=certfile, keyfile=keyfile)
    if client_cafile is not None:
        ctx.load_verify_locations(cafile=client_cafile)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
