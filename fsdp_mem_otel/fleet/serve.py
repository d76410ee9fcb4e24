"""``fsdp-mem-otel serve``: one /metrics endpoint over a directory of per-rank files.

Each rank's ``PrometheusExporter(sidecar_dir=D)`` replaces ``D/rank-<rank>.prom`` atomically at
every step. At every scrape this server reads each rank file whole (so it never sees half a file),
merges the families (each HELP/TYPE once, the samples of all ranks, a series claimed twice kept
once) and adds, per rank, when its file last held valid metrics and whether that is longer ago
than ``--stale-seconds``, so a dead or stuck rank shows up as ``fsdp_mem_sidecar_rank_stale == 1``
instead of silently vanishing.

It trusts nothing in the directory (``emptyDir`` volumes are writable by every container of the
pod): files are opened without following symlinks and must be regular files (a FIFO or device is
refused, never read); at most ``max_file_bytes`` are read of one and ``max_files`` files are
served; a refusal is counted in ``fsdp_mem_sidecar_refused_files_total{reason}`` and logged once,
and nothing of a file's content ever reaches the log. A rank is fresh only by a file that parsed:
its time is taken after a successful parse (as node_exporter's textfile collector does), so a
rank rewriting garbage goes stale. Parsed files are cached by content, not by modification time,
so the ranks' 10 s heartbeats cost a read, not a parse; what is kept is the files' text, not
parsed objects. A directory it cannot list sets ``fsdp_mem_sidecar_directory_readable`` to 0 and
leaves the ranks it knew, stale.

A rank that ended (its exporter shut down and wrote ``fsdp_mem_rank_end_timestamp_seconds{reason}``
into its last file) is not stale: its last file is served, end included, for ``--ended-seconds``
after it was written, then left out, so the rank's series end with its end on record. On SIGTERM
the server keeps answering until every ended rank's last file has been scraped once (at most
``--drain-seconds``; a Kubernetes pod's sidecar is stopped right after training exits, before
the next scrape would come), waiting up to ``DRAIN_SETTLE_SECONDS`` for ranks still live to
write their end (containers stopped together). A restarted server reads the same files and
serves the same series and counter values: nothing resets.

Does not import torch: the sidecar container needs only prometheus_client.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import signal
import socket
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from fsdp_mem_otel.checks import check_tls, int_at_least, seconds_above_zero, seconds_at_least_zero
from fsdp_mem_otel.cli_errors import ArgumentParser, UsageError
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet.http_server import CONTENT_TYPE, MetricsServer, ssl_context
from fsdp_mem_otel.fleet.rank_files import rank_of

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "SidecarCollector", "make_server", "serve_main", "ssl_context"]

DEFAULT_STALE_SECONDS = 300.0
#: an ended rank's last file is served this long after it was written (several scrape intervals)
DEFAULT_ENDED_SECONDS = 300.0
#: on SIGTERM, keep serving at most this long until every ended rank's last file was scraped
#: (a 30 s scrape interval plus the scrape; the pod's terminationGracePeriodSeconds must exceed it)
DEFAULT_DRAIN_SECONDS = 40.0
#: on SIGTERM, how long to wait for ranks still live to write their end (pods whose containers
#: are stopped together; a native sidecar is stopped after training exited)
DRAIN_SETTLE_SECONDS = 2.0
#: bytes read of one rank file at most (a rank with 256 modules writes about 0.13 MB, 0.6 MB with
#: FSDP_MEM_OTEL_DETAIL=1 and the default top-8 detail budget; see docs/exporting.md's sidecar limits)
DEFAULT_MAX_FILE_BYTES = 16 * 1024 * 1024
#: rank files served at most (the ranks of one pod)
DEFAULT_MAX_FILES = 64
#: identity labels copied from a rank's samples onto its freshness series
_ID_LABELS = cat.IDENTITY_LABELS + cat.OPTIONAL_IDENTITY_LABELS
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass
class _Family:
    """One metric family of one rank file, as text."""

    name: str
    type: str
    head: list[str]  # its HELP and TYPE lines
    samples: list[tuple[str, str]] = field(default_factory=list)  # (series key, line)


@dataclass
class _Parsed:
    digest: bytes
    families: list[_Family]
    identity: dict[str, str]
    ended: bool = False  # the file records the rank's end (fsdp_mem_rank_end_timestamp_seconds)


class SidecarCollector:
    """The merged exposition of a directory of rank files, plus per-rank freshness (``render``)."""

    def __init__(self, directory: str, stale_seconds: float = DEFAULT_STALE_SECONDS,
                 clock: Callable[[], float] = time.time, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_files: int = DEFAULT_MAX_FILES, ended_seconds: float = DEFAULT_ENDED_SECONDS) -> None:
        if not isinstance(stale_seconds, int | float) or stale_seconds <= 0:
            raise ValueError(f"stale_seconds must be a positive number; got {stale_seconds!r}")
        if not isinstance(ended_seconds, int | float) or ended_seconds <= 0:
            raise ValueError(f"ended_seconds must be a positive number; got {ended_seconds!r}")
        self.directory = directory
        self.stale_seconds = float(stale_seconds)
        self.ended_seconds = float(ended_seconds)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self._clock = clock
        self._lock = threading.Lock()
        self._parsed: dict[int, _Parsed] = {}  # rank -> its file's last good parse
        self._fresh: dict[int, float] = {}  # rank -> modification time of its last good file (0: none yet)
        self._identity: dict[int, dict[str, str]] = {}
        self._read_errors: dict[int, int] = {}
        self._delivered: dict[int, bytes] = {}  # ended rank -> digest of its last file, once served
        self._refused: dict[str, int] = {"not_regular": 0, "too_large": 0, "too_many": 0}
        self._readable: bool | None = None  # None: the directory does not exist (yet)
        self.failures = FailureLog(logger, "sidecar server")

    # -- reading ---------------------------------------------------------------------------------
    def _rank_files(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # no rank has written yet: nothing to say about it either
            self._readable = None
            return []
        except OSError as exc:
            self._readable = False
            self.failures.failed("listing the directory", None, f"cannot list {self.directory}: {type(exc).__name__}")
            return []
        self._readable = True
        self.failures.recovered("listing the directory")
        found = sorted((rank, name) for name in names if (rank := rank_of(name)) is not None)
        if len(found) > self.max_files:
            self._refused["too_many"] += len(found) - self.max_files
            self.failures.failed("too many rank files", None,
                                 f"{len(found)} rank files, serving the first {self.max_files} (max_files)")
            found = found[: self.max_files]
        return [(rank, os.path.join(self.directory, name)) for rank, name in found]

    def _read(self, rank: int, path: str) -> tuple[bytes, float] | None:
        """(content, modification time) of a regular file of at most max_file_bytes, else None."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink; EACCES: another user's file
            reason = "not_regular" if os.path.islink(path) else None
            self._error(rank, path, exc, reason)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._error(rank, path, None, "not_regular")
                return None
            if st.st_size > self.max_file_bytes:
                self._error(rank, path, None, "too_large")
                return None
            chunks, total = [], 0
            while True:
                chunk = os.read(fd, min(1 << 20, self.max_file_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > self.max_file_bytes:  # grew while being read
                    self._error(rank, path, None, "too_large")
                    return None
            return b"".join(chunks), os.fstat(fd).st_mtime
        except OSError as exc:
            self._error(rank, path, exc, None)
            return None
        finally:
            os.close(fd)

    def _error(self, rank: int, path: str, exc: BaseException | None, refused: str | None) -> None:
        self._read_errors[rank] = self._read_errors.get(rank, 0) + 1
        if refused is not None:
            self._refused[refused] += 1
        # what went wrong, never what the file holds
        what = refused or (type(exc).__name__ if exc is not None else "unreadable")
        self.failures.failed(f"reading {path}", None, f"rank {rank}'s file left out: {what}")

    @staticmethod
    def _parse(data: bytes) -> _Parsed:
        """Validate a rank file and split it into families of text lines; ValueError if invalid."""
        text = data.decode("utf-8")
        list(text_string_to_metric_families(text))  # validates; the objects are not kept
        families: list[_Family] = []
        by_name: dict[str, _Family] = {}
        identity: dict[str, str] = {}
        current: _Family | None = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                parts = line.split(" ", 3)
                name = parts[2]
                fam = by_name.get(name)
                if fam is None:
                    fam = by_name[name] = _Family(name, "untyped", [])
                    families.append(fam)
                if parts[1] == "TYPE" and len(parts) > 3:
                    fam.type = parts[3]
                fam.head.append(line)
                current = fam
            elif line.startswith("#"):
                continue
            else:
                key = line.rsplit(" ", 1)[0]
                if current is None:
                    raise ValueError("a sample before any HELP/TYPE line")
                current.samples.append((key, line))
        info = by_name.get(cat.TRACKER_INFO.name)
        if info is not None:
            info_text = "\n".join(info.head + [ln for _, ln in info.samples]) + "\n"
            for info_family in text_string_to_metric_families(info_text):
                if info_family.samples:
                    labels = info_family.samples[0].labels
                    identity = {k: labels[k] for k in _ID_LABELS if k in labels}
        return _Parsed(b"", families, identity, cat.RANK_END_TIMESTAMP_SECONDS.name in by_name)

    # -- one scrape --------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The merged exposition of every rank file, then the sidecar's own series."""
        with self._lock:  # the cache and counters are shared by concurrent scrapes
            self._read_all()
            hidden = self._ended_long_ago()
            body = self._merge(hidden)
            own = self._own_families(hidden)
            for rank, parsed in self._parsed.items():
                if parsed.ended and rank not in hidden:
                    self._delivered[rank] = parsed.digest
        return body + generate_latest(_Families(own))

    def drain_state(self) -> tuple[list[int], list[int]]:
        """Read the directory; (ended ranks whose last file no scrape has served yet, ranks still
        live: fresh, not ended). SIGTERM waits on these."""
        with self._lock:
            self._read_all()
            hidden = self._ended_long_ago()
            now = self._clock()
            pending = [r for r, p in sorted(self._parsed.items())
                       if p.ended and r not in hidden and self._delivered.get(r) != p.digest]
            live = [r for r, p in sorted(self._parsed.items())
                    if not p.ended and now - self._fresh.get(r, 0.0) <= self.stale_seconds]
        return pending, live

    def _read_all(self) -> None:
        files = self._rank_files()
        present = {rank for rank, _ in files}
        for rank in list(self._parsed):
            if rank not in present and self._readable is not False:
                del self._parsed[rank]  # the file is gone: so are its samples
                self._fresh.pop(rank, None)
                self._delivered.pop(rank, None)
        for rank, path in files:
            self._refresh(rank, path)

    def _ended_long_ago(self) -> set[int]:
        """Ended ranks whose last file is older than ended_seconds: no longer served."""
        now = self._clock()
        return {r for r, p in self._parsed.items() if p.ended and now - self._fresh.get(r, 0.0) > self.ended_seconds}

    def _refresh(self, rank: int, path: str) -> None:
        got = self._read(rank, path)
        self._fresh.setdefault(rank, 0.0)
        if got is None:
            return
        data, mtime = got
        digest = hashlib.blake2b(data, digest_size=16).digest()
        cached = self._parsed.get(rank)
        if cached is None or cached.digest != digest:
            try:
                parsed = self._parse(data)
            except Exception as exc:  # noqa: BLE001 - a bad file must not break the other ranks
                self._parsed.pop(rank, None)
                self._error(rank, path, exc, None)
                return
            parsed.digest = digest
            self._parsed[rank] = parsed
            if parsed.identity:
                self._identity[rank] = parsed.identity
        self._fresh[rank] = mtime  # only a file that parsed makes its rank fresh

    def _merge(self, hidden: set[int]) -> bytes:
        merged: dict[str, _Family] = {}
        seen: set[str] = set()
        for rank in sorted(self._parsed):
            if rank in hidden:
                continue
            for fam in self._parsed[rank].families:
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = _Family(fam.name, fam.type, fam.head, [])
                elif into.type != fam.type:
                    self.failures.failed(f"type of {fam.name}", None,
                                         f"rank {rank}: {fam.name} is a {fam.type}, another rank's a {into.type}; "
                                         "left out")
                    continue
                for key, line in fam.samples:
                    if key not in seen:  # the same series from two files: Prometheus would reject the scrape
                        seen.add(key)
                        into.samples.append((key, line))
        out: list[str] = []
        for fam in merged.values():
            out.extend(fam.head)
            out.extend(line for _, line in fam.samples)
        return ("\n".join(out) + "\n").encode("utf-8") if out else b""

    def _own_families(self, hidden: set[int]) -> list[Metric]:
        now = self._clock()
        updated = GaugeMetricFamily(cat.SIDECAR_RANK_LAST_UPDATE.name, cat.SIDECAR_RANK_LAST_UPDATE.help,
                                    labels=None)
        stale = GaugeMetricFamily(cat.SIDECAR_RANK_STALE.name, cat.SIDECAR_RANK_STALE.help, labels=None)
        for rank in sorted(self._fresh):
            if rank in hidden:
                continue
            mtime = self._fresh[rank]
            labels = {**self._identity.get(rank, {}), "rank": str(rank)}
            updated.add_sample(updated.name, labels, mtime)
            parsed = self._parsed.get(rank)
            ended = parsed is not None and parsed.ended  # an ended rank is not stale: it said goodbye
            stale.add_sample(stale.name, labels, 1.0 if not ended and now - mtime > self.stale_seconds else 0.0)
        errors = CounterMetricFamily(cat.SIDECAR_READ_ERRORS_TOTAL.name, cat.SIDECAR_READ_ERRORS_TOTAL.help,
                                     labels=list(cat.SIDECAR_READ_ERRORS_TOTAL.labels))
        for rank in sorted(self._read_errors):
            errors.add_metric([str(rank)], float(self._read_errors[rank]))
        refused = CounterMetricFamily(cat.SIDECAR_REFUSED_FILES_TOTAL.name, cat.SIDECAR_REFUSED_FILES_TOTAL.help,
                                      labels=list(cat.SIDECAR_REFUSED_FILES_TOTAL.labels))
        for reason, n in sorted(self._refused.items()):
            if n:
                refused.add_metric([reason], float(n))
        out = [updated, stale, errors, refused]
        if self._readable is not None:
            out.append(GaugeMetricFamily(cat.SIDECAR_DIRECTORY_READABLE.name, cat.SIDECAR_DIRECTORY_READABLE.help,
                                         value=1.0 if self._readable else 0.0))
        return out


class _Families:
    """A fixed list of families, as prometheus_client's generate_latest wants them."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def make_server(directory: str, port: int, addr: str = "0.0.0.0", *, certfile: str | None = None,
                keyfile: str | None = None, client_cafile: str | None = None,
                stale_seconds: float = DEFAULT_STALE_SECONDS, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                max_files: int = DEFAULT_MAX_FILES, ended_seconds: float = DEFAULT_ENDED_SECONDS) -> MetricsServer:
    """A bound (not yet serving) sidecar server; call ``start()`` or ``serve_forever()``."""
    check_tls(certfile, keyfile, client_cafile, must_exist=False)
    ctx = ssl_context(certfile, keyfile, client_cafile) if certfile is not None and keyfile is not None else None
    collector = SidecarCollector(directory, stale_seconds, max_file_bytes=max_file_bytes, max_files=max_files,
                                 ended_seconds=ended_seconds)
    server = MetricsServer(collector.render, addr, port, ssl_context=ctx,
                           banner=b"fsdp-mem-otel sidecar: metrics at /metrics\n")
    server.collector = collector  # type: ignore[attr-defined]
    return server


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The ``serve`` options (for the CLI's subparser)."""
    p.add_argument("--dir", required=True, help="directory the ranks write rank-<rank>.prom files to")
    p.add_argument("--port", type=int_at_least(0, 65535, "a port in 0..65535"), required=True,
                   help="port to serve /metrics on")
    p.add_argument("--addr", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--certfile", help="serve HTTPS with this certificate (PEM); needs --keyfile")
    p.add_argument("--keyfile", help="private key of --certfile (PEM)")
    p.add_argument("--client-cafile", help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--stale-seconds", type=seconds_above_zero, default=DEFAULT_STALE_SECONDS,
                   help=f"a rank whose file is older than this is flagged stale (default {DEFAULT_STALE_SECONDS:g})")
    p.add_argument("--max-file-bytes", type=int_at_least(1), default=DEFAULT_MAX_FILE_BYTES,
                   help=f"read at most this much of one rank file; larger ones are refused (default "
                        f"{DEFAULT_MAX_FILE_BYTES})")
    p.add_argument("--max-files", type=int_at_least(1), default=DEFAULT_MAX_FILES,
                   help=f"serve at most this many rank files (default {DEFAULT_MAX_FILES})")
    p.add_argument("--ended-seconds", type=seconds_above_zero, default=DEFAULT_ENDED_SECONDS,
                   help="serve a rank that ended (its last file records the end) this long after its last write, "
                        f"then leave it out (default {DEFAULT_ENDED_SECONDS:g})")
    p.add_argument("--drain-seconds", type=seconds_at_least_zero, default=DEFAULT_DRAIN_SECONDS,
                   help="on SIGTERM, keep serving at most this long until every ended rank's last file was scraped "
                        f"once (default {DEFAULT_DRAIN_SECONDS:g}; 0: stop at once)")


def serve_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel serve --dir D --port P [...]``: serve until SIGTERM / Ctrl-C."""
    p = ArgumentParser(prog="fsdp-mem-otel serve", description=(__doc__ or "").split("\n\n")[0])
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
                             client_cafile=args.client_cafile, stale_seconds=args.stale_seconds,
                             max_file_bytes=args.max_file_bytes, max_files=args.max_files,
                             ended_seconds=args.ended_seconds)
    except ssl.SSLError as exc:
        raise UsageError(f"--certfile/--keyfile: cannot serve TLS with {args.certfile} and {args.keyfile}: {exc}",
                         code=1) from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {args.port}: {args.addr}:{args.port} is already in use; stop what listens "
                             "there or give another --port", code=1) from exc
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UsageError(f"--port {args.port}: not allowed to listen on {args.addr}:{args.port} "
                             f"({exc.strerror}); give a --port above 1023", code=1) from exc
        if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
            raise UsageError(f"--addr {args.addr}: cannot listen there ({exc.strerror or exc}); give an address "
                             "of this machine (0.0.0.0 for every one)", code=1) from exc
        if args.certfile and not all(os.path.isfile(f) for f in (args.certfile, args.keyfile)):
            raise UsageError(f"--certfile/--keyfile: {exc}; give the PEM files of the certificate and its key",
                             code=1) from exc
        raise UsageError(f"--addr/--port: cannot listen on {args.addr}:{args.port} ({exc.strerror or exc})",
                         code=1) from exc
    stopping = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=_drain_then_stop, args=(server, args.drain_seconds), daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    scheme = "https" if args.certfile else "http"
    print(f"fsdp-mem-otel serve: {scheme}://{args.addr}:{server.port}/metrics from {args.dir}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(timeout=1.0)
    return 0


def _drain_then_stop(server: MetricsServer, drain_seconds: float) -> None:
    """Keep serving until every ended rank's last file was scraped (and ranks still live had
    DRAIN_SETTLE_SECONDS to write their end), at most ``drain_seconds``; then stop."""
    collector: SidecarCollector = server.collector  # type: ignore[attr-defined]
    start = time.monotonic()
    deadline, settle = start + drain_seconds, start + min(DRAIN_SETTLE_SECONDS, drain_seconds)
    while True:
        try:
            pending, live = collector.drain_state()
        except Exception:  # noqa: BLE001 - stopping must not fail
            logger.exception("fsdp_mem_otel serve: reading the rank files while stopping failed")
            break
        now = time.monotonic()
        if not pending and (not live or now >= settle):
            break
        if now >= deadline:
            logger.warning("fsdp_mem_otel serve: stopping before ranks %s were scraped with their end "
                           "(--drain-seconds %g)", pending, drain_seconds)
            break
        time.sleep(0.1)
    server.shutdown()


if __name__ == "__main__":
    from fsdp_mem_otel.cli_errors import run_command

    logging.basicConfig(level=logging.INFO)
    raise SystemExit(run_command("fsdp-mem-otel serve", serve_main, sys.argv[1:]))
