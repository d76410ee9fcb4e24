"""Light mode's deferred ledger (``Ledger.defer``) against an immediate one, driven directly.

Oracle: the same events through a ledger that applies every change at once (how the ledger
worked before deferral, and how deep mode still uses it). Both are fed in lockstep; the deferred
one must give the same snapshots, window peaks, step peak, live bytes and location at every read,
whenever the reads come (mid-step or at the end), and must never hold a tensor.
"""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch

from fsdp_mem_otel.schema import (
    ACTIVATION,
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    ALL_GATHER,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    PEAK_BACKWARD,
    REDUCE_SCATTER,
    TEMP,
    UNSHARDED_PARAM,
)
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder
from fsdp_mem_otel.training.light.sink import Sink


def _pair() -> tuple[list[Sink], list[BaseException]]:
    errors: list[BaseException] = []
    sinks = []
    for deferred in (False, True):
        ledger = Ledger()
        ledger.defer(deferred)
        sink = Sink(ledger, StepRecorder(ledger), errors.append)
        sink.active = True
        sinks.append(sink)
    assert sinks[0].ledger.pending is None and sinks[1].ledger.pending == []
    return sinks, errors


def _reports(sink: Sink) -> dict[str, Any]:
    return {key: (mod.snapshots, {s: len(t) for s, t in mod.times.items()}, mod.peak_totals)
            for key, mod in sink.recorder.modules.items()}


def _same(sinks: list[Sink]) -> None:
    now, later = sinks
    assert later.ledger.current == now.ledger.current
    assert later.recorder.location() == now.recorder.location()
    assert later.recorder.in_pass == now.recorder.in_pass
    assert later.ledger.category_bytes(ACTIVATION) == now.ledger.category_bytes(ACTIVATION)


def _random_step(sinks: list[Sink], rng: random.Random, blocks: int, read_every: int,
                 second_device: bool = False) -> None:
    """One step of a nested model: forward (inputs, saved and freed tensors, all-gathers, temps),
    backward (grads, reduce-scatters, a group's windows ended out of order), reads in between;
    ``second_device``: an integer account on another device as well, up and down."""
    alive: list[torch.Tensor] = []
    events = 0

    def each(fn: Any) -> None:
        nonlocal events
        for sink in sinks:
            fn(sink)
        events += 1
        if read_every and events % read_every == 0:
            _same(sinks)

    def tensor(numel: int, category: str) -> None:
        t = torch.empty(numel)
        each(lambda s: s.ledger.track(t, category))
        alive.append(t)

    def free_some() -> None:
        for _ in range(rng.randint(0, len(alive))):
            alive.pop(rng.randrange(len(alive)))  # freed here: the free callbacks run now

    keys = ["<root>"] + [f"layers.{i}" for i in range(blocks)]
    for key in keys:
        each(lambda s, k=key: s.on_state(k, BEFORE_PRE_FORWARD))
        each(lambda s: s.add("cpu", INDEX[ALL_GATHER], 512))
        if second_device:
            n = rng.randint(1, 9) * 512
            each(lambda s, n=n: s.add("cuda:7", INDEX[TEMP], n))
            each(lambda s: s.add("cuda:7", INDEX[TEMP], -512))
        x = torch.empty(rng.randint(1, 64))
        each(lambda s, k=key, x=x: s.on_state(k, AFTER_PRE_FORWARD, (x,)))
        each(lambda s: s.add("cpu", INDEX[ALL_GATHER], -512))
        each(lambda s: s.add("cpu", INDEX[UNSHARDED_PARAM], 512))
        tensor(rng.randint(1, 100), TEMP)
        tensor(rng.randint(1, 100), ACTIVATION)
        relabelled = alive[-1]  # a storage named again (FSDP's, the optimizer's): its bytes move
        each(lambda s, t=relabelled: s.ledger.track(t, UNSHARDED_PARAM))
        free_some()
        out = torch.empty(rng.randint(1, 64))
        each(lambda s, k=key, o=out: s.on_state(k, BEFORE_POST_FORWARD, o))
        each(lambda s: s.add("cpu", INDEX[UNSHARDED_PARAM], -512))
        alive.append(out)
    for key in reversed(keys):
        each(lambda s, k=key: s.on_state(k, AFTER_POST_FORWARD, None))
    for key in reversed(keys):
        each(lambda s, k=key: s.on_state(k, BEFORE_PRE_BACKWARD))
        each(lambda s, k=key: s.on_state(k, AFTER_PRE_BACKWARD))
        tensor(rng.randint(1, 200), TEMP)
        each(lambda s: s.add("cpu", INDEX[REDUCE_SCATTER], 256))
        free_some()
        each(lambda s, k=key: s.on_state(k, BEFORE_POST_BACKWARD))
        each(lambda s: s.add("cpu", INDEX[REDUCE_SCATTER], -256))
        each(lambda s, k=key: s.on_state(k, AFTER_POST_BACKWARD))
    if second_device:  # back to what it was
        for sink in sinks:
            sink.add("cuda:7", INDEX[TEMP], -sink.ledger.raw()["cuda:7"][INDEX[TEMP]])
    # two modules of one FSDP group: windows opened by the adapter, ended out of order
    each(lambda s: s.open_window("a", PEAK_BACKWARD))
    tensor(300, TEMP)
    each(lambda s: s.open_window("b", PEAK_BACKWARD))
    tensor(50, TEMP)
    free_some()
    each(lambda s: s.end_window("a", PEAK_BACKWARD, True))
    tensor(10, TEMP)
    each(lambda s: s.close_window("b", PEAK_BACKWARD))
    alive.clear()
    gc.collect()


