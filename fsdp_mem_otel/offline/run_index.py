"""What ``report`` keeps of a run: per rank, the step-level figures of every step, as columns.

A 1,024-rank job of 1,000 steps is a million step reports. As StepReport objects (dicts of
dicts) they take ~4.6 KB each, ~5 GB in all; the charts need a few numbers of each. So
:func:`scan_files` reads one data file at a time (``jsonl_format.scan``) and keeps, per step,
its number, whether it ran deep or was aborted, its peak per category on each device, its
allocator figures and where its line is (file, byte span): about 250 bytes on a CUDA rank. An
aborted step keeps its StepReport (where it stopped, with what live), as aborts are few. The
complete report of a step, with its module snapshots, is read back from its line when a chart
asks (:meth:`RunIndex.full`); a small cache keeps the last few.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fsdp_mem_otel.offline.jsonl_format import Progress, fill_modules, pick_main_device, quiet, read_line, scan
from fsdp_mem_otel.schema import CATEGORY_KEYS, DEEP, TOTAL, StepReport

_COLUMN = {c: i for i, c in enumerate(CATEGORY_KEYS)}
_TOTAL = _COLUMN[TOTAL]
#: complete reports (with module snapshots) kept by RunIndex.full: a module view and the
#: modules_from line it is filled from, per rank being drawn
FULL_CACHE = 8


@dataclass(eq=False)
class StepSeries:
    """One rank's steps, sorted by step; a step reported twice keeps its later report.

    Row ``i`` is step ``steps[i]``: ``peak[device][i, c]`` the step peak of category
    ``CATEGORY_KEYS[c]`` on ``device`` (0 where the step has no figure for it),
    ``allocator[device][key][i]`` an allocator statistic (NaN where not reported)."""

    rank: int
    steps: np.ndarray
    deep: np.ndarray
    aborted: np.ndarray
    peak: dict[str, np.ndarray]
    allocator: dict[str, dict[str, np.ndarray]]
    world_size: int
    fsdp_version: int
    #: step -> the report of an aborted step (step-level fields only when scanned)
    aborts: dict[int, StepReport]
    files: list[str] = field(default_factory=list)
    file_ix: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: step -> complete report, for series built from reports in memory (RunIndex.of)
    complete: dict[int, StepReport] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.steps)

    def __eq__(self, other: object) -> bool:
        """Same steps and figures (where the lines are is not compared)."""
        if not isinstance(other, StepSeries):
            return NotImplemented
        return (self.rank == other.rank and (self.world_size, self.fsdp_version) == (other.world_size,
                                                                                     other.fsdp_version)
                and all(np.array_equal(getattr(self, a), getattr(other, a)) for a in ("steps", "deep", "aborted"))
                and self.peak.keys() == other.peak.keys()
                and all(np.array_equal(v, other.peak[d]) for d, v in self.peak.items())
                and self.allocator.keys() == other.allocator.keys()
                and all(v.keys() == other.allocator[d].keys()
                        and all(np.array_equal(a, other.allocator[d][k], equal_nan=True) for k, a in v.items())
                        for d, v in self.allocator.items())
                and self.aborts == other.aborts)

    @property
    def main_device(self) -> str:
        """The device the rank's charts show (``jsonl_format.main_device``)."""
        return pick_main_device({d: int(v[:, _TOTAL].max(initial=0)) for d, v in self.peak.items()})

    def totals(self, device: str) -> np.ndarray:
        """The step peak total on ``device``, per step (int64)."""
        return self.category(device, TOTAL)

    def category(self, device: str, category: str) -> np.ndarray:
        got = self.peak.get(device)
        return np.zeros(len(self.steps), np.int64) if got is None else got[:, _COLUMN[category]]

    def allocator_values(self, device: str, key: str) -> np.ndarray | None:
        """Float64 per step, NaN where the step did not report ``key``; None if none did."""
        return self.allocator.get(device, {}).get(key)

    def row(self, step: int) -> int | None:
        i = int(np.searchsorted(self.steps, step))
        return i if i < len(self.steps) and self.steps[i] == step else None

    def location(self, step: int) -> tuple[str, int, int] | None:
        """(file, start, end) of the step's line, None when it has none (or no such step)."""
        i = self.row(step)
        if i is None or not len(self.file_ix) or self.file_ix[i] < 0:
            return None
        return self.files[int(self.file_ix[i])], int(self.starts[i]), int(self.ends[i])

    @property
    def nbytes(self) -> int:
        """Bytes held in the columns (what a rank costs the report)."""
        arrays = [self.steps, self.deep, self.aborted, self.file_ix, self.starts, self.ends, *self.peak.values(),
                  *(a for v in self.allocator.values() for a in v.values())]
        return sum(a.nbytes for a in arrays)


