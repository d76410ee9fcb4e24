"""The JSON-lines run file: how a StepReport is written, indexed, rotated, read and scanned.

Standard library, plus orjson to write lines (the standard library's ``json`` when it is missing).
``exporters/jsonl.py`` writes these files (its thread, its I/O failures); ``report.py`` charts what
this module reads. Nothing else knows the layout.

Layout: one ``StepReport.to_dict()`` per line, keys sorted (so the step-level fields sit around
``"modules"``, nearly all of a line's bytes), as ``json.dumps(..., sort_keys=True)`` writes it,
except the value of ``"modules"``, which orjson writes: compact, keys sorted, UTF-8 (``encode``;
about 5x less CPU on a line of 300 KB, and 10% fewer bytes). Where orjson would write something
that reads back differently (``null`` for NaN and the infinities) or refuses (integers past 64
bits), ``json.dumps`` writes it. Readers parse either (lines written before orjson, or
``StepReport.to_json()``, read the same).

Beside each data file, ``<file>.index`` holds one compact entry per data line:
``{"length": L, "offset": O, "report": {...}}``, the line's step-level fields (``INDEX_OMITS``
left out) and where the whole line is. Rotation moves ``path`` -> ``path.1`` -> ... with each
index following its data file; a rotated file is
gzip-compressed (``path.1.gz``, its index ``path.1.gz.index``, offsets in the uncompressed
bytes), and every reader here reads both forms.

Reading: ``read_reports`` parses whole lines; ``scan`` reads only the step-level fields (from a
consistent index, else around ``"modules"``), one file at a time, and ``read_line`` reads back
the complete line of a step when a chart needs its modules (``run_index.RunIndex`` keeps where
each line is). A line that does not parse is skipped with a warning.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from fsdp_mem_otel.checks import check_path
from fsdp_mem_otel.schema import TOTAL, StepReport

try:  # a dependency (pyproject.toml): writes the modules of a 300 KB line ~5x faster than json.dumps
    import orjson as _orjson
except ImportError:  # pragma: no cover - without it, json.dumps writes every value
    _orjson = None  # type: ignore[assignment]

Progress = Callable[[str], None]
#: what a line that does not make a StepReport raises: bad JSON, missing or mistyped fields, a
#: number too large for an int (1e400), nesting too deep for the parser
LINE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)


def quiet(_: str) -> None:
    pass


#: ``{rank}`` in the path is replaced by the report's rank (one file per rank from one code path)
RANK_PLACEHOLDER = "{rank}"
#: suffix of a data file's side index (``run.jsonl`` -> ``run.jsonl.index``)
INDEX_SUFFIX = ".index"
#: top-level keys of a StepReport dict left out of its index entry (the bulk of the line)
INDEX_OMITS = ("modules", "module_order")

def index_path(path: str) -> str:
    """The side index of data file ``path``."""
    return path + INDEX_SUFFIX


def is_index_path(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).endswith(INDEX_SUFFIX)


def index_line(report_dict: dict[str, Any], offset: int, length: int) -> bytes:
    """The index entry (one line, newline included) of a data line written at byte ``offset``
    with ``length`` bytes (its newline included) from ``report_dict`` (``StepReport.to_dict()``)."""
    summary = {k: v for k, v in report_dict.items() if k not in INDEX_OMITS}
    entry = {"length": length, "offset": offset, "report": summary}
    return (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


def encode(report: StepReport) -> tuple[dict[str, Any], bytes]:
    """``report`` as its dict (sharing ``report``'s nested data: serialize, never modify it) and
    its data line (UTF-8, newline included; the layout in the module doc)."""
    data = report.to_dict(copy=False)
    modules = data.get("modules")
    if not modules or _orjson is None:
        return data, (json.dumps(data, sort_keys=True) + "\n").encode("utf-8")
    # json.dumps' line with the value of "modules" written by orjson: the keys before it, it, those after
    head = json.dumps({k: v for k, v in data.items() if k < "modules"}, sort_keys=True)
    tail = json.dumps({k: v for k, v in data.items() if k > "modules"}, sort_keys=True)
    parts = [head[1:-1].encode("utf-8"), b'"modules": ' + _modules_text(modules), tail[1:-1].encode("utf-8")]
    return data, b"{" + b", ".join(p for p in parts if p) + b"}\n"


#: orjson's options: keys sorted (as json.dumps(sort_keys=True) sorts them); keys that are not
#: exactly ``str`` (the schema's categories and states are StrEnum members) written as json.dumps
#: writes them
_ORJSON_OPTIONS = 0 if _orjson is None else _orjson.OPT_SORT_KEYS | _orjson.OPT_NON_STR_KEYS


def _modules_text(modules: dict[str, Any]) -> bytes:
    """The JSON of a line's ``modules`` (module -> snapshots and times: integers): orjson's, compact,
    when it reads back as ``json.dumps``'s does, else ``json.dumps``'s. orjson writes NaN and the
    infinities as ``null`` (``json.dumps``: ``NaN``, ``Infinity``, which ``json.loads`` reads back)
    and refuses integers past 64 bits and lone surrogates: a text with ``null`` in it (or a module
    key with "null" in it) and what orjson refuses go to json.dumps."""
    assert _orjson is not None
    try:
        text: bytes = _orjson.dumps(modules, option=_ORJSON_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError
        pass
    else:
        if b"null" not in text:
            return text
    return json.dumps(modules, sort_keys=True).encode("utf-8")


# -- rotation ------------------------------------------------------------------------------------
def remove_if_exists(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def move_pair(src: str, dst: str) -> None:
    os.replace(src, dst)
    if os.path.exists(index_path(src)):
        os.replace(index_path(src), index_path(dst))
    else:
        remove_if_exists(index_path(dst))  # a stale index must not pair with other data


#: suffix of a compressed rotated data file (``run.jsonl.1.gz``)
GZIP_SUFFIX = ".gz"


def is_gzip(path: str) -> bool:
    return path.endswith(GZIP_SUFFIX)


def slot_files(path: str, i: int) -> list[str]:
    """The data files of rotation slot ``i`` of ``path`` that exist (plain and/or compressed)."""
    return [f for f in (f"{path}.{i}", f"{path}.{i}{GZIP_SUFFIX}") if os.path.exists(f)]


def compress_pair(path: str, level: int = 6) -> str:
    """Compress the rotated data file ``path`` to ``path.gz`` (its index follows); returns the new
    name. Written to a temporary file first, so a crash leaves ``path`` whole; readers take the
    plain file when both exist."""
    dst = path + GZIP_SUFFIX
    tmp = dst + ".tmp"
    try:
        with open(path, "rb") as src, open(tmp, "wb") as raw, \
                gzip.GzipFile(os.path.basename(path), "wb", level, raw) as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
        os.replace(tmp, dst)
    except BaseException:
        try:
            remove_if_exists(tmp)
        except OSError:
            pass
        raise
    if os.path.exists(index_path(path)):
        os.replace(index_path(path), index_path(dst))
    os.remove(path)
    return dst


def open_data(path: str) -> Any:
    """A data file for binary reading, decompressed when it is gzip (seekable either way)."""
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb", buffering=0)


def data_size(path: str) -> int:
    """The uncompressed size of a data file (for gzip, the trailer's size: modulo 4 GiB)."""
    if not is_gzip(path):
        return os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return int(struct.unpack("<I", f.read(4))[0])



# -- reading back ---------------------------------------------------------------------------
def rotated_files(path: str | os.PathLike[str]) -> list[str]:
    """``path``'s rotated predecessors (plain or compressed; the plain one where a crash left
    both) and ``path`` itself, oldest first, those that exist."""
    base = check_path("path", path)
    parent = os.path.dirname(base) or "."
    name = os.path.basename(base)
    pattern = re.compile(re.escape(name) + r"\.(\d+)(" + re.escape(GZIP_SUFFIX) + r")?$")
    numbered: dict[int, str] = {}
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        m = pattern.match(entry)
        if m and (int(m.group(1)) not in numbered or not m.group(2)):
            numbered[int(m.group(1))] = os.path.join(parent, entry)
    files = [numbered[i] for i in sorted(numbered, reverse=True)]
    if os.path.exists(base):
        files.append(base)
    return files


#: what a step-report file is, as the command line's errors say it
STEP_REPORT_FILE = ("a JSON-lines file of step reports (written by the JSONL exporter, FSDP_MEM_OTEL_JSONL, "
                    "demo --out or estimate --out)")


def check_step_report_file(path: str | os.PathLike[str], argument: str) -> None:
    """A ``cli_errors.UsageError`` naming ``argument`` unless ``path`` (with its rotated
    predecessors) is a step-report file: it exists, is not a folder, has a non-blank line, and
    its first such line is a StepReport. Reads the first line of the oldest file only."""
    from fsdp_mem_otel.cli_errors import UsageError

    shown = os.fspath(path)
    if os.path.isdir(shown):
        raise UsageError(f"{shown} ({argument}): is a folder; give {STEP_REPORT_FILE} in it")
    files = rotated_files(shown)
    if not files:
        raise UsageError(f"{shown} ({argument}): no such file (nor rotated {shown}.N); give {STEP_REPORT_FILE}")
    for f in files:
        try:
            with open_data(f) as fh:
                for i, raw in enumerate(_lines(fh)):
                    if not raw.strip():
                        continue
                    try:
                        StepReport.from_dict(json.loads(raw))
                    except LINE_ERRORS as exc:
                        why = " ".join(str(exc).split())[:120]
                        raise UsageError(f"{shown} ({argument}): not {STEP_REPORT_FILE}: line {i + 1} of {f} is not a "
                                         f"step report ({type(exc).__name__}: {why})") from None
                    return
        except OSError as exc:
            raise UsageError(f"{shown} ({argument}): cannot read {f} ({exc.strerror or exc}); give "
                             f"{STEP_REPORT_FILE}") from None
    raise UsageError(f"{shown} ({argument}): is empty (no step report in it); give {STEP_REPORT_FILE}")


def _lines(f: Any) -> Iterator[bytes]:
    """The lines of a binary file, read in chunks (an unbuffered raw file iterates slowly)."""
    rest = b""
    while chunk := f.read(_CHUNK):
        rest += chunk
        *whole, rest = rest.split(b"\n")
        yield from whole
    if rest:
        yield rest


def read_reports(*paths: str | os.PathLike[str]) -> Iterator[StepReport]:
    """The StepReports in JSONL files, in file order.

    Each path is read with its rotated predecessors (``path.N`` .. ``path.1``, oldest first)
    when it has any; a path that is itself a rotated file (``run.jsonl.2``) is read alone. A
    line that does not parse (the last one cut short by a crash, or one left by a write that
    failed midway) is skipped with a warning. Side index files (``*.index``) given among the
    paths are ignored. Raises FileNotFoundError for a path with no files.
    """
    if not paths:
        raise ValueError("paths: give at least one JSONL file")
    checked = [check_path(f"paths[{i}]", p) for i, p in enumerate(paths)]
    checked = [p for p in checked if not is_index_path(p)]
    if not checked:
        raise ValueError("paths: only side index files (*.index) given; give the JSONL files")
    files: list[str] = []
    for p in checked:
        found = rotated_files(p)
        if not found:
            raise FileNotFoundError(f"no JSONL file at {p} (nor rotated {p}.N)")
        files.extend(found)
    return _read(files)


def fill_modules(report: StepReport, source: StepReport | None) -> StepReport:
    """A line written without module snapshots (``modules_from``) gets those of ``source``, the
    report of that step, when given; the report is returned either way."""
    if report.modules_from is not None and not report.modules and source is not None \
            and source.step == report.modules_from and source.rank == report.rank:
        report.modules, report.module_order = source.modules, source.module_order
    return report


def _read(files: list[str]) -> Iterator[StepReport]:
    carried: dict[int, StepReport] = {}  # rank -> its last report with module snapshots
    for report in _read_lines(files):
        if report.modules_from is None:
            carried[report.rank] = report
        yield fill_modules(report, carried.get(report.rank))


def _read_lines(files: list[str]) -> Iterator[StepReport]:
    for path in files:
        with gzip.open(path, "rb") if is_gzip(path) else open(path, "rb") as f:
            for i, raw in enumerate(f):
                if not raw.strip():
                    continue
                try:
                    report = StepReport.from_dict(json.loads(raw))
                except LINE_ERRORS as exc:
                    # no newline after it: the last line, whose write did not finish
                    what = "truncated last line" if not raw.endswith(b"\n") else "unreadable line"
                    warnings.warn(f"{path}:{i + 1}: skipping {what} ({exc})", RuntimeWarning, stacklevel=2)
                    continue
                yield report


# -- scanning large runs ----------------------------------------------------------------------
def main_device(reports: Iterable[StepReport]) -> str:
    """The device a rank's charts show: the non-host device with the largest peak, else "cpu"."""
    best: dict[str, int] = {}
    for r in reports:
        for dev, cats in r.peak.items():
            best[dev] = max(best.get(dev, 0), int(cats.get(TOTAL, 0)))
    return pick_main_device(best)


def pick_main_device(best: dict[str, int]) -> str:
    """Of device -> largest step peak: the non-host device with the largest, else "cpu"."""
    accel = {d: v for d, v in best.items() if d != "cpu"}
    if accel:
        return max(sorted(accel), key=lambda d: accel[d])
    return "cpu" if "cpu" in best or not best else max(sorted(best), key=lambda d: best[d])


def step_peak(report: StepReport, device: str) -> int:
    return int(report.peak.get(device, {}).get(TOTAL, 0))


def read_line(path: str, start: int, end: int) -> StepReport | None:
    """The complete report of the line at bytes ``start`` .. ``end`` of ``path`` (None, with a
    warning, if it does not parse)."""
    with open_data(path) as f:
        f.seek(start)
        raw = f.read(end - start)
    try:
        return StepReport.from_dict(json.loads(raw))
    except LINE_ERRORS as exc:
        warnings.warn(f"{path}: line at byte {start} does not parse ({exc})", RuntimeWarning, stacklevel=2)
        return None


_HEAD_END = b'"module_order": '
_MODULES = b'"modules": '
_TAIL_START = b'"peak": '
#: sorts between "modules" and "peak": the one step-level field in the part _summary skips
_MODULES_FROM = b'"modules_from": '


def _summary(buf: Any, start: int, end: int) -> StepReport:
    """Step-level fields of the line buf[start:end]; its modules are left out (see module doc)."""
    i = buf.find(_MODULES, start, end)
    j = buf.rfind(_TAIL_START, start, end)
    if 0 <= i < j:
        h = buf.find(_HEAD_END, start, i)
        head = buf[start : h if h >= 0 else i]
        try:
            data = json.loads(head + buf[j:end])
            data["modules"] = {}
            k = buf.rfind(_MODULES_FROM, i, j)
            if k >= 0:
                value = bytes(buf[k + len(_MODULES_FROM) : j]).strip().rstrip(b",")
                data["modules_from"] = json.loads(value)
            return StepReport.from_dict(data)
        except LINE_ERRORS:
            pass  # not the exporter's layout: parse it whole
    data = json.loads(buf[start:end])
    data["modules"], data["module_order"] = {}, []
    return StepReport.from_dict(data)


#: files at least this large (in all) are read by worker processes, two files at a time
PARALLEL_BYTES = 256 * 1024 * 1024
_CHUNK = 16 * 1024 * 1024


class ScannedFile(NamedTuple):
    """One data file's step-level reports, the (start, end) byte span of each line, in file order."""

    group: str  # the path given (the file is it or one of its rotated predecessors)
    path: str
    reports: list[StepReport]
    spans: list[tuple[int, int]]


def scan(paths: Sequence[str], progress: Progress = quiet, workers: int | None = None) -> Iterator[ScannedFile]:
    """The step-level fields of every report in ``paths`` (each with its rotated predecessors,
    oldest first, as ``read_reports`` does), one file at a time in that order, so a reader keeps
    only what it summarises. Raises FileNotFoundError for a path with no file and ValueError for
    one without a single readable report (when its last file has been read).

    Reading is bound by the disk: past PARALLEL_BYTES, ``workers`` processes (default: up to 2,
    at most the CPU count) read the files that have no usable index, which keeps two reads in
    flight."""
    if not paths:
        raise ValueError("paths: give at least one JSONL file")
    given = [p for p in paths if not is_index_path(p)]
    for p in paths:
        if is_index_path(p):
            progress(f"{p}: a side index, not a data file; skipped (the index of a data file is used with it)")
    if not given:
        raise ValueError("paths: only side index files (*.index) given; give the JSONL files")
    groups: list[tuple[str, list[str]]] = []
    for p in given:
        files = rotated_files(p)
        if not files:
            raise FileNotFoundError(f"{p}: no such file (nor rotated {p}.N)")
        groups.append((p, files))
    order = [(p, f) for p, files in groups for f in files]
    unindexed = {f for _, f in order if not os.path.exists(index_path(f))}
    total = sum(data_size(f) for f in unindexed)
    if workers is None:
        workers = min(2, os.cpu_count() or 1, len(unindexed)) if total >= PARALLEL_BYTES else 1
    t0 = time.perf_counter()
    counts = dict.fromkeys((p for p, _ in groups), 0)
    last_of = {p: files[-1] for p, files in groups}
    pool = None
    pending: dict[str, Any] = {}
    if workers > 1 and unindexed:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    try:
        ahead = 0
        for i, (group, f) in enumerate(order):
            if pool is not None:  # keep up to 2 x workers unindexed files in flight, in order
                while ahead < len(order) and len(pending) < 2 * workers:
                    _, g = order[ahead]
                    ahead += 1
                    if g in unindexed and g not in pending:
                        pending[g] = pool.submit(_scan_one, g)
            if f in pending:
                progress(f"{f}: no index ({os.path.basename(index_path(f))}); reading the whole file")
            indexed = None if f in pending else _from_index(f, progress)
            if indexed is not None:
                got = indexed
                how = "via its index"
            else:
                got = pending.pop(f).result() if f in pending else _scan_one(f)
                how = "scanned"
            reports, spans, warned = got
            for msg in warned:
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
            progress(f"read {f} ({how}): {len(reports)} steps, {data_size(f) / 1e6:.1f} MB "
                     f"({time.perf_counter() - t0:.1f} s since start of reading; file {i + 1} of {len(order)})")
            counts[group] += len(reports)
            yield ScannedFile(group, f, reports, spans)
            if f == last_of[group] and not counts[group]:
                raise ValueError(f"{group}: no step reports in it (empty file, or no line parses)")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


_Scanned = tuple[list[StepReport], list[tuple[int, int]], list[str]]


def _scan_one(path: str) -> _Scanned:
    """(step-level reports, (start, end) byte span of each line, warnings) of one file, read in
    large chunks into one reused buffer; only the head and the tail of each line are parsed."""
    out: list[StepReport] = []
    spans: list[tuple[int, int]] = []
    warned: list[str] = []
    with open_data(path) as f:
        _scan_range(f, path, 0, None, 0, out, spans, warned)
    return out, spans, warned


def _scan_range(f: Any, path: str, start: int, stop: int | None, lineno: int, out: list[StepReport],
                spans: list[tuple[int, int]], warned: list[str]) -> int:
    """Scan the lines of ``f`` (unbuffered) from byte ``start`` (a line start) to ``stop`` (a line
    end + 1, or None: the end of the file) into ``out`` / ``spans`` / ``warned``, numbering lines
    after ``lineno``; returns the last line number."""
    left = None if stop is None else stop - start
    chunk = _CHUNK if left is None else max(1, min(_CHUNK, left))
    buf = bytearray(2 * chunk)
    filled = 0  # valid bytes in buf
    base = start  # file offset of buf[0]
    f.seek(start)
    while True:
        if len(buf) - filled < chunk:  # a line longer than the buffer: grow it
            buf.extend(bytes(len(buf)))
        want = chunk if left is None else min(chunk, left)
        n = f.readinto(memoryview(buf)[filled : filled + want]) if want else 0
        if left is not None:
            left -= n or 0
        filled += n or 0
        last = not n
        pos = 0
        while pos < filled:
            nl = buf.find(b"\n", pos, filled)
            if nl < 0 and not last:
                break  # the rest of this line comes with the next chunk
            end = filled if nl < 0 else nl
            lineno += 1
            if end - pos > 64 or buf[pos:end].strip():  # skip blank lines
                try:
                    report = _summary(buf, pos, end)
                except LINE_ERRORS as exc:
                    what = "truncated last line" if nl < 0 else "unreadable line"
                    warned.append(f"{path}:{lineno}: skipping {what} ({exc})")
                else:
                    out.append(report)
                    spans.append((base + pos, base + end))
            pos = end + 1
        if last:
            break
        keep = filled - pos
        if keep > 0:
            buf[:keep] = buf[pos:filled]
        base += pos
        filled = max(keep, 0)
    return lineno


def _from_index(path: str, progress: Progress) -> _Scanned | None:
    """The scan of ``path`` from its side index (see the module doc), or None when the file has
    no usable index (then it is scanned whole; a note says why)."""
    ipath = index_path(path)
    try:
        with open(ipath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        progress(f"{path}: no index ({os.path.basename(ipath)}); reading the whole file")
        return None
    except OSError as exc:
        warnings.warn(f"{ipath}: cannot read the index ({exc}); reading the whole data file", RuntimeWarning,
                      stacklevel=3)
        return None
    try:
        size = data_size(path)
        entries = _parse_index(raw, size)
        with open_data(path) as f:
            n = len(entries)
            for k in sorted({n * i // _SPOT_CHECKS for i in range(_SPOT_CHECKS)} | {n - 1} if n else set()):
                _check_entry(f, *entries[k])
            out: list[StepReport] = []
            spans: list[tuple[int, int]] = []
            warned: list[str] = []
            lineno = 0
            pos = 0
            gap_bytes = 0
            for off, length, report in entries:
                if off > pos:  # lines the index does not cover: scan them
                    gap_bytes += off - pos
                    lineno = _scan_range(f, path, pos, off, lineno, out, spans, warned)
                out.append(report)
                spans.append((off, off + length - 1))
                lineno += 1
                pos = off + length
            if pos < size:
                gap_bytes += size - pos
                _scan_range(f, path, pos, None, lineno, out, spans, warned)
    except (*LINE_ERRORS, OSError) as exc:
        warnings.warn(f"{ipath}: index does not fit its data file ({exc}); reading the whole data file",
                      RuntimeWarning, stacklevel=3)
        return None
    if gap_bytes:
        progress(f"{path}: {gap_bytes / 1e6:.1f} MB not in its index (lines written without an index entry); "
                 "read those")
    return out, spans, warned


#: index entries compared with their data lines before the index is trusted (first, last, evenly spaced)
_SPOT_CHECKS = 8
_TAIL_BYTES = 64 * 1024
_TAIL_KEYS = ("peak", "rank", "step", "world_size", "timestamp", "start_time_ns", "end_time_ns")


def _check_entry(f: Any, off: int, length: int, report: StepReport) -> None:
    """ValueError unless the data line at ``off`` (``length`` bytes, newline included) starts and
    ends at line boundaries and its step-level tail (from its last ``"peak"``) equals the entry's."""
    if off > 0:
        f.seek(off - 1)
        if f.read(1) != b"\n":
            raise ValueError(f"entry at byte {off} does not start a line")
    start = max(off, off + length - _TAIL_BYTES)
    f.seek(start)
    tail = f.read(off + length - start)
    if not tail.endswith(b"\n"):
        raise ValueError(f"entry at byte {off} does not end at a line end")
    j = tail.rfind(_TAIL_START)
    if j < 0:
        raise ValueError(f"line at byte {off} is not in the exporter's layout")
    data = json.loads(b"{" + tail[j:])
    mine = report.to_dict()
    if any(data.get(k) != mine[k] for k in _TAIL_KEYS if k in data):
        raise ValueError(f"entry at byte {off} (rank {report.rank}, step {report.step}) differs from its data line")


def _index_report(d: dict[str, Any]) -> StepReport:
    """The step-level report of an index entry (no modules): ``StepReport.from_dict`` without
    its defensive copies, as the dicts come fresh from json."""
    return StepReport.from_dict({**d, "modules": {}, "module_order": []}, copy=False)


def _parse_index(raw: bytes, size: int) -> list[tuple[int, int, StepReport]]:
    """(offset, length, step-level report) of each entry; ValueError if they do not fit a data file
    of ``size`` bytes (past its end, out of order, overlapping). A torn last entry is skipped."""
    lines = raw.split(b"\n")
    torn = lines.pop()  # b"" when the index ends with a newline, else a last entry cut short
    entries: list[tuple[int, int, StepReport]] = []
    end = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"entry {i + 1} does not parse ({exc})") from None
        off, length, data = e["offset"], e["length"], e["report"]
        if not (type(off) is int and type(length) is int and isinstance(data, dict)) or off < end or length < 1:
            raise ValueError(f"entry {i + 1}: bad or out-of-order offset/length ({off!r}, {length!r})")
        end = off + length
        if end > size:
            raise ValueError(f"entry {i + 1} ends at byte {end}, past the end of the data file ({size} bytes)")
        entries.append((off, length, _index_report(data)))
    del torn  # skipped: its data line (if complete) is read from the data file as not indexed
    return entries
