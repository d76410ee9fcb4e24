"""The report schema: categories, states and the per-step report, as plain data.

Standard library only: exporters and the report tool read these without importing torch.
Categories and states are ``StrEnum`` members: they are the strings they name (equal, same hash,
JSON and label values unchanged), with the state groups (forward, backward, ...) named once here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any


class Category(StrEnum):
    """Where bytes go; ``TOTAL`` is their sum."""

    SHARDED_PARAM = "sharded_param"
    UNSHARDED_PARAM = "unsharded_param"
    BUFFER = "buffer"
    SHARDED_GRAD = "sharded_grad"
    UNSHARDED_GRAD = "unsharded_grad"
    ACTIVATION = "activation"
    TEMP = "temp"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    TOTAL = "total"


class State(StrEnum):
    """Where an FSDP module is, when a snapshot is taken."""

    BEFORE_PRE_FORWARD = "before_pre_forward"
    AFTER_PRE_FORWARD = "after_pre_forward"
    BEFORE_POST_FORWARD = "before_post_forward"
    AFTER_POST_FORWARD = "after_post_forward"
    BEFORE_PRE_BACKWARD = "before_pre_backward"
    AFTER_PRE_BACKWARD = "after_pre_backward"
    BEFORE_POST_BACKWARD = "before_post_backward"
    AFTER_POST_BACKWARD = "after_post_backward"
    PRE_FORWARD_AC = "pre_forward_ac"
    POST_FORWARD_AC = "post_forward_ac"
    PEAK_FORWARD = "peak_forward"
    PEAK_BACKWARD = "peak_backward"


SHARDED_PARAM = Category.SHARDED_PARAM
UNSHARDED_PARAM = Category.UNSHARDED_PARAM
BUFFER = Category.BUFFER
SHARDED_GRAD = Category.SHARDED_GRAD
UNSHARDED_GRAD = Category.UNSHARDED_GRAD
ACTIVATION = Category.ACTIVATION
TEMP = Category.TEMP
ALL_GATHER = Category.ALL_GATHER
REDUCE_SCATTER = Category.REDUCE_SCATTER
OPTIMIZER_STATE = Category.OPTIMIZER_STATE
INPUTS = Category.INPUTS
TOTAL = Category.TOTAL

#: Memory categories, in display order; ``total`` is their sum.
CATEGORIES: tuple[str, ...] = tuple(c for c in Category if c is not Category.TOTAL)
CATEGORY_KEYS: tuple[str, ...] = (*CATEGORIES, TOTAL)
_TOTAL_AT = CATEGORY_KEYS.index(TOTAL)  # where ``total`` is in a counter list

BEFORE_PRE_FORWARD = State.BEFORE_PRE_FORWARD
AFTER_PRE_FORWARD = State.AFTER_PRE_FORWARD
BEFORE_POST_FORWARD = State.BEFORE_POST_FORWARD
AFTER_POST_FORWARD = State.AFTER_POST_FORWARD
BEFORE_PRE_BACKWARD = State.BEFORE_PRE_BACKWARD
AFTER_PRE_BACKWARD = State.AFTER_PRE_BACKWARD
BEFORE_POST_BACKWARD = State.BEFORE_POST_BACKWARD
AFTER_POST_BACKWARD = State.AFTER_POST_BACKWARD
PRE_FORWARD_AC = State.PRE_FORWARD_AC
POST_FORWARD_AC = State.POST_FORWARD_AC
PEAK_FORWARD = State.PEAK_FORWARD
PEAK_BACKWARD = State.PEAK_BACKWARD

#: FSDP module states at which snapshots are taken, in execution order.
STATES: tuple[str, ...] = tuple(State)
#: The states FSDP reaches around a module's forward (in backward too, during a recompute).
FORWARD_STATES: frozenset[str] = frozenset(STATES[:4])
#: The states FSDP reaches around a module's backward.
BACKWARD_STATES: frozenset[str] = frozenset(STATES[4:8])
#: Where the forward pass of a module shows: its forward states, their recompute and peak.
FORWARD_PASS_STATES: frozenset[str] = FORWARD_STATES | {PRE_FORWARD_AC, POST_FORWARD_AC, PEAK_FORWARD}
#: Where the backward pass of a module shows: its backward states and peak.
BACKWARD_PASS_STATES: frozenset[str] = BACKWARD_STATES | {PEAK_BACKWARD}

LIGHT = "light"
DEEP = "deep"
MODES: tuple[str, ...] = (LIGHT, DEEP)

ROOT_KEY = "<root>"

#: StepReport.deep_skipped: a deep step stayed light because the model runs torch.compile'd code
DEEP_SKIPPED_COMPILED = "compiled"
DEEP_SKIP_REASONS: tuple[str, ...] = (DEEP_SKIPPED_COMPILED,)

#: StepReport.warnings: conditions under which a figure means less than it seems (each logged once)
#: the optimizer stepped with gradients present and holds no state: optimizer_state reads 0
WARNING_OPTIMIZER_NO_STATE = "optimizer_no_state"
#: a multi-rank job whose FSDP shard groups all have one rank: nothing is sharded
WARNING_NOTHING_SHARDED = "nothing_sharded"
WARNINGS: tuple[str, ...] = (WARNING_OPTIMIZER_NO_STATE, WARNING_NOTHING_SHARDED)

#: device ("cpu", "cuda:0") -> category key -> bytes
DeviceBreakdown = dict[str, dict[str, int]]


@dataclass
class ModuleReport:
    """Snapshots of one FSDP module during one step: state -> one breakdown per call.

    ``times`` runs parallel to ``snapshots``: state -> wall-clock time (ns since the epoch) of
    each snapshot; for peak states, when the window closed. Forward of call i spans
    times["before_pre_forward"][i] .. times["after_post_forward"][i]; backward likewise.
    """

    snapshots: dict[str, list[DeviceBreakdown]] = field(default_factory=dict)
    times: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self, copy: bool = True) -> dict[str, Any]:
        """As plain data; ``copy=False`` shares the snapshot and time lists (to serialize at once)."""
        if not copy:
            return {"snapshots": self.snapshots, "times": self.times}
        return {
            "snapshots": {s: [_copy(b) for b in calls] for s, calls in self.snapshots.items()},
            "times": {s: list(t) for s, t in self.times.items()},
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModuleReport):
            return NotImplemented
        return self.snapshots == other.snapshots and self.times == other.times

    __hash__ = None  # type: ignore[assignment]

    def times_of(self, state: str) -> list[int]:
        """When each call reached ``state`` (``time.time_ns()``), in order; empty if never."""
        return self.times.get(state, [])

    def peak_total(self, state: str) -> int:
        """Largest ``total`` over devices and calls for ``state`` (0 if never reached)."""
        return max(
            (cats.get(TOTAL, 0) for b in self.snapshots.get(state, []) for cats in b.values()),
            default=0,
        )


class CountedModuleReport(ModuleReport):
    """A ModuleReport whose snapshots stay counters (``device_counters``) until first read: the
    tracker hands these to exporters, which read them on their own threads.

    Given ``counters`` and ``times`` (state -> one entry per call), or ``record`` (the step's states,
    counters and times, parallel lists) and ``at`` (this module's positions in it), which are
    sorted per state when first read: the tracker's form, with no container per module or state
    for the step to keep alive."""

    def __init__(self, counters: dict[str, list[Any]] | None, times: dict[str, list[int]] | None,
                 peak_totals: tuple[int | None, int | None] | None = None,
                 record: tuple[list[str], Any, list[int]] | None = None, at: tuple[int, ...] = ()) -> None:
        self._counters = counters
        self._times = times
        # (states, counters or a function that replays and returns them, times)
        self._record = record if counters is None else None
        self._at = at
        self._snapshots: dict[str, list[DeviceBreakdown]] | None = None
        #: the largest ``total`` of ``peak_forward`` and of ``peak_backward`` (None: not reached),
        #: computed by the recorder; None when not given (``exporters.peaks`` then reads the counters)
        self.peak_totals = peak_totals

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # a light step's replay (a function, a lock) goes as its result
        record = state.get("_record")
        if record is not None and callable(record[1]):
            state["_record"] = (record[0], record[1](), record[2])
        return state

    def _sorted(self) -> tuple[dict[str, list[Any]], dict[str, list[int]]]:
        if self._counters is None or self._times is None:
            counters: dict[str, list[Any]] = {}
            times: dict[str, list[int]] = {}
            if self._record is not None:
                states, snaps, stamps = self._record
                if callable(snaps):  # a light step's, replayed at the first read
                    snaps = snaps()
                for i in self._at:
                    state = states[i]
                    calls = counters.get(state)
                    if calls is None:
                        counters[state], times[state] = [snaps[i]], [stamps[i]]
                    else:
                        calls.append(snaps[i])
                        times[state].append(stamps[i])
            # two threads may sort at once: each sets the same lists' equals
            self._counters = counters if self._counters is None else self._counters
            self._times = times if self._times is None else self._times
        return self._counters, self._times

    @property  # type: ignore[override]
    def snapshots(self) -> dict[str, list[DeviceBreakdown]]:
        if self._snapshots is None:
            self._snapshots = {s: [breakdown_of(b) for b in calls] for s, calls in self._sorted()[0].items()}
        return self._snapshots

    @snapshots.setter
    def snapshots(self, value: dict[str, list[DeviceBreakdown]]) -> None:
        self._snapshots = value
        self.peak_totals = None  # they were the counters'

    @property  # type: ignore[override]
    def times(self) -> dict[str, list[int]]:
        times = self._times  # read per state by every exporter: the sorted case, written out
        return times if times is not None else self._sorted()[1]

    @times.setter
    def times(self, value: dict[str, list[int]]) -> None:
        self._times = value

    def times_of(self, state: str) -> list[int]:
        if self._times is None and self._record is not None:  # one state, read from the record: nothing sorted
            states, _, stamps = self._record
            return [stamps[i] for i in self._at if states[i] == state]
        return self.times.get(state, [])

    @property
    def calls(self) -> int:
        """How many snapshots the module holds (every state and call), without sorting them."""
        if self._snapshots is not None:
            return sum(map(len, self._snapshots.values()))
        if self._counters is None and self._record is not None:
            return len(self._at)
        return sum(map(len, self._sorted()[0].values()))

    @property
    def counters(self) -> dict[str, list[Any]] | None:
        """State -> one snapshot's counters per call (``breakdown_of`` turns one into a snapshot),
        while ``snapshots`` has not built its dicts; None once it has (read those)."""
        if self._snapshots is not None:
            return None
        counters = self._counters
        return counters if counters is not None else self._sorted()[0]


def device_counters(snap: Any) -> Any:
    """(device, counters) pairs of one snapshot: a ``{device: counters}`` dict, or the tracker's
    flat ``(device, counters, device, counters, ...)`` tuple (``training.counters.Snap``)."""
    return snap.items() if isinstance(snap, dict) else zip(snap[::2], snap[1::2], strict=True)


def largest_total(calls: list[Any]) -> int:
    """The largest ``total`` over one state's snapshots (``device_counters``), every call and
    device (0 for none)."""
    if len(calls) == 1:  # one call on one device: nearly every module
        snap = calls[0]
        if len(snap) == 2 and isinstance(snap, tuple):
            return int(snap[1][_TOTAL_AT])
        if len(snap) == 1 and isinstance(snap, dict):
            for counters in snap.values():
                return int(counters[_TOTAL_AT])
    return max([c[_TOTAL_AT] for call in calls for _, c in device_counters(call)], default=0)


def breakdown_of(counters: Any) -> DeviceBreakdown:
    """A snapshot's counters (``device_counters``: device -> bytes indexed like ``CATEGORY_KEYS``)
    as ``{device: {category: bytes}}``."""
    return {d: dict(zip(CATEGORY_KEYS, c, strict=True)) for d, c in device_counters(counters)}


@dataclass
class LeakReport:
    """What stayed alive at a step's end that a healthy step frees, and what keeps growing.

    ``growing``: category -> bytes per step, for each category whose live bytes at the step end
    rose at every one of the last steps (see ``training/leaks.py``); ``held``: FSDP module ->
    bytes its saved tensors, inputs and outputs still hold at the step end (light mode; the
    largest holders), ``held_elsewhere`` the rest; ``steps``: step ends looked at.
    """

    growing: dict[str, float] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    held_elsewhere: int = 0
    steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"growing": dict(self.growing), "held": dict(self.held), "held_elsewhere": self.held_elsewhere,
                "steps": self.steps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeakReport:
        return cls({str(k): float(v) for k, v in data.get("growing", {}).items()},
                   {str(k): int(v) for k, v in data.get("held", {}).items()},
                   int(data.get("held_elsewhere", 0)), int(data.get("steps", 0)))


@dataclass
class StepAbort:
    """Why and where a step stopped early (an exception such as an OOM, or step() mid-pass)."""

    error: str  # exception type name, or "IncompleteStep"
    message: str
    oom: bool
    module: str  # innermost FSDP module active when it happened ("" if none)
    state: str  # the last state that module reached
    breakdown: DeviceBreakdown  # live bytes by category at that moment
    #: CUDA device -> bytes in use outside PyTorch's allocator at that moment (context, NCCL, ...)
    outside_pytorch_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "message": self.message,
            "oom": self.oom,
            "module": self.module,
            "state": self.state,
            "breakdown": _copy(self.breakdown),
            "outside_pytorch_bytes": dict(self.outside_pytorch_bytes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepAbort:
        return cls(
            error=str(data["error"]),
            message=str(data.get("message", "")),
            oom=bool(data.get("oom", False)),
            module=str(data.get("module", "")),
            state=str(data.get("state", "")),
            breakdown=_copy(data.get("breakdown", {})),
            outside_pytorch_bytes={d: int(v) for d, v in data.get("outside_pytorch_bytes", {}).items()},
        )


#: held while a report's field given to ``StepReport.fill_later`` is built (any report, any thread)
_FILLING = threading.RLock()


@dataclass
class StepReport:
    """What the tracker saw during one training step. Plain data, JSON-able via to_dict().

    The tracker hands reports over with some fields built when first read (``fill_later``), on
    whichever thread reads them: attributes like any other to readers, copies and pickles.
    """

    step: int
    rank: int
    world_size: int
    mode: str
    fsdp_version: int
    peak: DeviceBreakdown
    modules: dict[str, ModuleReport]
    module_order: list[str] = field(default_factory=list)
    current: DeviceBreakdown = field(default_factory=dict)
    #: device -> allocator statistic -> value (see allocator.py for the keys)
    allocator: dict[str, dict[str, float]] = field(default_factory=dict)
    local_rank: int = 0
    duration_seconds: float = 0.0
    tracker_overhead_seconds: float = 0.0
    errors_total: int = 0
    timestamp: float = 0.0
    start_time_ns: int = 0
    end_time_ns: int = 0
    #: None for a step that completed; else what stopped it (see StepAbort)
    aborted: StepAbort | None = None
    #: why a step due to run deep stayed light ("compiled": the model runs torch.compile'd code)
    deep_skipped: str | None = None
    #: what the tracker found wrong with the setup it measures (``WARNINGS``), in that order
    warnings: list[str] = field(default_factory=list)
    #: FSDP groups light mode accounts per tensor because their own events cannot tell their
    #: buffers' bytes (see adapters/fsdp2_groups.py); 0 on every configuration tested
    fallback_groups: int = 0
    #: None, or what stayed alive at the step's end and what keeps growing (see LeakReport); a
    #: factory (``NoneType()`` is None), not a default, leaves no class attribute: the tracker fills
    #: it later (``fill_later``)
    leak: LeakReport | None = field(default_factory=type(None))
    #: in a JSONL file: this line was written without module snapshots (the JSONL budget), and
    #: ``modules`` are those of this earlier step, which readers fill in; None: its own
    modules_from: int | None = None

    def to_dict(self, copy: bool = True) -> dict[str, Any]:
        """As plain data (JSON-able). ``copy=False`` shares the nested dicts and lists with this
        report instead of copying them: for serializing it at once (the JSONL writer; at 100
        modules the copy cost more than the JSON encoding)."""
        copied = _copy if copy else _same
        return {
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.mode,
            "fsdp_version": self.fsdp_version,
            "peak": copied(self.peak),
            "current": copied(self.current),
            "modules": {k: m.to_dict(copy) for k, m in self.modules.items()},
            "module_order": list(self.module_order),
            "allocator": {d: dict(v) for d, v in self.allocator.items()},
            "local_rank": self.local_rank,
            "duration_seconds": self.duration_seconds,
            "tracker_overhead_seconds": self.tracker_overhead_seconds,
            "errors_total": self.errors_total,
            "timestamp": self.timestamp,
            "start_time_ns": self.start_time_ns,
            "end_time_ns": self.end_time_ns,
            "aborted": None if self.aborted is None else self.aborted.to_dict(),
            "deep_skipped": self.deep_skipped,
            "warnings": list(self.warnings),
            "fallback_groups": self.fallback_groups,
            "leak": None if self.leak is None else self.leak.to_dict(),
            **({} if self.modules_from is None else {"modules_from": self.modules_from}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def fill_later(self, on_error: Callable[[Exception], None] | None = None, **build: Callable[[], Any]) -> None:
        """Build each field named here the first time it is read, as ``build[name]()`` (once, under
        a lock: exporters read reports on their own threads), instead of now. The tracker's step
        end gives the breakdowns, the leak report and the module reports this way: a job whose
        exporters never read them (or read them on their own threads) never builds them on the
        training thread. A function must give the same value whenever it is called. One that
        raises, with ``on_error`` given, leaves its field empty (``leak``: None) and ``on_error``
        gets the exception; without, the reader does."""
        attrs = self.__dict__
        for name in build:
            if name not in _FILLED_LATER:
                raise ValueError(f"{name!r} is not a field that can be filled later")
            del attrs[name]  # read now: ``__getattr__`` builds it
        later = attrs.get("_later")
        if later is None:
            attrs["_later"] = later = build
        else:
            later.update(build)
        if on_error is not None:
            attrs["_later_error"] = on_error

    if not TYPE_CHECKING:  # for type checkers, the fields are plain attributes

        def __getattr__(self, name: str) -> Any:
            # Python calls this only for a name that is neither in the instance's __dict__ nor a
            # class attribute: a field of ``fill_later`` not read yet, or a missing attribute
            later = self.__dict__.get("_later")
            if later is None or name not in later:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            with _FILLING:
                attrs = self.__dict__
                if name not in attrs:
                    attrs[name] = self._built(name, later[name])
                return attrs[name]

    def _built(self, name: str, build: Callable[[], Any]) -> Any:
        try:
            return build()
        except Exception as exc:
            on_error = self.__dict__.get("_later_error")
            if on_error is None:
                raise
            on_error(exc)
            return _FILLED_LATER[name]()

    def __getstate__(self) -> dict[str, Any]:
        """The fields, each built (copies and pickles never carry a ``fill_later`` function)."""
        for name in list(self.__dict__.get("_later") or ()):
            getattr(self, name)
        return {k: v for k, v in self.__dict__.items() if k != "_later" and k != "_later_error"}

    @classmethod
    def from_dict(cls, data: dict[str, Any], copy: bool = True) -> StepReport:
        """Inverse of to_dict(); unknown keys are ignored so old readers accept new files.

        ``copy=False``: take ``peak`` and ``current`` as they are (fresh from ``json.loads``),
        only checking that their byte counts are integers; for readers of many lines."""
        if not copy:
            for b in (data["peak"], data.get("current", {})):
                for cats in b.values():
                    for v in cats.values():
                        if type(v) is not int:
                            raise TypeError(f"byte count {v!r} is not an integer")
        copied = _copy if copy else _same
        return cls(
            step=int(data["step"]),
            rank=int(data["rank"]),
            world_size=int(data["world_size"]),
            mode=str(data["mode"]),
            fsdp_version=int(data.get("fsdp_version", 0)),
            peak=copied(data["peak"]),
            current=copied(data.get("current", {})),
            modules={
                k: ModuleReport(
                    {s: [_copy(b) for b in calls] for s, calls in m["snapshots"].items()},
                    {s: [int(t) for t in ts] for s, ts in m.get("times", {}).items()},
                )
                for k, m in data["modules"].items()
            },
            module_order=list(data.get("module_order", [])),
            allocator={d: dict(v) for d, v in data.get("allocator", {}).items()},
            local_rank=int(data.get("local_rank", 0)),
            duration_seconds=float(data.get("duration_seconds", 0.0)),
            tracker_overhead_seconds=float(data.get("tracker_overhead_seconds", 0.0)),
            errors_total=int(data.get("errors_total", 0)),
            timestamp=float(data.get("timestamp", 0.0)),
            start_time_ns=int(data.get("start_time_ns", 0)),
            end_time_ns=int(data.get("end_time_ns", 0)),
            aborted=None if data.get("aborted") is None else StepAbort.from_dict(data["aborted"]),
            deep_skipped=None if data.get("deep_skipped") is None else str(data["deep_skipped"]),
            warnings=[str(w) for w in data.get("warnings", [])],
            fallback_groups=int(data.get("fallback_groups", 0)),
            leak=None if data.get("leak") is None else LeakReport.from_dict(data["leak"]),
            modules_from=None if data.get("modules_from") is None else int(data["modules_from"]),
        )

    def peak_total(self, device: str | None = None) -> int:
        """Step peak total bytes on ``device`` (default: the largest over devices)."""
        if device is not None:
            return self.peak.get(device, {}).get(TOTAL, 0)
        return max((c.get(TOTAL, 0) for c in self.peak.values()), default=0)


#: the fields ``StepReport.fill_later`` takes, with what each reads as when its function fails: the
#: breakdowns, the leak report, the modules (fields without a default, which a missing instance
#: attribute would read instead of ``__getattr__``)
_FILLED_LATER: dict[str, Callable[[], Any]] = {
    "peak": dict, "current": dict, "modules": dict, "module_order": list, "leak": type(None)}


def empty_breakdown() -> dict[str, int]:
    """A category -> bytes dict with every key present and zero."""
    return dict.fromkeys(CATEGORY_KEYS, 0)


def _same(b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return b


def _copy(b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {dev: {k: int(v) for k, v in cats.items()} for dev, cats in b.items()}
