"""JSONL exporter: one ``StepReport.to_dict()`` per line, size-capped rotation. Does not import torch.

``export()`` hands the report to a background worker (``fsdp_mem_otel.exporters.worker``) and returns; the
worker serializes it (JSON, sorted keys) and writes the line with one unbuffered ``write`` to a
file opened in append mode, so what a step wrote is in the kernel once the worker is past it: a
crash loses at most the step in flight (and what waits behind a stalled file system). What waits
is bounded in reports and in bytes; beyond that the oldest waiting reports are dropped and counted,
and a write stuck for ``DEFAULT_STALL_SECONDS`` is logged once, so a hung file system costs
bounded memory. Before a line would take the file past ``max_bytes`` the file is rotated like
``logging.handlers.RotatingFileHandler``:
``path`` -> ``path.1`` -> ... -> ``path.<backup_count>`` (the oldest is deleted); the file just
rotated is gzip-compressed in the writer's thread (``path.1.gz``, about a tenth of the bytes;
``compress=False`` keeps it plain), and ``read_reports``, ``report`` and ``compare`` read it.

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

import copy
import logging
import os
from typing import Any

from fsdp_mem_otel.config import DEFAULT_JSONL_MODULES_CHANGE, DEFAULT_JSONL_MODULES_EVERY, JSONLConfig
from fsdp_mem_otel.exporters.peaks import all_calls, module_peaks
from fsdp_mem_otel.exporters.worker import BackgroundWorker
from fsdp_mem_otel.failures import FailureLog
from fsdp_mem_otel.offline.jsonl_format import (
    GZIP_SUFFIX,
    INDEX_OMITS,
    INDEX_SUFFIX,
    RANK_PLACEHOLDER,
    check_path,
    compress_pair,
    encode,
    index_line,
    index_path,
    is_gzip,
    is_index_path,
    move_pair,
    read_reports,
    remove_if_exists,
    rotated_files,
    slot_files,
)
from fsdp_mem_otel.schema import DEEP, StepReport

# the file format lives in jsonl_format; these names stay importable from here
__all__ = ["INDEX_OMITS", "INDEX_SUFFIX", "RANK_PLACEHOLDER", "JSONLExporter", "index_line", "index_path",
           "is_index_path", "read_reports", "rotated_files"]

logger = logging.getLogger(__name__)

_DEFAULTS = JSONLConfig(path="-")
#: a module's peak must move by at least this much (and by modules_change) to force a snapshot
_MIN_CHANGE_BYTES = 64 * 1024
DEFAULT_MAX_BYTES = _DEFAULTS.max_bytes
DEFAULT_BACKUP_COUNT = _DEFAULTS.backup_count
DEFAULT_MAX_QUEUE = _DEFAULTS.max_queue
#: bytes of reports waiting for the writer at most (estimated in memory, see ``report_bytes``)
DEFAULT_MAX_QUEUE_BYTES = _DEFAULTS.max_queue_bytes
#: a write stuck this long (hung NFS, a FIFO nobody reads) is logged once
DEFAULT_STALL_SECONDS = 30.0


def report_bytes(report: StepReport, snapshots: int | None = None) -> int:
    """What ``report`` holds in memory, roughly: its module snapshots dominate (a dict of 12
    integers per device each, about 700 bytes measured), plus the step-level fields. Counted
    without building the snapshot dicts (this runs on the training thread, in ``export``);
    ``snapshots``: their number, when known (else counted)."""
    if snapshots is None:
        snapshots = all_calls(report.modules)
    return 2048 + 700 * snapshots * max(1, len(report.peak))


#: ``export`` counts a light step's snapshots every this many light steps (and when the number of
#: modules changes); in between it takes the last count (see ``JSONLExporter._queue_bytes``)
_COUNT_EVERY = 100


class JSONLExporter:
    """Write every StepReport as one JSON line to ``path``.

    Args:
        path: the file (parents are created). ``{rank}`` in it is replaced by the report's rank.
        max_bytes: rotate before a line would take the file past this size; 0 = never rotate. A
            single line larger than this gets a file of its own.
        backup_count: rotated files kept (``path.1`` newest .. ``path.N`` oldest); with 0 the file
            is simply restarted when full.
        max_queue, max_queue_bytes: reports (and their estimated bytes) waiting for the writer
            at most; beyond that the oldest waiting are dropped and counted (``dropped_total``
            and ``errors_total``).
        index: also write the side index ``<file>.index`` (see the module doc).
        compress: gzip each rotated file (``path.1.gz``; a failure is counted and leaves it plain).
        modules_every, modules_change: the budget. A line carries the module snapshots (nearly
            all of its bytes at 100 modules) on the first step, every ``modules_every``-th step,
            deep and aborted steps, the first line of a file, and when the module keys changed or
            a module's forward or backward peak moved by more than ``modules_change`` (a ratio)
            and 64 KiB since the last line that carried them; other lines carry
            ``modules_from``, that line's step, and readers (``read_reports``, ``scan_files``,
            ``report``, ``compare``) fill its snapshots in.
        config: all of the above as one ``JSONLConfig`` (then ``path`` and the keywords are not used).

    I/O failures never raise into training: each failed line is counted in ``errors_total``,
    the first of an outage is logged (and the recovery), and the next report retries.
    ``flush()`` waits until everything exported so far is written; ``shutdown()`` writes what
    waits until its deadline, closes the file, and is safe to call twice.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = "",
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backup_count: int = DEFAULT_BACKUP_COUNT,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        index: bool = True,
        compress: bool = True,
        modules_every: int = DEFAULT_JSONL_MODULES_EVERY,
        modules_change: float = DEFAULT_JSONL_MODULES_CHANGE,
        config: JSONLConfig | None = None,
    ) -> None:
        if config is None:
            config = JSONLConfig(path=check_path("path", path), max_bytes=max_bytes, backup_count=backup_count,
                                 max_queue=max_queue, max_queue_bytes=max_queue_bytes, index=index,
                                 compress=compress, modules_every=modules_every, modules_change=modules_change)
        elif not isinstance(config, JSONLConfig):
            raise TypeError(f"config must be a JSONLConfig or None; got {type(config).__name__}")
        self.config = config
        self.path_template = config.path
        self.max_bytes, self.backup_count = config.max_bytes, config.backup_count
        self.max_queue, self.max_queue_bytes, self.index = config.max_queue, config.max_queue_bytes, config.index
        self.path: str | None = None if RANK_PLACEHOLDER in self.path_template else self.path_template
        self.lines_total = 0
        self.failures = FailureLog(logger, "JSONL exporter")
        self._file: Any = None  # raw (unbuffered) binary file, or None when closed / after a failure
        self._size = 0
        self._index_file: Any = None  # raw binary file of the side index, or None
        self._closed = False
        self._worker: BackgroundWorker[StepReport] | None = None
        #: the last line with module snapshots: its step and its modules' peaks
        self._modules_step: int | None = None
        self._module_peaks: dict[str, tuple[int, int, float, float]] = {}
        #: lines written without module snapshots (the budget), and with them
        self.lines_without_modules = 0
        #: _queue_bytes: the snapshots of the last light step counted, its modules, light steps since
        self._light_snapshots: int | None = None
        self._counted_modules = 0
        self._since_count = 0

    @property
    def errors_total(self) -> int:
        """Failed writes plus dropped reports."""
        return self.failures.total

    @property
    def dropped_total(self) -> int:
        """Reports dropped because the writer fell too far behind."""
        return self._worker.dropped if self._worker is not None else 0

    def open(self) -> None:
        """Open the file now (making its folder), so that a path this process cannot write fails
        here, with the ``OSError``, rather than at the first report. A path with ``{rank}`` is
        opened at the first report (the rank comes with it)."""
        if self.path is not None and self._file is None and not self._closed:
            self._open(self.path)

    # -- Exporter protocol -------------------------------------------------------------------
    def export(self, report: StepReport) -> None:
        """Queue ``report`` for the writer; returns at once."""
        if self._closed:
            return
        if self._worker is None:
            self._worker = BackgroundWorker("jsonl", self._write_report, self.failures, max_items=self.max_queue,
                                            max_bytes=self.max_queue_bytes)
        elif self._worker.stalled(DEFAULT_STALL_SECONDS):
            self.failures.warn_once("stall", f"writing {self.path} has been stuck for over "
                                    f"{DEFAULT_STALL_SECONDS:.0f} s (hung file system?); reports wait, "
                                    "bounded, the oldest dropped and counted")
        self._worker.submit(report, self._queue_bytes(report))

    def _queue_bytes(self, report: StepReport) -> int:
        """``report_bytes(report)`` for the queue's bound, on the training thread. Counting the
        snapshots walks every module's counters (0.1-0.2 ms a step at 100 modules, mostly cache
        misses), and a light step has as many as the last: deep and aborted steps are counted, and
        a light one on the first light step, when the number of modules changed and every
        ``_COUNT_EVERY`` light steps; the others take the last light count."""
        if report.mode == DEEP or report.aborted is not None:
            return report_bytes(report)
        modules = len(report.modules)
        self._since_count += 1
        if self._light_snapshots is None or modules != self._counted_modules or self._since_count >= _COUNT_EVERY:
            self._light_snapshots = all_calls(report.modules)
            self._counted_modules, self._since_count = modules, 0
        return report_bytes(report, self._light_snapshots)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report exported so far is written (or failed); False on timeout."""
        return self._worker.flush(timeout) if self._worker is not None else True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Write what waits (until ``timeout`` seconds), stop the worker and close the file.
        Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None and not self._worker.shutdown(timeout):
            return  # a write is stuck in the kernel: leave the file to the abandoned worker
        self._close_file()

    # -- the worker's side -------------------------------------------------------------------
    def _needs_modules(self, report: StepReport) -> bool:
        """Whether ``report``'s line carries its module snapshots (see the class doc). It runs for
        every line: the modules' peaks are compared with the tolerances kept from the last line
        that carried them, read from the counters (``exporters.peaks``), and nothing is built
        unless one moved."""
        last = self._module_peaks
        if (self._modules_step is None or report.step == 1 or report.step % self.config.modules_every == 0
                or report.mode == DEEP or report.aborted is not None or report.modules.keys() != last.keys()):
            return True
        for key, fwd, bwd in module_peaks(report.modules):
            old_fwd, old_bwd, fwd_tolerance, bwd_tolerance = last[key]
            if abs(fwd - old_fwd) > fwd_tolerance or abs(bwd - old_bwd) > bwd_tolerance:
                return True
        return False

    def _module_baseline(self, report: StepReport) -> dict[str, tuple[int, int, float, float]]:
        """Per module of a line that carries them: its forward and backward peaks and how far each
        may move before a line carries the snapshots again (``modules_change``, at least 64 KiB)."""
        ratio = self.config.modules_change
        out = {}
        for key, fwd, bwd in module_peaks(report.modules):
            out[key] = (fwd, bwd, max(ratio * fwd, _MIN_CHANGE_BYTES), max(ratio * bwd, _MIN_CHANGE_BYTES))
        return out

    def _starts_a_file(self, size: int) -> bool:
        return self._file is None or bool(self.max_bytes and self._size > 0 and self._size + size > self.max_bytes)

    def _write_report(self, report: StepReport) -> None:
        full = self._needs_modules(report)
        if not full:
            sparse = copy.copy(report)
            sparse.modules, sparse.module_order, sparse.modules_from = {}, [], self._modules_step
            data, line = encode(sparse)
            full = self._starts_a_file(len(line))  # every file stands alone: its first line has them
        if full:
            data, line = encode(report)
        if self.path is None:
            self.path = self.path_template.replace(RANK_PLACEHOLDER, str(int(report.rank)))
        try:
            offset = self._write_line(self.path, line)
        except OSError as exc:
            self._close_file()
            self.failures.failed("writing", exc, self.path)
            return
        self.lines_total += 1
        if full:
            self._modules_step, self._module_peaks = report.step, self._module_baseline(report)
        else:
            self.lines_without_modules += 1
        if self.index:
            # only now: the data line is complete, so the entry never points at a partial line
            try:
                self._write_index(self.path, index_line(data, offset, len(line)))
            except OSError as exc:
                self._close_index()
                self.failures.failed("writing", exc, index_path(self.path))
                return
        self.failures.recovered("writing")

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
        ``path.i+1.index`` (``.gz`` ones alike); a data file moved without an index leaves none
        behind at its target. Then ``path.1`` is compressed (``compress``)."""
        self._close_file()
        if self.backup_count > 0:
            for oldest in slot_files(path, self.backup_count):
                remove_if_exists(oldest)
                remove_if_exists(index_path(oldest))
            for i in range(self.backup_count - 1, 0, -1):
                for src in slot_files(path, i):
                    move_pair(src, f"{path}.{i + 1}{GZIP_SUFFIX if is_gzip(src) else ''}")
            move_pair(path, f"{path}.1")
        else:
            os.remove(path)
            remove_if_exists(index_path(path))
        self._open(path)
        if self.backup_count > 0 and self.config.compress:
            try:
                compress_pair(f"{path}.1")
            except OSError as exc:  # the file stays plain and readable
                self.failures.failed("compressing", exc, f"{path}.1")
            else:
                self.failures.recovered("compressing")

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