class _SeriesBuilder:
    """Collects one rank's step-level reports, in reading order, into a StepSeries."""

    def __init__(self, rank: int, keep_complete: bool) -> None:
        self.rank = rank
        self.keep_complete = keep_complete
        self.steps = array("q")
        self.flags = array("b")  # bit 0 deep, bit 1 aborted
        self.world = array("q")
        self.fsdp = array("q")
        self.file_ix = array("i")
        self.starts = array("q")
        self.ends = array("q")
        self.peak: dict[str, tuple[array[int], array[int]]] = {}  # device -> (rows, values row-major)
        self.alloc: dict[tuple[str, str], tuple[array[int], array[float]]] = {}
        self.reports: dict[int, StepReport] = {}  # row -> aborted (or, keep_complete, every) report

    def add(self, r: StepReport, where: tuple[int, int, int] | None) -> None:
        row = len(self.steps)
        self.steps.append(r.step)
        self.flags.append((r.mode == DEEP) | ((r.aborted is not None) << 1))
        self.world.append(r.world_size)
        self.fsdp.append(r.fsdp_version)
        f, start, end = where if where is not None else (-1, -1, -1)
        self.file_ix.append(f)
        self.starts.append(start)
        self.ends.append(end)
        for dev, cats in r.peak.items():
            rows, values = self.peak.setdefault(dev, (array("q"), array("q")))
            rows.append(row)
            values.extend(int(cats.get(c, 0)) for c in CATEGORY_KEYS)
        for dev, stats in r.allocator.items():
            for key, v in stats.items():
                arows, avalues = self.alloc.setdefault((dev, key), (array("q"), array("d")))
                arows.append(row)
                avalues.append(float(v))
        if self.keep_complete or r.aborted is not None:
            self.reports[row] = r

    def __len__(self) -> int:
        return len(self.steps)

    def build(self, files: list[str]) -> tuple[StepSeries, int]:
        """The series and how many reports it dropped as repeats of a step (the later one kept)."""
        n = len(self.steps)
        steps = np.frombuffer(self.steps, np.int64) if n else np.zeros(0, np.int64)
        order = np.argsort(steps, kind="stable")
        ordered = steps[order]
        last = np.ones(n, bool)
        last[:-1] = ordered[1:] != ordered[:-1]  # the last of equal steps is the latest report
        keep = order[last]
        flags = np.frombuffer(self.flags, np.int8)[keep] if n else np.zeros(0, np.int8)
        peak = {}
        for dev, (rows, values) in self.peak.items():
            dense = np.zeros((n, len(CATEGORY_KEYS)), np.int64)
            dense[np.frombuffer(rows, np.int64)] = np.frombuffer(values, np.int64).reshape(-1, len(CATEGORY_KEYS))
            peak[dev] = dense[keep]
        alloc: dict[str, dict[str, np.ndarray]] = {}
        for (dev, key), (arows, avalues) in sorted(self.alloc.items()):
            col = np.full(n, np.nan)
            col[np.frombuffer(arows, np.int64)] = np.frombuffer(avalues, np.float64)
            alloc.setdefault(dev, {})[key] = col[keep]
        row_of = {int(old): new for new, old in enumerate(keep)}
        reports = {int(steps[old]): r for old, r in self.reports.items() if old in row_of}
        first = int(keep[0]) if n else 0
        series = StepSeries(
            rank=self.rank, steps=steps[keep].copy(), deep=(flags & 1).astype(bool), aborted=(flags & 2).astype(bool),
            peak=peak, allocator=alloc, world_size=int(self.world[first]) if n else 0,
            fsdp_version=int(self.fsdp[first]) if n else 0,
            aborts={s: r for s, r in reports.items() if r.aborted is not None},
            files=files, file_ix=np.frombuffer(self.file_ix, np.int32)[keep].copy() if n else np.zeros(0, np.int32),
            starts=np.frombuffer(self.starts, np.int64)[keep].copy() if n else np.zeros(0, np.int64),
            ends=np.frombuffer(self.ends, np.int64)[keep].copy() if n else np.zeros(0, np.int64),
            complete=reports if self.keep_complete else {},
        )
        return series, n - len(keep)


