"""Light steps learnt once and replayed on the steps that repeat them.

Two parts of light mode's work are per saved tensor or per FSDP event and say the same every step
of a steady run: the saved-tensor hooks (a pack, an unpack and a free callback per saved tensor:
``activations.py``) and FSDP2's integer accounts (``adapters/fsdp2_groups.LightGroup``, at each
unshard, wait, reshard and post-backward of every group). Training repeats itself: a step whose
outermost forward gets inputs of the same shapes saves the same tensors and runs the same FSDP
events in the same order as the step before. So a *learn* step does that work, and what it
changes goes into the ledger's log *scripted*: under a negative category index (the category
counted from the end: every counter list adds it to the same category as it stands, and a log
tells it apart). Before each replay of the log (``ledger.Ledger.flush``) this class keeps what
is replayed, all the step's parts in one (its *script*), and the same without the scripted changes
(its *skeleton*: module states, the tracked storages' changes, everything the training's own
tensors tell).

Once two learn steps in a row logged the same script, a step whose outermost forwards get inputs
of the same shapes (``signature``) is a *replay* step: no saved-tensor hooks, inner modules'
inputs and outputs not walked, FSDP2's light groups not told of their events. Wherever its log is
cut for a replay, the cut must be the skeleton's next entries (event times aside); it is replaced
by the script up to the last of them, with this step's times, and replayed as if the work had run
(what happens after the script's end is the step's own). At its end the groups take the state the
learn step left (``restore``). Every ``VERIFY_EVERY`` replayed steps a step learns again, to check.

What does not repeat is never replayed silently. A log that parts from the skeleton, another
outermost forward's inputs, or a step ending before its script does is a *miss*: that step's
figures are exact up to where it parted and off after it, by what it skipped. It is counted
(``misses``, ``StepReport.replay_misses``), the scripted bytes it took in are taken out again at
its end and the groups count what FSDP holds then (``resync``); the steps after it learn until two
agree. A check that finds the script changed under the same skeleton (data-dependent shapes inside
a module, such as token routing) counts too: the steps replayed since may have been off. Saved
tensors that outlive their step (a graph kept for later) stop the replay while they live; what the
outermost module receives and returns, which the training loop keeps across steps, is always seen.

Knows no torch (the signature is built by the sink, the groups' state by the adapter).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

#: replayed steps between two learn steps that check the script
VERIFY_EVERY = 16
_LEARN, _REPLAY, _MISSED, _NONE = "learn", "replay", "missed", "none"


class _Script:
    """A learn step's log as replayed, all its parts in one: the script and its skeleton, each
    with every event's last argument (its time) masked and where those are, where each skeleton
    entry sits in the script; its outermost forwards' input signatures; the state its groups were
    left in."""

    __slots__ = ("cuts", "end_state", "full", "full_at", "signatures", "skel", "skel_at", "skel_in_full")

    def __init__(self, signature: Any) -> None:
        self.full: list[Any] = []
        self.skel: list[Any] = []
        self.full_at: list[int] = []  # where the times are in ``full``
        self.skel_at: list[int] = []  # and in ``skel``, pairwise
        self.skel_in_full: list[int] = []  # per entry of ``skel``, its position in ``full``
        self.signatures = [signature]
        self.end_state: Any = None
        self.cuts: dict[tuple[int, int], _Cut] = {}  # the replayed steps' cuts of it, built once

    def add_part(self, part: list[Any]) -> None:
        """Append a part of the log as it is about to be replayed."""
        full, skel, skel_in_full = self.full, self.skel, self.skel_in_full
        base = len(full)
        full.extend(part)
        i, n_all = 0, len(part)
        while i < n_all:
            head = part[i]
            if head.__class__ is str:  # a change: device, category, delta (an event's head is a method)
                if part[i + 1] >= 0:  # not scripted: the skeleton's
                    skel.extend(part[i:i + 3])
                    skel_in_full.extend((base + i, base + i + 1, base + i + 2))
                i += 3
                continue
            n = part[i + 1]  # an event: method, n, *n args (the time last)
            if n:
                self.full_at.append(base + i + 1 + n)
                self.skel_at.append(len(skel) + 1 + n)
                full[base + i + 1 + n] = 0
            skel.extend(part[i:i + 2 + n])
            skel_in_full.extend(range(base + i, base + i + 2 + n))
            if n:
                skel[-1] = 0
            i += 2 + n

    def same(self, other: _Script) -> bool:
        return self.signatures == other.signatures and self.end_state == other.end_state \
            and self.full == other.full

    def net(self, end: int) -> dict[tuple[str, int], int]:
        """The scripted bytes of ``full[:end]`` per device and category."""
        full = self.full
        out: dict[tuple[str, int], int] = {}
        i = 0
        while i < end:
            head = full[i]
            if head.__class__ is str:
                if full[i + 1] < 0:
                    out[head, full[i + 1]] = out.get((head, full[i + 1]), 0) + full[i + 2]
                i += 3
            else:
                i += 2 + full[i + 1]
        return out


def entries_getter(positions: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """Those entries of a list, as a tuple, in one C call."""
    if len(positions) > 1:
        return itemgetter(*positions)  # type: ignore[return-value]
    return lambda log: tuple(log[p] for p in positions)


class _Cut:
    """A replayed step's log cut at skeleton entries ``[s0, s0 + m)`` (the same every steady step,
    so kept): what it must hold besides the times, where its times go in the script."""

    __slots__ = ("expected", "f0", "f1", "fixed", "full", "full_at", "t1", "time_slots", "times")

    def __init__(self, script: _Script, s0: int, m: int, t0: int) -> None:
        end = s0 + m
        skel_at = script.skel_at
        t1 = t0
        while t1 < len(skel_at) and skel_at[t1] < end:
            t1 += 1
        times = [skel_at[t] - s0 for t in range(t0, t1)]
        timed = set(times)
        fixed = [p for p in range(m) if p not in timed]
        self.fixed, self.times, self.time_slots = entries_getter(fixed), entries_getter(times), times
        self.expected = tuple(script.skel[s0 + p] for p in fixed)
        # from after the skeleton's entry before it (the scripted changes since are this cut's) to
        # after its own last one (those after it have not happened yet), or the script's end
        self.f0 = script.skel_in_full[s0 - 1] + 1 if s0 else 0
        self.f1 = len(script.full) if end == len(script.skel) else script.skel_in_full[end - 1] + 1
        self.full_at = [script.full_at[t] - self.f0 for t in range(t0, t1)]
        self.t1 = t1
        self.full = script.full[self.f0:self.f1]

    def spliced(self, times: tuple[int, ...]) -> list[Any]:
        """The script's entries of this cut, with ``times`` (a step's log's, ``times(log)``) in
        their places: the step's log as if the work had run."""
        full = self.full[:]
        for p, t in zip(self.full_at, times):  # noqa: B905 - as many as the getter takes
            full[p] = t
        return full