@pytest.mark.parametrize("read_every", [0, 1, 7])
def test_a_deferred_ledger_reads_what_an_immediate_one_does(read_every: int) -> None:
    sinks, errors = _pair()
    rng = random.Random(read_every)
    for _ in range(3):
        _random_step(sinks, rng, blocks=4, read_every=read_every)
        _same(sinks)
        assert _reports(sinks[1]) == _reports(sinks[0])
        assert sinks[1].ledger.step_peak() == sinks[0].ledger.step_peak()
        for sink in sinks:
            sink.end_step()
            sink.recorder.reset()
            sink.ledger.reset_step()
    assert not errors
    assert sinks[1].ledger.pending == [] and sinks[1].ledger.current == sinks[0].ledger.current


def test_deferred_snapshots_keep_the_time_of_their_event() -> None:
    sinks, _ = _pair()
    sink = sinks[1]
    for state in (BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, AFTER_POST_FORWARD):
        sink.on_state("m", state)
    pending = sink.ledger.pending or []
    queued = [pending[i + 6] for i, x in enumerate(pending) if x == sink.recorder.on_state]
    times = sink.recorder.modules["m"].times
    assert [times[s][0] for s in (BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD,
                                  AFTER_POST_FORWARD)] == queued
    assert sink.ledger.pending == []


def test_the_pending_log_holds_no_tensor_and_is_bounded() -> None:
    sinks, _ = _pair()
    sink = sinks[1]
    t = torch.empty(1000)
    ref = weakref.ref(t)
    sink.on_state("m", BEFORE_PRE_FORWARD)
    sink.on_state("m", AFTER_PRE_FORWARD, (t,))  # an input: accounted, its bytes queued
    assert sink.ledger.pending
    del t
    gc.collect()
    assert ref() is None  # the log keeps numbers and names, not the tensor
    for _ in range(40_000):  # a loop that never calls step(): the log replays itself when long
        sink.on_state("m", BEFORE_POST_FORWARD)
        sink.on_state("m", AFTER_POST_FORWARD)
    assert len(sink.ledger.pending or []) <= 1 << 16
    assert sink.ledger.current["cpu"]["total"] == 0


def test_the_pending_log_gives_the_collector_nothing_to_count() -> None:
    """Entries wait in the log from their event to the replay, most of a step: an object per entry
    would bring on a collection every ~700 of them and be moved to older generations. The log
    holds names, numbers and the recorder's one bound method, never an object made per entry."""
    sinks, _ = _pair()
    sink = sinks[1]
    tensors = [torch.empty(100 * (i + 1)) for i in range(5)]
    sink.on_state("m", BEFORE_PRE_FORWARD)
    sink.on_state("m", AFTER_PRE_FORWARD, tuple(tensors))  # five inputs: five byte changes
    sink.open_window("m", PEAK_BACKWARD)
    del tensors  # five frees, queued from the weak references' callbacks
    gc.collect()
    for _ in range(50):
        sink.on_state("m", BEFORE_POST_FORWARD)
        sink.on_state("m", AFTER_POST_FORWARD)
    pending = sink.ledger.pending or []
    assert len(pending) >= 3 * 10 + 7 * 102
    assert [x for x in pending if x.__class__ is str and x == "cpu"] == ["cpu"] * 10  # the byte changes
    # what the collector sees in the log: the same few objects (the recorder's methods, the state
    # names), however many entries wait
    seen = {id(x) for x in pending if gc.is_tracked(x)}
    assert len(seen) <= 8  # on_state, open_window, the four states, the peak state: 7
    assert sink.ledger.current["cpu"]["total"] == 0 and sink.ledger.pending == []


def test_a_failing_event_is_raised_after_the_others_replay() -> None:
    ledger = Ledger()
    ledger.defer(True)

    def broken() -> None:
        raise RuntimeError("boom")

    ledger.queue(broken)
    ledger.add_at("cpu", INDEX[TEMP], 100)
    with pytest.raises(RuntimeError, match="boom"):
        ledger.flush()
    assert ledger.current["cpu"]["total"] == 100  # the change after the failure still counted
    assert ledger.pending == []


