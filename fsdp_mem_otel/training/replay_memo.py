"""A light step's replay, remembered and reused by the next step that logs the same.

Training repeats itself: in steady state every step queues the same byte changes and the same
module events in the same order (``counters.Counters.flush`` replays them), only their times
differ. ``ReplayMemo`` keeps what the last replay of each part of a step left behind (the
counters, the peak windows, the step recorder's entries) together with the part's log, its times
masked out; a part of a later step whose log is equal, starting from the same counters, is not
replayed again: the remembered state is put back, with this step's times. The counters may also
start higher or lower by a constant (a job that keeps its batches, a slow leak): on one device
every total, peak and window total of the replay moves by that constant (``_Shift``), so a step
that starts from other counters reuses it too; on several devices only equal counters do.

What a replay leaves depends on nothing but the counters a step starts from and its log (the
recorder starts each step afresh, windows are dropped, the step's peak starts from the counters),
so a part reused is exactly what the replay would have given: tests/training/test_replay_memo.py
replays random steps both ways and compares everything. A step in which anything changes the
counters outside a replay (``skip_step``) neither reuses nor teaches. Learning a part costs about
as much as a tenth of its replay: while no step repeats the last one learnt (shapes that change
every step), steps are learnt ever less often, down to one in 32. Knows no torch.
"""

from __future__ import annotations

import logging
import time
from operator import add
from typing import Any

from fsdp_mem_otel.training.counters import _T, _Window
from fsdp_mem_otel.training.step_script import SplicedLog
from fsdp_mem_otel.training.step_script import entries_getter as _getter

logger = logging.getLogger(__name__)

#: a window's state: per device its peak total, the devices whose peak is live, its counters then
_State = tuple[dict[str, int], set[str], dict[str, tuple[int, ...]] | None]

#: a step's first parts remembered at most, and log entries in all (a loop that never calls step())
_MAX_PARTS = 16
_MAX_ENTRIES = 1 << 17  # twice the sink's flush of a step without step(): such a part fits
#: steps at most between two that learn, while no step repeats the last one learnt
_MAX_WAIT = 31


class _Part:
    """One replayed part of a step: its log with the times zeroed, where they were, and the state
    the replay left (the counters' and the step recorder's entries of that part)."""

    __slots__ = ("ac_key", "cur", "cut_times", "expected", "fixed", "in_ac", "keys", "masked", "phase", "rec_windows",
                 "snaps", "spliced", "states", "step", "time_src", "times_at", "times_of", "totals_at", "windows")
    masked: list[Any]  # the log, each event's time 0
    times_at: list[int]  # where the times are
    fixed: Any  # a C-level getter of everything else (``operator.itemgetter``)
    expected: tuple[Any, ...]  # and what it must read
    spliced: Any  # the step script's cut of a replayed step's log found equal to it, or None
    cut_times: Any  # then: a C-level getter of its entries' times from the cut's times, or None
    cur: dict[str, tuple[int, ...]]  # the counters after the part
    step: _State  # the step's window then
    windows: list[_State]  # the open windows then, outermost first
    keys: list[str]  # the recorder's entries the part made: keys, states, snapshots
    states: list[str]
    snaps: list[Any]
    time_src: list[int]  # per entry, where in the log its time is (-1: the time of the replay)
    times_of: Any  # a C-level getter of those times where every entry has one in the log, else None
    totals_at: list[int]  # where ``snaps`` holds window totals (ints), which a shift moves
    rec_windows: list[tuple[str, str]]  # the recorder's open windows, its phase and recompute
    phase: str
    ac_key: str | None
    in_ac: bool


def _cut_times(part: _Part, cut: Any) -> Any:
    """For a part found equal to a step script's cut, whole: a getter of its recorder entries'
    times from the cut's times (``cut.times(log)``), or None where one has no time in the log."""
    at = {p: i for i, p in enumerate(cut.full_at)}
    where = [at.get(p, -1) for p in part.time_src]
    return _getter(where) if not where or min(where) >= 0 else None


def _copied(state: _State) -> _State:
    peak, live, snap = state
    return dict(peak), set(live), None if snap is None else dict(snap)


def _times_of(rec: Any, part_log: list[Any], events: list[int]) -> list[int] | None:
    """Where the events' times are in ``part_log``; None where a part cannot be remembered: an
    event that is not recorder ``rec``'s with its time last, or two events at the same time (which
    snapshot took which could not be told apart)."""
    times_at = []
    for at in events:
        n = part_log[at + 1]
        p = at + 1 + n
        if not n or getattr(part_log[at], "__self__", None) is not rec or part_log[p].__class__ is not int:
            return None
        times_at.append(p)
    if len({part_log[p] for p in times_at}) != len(times_at):
        return None
    return times_at


