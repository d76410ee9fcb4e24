"""JSONL exporter: one ``StepReport.to_dict()`` per line, size-capped rotation. Does not import torch.

``export()`` hands the report to a writer thread and returns; the thread serializes it (JSON,
sorted keys) and writes the line with one unbuffered ``write`` to a file opened in append mode,
so what a step wrote is in the kernel once the thread is past it: a crash loses at most the step
in flight (and anything still queued behind a stalled file system). Before a line would take the
file past ``max_bytes`` the file is rotated like ``logging.handlers.RotatingFileHandler``:
``path`` -> ``path.1`` -> ... -> ``path.<backup_count>`` (the oldest is deleted).

Why not ``RotatingFileHandler`` itself: it reports write failures only through
``Handler.handleError`` (a traceback on stderr per record), leaves a half-rotated stream behind,
and we need each failure counted in ``errors_total``, logged once per outage, and the file
reopened when the fault clears (disk full, directory gone read-only, NFS hiccup).

Side index: for every line written to a data file, one compact JSON line is appended to
``<data file>.index`` (``run.jsonl.index``, rotated with its data file: ``run.jsonl.1.index``,
...): ``{"length": L, "offset": O, "report": {...}}`` where ``report`` is the line's
``StepReport.to_dict()`` without ``modules`` and ``module_order`` (the step-level fields) and
``offset`` / ``length`` locate the full line (its newline included) in the data file. The index
line is written only after the data line is complete, so an entry never points at a partial line;
a crash can leave the index one entry short or its last line torn, never ahead of the data.
``fsdp-mem-otel report`` reads the index instead of the (large) data file when it is consistent,
and falls back to reading the data file otherwise. Index write failures are counted in
``errors_total`` like data write failures and never raise.

``read_reports(path)`` reads a file back, with its rotated predecessors first when given the base
path; a line cut short by a crash or a full disk is skipped with a warning. Index files are not
step reports: they are never picked up as rotated files, and one given by name is ignored.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import Any

from fsdp_mem_otel.jsonl_format import (
    INDEX_OMITS,
    INDEX_SUFFIX,
    RANK_PLACEHOLDER,
    check_path,
    encode,
    index_line,
    index_path,
    is_index_path,
    move_pair,
    read_reports,
    remove_if_exists,
    rotated_files,
)
from fsdp_mem_otel.model import StepReport

# the file format lives in jsonl_format; these names stay importable from here
__all__ = ["INDEX_OMITS", "INDEX_SUFFIX", "RANK_PLACEHOLDER", "JSONLExporter", "index_line", "index_path",
           "is_index_path", "read_reports", "rotated_files"]

logger = logging.getLogger("fsdp_mem_otel")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_BACKUP_COUNT = 5
DEFAULT_MAX_QUEUE = 1000
_FILE_MODE = 0o644
_STOP = object()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    return value


class JSONLExporter:
    """Write every StepReport as one JSON line to ``path``.

    Args:
        path: the file (parents are created). ``{rank}`` in it is replaced by the report's rank.
        max_bytes: rotate before a line would take the file past this size; 0 = never rotate. A
            single line larger than this gets a file of its own.
        backup_count: rotated files kept (``path.1`` newest .. ``path.N`` oldest); with 0 the file
            is simply restarted when full.
        max_queue: reports waiting for the writer thread at most; beyond that a report is
            dropped and counted (``dropped_total`` and ``errors_total``).
        index: also write the side index ``<file>.index`` (see the module doc).

    I/O failures never raise into training: each failed line is counted in ``errors_total``,
    the first of an outage is logged (and the recovery), and the next report retries.
    ``flush()`` waits until everything exported so far is written; ``shutdown()`` flushes, stops
    the thread and closes the file, and is safe to call twice.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backup_count: int = DEFAULT_BACKUP_COUNT,
        max_queue: int = DEFAULT_MAX_QUEUE,
        index: bool = True,
    ) -> None:
        self.path_template = check_path("path", path)
        self.max_bytes = _check_int("max_bytes", max_bytes, 0)
        self.backup_count = _check_int("backup_count", backup_count, 0)
        self.max_queue = _check_int("max_queue", max_queue, 1)
        if not isinstance(index, bool):
            raise TypeError(f"index must be a bool; got {type(index).__name__}")
        self.index = index
        self.path: str | None = None if RANK_PLACEHOLDER in self.path_template else self.path_template
        self.errors_total = 0
        self.dropped_total = 0
        self.lines_total = 0
        self._file: Any = None  # raw (unbuffered) binary file, or None when closed / after a failure
        self._size = 0
        self._index_file: Any = None  # raw binary file of the side index, or None
        self._failing = False
        self._closed = False
        self._queue: queue.Queue[object] = queue.Queue(maxsize=self.max_queue)
        self._pending = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._atexit: Any = None

    # -- Exporter protocol -------------------------------------------------------------------
    def export(self, report: StepReport) -> None:
        """Queue ``report`` for the writer thread; returns at once."""
        if self._closed:
            return
        if self._thread is None:
            self._start()
        with self._cond:
            self._pending += 1
        try:
            self._queue.put_nowait(report)
        except queue.Full:
            with self._cond:
                self._pending -= 1
                self.dropped_total += 1
                self.errors_total += 1
                self._cond.notify_all()
            if self.dropped_total == 1:
                logger.warning("fsdp_mem_otel: JSONL writer is %d reports behind; dropping reports", self.max_queue)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report exported so far is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Write what is queued, stop the thread and close the file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        thread = self._thread
        if thread is not None:
            try:
                self._queue.put(_STOP, timeout=timeout)  # the queue may be full behind a stuck write
            except queue.Full:
                logger.warning("fsdp_mem_otel: JSONL writer stuck; %d reports not written", self._pending)
                return
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("fsdp_mem_otel: JSONL writer did not finish within %.0f s", timeout)
                return
        self._close_file()

    # -- writer thread -----------------------------------------------------------------------
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fsdp-mem-otel-jsonl", daemon=True)
        self._thread.start()
        # Drain at interpreter exit if the user never called shutdown(); weak so the exporter
        # can still be collected.
        ref = weakref.ref(self)

        def _drain() -> None:
            exporter = ref()
            if exporter is not None:
                exporter.shutdown(timeout=5.0)

        self._atexit = _drain
        atexit.register(_drain)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self._write_report(item)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - the writer thread must survive anything
                self._count_error("JSONL export failed")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _write_report(self, report: StepReport) -> None:
        data, line = encode(report)
        if self.path is None:
            self.path = self.path_template.replace(RANK_PLACEHOLDER, str(int(report.rank)))
        try:
            offset = self._write_line(self.path, line)
        except OSError:
            self._close_file()
            self._count_error(f"cannot write {self.path}")
            return
        self.lines_total += 1
        if self.index:
            # only now: the data line is complete, so the entry never points at a partial line
            try:
                self._write_index(self.path, index_line(data, offset, len(line)))
            except OSError:
                self._close_index()
                self._count_error(f"cannot write {index_path(self.path)}")
                return
        if self._failing:
            self._failing = False
            logger.warning("fsdp_mem_otel: JSONL export to %s recovered", self.path)

    def _count_error(self, what: str) -> None:
        with self._cond:
            self.errors_total += 1
        if not self._failing:
            self._failing = True
            logger.exception("fsdp_mem_otel: %s (counted in errors_total; retrying at every step)", what)

    def _write_line(self, path: str, line: bytes) -> int:
        """Append ``line`` to the data file (rotating first if due); returns its offset."""
        if self._file is None:
            self._open(path)
        if self.max_bytes and self._size > 0 and self._size + len(line) > self.max_bytes:
            self._rotate(path)
        offset = self._size
        _write_all(self._file, line, self)
        return offset

    def _write_index(self, path: str, entry: bytes) -> None:
        if self._index_file is None:
            ipath = index_path(path)
            f = open(ipath, "ab", buffering=0)
            try:
                size = f.seek(0, os.SEEK_END)
                if size > 0:
                    with open(ipath, "rb") as r:  # a torn last entry must not swallow this one
                        r.seek(size - 1)
                        if r.read(1) != b"\n":
                            f.write(b"\n")
            except BaseException:
                f.close()
                raise
            self._index_file = f
        _write_all(self._index_file, entry, None)

    def _open(self, path: str) -> None:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        f = open(path, "ab", buffering=0)
        try:
            size = f.seek(0, os.SEEK_END)
            if size > 0:
                # A line cut short by an earlier failure (or a crash) must not swallow the next one.
                with open(path, "rb") as r:
                    r.seek(size - 1)
                    if r.read(1) != b"\n":
                        size += f.write(b"\n")
        except BaseException:
            f.close()
            raise
        self._file, self._size = f, size

    def _rotate(self, path: str) -> None:
        """Data file and index move together: ``path.i`` and ``path.i.index`` -> ``path.i+1`` and
        ``path.i+1.index``; a data file moved without an index leaves none behind at its target."""
        self._close_file()
        if self.backup_count > 0:
            for i in range(self.backup_count - 1, 0, -1):
                src = f"{path}.{i}"
                if os.path.exists(src):
                    move_pair(src, f"{path}.{i + 1}")
            move_pair(path, f"{path}.1")
        else:
            os.remove(path)
            remove_if_exists(index_path(path))
        self._open(path)

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        self._close_index()

    def _close_index(self) -> None:
        f, self._index_file = self._index_file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def _write_all(f: Any, data: bytes, exporter: JSONLExporter | None) -> None:
    """Write all of ``data`` to the unbuffered file ``f`` (adding to ``exporter._size``)."""
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError("short write")
        if exporter is not None:
            exporter._size += n
        view = view[n:]
