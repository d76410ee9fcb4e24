"""The step state machine: FSDP module states in, module snapshots and peak windows out; plain Python, which unit
tests drive. It snapshots each module state, opens a peak window at ``before_pre_forward`` /
``before_pre_backward``, closes it at the matching ``after_post_*`` (inner ones first), recognises
activation-checkpoint recompute and locates an abort. Light steps keep window totals until read."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fsdp_mem_otel.schema import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    FORWARD_STATES,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    POST_FORWARD_AC,
    PRE_FORWARD_AC,
    CountedModuleReport,
    ModuleReport,
    largest_total,
)
from fsdp_mem_otel.training.light import log
from fsdp_mem_otel.training.light.counters import INDEX, Counters, RawBreakdown, Snap

logger = logging.getLogger(__name__)

# FSDP phases, as deep mode labels collectives by them (the same phases upstream uses).
IDLE = "idle"
PRE_FORWARD = "pre_forward"
FORWARD = "forward"
POST_FORWARD = "post_forward"
PRE_BACKWARD = "pre_backward"
BACKWARD = "backward"
POST_BACKWARD = "post_backward"

# FSDP phase after each state.
_PHASE_AFTER: dict[str, str] = {
    BEFORE_PRE_FORWARD: PRE_FORWARD,
    AFTER_PRE_FORWARD: FORWARD,
    BEFORE_POST_FORWARD: POST_FORWARD,
    AFTER_POST_FORWARD: FORWARD,
    BEFORE_PRE_BACKWARD: PRE_BACKWARD,
    AFTER_PRE_BACKWARD: BACKWARD,
    BEFORE_POST_BACKWARD: POST_BACKWARD,
    AFTER_POST_BACKWARD: POST_BACKWARD,  # upstream keeps POST_BW until the next pre-backward
}
_TOTAL = INDEX["total"]
_OPENS: dict[str, str] = {BEFORE_PRE_FORWARD: PEAK_FORWARD, BEFORE_PRE_BACKWARD: PEAK_BACKWARD}
_CLOSES: dict[str, str] = {AFTER_POST_FORWARD: PEAK_FORWARD, AFTER_POST_BACKWARD: PEAK_BACKWARD}
#: per state: the phase after it, the peak window it closes and the one it opens (one lookup)
_STEPS: dict[str, tuple[str, str | None, str | None]] = {
    state: (phase, _CLOSES.get(state), _OPENS.get(state)) for state, phase in _PHASE_AFTER.items()}


class StepContext:
    """What per-op accounting reads: FSDP phase, optimizer, AC recompute, backend buffers."""

    __slots__ = ("backend_buffers", "in_ac_recompute", "in_optimizer", "phase")

    def __init__(self) -> None:
        self.phase = IDLE
        self.in_optimizer = False
        self.in_ac_recompute = False
        #: deep steps, a reduce-scatter to its post-backward's end: weak refs to the backend's own storages
        self.backend_buffers: list[Any] | None = None


class _Totals:
    """What the recorder records against in a deferring ledger's flush: window totals alone, no snapshot."""

    __slots__ = ("_counters", "close_window_raw", "open_window")

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        # the usual events' window edges, bound once (a frame less each, ~70 a step)
        self.open_window = counters.open_totals_window
        self.close_window_raw = counters.close_totals_window

    def snap(self) -> Snap:
        return ()

    def close_window_at(self, index: int) -> int:
        return self._counters.close_window_total(index)


#: log entries a step replay keeps before it replays them at once (a loop that never calls step())
_REPLAY_AT = 1 << 18


def _rebound(recorder: StepRecorder, method: Callable[..., None], args: list[Any]) -> None:
    """A step recorder's event of the log, run on ``recorder`` instead of the one it was queued for."""
    method.__func__(recorder, *args)  # type: ignore[attr-defined]


class StepReplay:
    """A light step's snapshots: each flushed part of its log (``Counters.retain``) replayed when first read
    through a recorder of its own, so they are an immediate ledger's. Holds no tensor."""

    def __init__(self, start: RawBreakdown) -> None:
        self._start = start  # the counters when the step began; its recorder is made at the first read
        self._recorder: StepRecorder | None = None
        self._parts: list[list[Any]] = []  # flushed parts of the log (``keep``)
        self._waiting = 0
        self._lock = threading.Lock()

    def keep(self, part: list[Any]) -> None:
        """A flushed part of the step's log, in order."""
        with self._lock:
            self._parts.append(part)
            self._waiting += len(part)
        if self._waiting > _REPLAY_AT:
            self.snaps()

    def snaps(self) -> list[Snap]:
        """The step's snapshots so far, in order (replayed once, under a lock: exporters may read at once)."""
        with self._lock:
            parts, self._parts, self._waiting = self._parts, [], 0
            recorder = self._recorder
            if recorder is None:
                counters = Counters()
                counters.start_from(self._start)
                recorder = self._recorder = StepRecorder(counters, StepContext())
            failures: list[Exception] = []
            for part in parts:  # the step recorder's events here; they ran once already, with window totals alone
                log.take(part, recorder.ledger.apply, functools.partial(_rebound, recorder), failures)
            for exc in failures:  # as a flush's: the others still ran
                logger.debug("fsdp_mem_otel: a replayed event failed", exc_info=exc)
            return recorder._snaps