def test_a_failing_change_is_skipped_alone() -> None:
    ledger = Ledger()
    ledger.defer(True)
    errors: list[BaseException] = []
    ledger.on_flush_error = errors.append
    recorder = StepRecorder(ledger)
    ledger.add_at("cpu", INDEX[TEMP], 100)
    ledger.add_at("cpu", len(INDEX) + 5, 7)  # no such category: this change fails
    ledger.add_at("cpu", INDEX[TEMP], 20)
    ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD)  # an event after it still replays
    assert ledger.pending is not None and len(ledger.pending) == 13  # changes of 3 items, an event of 4
    ledger.flush()
    assert len(errors) == 1 and isinstance(errors[0], IndexError)
    assert ledger.current["cpu"]["total"] == 120
    assert recorder.logged == [("m", BEFORE_PRE_FORWARD)] and ledger.pending == []


def test_a_malformed_log_fails_once_and_is_dropped() -> None:
    ledger = Ledger()
    ledger.defer(True)
    ledger.add_at("cpu", INDEX[TEMP], 100)
    assert ledger.pending is not None
    ledger.pending.extend((None, "not a length"))  # no entry begins like this
    ledger.add_at("cpu", INDEX[TEMP], 1)  # unreadable after it
    with pytest.raises(TypeError):
        ledger.flush()
    assert ledger.pending == [] and ledger.current["cpu"]["total"] == 100


def test_deferral_is_off_where_windows_are_watched() -> None:
    ledger = Ledger()
    ledger.defer(True)
    ledger.add_at("cpu", INDEX[TEMP], 10)
    ledger.watch_windows(object())
    assert ledger.pending is None and ledger.current["cpu"]["total"] == 10
    ledger.defer(True)
    assert ledger.pending is None


def test_a_change_queued_while_replaying_comes_after_the_replayed_ones() -> None:
    """A storage freed while the log replays (the collector, another thread: FSDP's gloo worker or
    CUDA's autograd thread drop references whenever they finish) lands behind what is being
    replayed, in the same list: it is neither applied early nor lost."""
    ledger = Ledger()
    ledger.defer(True)
    held = [torch.empty(250)]  # 1000 bytes
    ledger.track(held[0], TEMP)
    seen: list[int] = []
    ledger.queue(held.clear)  # the last reference goes while replaying
    ledger.queue(lambda: seen.append(ledger.raw()["cpu"][-1]))  # queued before the free
    ledger.flush()
    assert seen == [1000]  # the snapshot queued before the free still has the bytes
    assert ledger.pending == [] and ledger.current["cpu"]["total"] == 0


def test_the_replay_counts_in_the_trackers_overhead() -> None:
    """``tracker_overhead_seconds`` (the fsdp_mem_step_overhead_seconds gauge) times on_state; with
    the snapshots and windows now replayed later, the replay's time must count too, or the
    reported overhead would fall while the work only moved."""
    sinks, _ = _pair()
    sink = sinks[1]
    for i in range(200):
        for state in (BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, AFTER_POST_FORWARD):
            sink.on_state(f"m{i}", state)
    queued = sink.overhead
    assert queued > 0 and sink.ledger.flush_seconds == 0
    sink.ledger.flush()
    assert sink.ledger.flush_seconds > 0 and sink.overhead == queued + sink.ledger.flush_seconds
    sink.end_step()
    assert sink.overhead == 0


def test_a_light_steps_snapshots_are_replayed_only_when_read() -> None:
    """The recorder follows the events with window totals alone; the step's snapshots are
    replayed from its log the first time a report's are read, equal to an immediate ledger's, and
    a report travels (pickled) with them. The peak totals, which exporters read every step, need
    no replay."""
    import pickle

    sinks, errors = _pair()
    _random_step(sinks, random.Random(3), blocks=3, read_every=0)
    now, later = (sink.recorder.modules for sink in sinks)
    replay = sinks[1].recorder._replay
    assert replay is not None and replay._recorder is None and replay._parts  # nothing replayed yet
    assert {k: m.peak_totals for k, m in later.items()} == {k: m.peak_totals for k, m in now.items()}
    assert replay._recorder is None and replay._parts  # the peaks came without a replay
    first = next(iter(later.values()))
    assert first.snapshots == next(iter(now.values())).snapshots  # the first read replays
    assert replay._recorder is not None and replay._recorder._snaps and not replay._parts
    assert _reports(sinks[1]) == _reports(sinks[0])
    unread = sinks[1].recorder.modules  # read again: the same replay, nothing more to do
    copied = pickle.loads(pickle.dumps(unread))
    assert {k: m.snapshots for k, m in copied.items()} == {k: m.snapshots for k, m in now.items()}
    assert not errors


def test_a_failing_keeper_of_the_log_is_counted_and_the_replay_goes_on() -> None:
    ledger = Ledger()
    ledger.defer(True)
    recorder = StepRecorder(ledger)
    errors: list[BaseException] = []
    ledger.on_flush_error = errors.append

    def keep(part: list[Any]) -> None:
        raise MemoryError("keep failed")

    ledger.retain(keep)
    ledger.add("cpu", TEMP, 100)
    ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, 1)
    ledger.flush()
    ledger.add("cpu", TEMP, 1)
    ledger.flush()
    assert ledger.pending == [] and ledger.raw()["cpu"][INDEX["total"]] == 101
    assert len(errors) == 2 and all(isinstance(e, MemoryError) for e in errors)