def _capture(counters: Any, rec: Any, rec_len: int, part_log: list[Any], times_at: list[int]) -> _Part:
    """The part ``part_log`` just replayed: its log masked, and the state the replay left in
    ``counters`` and in recorder ``rec`` (its entries from ``rec_len`` on)."""
    part = _Part()
    masked = part_log[:]
    for p in times_at:
        masked[p] = 0
    part.masked, part.times_at = masked, times_at
    timed = set(times_at)
    fixed = [p for p in range(len(masked)) if p not in timed]
    part.fixed = _getter(fixed)
    part.expected = tuple(masked[p] for p in fixed)
    part.spliced = part.cut_times = None
    part.cur = {d: tuple(c) for d, c in counters._cur.items()}
    part.step = _copied((counters._step.peak, counters._step.live, counters._step.snap))
    part.windows = [_copied((w.peak, w.live, w.snap)) for w in counters._windows]
    n = rec_len
    part.keys, part.states, part.snaps = rec._keys[n:], rec._states[n:], rec._snaps[n:]
    where = {part_log[p]: p for p in times_at}
    part.time_src = [where.get(t, -1) for t in rec._times[n:]]
    part.times_of = _getter(part.time_src) if part.time_src and min(part.time_src) >= 0 else None
    part.totals_at = [i for i, snap in enumerate(part.snaps) if snap.__class__ is int]
    part.rec_windows = list(rec.windows)
    part.phase, part.ac_key, part.in_ac = rec.context.phase, rec._ac_key, rec.context.in_ac_recompute
    return part


class _Shift:
    """Moves remembered counters by a constant, on the one device a shiftable step has."""

    __slots__ = ("device", "total", "vector")

    def __init__(self, device: str, vector: tuple[int, ...], total: int) -> None:
        self.device, self.vector, self.total = device, vector, total

    def window(self, state: _State) -> _State:
        peak, live, snap = state
        d = self.device
        return ({d: peak[d] + self.total}, set(live),
                None if snap is None else {d: tuple(map(add, snap[d], self.vector))})