class StepRecorder:
    """Snapshots and peak windows of one step at a time, from module state events: ``Snap`` tuples in parallel
    lists; each module's report builds its dicts when read."""

    def __init__(self, ledger: Counters, context: StepContext | None = None) -> None:
        self.ledger = ledger
        self.context = context if context is not None else StepContext()
        self._totals = _Totals(ledger)
        self.reset()

    def reset(self) -> None:
        """Start a new step: no snapshots, no open windows, phase idle."""
        self.ledger.flush()  # what is pending belongs to the step that ends
        # per snapshot: module key, state, counters, time_ns (parallel lists, only appended to)
        self._keys: list[str] = []
        self._states: list[str] = []
        self._snaps: list[Any] = []  # Snaps; a light step's replay: (), and a window's largest total
        self._times: list[int] = []
        self.windows: list[tuple[str, str]] = []  # (module key, peak state) per open window
        self.context.phase = IDLE
        self.context.in_ac_recompute = False
        self.context.backend_buffers = None
        self._ac_key: str | None = None
        # Deferring: the flush runs events here with totals alone (``_Totals``), ``StepReplay`` again when read.
        self._replay: StepReplay | None = None
        if self.ledger.pending is not None:
            self._replay = StepReplay(self.ledger.raw())
            self.ledger.retain(self._replay.keep)

    # -- events --------------------------------------------------------------------------------
    def on_state(self, key: str, state: str, in_backward: bool = False, windowed: bool = True,
                 t: int | None = None) -> None:
        """Module ``key`` reached ``state`` (in backward, forward states are a recompute); ``windowed=False``: the
        adapter opens and closes windows itself; ``t``: time_ns (None: now)."""
        if t is None:
            t = time.time_ns()
        if in_backward and state in FORWARD_STATES:
            self._on_recompute(key, state, t)
            return
        phase, closes, opens = _STEPS[state]
        self.context.phase = phase
        ledger, windows = self._target(), self.windows
        keys, states, snaps, times = self._keys, self._states, self._snaps, self._times
        if windowed and closes is not None:
            if windows and windows[-1] == (key, closes):  # the usual nesting
                windows.pop()
                peak = ledger.close_window_raw()
                keys.append(key)  # ``_append``, written out
                states.append(closes)
                snaps.append(peak)
                times.append(t)
            else:
                self._close_window(key, closes, t)
        snap = () if ledger is self._totals else ledger.snap()  # a replay's: taken when read
        keys.append(key)  # after the snapshot: one that raises leaves the four lists in step
        states.append(state)
        snaps.append(snap)
        times.append(t)
        if windowed and opens is not None:
            ledger.open_window()
            windows.append((key, opens))

    def open_window(self, key: str, peak_state: str, t: int | None = None) -> None:
        """Start module ``key``'s ``peak_state`` window; ``t``: unused (the replay signature)."""
        self._target().open_window()
        self.windows.append((key, peak_state))

    def close_window(self, key: str, peak_state: str, t: int | None = None) -> None:
        """End module ``key``'s ``peak_state`` window (inner ones first); a no-op if not open."""
        self._close_window(key, peak_state, t)

    def end_window(self, key: str, peak_state: str, oldest: bool = False, t: int | None = None) -> None:
        """End ``key``'s latest (``oldest``: earliest) ``peak_state`` window alone, nested or not."""
        n = len(self.windows)
        for i in range(n) if oldest else range(n - 1, -1, -1):
            if self.windows[i] == (key, peak_state):
                del self.windows[i]
                self._append(key, peak_state, self._target().close_window_at(i), t)
                return

    def _on_recompute(self, key: str, state: str, t: int) -> None:
        target, ctx = self._target(), self.context  # a direct call turns a deferring step immediate
        if state == BEFORE_PRE_FORWARD:
            ctx.phase = PRE_FORWARD
        elif state == AFTER_PRE_FORWARD:
            ctx.phase = FORWARD
            self._append(key, PRE_FORWARD_AC, target.snap(), t)
            if self._ac_key is None:
                self._ac_key, ctx.in_ac_recompute = key, True
        elif state == BEFORE_POST_FORWARD:
            ctx.phase = POST_FORWARD
            self._append(key, POST_FORWARD_AC, target.snap(), t)
            if self._ac_key == key:
                self._ac_key, ctx.in_ac_recompute = None, False

    def _close_window(self, key: str, peak_state: str, t: int | None = None) -> None:
        # Windows nest; if FSDP closes one out of order, close the inner ones first.
        if (key, peak_state) not in self.windows:
            return
        target = self._target()
        while self.windows:
            k, s = self.windows.pop()
            self._append(k, s, target.close_window_raw(), t)
            if k == key and s == peak_state:
                return

    def close_open_windows(self) -> None:
        """Close every window still open (step end), innermost first."""
        # an event of the log where it defers, replayed in its place
        self.ledger.queue(self._close_all, time.time_ns())
        self.ledger.flush()

    def _close_all(self, t: int | None = None) -> None:
        target = self._target()
        while self.windows:
            key, peak_state = self.windows.pop()
            self._append(key, peak_state, target.close_window_raw(), t)

    def _target(self) -> Any:
        """Where snapshots and windows go: ``_Totals`` in a deferring flush, else the ledger."""
        ledger = self.ledger
        if self._replay is not None:
            if ledger.flushing and ledger.pending is not None:
                return self._totals
            self._replay = None  # this step's reports take their snapshots here: no replay
            ledger.retain(None)
        return ledger

    def _append(self, key: str, state: str, snap: Snap, t: int | None = None) -> None:
        self._keys.append(key)
        self._states.append(state)
        self._snaps.append(snap)
        self._times.append(time.time_ns() if t is None else t)

    @property
    def fresh(self) -> bool:
        """A light step as ``reset()`` began it: nothing recorded, no window open, phase idle."""
        ctx = self.context
        return (self._replay is not None and not self._keys and not self.windows and self._ac_key is None
                and ctx.phase == IDLE and not ctx.in_ac_recompute and ctx.backend_buffers is None)

    @property
    def logged(self) -> list[tuple[str, str]]:
        """(module key, state) of each snapshot of the step so far, in order."""
        self.ledger.flush()
        return list(zip(self._keys, self._states, strict=True))

    @property
    def modules(self) -> dict[str, ModuleReport]:
        """The step's snapshots so far, per module: reports that build their dicts when first read."""
        return self.modules_later()()

    def modules_later(self) -> Callable[[], dict[str, ModuleReport]]:
        """``modules`` as of now, built when called, on any thread (the record is only appended to)."""
        self.ledger.flush()
        replay = self._replay  # a light step's snapshots are replayed when read
        record = (self._states, replay.snaps if replay is not None else self._snaps, self._times)
        return functools.partial(_module_reports, self._keys, len(self._keys), self._snaps, record)

    # -- where are we --------------------------------------------------------------------------
    @property
    def in_pass(self) -> bool:
        """A forward or backward pass is open (some module's window has not closed)."""
        self.ledger.flush()
        return bool(self.windows)

    def location(self) -> tuple[str, str]:
        """(module, state) now: the innermost window's or the last snapshot's module; ("", "") before any."""
        self.ledger.flush()
        keys = self._keys
        if self.windows:
            key = self.windows[-1][0]
        elif keys:
            key = keys[-1]
        else:
            return "", ""
        return key, next((self._states[i] for i in range(len(keys) - 1, -1, -1) if keys[i] == key), "")


