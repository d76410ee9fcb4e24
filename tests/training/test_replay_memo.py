"""A light step's replay reused where a step logs the same (``replay_memo.ReplayMemo``).

Oracle: the same events through a ledger that applies every change at once (as in
test_deferred.py). Steps repeat (the same random step again), start from counters apart by a
constant (a batch kept each step), read mid-step or not, on one device or two; the deferred ledger,
which reuses what it can, must give the immediate one's snapshots, window peaks, step peak and
live bytes at every read, and must have reused parts (else this tests nothing).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.schema import AFTER_POST_FORWARD, AFTER_PRE_FORWARD, BEFORE_PRE_FORWARD, INPUTS, TEMP
from fsdp_mem_otel.training.ledger import INDEX, Ledger
from fsdp_mem_otel.training.recorder import StepRecorder
from fsdp_mem_otel.training.replay_memo import ReplayMemo
from tests.dist import run_ranks
from tests.training.test_deferred import _pair, _random_step, _reports, _same

#: the random step each step runs (its seed): repeats, and others between them
SCHEDULE = [0, 0, 0, 0, 1, 1, 0, 0, 2, 2, 2, 0]


def _run(read_every: int, second_device: bool, keep_every: int) -> tuple[list, list]:
    sinks, errors = _pair()
    kept = []
    for i, seed in enumerate(SCHEDULE):
        if keep_every and i % keep_every == 0:  # a batch kept from now on: the counters start higher
            batch = torch.empty(100)
            kept.append(batch)
            for sink in sinks:
                sink.ledger.track(batch, INPUTS)
        _random_step(sinks, random.Random(seed), blocks=3, read_every=read_every, second_device=second_device)
        _same(sinks)
        assert _reports(sinks[1]) == _reports(sinks[0]), f"step {i}"
        assert sinks[1].ledger.step_peak() == sinks[0].ledger.step_peak(), f"step {i}"
        for sink in sinks:
            sink.end_step()
            sink.recorder.reset()
            sink.ledger.reset_step()
    assert not errors
    assert sinks[1].ledger.current == sinks[0].ledger.current
    return sinks, kept


@pytest.mark.parametrize("read_every", [0, 7])
@pytest.mark.parametrize("second_device", [False, True])
def test_a_reused_replay_reads_what_an_immediate_ledger_does(read_every: int, second_device: bool) -> None:
    sinks, _ = _run(read_every, second_device, keep_every=0)
    memo = sinks[1].recorder.memo
    assert memo.reused > 0 and memo.replayed > 0
    assert memo.shifted == 0


@pytest.mark.parametrize("read_every", [0, 7])
def test_counters_apart_by_a_constant_reuse_it_on_one_device(read_every: int) -> None:
    sinks, _ = _run(read_every, second_device=False, keep_every=1)
    memo = sinks[1].recorder.memo
    assert memo.shifted > 0


def test_counters_apart_on_two_devices_replay_again() -> None:
    sinks, _ = _run(0, second_device=True, keep_every=1)
    memo = sinks[1].recorder.memo
    assert memo.shifted == 0


def test_a_step_with_a_change_of_its_own_is_replayed() -> None:
    # the same step but for one byte count: nothing of it may be reused
    sinks, errors = _pair()
    for i in range(3):
        _random_step(sinks, random.Random(0), blocks=2, read_every=0)
        if i == 2:
            for sink in sinks:
                sink.add("cpu", 0, 4096)
        _same(sinks)
        assert _reports(sinks[1]) == _reports(sinks[0])
        for sink in sinks:
            sink.end_step()
            sink.recorder.reset()
            sink.ledger.reset_step()
    assert not errors


# -- driven directly: a deferring ledger and its recorder, memo on and off ---------------------
def _ledgers() -> list[tuple[Ledger, StepRecorder]]:
    out = []
    for memo in (True, False):
        ledger = Ledger()
        ledger.defer(True)
        recorder = StepRecorder(ledger)
        if not memo:
            ledger.memo = None
        out.append((ledger, recorder))
    return out


def _state(ledger: Ledger, recorder: StepRecorder) -> tuple[Any, ...]:
    ledger.flush()
    return (ledger.raw(), ledger.step_peak(), recorder.logged, list(recorder._snaps), list(recorder._times))


def _forward(ledger: Ledger, recorder: StepRecorder, t: int) -> None:
    ledger.add("cpu", TEMP, 1000)
    ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, t)
    ledger.add("cpu", TEMP, -900)  # 100 bytes stay each step
    ledger.queue(recorder.on_state, "m", AFTER_POST_FORWARD, False, True, t + 1)


def test_a_change_queued_while_a_part_is_put_back_is_replayed_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # a free on another thread lands between the comparison and the part's removal from the log
    put_back = ReplayMemo._put_back

    def with_a_free(self: ReplayMemo, pending: list[Any], *rest: Any) -> None:
        pending.extend(("cpu", INDEX[TEMP], -64))
        put_back(self, pending, *rest)

    monkeypatch.setattr(ReplayMemo, "_put_back", with_a_free)
    (on, rec), (off, rec_off) = _ledgers()
    for step in range(3):
        for ledger, recorder in ((on, rec), (off, rec_off)):
            _forward(ledger, recorder, 10 * step)
            if ledger is off and step == 2:
                ledger.flush()
                ledger.pending.extend(("cpu", INDEX[TEMP], -64))  # type: ignore[union-attr]
            ledger.flush()
            recorder.reset()
            ledger.reset_step()
    assert rec.memo.reused == 1
    assert on.raw() == off.raw()


def test_a_change_between_the_recorders_reset_and_the_ledgers_is_not_reused_with_the_old_peak() -> None:
    # tracker.step() resets the recorder, then the ledger: a free between them is replayed with the
    # step window of the step that ended, which no later step may get back
    states = []
    for ledger, recorder in _ledgers():
        ledger.add("cpu", TEMP, 1000)
        ledger.flush()
        recorder.reset()
        ledger.reset_step()
        ledger.add("cpu", TEMP, 5000)
        ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, 1)
        ledger.add("cpu", TEMP, -5000)
        recorder.close_open_windows()
        recorder.reset()
        ledger.add("cpu", TEMP, -100)
        ledger.reset_step()
        ledger.add("cpu", TEMP, -100)
        states.append(_state(ledger, recorder))
    assert states[0] == states[1]


def test_only_the_recorders_timed_events_are_remembered() -> None:
    # anything else queued (an event without its time last, another callable) is always replayed
    calls: dict[int, list[int]] = {}
    states = []
    for ledger, recorder in _ledgers():
        mine = calls[id(ledger)] = []
        for step, state in enumerate([BEFORE_PRE_FORWARD, BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD]):
            ledger.add("cpu", TEMP, 100)
            ledger.queue(recorder.on_state, "m", state)  # no time: the state is the last argument
            ledger.queue(mine.append, step)
            ledger.add("cpu", TEMP, -100)
            ledger.flush()
            if step < 2:
                recorder.reset()
                ledger.reset_step()
        states.append((recorder.logged, list(recorder.windows)))
        assert recorder.memo.reused == 0
    assert states[0] == states[1]
    assert list(calls.values())[0] == list(calls.values())[1] == [0, 1, 2]


def test_a_failure_while_putting_back_counts_and_never_applies_a_part_twice() -> None:
    ledger = Ledger()
    ledger.defer(True)
    recorder = StepRecorder(ledger)
    errors: list[BaseException] = []
    ledger.on_replay_error = errors.append
    kept = []

    def keep(part: list[Any], calls: list[int] = []) -> None:  # noqa: B006 - a counter
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("keep failed once")
        kept.append(part)

    for step in range(4):
        ledger.retain(keep)
        _forward(ledger, recorder, 10 * step)
        ledger.flush()
        recorder.reset()
        ledger.reset_step()
    assert ledger.raw()["cpu"][INDEX["total"]] == 400
    assert len(errors) == 1 and isinstance(errors[0], MemoryError)
    assert recorder.memo.off  # and every step replays from then on


# -- real training on 2 ranks: the same run with the memo and without -----------------------------
@dataclass(frozen=True)
class MemoRun:
    reused: int  # parts of the memo run put back (of them, shifted: counters apart by a constant)
    shifted: int
    replayed: int
    differences: list[str]  # steps whose report differs from the run that replays every step


def _summary(report: Any) -> Any:
    modules = {key: (mod.snapshots, {s: len(t) for s, t in mod.times.items()}, mod.peak_totals)
               for key, mod in report.modules.items()}
    return report.peak, report.current, modules, report.errors_total


def memo_against_replay(opts: dict[str, Any], keep_batches: bool) -> MemoRun:
    """Train STEPS steps twice from the same seed, the second with the memo off; compare reports."""
    import torch.distributed as dist

    from fsdp_mem_otel.training.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
    from tests.oracles import BATCH, BLOCKS, WIDTH

    rank = dist.get_rank()
    runs, memo = [], None
    for memo_on in (True, False):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts))
        tracker = FSDPMemoryTracker(model, opt).attach()
        if memo_on:
            memo = tracker.recorder.memo
        else:
            tracker.ledger.memo = None
        kept, reports = [], []
        for step in range(STEPS):
            x = make_batch(step, BATCH, WIDTH, rank)
            tracker.track_inputs(x)
            if keep_batches:  # inputs grow by a batch a step: counters apart by a constant
                kept.append(x)
            train_step(model, opt, x)
            del x
            reports.append(_summary(tracker.step()))
        tracker.detach()
        runs.append(reports)
    assert memo is not None
    differences = [f"step {i}" for i, (a, b) in enumerate(zip(*runs, strict=True)) if a != b]
    return MemoRun(memo.reused, memo.shifted, memo.replayed, differences)


STEPS = 6


@pytest.mark.parametrize("opts", [{"fsdp": 1}, {"fsdp": 2}, {"fsdp": 2, "checkpoint": True}],
                         ids=["fsdp1", "fsdp2", "fsdp2_checkpoint"])
@pytest.mark.parametrize("keep_batches", [False, True], ids=["batches_dropped", "batches_kept"])
def test_training_reports_the_same_with_the_memo_as_without(opts: dict[str, Any], keep_batches: bool) -> None:
    for run in run_ranks(memo_against_replay, opts, keep_batches):
        assert run.differences == []
        assert run.reused >= STEPS - 2  # the warm steps reuse the replay
        assert (run.shifted > 0) == keep_batches


def test_steps_that_never_repeat_are_learnt_ever_less_often_and_repeats_are_found_again() -> None:
    ledger, recorder = _ledgers()[0]
    for step in range(64):  # a byte count of its own each step: nothing to reuse
        ledger.add("cpu", TEMP, 1 + step)
        ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, 10 * step)
        ledger.flush()
        recorder.reset()
        ledger.reset_step()
    assert recorder.memo.reused == 0
    assert recorder.memo.remembered <= 8  # steps 0, 1, 3, 7, 15, 31, 63 (then every 32nd)
    for step in range(64, 64 + 40):  # from now on every step the same
        ledger.add("cpu", TEMP, 1)
        ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, 10 * step)
        ledger.flush()
        recorder.reset()
        ledger.reset_step()
    assert recorder.memo.reused >= 40 - 33


def _step(ledger: Ledger, recorder: StepRecorder, t: int, delta: int, parts: int = 1, kept: int = 0,
          same_time_last: bool = False) -> None:
    """A step of ``parts`` parts (each read, as a mid-step reader would), ``delta`` bytes up and
    down in each; ``kept`` bytes stay (the next step starts higher); ``same_time_last``: the last
    part's two events at one time (a part that cannot be remembered)."""
    for p in range(parts):
        ledger.add("cpu", TEMP, delta)
        ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, t + 10 * p)
        ledger.add("cpu", TEMP, -delta)
        last = p == parts - 1
        ledger.queue(recorder.on_state, "m", AFTER_POST_FORWARD, False, True,
                     t + 10 * p + (0 if same_time_last and last else 1))
        if last and kept:
            ledger.add("cpu", TEMP, kept)
        ledger.flush()
    recorder.reset()
    ledger.reset_step()


