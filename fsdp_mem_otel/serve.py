"""``fsdp-mem-otel serve``: one /metrics endpoint over a directory of per-rank files.

Each rank's ``PrometheusExporter(sidecar_dir=D)`` replaces ``D/rank-<rank>.prom`` atomically at
every step. This server reads every rank file whole at scrape time (so it never sees half a
file), merges the families (each HELP/TYPE once, the samples of all ranks) and adds, per rank,
when its file last changed and whether that is longer ago than ``--stale-seconds``, so that a dead
or stuck rank shows up as ``fsdp_mem_sidecar_rank_stale == 1`` instead of silently vanishing.

Does not import torch: the sidecar container needs only prometheus_client.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from fsdp_mem_otel import catalog as cat
from fsdp_mem_otel.checks import check_tls
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.rank_files import rank_of

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_STALE_SECONDS = 300.0
#: identity labels copied from a rank's samples onto its freshness series
_ID_LABELS = cat.IDENTITY_LABELS + cat.OPTIONAL_IDENTITY_LABELS
#: seconds a client gets to finish the TLS handshake and send its request
_CLIENT_TIMEOUT = 10.0


class SidecarCollector:
    """Collector over a directory of rank files: merged families plus per-rank freshness."""

    def __init__(self, directory: str, stale_seconds: float = DEFAULT_STALE_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        if not isinstance(stale_seconds, int | float) or stale_seconds <= 0:
            raise ValueError(f"stale_seconds must be a positive number; got {stale_seconds!r}")
        self.directory = directory
        self.stale_seconds = float(stale_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        # path -> ((inode, mtime_ns, size), parsed families): files are replaced, never edited
        self._cache: dict[str, tuple[tuple[int, int, int], list[Metric]]] = {}
        self._identity: dict[int, dict[str, str]] = {}
        self._read_errors: dict[int, int] = {}
        self.failures = FailureLog(logger, "sidecar server")

    def _rank_files(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # no rank has written yet
            return []
        except OSError as exc:
            self._log_once("listdir", f"cannot list {self.directory}: {exc!r}")
            return []
        found = []
        for name in names:
            rank = rank_of(name)
            if rank is not None:
                found.append((rank, os.path.join(self.directory, name)))
        return sorted(found)

    def _read(self, rank: int, path: str) -> tuple[float, list[Metric]] | None:
        """(mtime, families) of one rank file, or None if it vanished."""
        try:
            with open(path, "rb") as f:  # one open file: the atomic replace cannot tear it
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                cached = self._cache.get(path)
                if cached is not None and cached[0] == key:
                    return st.st_mtime, cached[1]
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self._read_error(rank, path, exc)
            return None
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:  # noqa: BLE001 - a bad file must not break the other ranks
            self._read_error(rank, path, exc)
            self._cache.pop(path, None)
            return st.st_mtime, []
        self._cache[path] = (key, families)
        return st.st_mtime, families

    def _read_error(self, rank: int, path: str, exc: BaseException) -> None:
        self._read_errors[rank] = self._read_errors.get(rank, 0) + 1
        self._log_once(f"read:{path}", f"cannot read or parse {path} (its samples are left out): {exc!r}")

    def _log_once(self, key: str, msg: str) -> None:
        self.failures.failed(key, None, msg)

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # the cache and counters are shared by concurrent scrapes
            families = self._collect()
        yield from families

    def _collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        fresh: list[tuple[int, float]] = []
        files = self._rank_files()
        live = {path for _, path in files}
        for path in list(self._cache):
            if path not in live:
                del self._cache[path]
        for rank, path in files:
            got = self._read(rank, path)
            if got is None:
                continue
            mtime, families = got
            fresh.append((rank, mtime))
            for fam in families:
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                elif into.type != fam.type:
                    self._log_once(f"type:{fam.name}", f"{path}: {fam.name} is a {fam.type}, another rank's a "
                                   f"{into.type}; left out")
                    continue
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if key in seen:  # the same series from two files: Prometheus would reject the scrape
                        continue
                    seen.add(key)
                    into.samples.append(s)
                if fam.name == cat.TRACKER_INFO.name and fam.samples:
                    # the rank's identity labels, kept for its freshness series even if it dies
                    labels = fam.samples[0].labels
                    self._identity[rank] = {k: labels[k] for k in _ID_LABELS if k in labels}
        out = list(merged.values())
        now = self._clock()
        updated = GaugeMetricFamily(cat.SIDECAR_RANK_LAST_UPDATE.name, cat.SIDECAR_RANK_LAST_UPDATE.help,
                                    labels=None)
        stale = GaugeMetricFamily(cat.SIDECAR_RANK_STALE.name, cat.SIDECAR_RANK_STALE.help, labels=None)
        for rank, mtime in fresh:
            labels = {**self._identity.get(rank, {}), "rank": str(rank)}
            updated.add_sample(updated.name, labels, mtime)
            stale.add_sample(stale.name, labels, 1.0 if now - mtime > self.stale_seconds else 0.0)
        errors = CounterMetricFamily(cat.SIDECAR_READ_ERRORS_TOTAL.name, cat.SIDECAR_READ_ERRORS_TOTAL.help,
                                     labels=list(cat.SIDECAR_READ_ERRORS_TOTAL.labels))
        for rank in sorted(self._read_errors):
            errors.add_metric([str(rank)], float(self._read_errors[rank]))
        return out + [updated, stale, errors]


class _Handler(BaseHTTPRequestHandler):
    server: SidecarServer
    timeout = _CLIENT_TIMEOUT  # a client that stalls mid-request does not hold a thread forever
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = generate_latest(self.server.collector)
            except Exception as exc:  # noqa: BLE001
                logger.exception("fsdp_mem_otel serve: scrape failed")
                self._send(500, f"scrape failed: {exc!r}\n".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, CONTENT_TYPE)
        elif path == "/":
            self._send(200, b"fsdp-mem-otel sidecar: metrics at /metrics\n", "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found; metrics at /metrics\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("fsdp_mem_otel serve: " + format, *args)


class SidecarServer(ThreadingHTTPServer):
    """HTTP(S) server for a SidecarCollector. TLS handshakes run in the per-request thread."""

    daemon_threads = True

    def __init__(self, collector: SidecarCollector, addr: str, port: int,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.collector = collector
        self.ssl_context = ssl_context
        super().__init__((addr, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.ssl_context is not None:
            request.settimeout(_CLIENT_TIMEOUT)
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError) as exc:  # bad or missing client certificate, plain HTTP
                logger.debug("fsdp_mem_otel serve: TLS handshake with %s failed: %r", client_address, exc)
                return
        super().finish_request(request, client_address)

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (stop with ``stop()``)."""
        t = threading.Thread(target=self.serve_forever, name="fsdp-mem-otel-serve", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def ssl_context(certfile: str, keyfile: str, client_cafile: str | None = None) -> ssl.SSLContext:
    """Server TLS context; with ``client_cafile``, clients must present a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=certfile, keyfile=keyfile)
    if client_cafile is not None:
        ctx.load_verify_locations(cafile=client_cafile)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def make_server(directory: str, port: int, addr: str = "0.0.0.0", *, certfile: str | None = None,
                keyfile: str | None = None, client_cafile: str | None = None,
                stale_seconds: float = DEFAULT_STALE_SECONDS) -> SidecarServer:
    """A bound (not yet serving) sidecar server; call ``start()`` or ``serve_forever()``."""
    check_tls(certfile, keyfile, client_cafile, must_exist=False)
    ctx = ssl_context(certfile, keyfile, client_cafile) if certfile is not None and keyfile is not None else None
    return SidecarServer(SidecarCollector(directory, stale_seconds), addr, port, ctx)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The ``serve`` options (for the CLI's subparser)."""
    p.add_argument("--dir", required=True, help="directory the ranks write rank-<rank>.prom files to")
    p.add_argument("--port", type=_port, required=True, help="port to serve /metrics on")
    p.add_argument("--addr", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--certfile", help="serve HTTPS with this certificate (PEM); needs --keyfile")
    p.add_argument("--keyfile", help="private key of --certfile (PEM)")
    p.add_argument("--client-cafile", help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--stale-seconds", type=_positive_float, default=DEFAULT_STALE_SECONDS,
                   help=f"a rank whose file is older than this is flagged stale (default {DEFAULT_STALE_SECONDS:g})")


def serve_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel serve --dir D --port P [...]``: serve until SIGTERM / Ctrl-C."""
    p = argparse.ArgumentParser(prog="fsdp-mem-otel serve", description=(__doc__ or "").split("\n\n")[0])
    add_serve_args(p)
    args = p.parse_args(argv)
    if (args.certfile is None) != (args.keyfile is None):
        p.error("--certfile and --keyfile go together")
    if args.client_cafile is not None and args.certfile is None:
        p.error("--client-cafile needs --certfile and --keyfile")
    if not os.path.isdir(args.dir):
        logger.warning("fsdp_mem_otel serve: %s does not exist yet; serving freshness once ranks write", args.dir)
    try:
        server = make_server(args.dir, args.port, args.addr, certfile=args.certfile, keyfile=args.keyfile,
                             client_cafile=args.client_cafile, stale_seconds=args.stale_seconds)
    except (OSError, ssl.SSLError) as exc:
        print(f"fsdp-mem-otel serve: cannot listen on {args.addr}:{args.port}: {exc}", flush=True)
        return 1

    def _stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    scheme = "https" if args.certfile else "http"
    print(f"fsdp-mem-otel serve: {scheme}://{args.addr}:{server.port}/metrics from {args.dir}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _port(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(serve_main())