def _module_reports(keys: list[str], n: int, snaps: list[Any], record: tuple[list[str], Any, list[int]],
                    ) -> dict[str, ModuleReport]:
    """``StepRecorder.modules`` from the record's first ``n`` entries and their snapshots (or window totals)."""
    states = record[0]
    at: dict[str, list[int]] = {}
    peaks: dict[str, list[int | None]] = {}  # key -> [forward, backward] peak totals
    for i, key in enumerate(keys[:n]):  # one pass: the step's record is ~10 entries per module
        where = at.get(key)
        if where is None:
            at[key] = [i]
        else:
            where.append(i)
        state = states[i]
        if state == PEAK_FORWARD or state == PEAK_BACKWARD:
            snap = snaps[i]  # a light step's: the window's total; else, nearly always one device
            total = snap if snap.__class__ is int else snap[1][_TOTAL] if len(snap) == 2 \
                else largest_total([snap])
            both = peaks.get(key)
            if both is None:
                both = peaks[key] = [None, None]
            side = 0 if state == PEAK_FORWARD else 1
            both[side] = max(both[side] or 0, total)
    out: dict[str, ModuleReport] = {}
    for key, where in at.items():
        fwd, bwd = peaks.get(key) or (None, None)
        out[key] = CountedModuleReport(None, None, (fwd, bwd), record, tuple(where))
    return out