@dataclass
class RunIndex:
    """A run's step series by rank; ``full(rank, step)`` gives a step's report with its modules.

    Built from complete reports in memory (``RunIndex.of(reports)``) or by :func:`scan_files`,
    which keeps step-level figures only and reads module snapshots back from the file on demand.
    A (rank, step) seen twice keeps the later report (counted in ``duplicates``)."""

    series: dict[int, StepSeries]
    duplicates: int = 0
    _cache: OrderedDict[tuple[int, int], StepReport | None] = field(default_factory=OrderedDict)

    @classmethod
    def of(cls, reports: Iterable[StepReport]) -> RunIndex:
        builders: dict[int, _SeriesBuilder] = {}
        for r in reports:
            builders.setdefault(r.rank, _SeriesBuilder(r.rank, keep_complete=True)).add(r, None)
        return cls._built(builders, [])

    @classmethod
    def _built(cls, builders: dict[int, _SeriesBuilder], files: list[str]) -> RunIndex:
        series: dict[int, StepSeries] = {}
        dup = 0
        for rank in sorted(builders):
            series[rank], d = builders[rank].build(files)
            dup += d
        return cls(series, dup)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.series)

    def device(self, rank: int) -> str:
        """The rank's main device (see ``jsonl_format.main_device``)."""
        return self.series[rank].main_device

    @property
    def reports_total(self) -> int:
        return sum(len(s) for s in self.series.values())

    def full(self, rank: int, step: int) -> StepReport | None:
        """The report of ``step`` on ``rank`` with its module snapshots (None if absent)."""
        key = (rank, step)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        s = self.series.get(rank)
        loc = None if s is None else s.location(step)
        report = (None if s is None else s.complete.get(step)) if loc is None else read_line(*loc)
        if loc is not None and report is not None and (report.rank, report.step) != key:
            import warnings

            warnings.warn(f"{loc[0]}: line at byte {loc[1]} holds rank {report.rank} step {report.step}, "
                          f"not rank {rank} step {step} (file changed since it was indexed?)",
                          RuntimeWarning, stacklevel=2)
            report = None
        if report is not None and report.modules_from is not None and not report.modules \
                and report.modules_from < step:  # written without snapshots: those of an earlier line
            report = fill_modules(report, self.full(rank, report.modules_from))
        self._cache[key] = report
        while len(self._cache) > FULL_CACHE:
            self._cache.popitem(last=False)
        return report


def scan_files(paths: Sequence[str], progress: Progress = quiet, workers: int | None = None,
               observe: Callable[[StepReport], None] | None = None) -> RunIndex:
    """Read the step-level fields of every report in ``paths`` (each with its rotated
    predecessors, oldest first) into a RunIndex, one file at a time (``jsonl_format.scan``:
    errors, warnings and the side index are as described there). ``observe``: called with each
    report as it is read (other figures gathered in the same pass)."""
    builders: dict[int, _SeriesBuilder] = {}
    files: list[str] = []
    for scanned in scan(paths, progress, workers):
        files.append(scanned.path)
        f = len(files) - 1
        for r, (start, end) in zip(scanned.reports, scanned.spans, strict=True):
            b = builders.get(r.rank)
            if b is None:
                b = builders[r.rank] = _SeriesBuilder(r.rank, keep_complete=False)
            b.add(r, (f, start, end))
            if observe is not None:
                observe(r)
    return RunIndex._built(builders, files)