def test_a_reuse_ends_the_wait_so_a_new_repeating_step_is_learnt_at_once() -> None:
    ledger, recorder = _ledgers()[0]
    for step in range(70):  # never repeats: the memo waits ever longer between two it learns
        _step(ledger, recorder, 100 * step, 1000 + step)
    for step in range(70, 170):  # repeats: reused within 32 steps, from then on every step
        _step(ledger, recorder, 100 * step, 7)
    reused = recorder.memo.reused
    for step in range(170, 173):  # another repeating step: learnt at its first, reused at its second
        _step(ledger, recorder, 100 * step, 9)
    assert recorder.memo.reused == reused + 2


@pytest.mark.parametrize("kept", [0, 100], ids=["equal", "shifted"])
def test_a_part_that_cannot_be_remembered_keeps_the_ones_before_it(kept: int) -> None:
    ledger, recorder = _ledgers()[0]
    for step in range(20):
        _step(ledger, recorder, 100 * step, 1000, parts=3, kept=kept, same_time_last=True)
    memo = recorder.memo
    # step 0 starts with no device yet, step 1 learns again; steps 2-19 reuse their first two parts
    assert memo.reused == 2 * 18 and memo.replayed == 20 + 2 + 2


def test_a_failure_before_the_part_is_taken_off_replays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_mem_otel.training import replay_memo

    ledger, recorder = _ledgers()[0]
    errors: list[BaseException] = []
    ledger.on_replay_error = errors.append
    for step in range(4):
        if step == 3:
            monkeypatch.setattr(replay_memo, "_copied", lambda _: (_ for _ in ()).throw(MemoryError("copying")))
        ledger.add("cpu", TEMP, 1000)
        ledger.queue(recorder.on_state, "m", BEFORE_PRE_FORWARD, False, True, 10 * step)
        assert ledger.raw()["cpu"][INDEX["total"]] == 1000  # a mid-step read sees the part, replayed
        ledger.add("cpu", TEMP, -1000)
        ledger.queue(recorder.on_state, "m", AFTER_POST_FORWARD, False, True, 10 * step + 1)
        ledger.flush()
        recorder.reset()
        ledger.reset_step()
    assert recorder.memo.off and [type(e) for e in errors] == [MemoryError]
    assert ledger.pending == [] and ledger.raw()["cpu"][INDEX["total"]] == 0


def test_a_failing_keeper_of_the_log_is_counted_and_the_replay_goes_on() -> None:
    ledger, recorder = _ledgers()[1]  # memo off: the replay's own path
    errors: list[BaseException] = []
    ledger.on_replay_error = errors.append

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


def test_a_recompute_state_called_directly_is_not_overwritten_by_a_reuse() -> None:
    phases = []
    for ledger, recorder in _ledgers():
        for step in range(3):
            ledger.queue(recorder.on_state, "m", AFTER_PRE_FORWARD, False, True, 100 * step)
            ledger.flush()
            if step == 2:
                recorder.on_state("m", BEFORE_PRE_FORWARD, True)  # not queued: the step turns immediate
            ledger.add("cpu", TEMP, 64)  # a part of bytes alone, remembered at the steps before
            ledger.flush()
            if step < 2:
                recorder.reset()
                ledger.reset_step()
        phases.append(recorder.context.phase)
    assert phases[0] == phases[1]