class SplicedLog:
    """The log a replayed step's cut of the script stands for (``_Cut.spliced``), built when
    called: the replay memo hands it on in place of a log it did not need to build."""

    __slots__ = ("cut", "times")

    def __init__(self, cut: _Cut, times: tuple[int, ...]) -> None:
        self.cut, self.times = cut, times

    def __len__(self) -> int:
        return len(self.cut.full)

    def __call__(self) -> list[Any]:
        return self.cut.spliced(self.times)


def _agreeing(script: _Script, s0: int, log: list[Any], cut: _Cut) -> int:
    """How many of ``log``'s first entries, whole, are the skeleton's from ``s0`` on (a miss:
    where the step parts from its script)."""
    for p in cut.time_slots:
        log[p] = 0
    skel = script.skel
    same = 0
    i, n = 0, len(log)
    while i < n:  # entry by entry: a change is three, an event two and its arguments
        size = 3 if skel[s0 + i].__class__ is str else 2 + skel[s0 + i + 1]
        if log[i:i + size] != skel[s0 + i:s0 + i + size]:
            break
        i += size
        same = i
    return same


def _nothing(*_: Any) -> Any:
    return None


class StepScript:
    """Decides per step whether it learns or replays, and replays it (see the module docstring).

    The sink asks ``forward_begins`` at each outermost forward; the ledger calls ``before_flush``
    before each replay of its log; ``end_step`` closes a step after its last flush, ``new_step``
    starts one. ``replaying`` and ``skipping`` tell the sink and the adapter what to leave out.
    Never raises: a failure of its own turns it off for good (every step then learns, as without
    it) and is reported.

    Args:
        counters: the deferring ledger (``ledger.Ledger``) whose log it rewrites.
        on: replay at all (``TrackerConfig.replay_steps``); off: every step learns.
    """

    def __init__(self, counters: Any, on: bool = True) -> None:
        self._counters = counters
        self.off = not on
        self._script: _Script | None = None
        self._confirmed = False  # the script is what the last two learn steps logged
        self._since = 0  # steps replayed since the last learn step
        #: replayed steps the script did not fit, and checks that found it changed; steps replayed
        self.misses = self.replayed = 0
        #: the adapter's: the light groups' state (comparable), put back, counted afresh; with
        #: them (``wire``), what the sink adds for the groups is scripted and replayed steps skip it
        self.state: Callable[[], Any] = tuple
        self.restore: Callable[[Any], None] = _nothing
        self.resync: Callable[[], None] = _nothing
        self._groups = False
        self.new_step()

    # -- the step ------------------------------------------------------------------------------
    def new_step(self) -> None:
        """A step begins: nothing decided until its first outermost forward."""
        self._mode = _NONE
        #: this step replays from its first forward on: the light groups are not told of events
        self.skipping = False
        #: and has not missed: no saved-tensor hooks, inner modules' inputs and outputs not walked
        self.replaying = False
        #: what the light groups change goes into the log scripted (a step was decided)
        self.scripting = False
        self._learning: _Script | None = None
        #: the cut of the script the log now being replayed is, whole (the replay memo trusts a
        #: part it found equal to it once), or None
        self.spliced: _Cut | None = None
        #: a cut of the script found in the log and not yet put into it, with its length in the
        #: log (``splice``), or None: the replay memo may put back what it leaves instead
        self.unspliced: tuple[_Cut, int] | None = None
        # how far this step's log has replayed the script: in the skeleton, its times, the script
        self._skel = self._time = self._full = 0
        self._forwards = 0  # outermost forwards begun

    def forward_begins(self, signature: Any, scripted_alive: int) -> bool:
        """An outermost FSDP forward begins with inputs of ``signature``; ``scripted_alive``:
        storages counted scripted still alive. Returns whether to push the saved-tensor hooks."""
        mode = self._mode
        if mode == _NONE:
            script = self._script
            self.scripting = self._groups
            if (not self.off and self._confirmed and script is not None and self._since < VERIFY_EVERY
                    and not scripted_alive and script.signatures[0] == signature
                    and self._counters.pending is not None):  # a log to rewrite
                self._mode, self._forwards = _REPLAY, 1
                self.skipping = self.replaying = True
                return False
            self._mode, self._learning = _LEARN, _Script(signature)
            return True
        if mode == _REPLAY:
            script, f = self._script, self._forwards
            if script is not None and f < len(script.signatures) and script.signatures[f] == signature:
                self._forwards = f + 1
                return False
            self._miss()
            return True
        if mode == _LEARN and self._learning is not None:
            self._learning.signatures.append(signature)
        return True

    def end_step(self) -> None:
        """After the step's last flush: keep what it learnt, or undo what a miss left."""
        try:
            self._end_step()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        if self.off:
            self._script = None
        self._mode = _NONE  # flushes until the next step neither learn nor replay
        self.skipping = self.replaying = self.scripting = False

    def wire(self, state: Callable[[], Any], restore: Callable[[Any], None], resync: Callable[[], None]) -> None:
        """Let replayed steps skip the adapter's light groups (see ``state``)."""
        self.state, self.restore, self.resync = state, restore, resync
        self._groups = True

    def forget(self) -> None:
        """The next two steps learn (attach)."""
        self._confirmed = False
        self._script = None

    def _end_step(self) -> None:
        mode, script = self._mode, self._script
        if mode == _REPLAY and script is not None and self._skel != len(script.skel):
            self._miss()  # the step ended before its script did
            mode = self._mode
        if mode == _REPLAY and script is not None:
            self.restore(script.end_state)
            self.replayed += 1
            self._since += 1
        elif mode == _MISSED:
            if script is not None:
                for (device, cat), n in script.net(self._full).items():
                    if n:
                        self._counters._add(device, cat, -n)
            self.resync()
            self._confirmed = False
        elif mode == _LEARN:
            learnt = self._learning
            if learnt is None or not learnt.skel or self._counters.scripted_entries:
                self._confirmed = False  # it failed, logged nothing, or keeps saved tensors past its end
                return
            learnt.end_state = self.state()
            if learnt.end_state is None:  # the adapter's groups cannot skip a step now
                self._confirmed = False
                return
            if script is not None and learnt.same(script):
                self._confirmed = True
            else:
                if self._confirmed and self._since and script is not None and learnt.skel == script.skel:
                    self.misses += 1  # the steps replayed since the last check may have been off
                self._script, self._confirmed = learnt, False
            self._since = 0
        else:
            self._confirmed = False  # no outermost forward decided (a deep step, or none)

    def _miss(self) -> None:
        self._mode = _MISSED
        self.replaying = False  # later forwards of the step see their activations
        self.misses += 1

    # -- the log -------------------------------------------------------------------------------
    def before_flush(self, pending: list[Any]) -> None:
        """Before the log is replayed: a learn step keeps it; a replaying step replaces it, if it
        is the skeleton's next entries, by the script up to the skeleton's entry after them, with
        this step's times (otherwise the step misses). Where the log is cut does not matter.
        Entries that fit are left as they are for the ledger (``unspliced``): the replay memo
        may put back what the script's entries would leave without building them, else
        ``splice`` puts them in."""
        mode = self._mode
        self.spliced = self.unspliced = None
        if mode == _LEARN:
            if self._learning is not None:
                try:
                    self._learning.add_part(pending)
                except Exception as exc:  # noqa: BLE001
                    self._learning = None
                    self._fail(exc)
            return
        if mode != _REPLAY:
            return
        try:
            self._splice(pending)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _splice(self, pending: list[Any]) -> None:
        script = self._script
        if script is None:
            self._miss()
            return
        s0, n = self._skel, len(script.skel)
        take = min(len(pending), n - s0)  # past the script's end: the step's own changes, as they are
        if not take:
            return
        cut = script.cuts.get((s0, take))
        if cut is None:
            cut = script.cuts[s0, take] = _Cut(script, s0, take, self._time)
        if cut.fixed(pending) != cut.expected:
            same = _agreeing(script, s0, pending[:take], cut)
            if same:  # what the step did up to where it parts from the script is replayed
                self._put(pending, _Cut(script, s0, same, self._time), same)
            self._miss()
            return
        self._put(pending, cut, take, later=True)

    def _put(self, pending: list[Any], cut: _Cut, m: int, later: bool = False) -> None:
        # the log's first ``m`` entries, which are the skeleton's next ones, become the script's:
        # now, or (``later``) where the replay memo does not put back what they leave (``splice``)
        self._skel, self._time, self._full = self._skel + m, cut.t1, cut.f1
        self.spliced = cut if len(pending) == m else None  # the log is this cut, whole
        if later:
            self.unspliced = (cut, m)
        else:
            pending[:m] = cut.spliced(cut.times(pending))

    def splice(self, pending: list[Any]) -> None:
        """Put the script's entries into the log for the cut ``before_flush`` found there and left
        (``unspliced``), before the log is replayed: the replay memo did not take it."""
        waiting, self.unspliced = self.unspliced, None
        if waiting is None:
            return
        cut, m = waiting
        try:
            pending[:m] = cut.spliced(cut.times(pending))
        except Exception as exc:  # noqa: BLE001
            self._full = cut.f0  # none of the cut's scripted changes went in
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.off = True  # the script stays until this step's end: a replaying step's undoing needs it
        self._confirmed = False
        if self._mode == _REPLAY:  # what it put in this step is taken out at its end
            self._miss()
        report = self._counters.on_replay_error
        if report is not None:
            report(exc)