class ReplayMemo:
    """Remembers a light step's replayed parts and reuses them (see the module docstring).

    Args:
        counters: the deferring ledger's counters (``counters.Counters``) whose ``flush`` asks.
        recorder: the step recorder (``recorder.StepRecorder``) whose events the log holds.
    """

    def __init__(self, counters: Any, recorder: Any) -> None:
        self._counters = counters
        self._recorder = recorder
        self._parts: list[_Part] = []
        self._start: dict[str, tuple[int, ...]] | None = None  # the counters the remembered step began from
        self._shiftable = False  # one device, none added during the remembered step
        self._entries = 0
        self._offer = True  # the counters' offer_on_add then
        # steps whose first part is not learnt before the next one is, and what comes after: 0, 1,
        # 3, ... while no step repeats the last learnt one (a learnt step costs ~30 us a part)
        self._wait = self._backoff = 0
        #: parts reused (of them, from counters apart by a constant) and replayed since attach
        self.reused = self.shifted = self.replayed = 0
        self.remembered = 0  # parts remembered
        self.off = False  # after a failure of its own
        self.new_step()

    def new_step(self) -> None:
        """A step begins (``Counters.reset_step``, ``StepRecorder.reset``): its first part is
        compared from the start."""
        self._k = 0  # the next part's position in the step
        self._hits_only = True  # every part of this step so far was reused
        self._learning = False  # this step's parts are being remembered
        self._shift: _Shift | None = None
        self._step_start: dict[str, tuple[int, ...]] = {}
        self._rec_len = 0
        self._fresh = False  # at this step's first replay: all as a step starts

    def skip_step(self) -> None:
        """Something changed the counters or the recorder outside a replay: nothing more of this
        step is reused or remembered (what is remembered stays right for the steps it matches)."""
        self._hits_only = self._learning = False

    # -- the replay asks ----------------------------------------------------------------------
    def reuse(self, pending: list[Any], unspliced: tuple[Any, int] | None = None) -> bool:
        """Put back what replaying ``pending`` would leave, if remembered, and take that part off
        it (what was queued meanwhile stays); False: replay it. Never raises: a failure turns the
        memo off for good (counted as a failing replay); before the part was taken off the log, it
        is then replayed. ``unspliced``: see ``reuse_cut``."""
        if self.off:
            return False
        try:
            plan = self._plan(pending, unspliced)
        except Exception as exc:  # noqa: BLE001 - the replay must go on
            self._fail(exc)
            return False
        if plan is None:
            return False
        started = time.perf_counter()
        taken: list[bool] = []
        try:
            part, n = plan
            if unspliced is None:
                self._put_back(pending, part, n, taken)
            else:
                cut = unspliced[0]
                times = cut.times(pending)
                self._put_back(pending, part, n, taken, part.cut_times(times), SplicedLog(cut, times))
        except Exception as exc:  # noqa: BLE001 - once taken off the log, never replayed as well
            self._fail(exc)
        self._counters.replay_seconds += time.perf_counter() - started
        return bool(taken)

    def reuse_cut(self, pending: list[Any], cut: Any, m: int) -> bool:
        """``reuse`` for a replayed step's log whose first ``m`` entries, all of it, the step script
        found to be ``cut`` of its script and has not put its entries in for yet
        (``StepScript.unspliced``): where the remembered part is that cut, put back what it
        leaves and take them off the log, and hand on the log the script would have put in to be
        built when read (``step_script.SplicedLog``). False: not remembered, or a failure of its
        own (it is then off); the script puts its entries in."""
        return self.reuse(pending, (cut, m))

    def learned(self, part_log: list[Any], events: list[int], failed: bool) -> None:
        """``part_log`` was replayed (``events``: where its events start); remember it where this
        step is being remembered. ``failed``: an event failed or the replay stopped. Never raises."""
        if self.off:
            return
        try:
            self._learned(part_log, events, failed)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.off = True
        self._forget()
        report = self._counters.on_replay_error
        if report is None:
            logger.warning("fsdp_mem_otel: the replay memo failed and is off; every step replays", exc_info=exc)
        else:
            report(exc)

    def _plan(self, pending: list[Any], unspliced: tuple[Any, int] | None = None) -> tuple[_Part, int] | None:
        # the remembered part that ``pending`` repeats, and its length; None: replay it.
        # ``unspliced``: the log is the step script's cut, whole, its entries not put in yet
        counters = self._counters
        self._rec_len = len(self._recorder._keys)
        k = self._k
        if k == 0:
            self._fresh = self._as_reset()
            self._step_start = {d: tuple(c) for d, c in counters._cur.items()}
        if not self._hits_only or k >= len(self._parts) or self._recorder._replay is None:
            return None
        part = self._parts[k]
        if unspliced is not None:  # only a part found to be that cut before, times at hand
            cut, m = unspliced
            if part.spliced is not cut or part.cut_times is None or len(pending) != m \
                    or (k == 0 and not self._starts_alike()):
                return None
            return part, m
        n = len(part.masked)
        if len(pending) != n or (k == 0 and not self._starts_alike()):
            return None
        # a replayed step's log as the step script put it in (``step_script.py``), which this part
        # was found equal to before: the same again
        spliced = getattr(getattr(counters, "script", None), "spliced", None)
        if spliced is not None and part.spliced is spliced:
            return part, n
        # everything but the times, equal: the same events, so a time where the part had one
        if part.fixed(pending) != part.expected:
            return None
        part.spliced, part.cut_times = spliced, None if spliced is None else _cut_times(part, spliced)
        return part, n

    def _learned(self, part_log: list[Any], events: list[int], failed: bool) -> None:
        k = self._k
        self._k = k + 1
        self.replayed += 1
        if failed:  # a failing event's effect is unknown
            self._forget()
            self._hits_only = self._learning = False
            return
        if self._hits_only:  # the first part of this step not reused: remember from here
            self._hits_only = False
            if k == 0:
                if self._fresh and self._wait:  # steps that do not repeat: learn less often
                    self._wait -= 1
                elif self._fresh:
                    self._forget()
                    self._start = self._step_start
                    self._shiftable = len(self._start) == 1
                    self._offer = self._counters.offer_on_add
                    self._learning = True
                    self._wait, self._backoff = self._backoff, min(2 * self._backoff + 1, _MAX_WAIT)
            elif self._shift is None and len(self._parts) >= k:
                del self._parts[k:]
                self._entries = sum(len(p.masked) for p in self._parts)
                self._learning = True
            elif self._learnable(k, part_log, _times_of(self._recorder, part_log, events)):  # other counters: afresh
                self._forget()
        if not self._learning:
            return
        if len(self._parts) != k:  # not in line with the remembered parts: start again next step
            self._forget()
            self._learning = False
            return
        times_at = _times_of(self._recorder, part_log, events)
        if times_at is None or not self._learnable(k, part_log, times_at):
            self._learning = False  # the parts before it stay
            return
        part = _capture(self._counters, self._recorder, self._rec_len, part_log, times_at)
        if self._shiftable and part.cur.keys() != self._start.keys():  # type: ignore[union-attr]
            self._shiftable = False  # a device came: its counters started at 0, not shifted
        self._parts.append(part)
        self._entries += len(part_log)
        self.remembered += 1

    # -- inside --------------------------------------------------------------------------------
    def _forget(self) -> None:
        self._parts = []
        self._start = None
        self._entries = 0

    def _as_reset(self) -> bool:
        # before a step's first replay: the recorder, the windows and the step's peak as a step
        # starts them (``StepRecorder.reset``, ``Counters.reset_step``)
        counters = self._counters
        step, cur = counters._step, counters._cur
        if not self._recorder.fresh or counters._windows or step.live or step.snap is None:
            return False
        if step.peak.keys() != cur.keys() or step.snap.keys() != cur.keys():
            return False
        return all(step.peak[d] == c[_T] and step.snap[d] == tuple(c) for d, c in cur.items())

    def _starts_alike(self) -> bool:
        # the counters now against those the remembered step began from: equal, or (one device)
        # apart by a constant
        start, now = self._start, self._counters._cur
        if start is None or not self._fresh or now.keys() != start.keys() \
                or self._counters.offer_on_add != self._offer:
            return False
        self._shift = None
        for d, c in now.items():
            if tuple(c) != start[d]:
                if not self._shiftable:
                    return False
                vector = tuple(a - b for a, b in zip(c, start[d], strict=True))
                self._shift = _Shift(d, vector, vector[_T])
        return True

    def _learnable(self, k: int, part_log: list[Any], times_at: list[int] | None) -> bool:
        # within the bounds, and made of the recorder's timed events only (``_times_of``)
        return k < _MAX_PARTS and self._entries + len(part_log) <= _MAX_ENTRIES and times_at is not None

    def _put_back(self, pending: list[Any], part: _Part, n: int, taken: list[bool], times: Any = None,
                  log: Any = None) -> None:
        # everything computed first, then the part taken off the log (``taken`` says so) and the
        # state assigned; every step end puts a part back: loops, no comprehension (a frame each)
        # where a loop does, none for an empty list
        counters, rec, shift = self._counters, self._recorder, self._shift
        cur = {}
        for d, c in part.cur.items():
            cur[d] = list(c) if shift is None else list(map(add, c, shift.vector))  # both a counter list long
        step = shift.window(part.step) if shift else _copied(part.step)
        windows = []
        for state in part.windows:
            w = _Window({})
            w.peak, w.live, w.snap = shift.window(state) if shift else _copied(state)
            windows.append(w)
        # a light step's window totals are ints; its state snapshots, taken when read, ()
        snaps = part.snaps
        if shift is not None and part.totals_at:
            snaps = snaps[:]
            total = shift.total
            for i in part.totals_at:
                snaps[i] += total
        if times is not None:  # ``reuse_cut``'s: the log is not built
            pass
        elif part.times_of is not None:  # the usual part: every entry's time is in the log
            times = part.times_of(pending)
        else:
            now = time.time_ns()
            times = [pending[p] if p >= 0 else now for p in part.time_src]
        if log is None:
            log = pending[:n]
        del pending[:n]
        taken.append(True)
        self._k += 1
        self._wait = self._backoff = 0
        self.reused += 1
        self.shifted += shift is not None
        for d, values in cur.items():
            have = counters._cur.get(d)
            if have is None:
                counters._cur[d] = values
            else:
                have[:] = values
        counters._step.peak, counters._step.live, counters._step.snap = step
        counters._windows[:] = windows
        rec._keys.extend(part.keys)
        rec._states.extend(part.states)
        rec._snaps.extend(snaps)
        rec._times.extend(times)
        rec.windows[:] = part.rec_windows
        rec.context.phase, rec._ac_key, rec.context.in_ac_recompute = part.phase, part.ac_key, part.in_ac
        if counters._retained is not None:
            counters._retained(log)
