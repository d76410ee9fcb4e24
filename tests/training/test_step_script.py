"""StepScript driven directly on a deferring ledger, no model: what a replayed step's log
becomes, and when a step learns, replays or misses. A step here saves activations (scripted by
the hooks), changes gradient bytes through an FSDP group's events (scripted by the sink once the
step is decided, skipped when it replays) and optimizer state through a tracked storage (never
scripted)."""

from __future__ import annotations

from typing import Any

from fsdp_mem_otel.training.counters import _N, INDEX, SCRIPTED
from fsdp_mem_otel.training.ledger import Ledger
from fsdp_mem_otel.training.step_script import VERIFY_EVERY, StepScript

ACT, GRAD, OPT = INDEX["activation"], INDEX["unsharded_grad"], INDEX["optimizer_state"]


class Events:
    """Stands for the step recorder: an event with its time last."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def state(self, name: str, time: int) -> None:
        self.seen.append((name, time))


class Groups:
    """Stands for the adapter's light groups: their state, restored at a replayed step's end."""

    def __init__(self) -> None:
        self.now: Any = ("held", 0)
        self.restored: list[Any] = []
        self.resynced = 0

    def state(self) -> Any:
        return self.now

    def restore(self, state: Any) -> None:
        self.restored.append(state)

    def resync(self) -> None:
        self.resynced += 1


def _counters() -> tuple[Ledger, StepScript, Events]:
    c = Ledger()
    c.defer(True)
    script = c.script = StepScript(c)
    groups = Groups()
    script.wire(groups.state, groups.restore, groups.resync)
    c.reset_step()
    return c, script, Events()


def _learnt(errors: list[BaseException] | None = None) -> tuple[Ledger, StepScript, Events]:
    """A ledger whose script two alike learn steps confirmed (failures to ``errors``)."""
    c, script, ev = _counters()
    if errors is not None:
        c.on_replay_error = errors.append
    for i in range(2):
        _step(c, script, ev, 10 * i)
    return c, script, ev


def _step(c: Ledger, script: StepScript, ev: Events, t0: int, signature: Any = ("x", 8),
          saved: int = 100, extra: bool = False) -> bool:
    """One step: a forward that saves ``saved`` bytes twice, a grad, a backward that frees them;
    two flushes (an optimizer hook, the step end). Returns whether it ran the hooks."""
    hooked = script.forward_begins(signature, c.scripted_entries)
    c.queue(ev.state, "fwd", t0)
    if hooked:
        c._add("cpu", SCRIPTED, saved)
        c._add("cpu", SCRIPTED, saved)
    c.queue(ev.state, "bwd", t0 + 1)
    if not script.skipping:  # a group's post-backward
        c._add("cpu", GRAD - _N, 40)
    if hooked:
        c._add("cpu", SCRIPTED, -saved)
        c._add("cpu", SCRIPTED, -saved)
    if extra:
        c._add("cpu", GRAD, 1)
    c.flush()  # the optimizer hook
    c._add("cpu", OPT, 8)  # a tracked storage (a temporary of the optimizer)
    c._add("cpu", OPT, -8)
    if not script.skipping:  # a group's reshard
        c._add("cpu", GRAD - _N, -40)
    c.queue(ev.state, "end", t0 + 2)
    c.flush()  # the step end
    script.end_step()
    c.reset_step()
    return hooked


def test_two_alike_learn_steps_are_replayed_with_their_peaks_and_this_steps_times() -> None:
    c, script, ev = _counters()
    assert [_step(c, script, ev, 10 * i) for i in range(3)] == [True, True, False]
    assert script.replayed == 1 and script.misses == 0
    assert script.restore.__self__.restored == [("held", 0)]  # type: ignore[attr-defined]  # as the learnt step ended
    # the replayed step's events ran with its own times, and its peak has the script's bytes
    assert ev.seen[-3:] == [("fwd", 20), ("bwd", 21), ("end", 22)]
    assert c._step.peak["cpu"] == 0  # a new step: its peak starts from what is live
    c2, script2, ev2 = _counters()
    for i in range(2):
        _step(c2, script2, ev2, 10 * i)
    assert c._cur == c2._cur


def test_the_replayed_peak_is_the_learnt_one() -> None:
    c, script, ev = _counters()
    peaks = []
    for i in range(4):
        hooked = script.forward_begins(("x", 8), c.scripted_entries)
        c.queue(ev.state, "fwd", i)
        if hooked:
            c._add("cpu", SCRIPTED, 100)
        c._add("cpu", GRAD, 40)
        if hooked:
            c._add("cpu", SCRIPTED, -100)
        c._add("cpu", GRAD, -40)
        c.flush()
        peaks.append(c._step.peak["cpu"])
        script.end_step()
        c.reset_step()
    assert peaks == [140, 140, 140, 140] and script.replayed == 2


def test_other_inputs_learn_and_a_step_that_does_not_fit_is_counted_and_undone() -> None:
    c, script, ev = _learnt()
    assert _step(c, script, ev, 20, signature=("x", 12))  # other shapes: learn
    assert _step(c, script, ev, 30, signature=("x", 12))  # learn again: two alike now
    assert not _step(c, script, ev, 40, signature=("x", 12))
    before = list(c._cur["cpu"])
    assert not _step(c, script, ev, 50, signature=("x", 12), extra=True)  # a change no learnt step had
    assert script.misses == 1
    after = c._cur["cpu"]
    assert after[ACT] == before[ACT] == 0  # what the forward's part put in is taken out again
    assert after[GRAD] == before[GRAD] + 1
    assert c.script.resync.__self__.resynced == 1  # type: ignore[attr-defined]  # the groups count afresh
    assert _step(c, script, ev, 60, signature=("x", 12))  # learns after a miss


def test_a_check_every_so_many_replayed_steps_finds_changed_activations() -> None:
    c, script, ev = _counters()
    hooked = [_step(c, script, ev, 10 * i) for i in range(3 + VERIFY_EVERY)]
    assert hooked[:2] == [True, True] and not any(hooked[2:2 + VERIFY_EVERY]) and hooked[-1]
    assert script.misses == 0  # the check found the same
    # the saved bytes change while the events do not: replayed steps are off until the next check
    for i in range(VERIFY_EVERY):
        assert not _step(c, script, ev, 1000 + 10 * i, saved=300)
    assert _step(c, script, ev, 5000, saved=300) and script.misses == 1


def test_a_failure_turns_it_off_and_every_step_learns() -> None:
    errors: list[BaseException] = []
    c, script, ev = _learnt(errors)
    script._script.skel = None  # type: ignore[union-attr,assignment]
    assert not _step(c, script, ev, 20)  # decided before the failure
    assert script.off and len(errors) == 1 and script.misses == 1
    assert c._cur["cpu"][ACT] == 0
    assert all(_step(c, script, ev, 30 + 10 * i) for i in range(3))


def test_groups_that_cannot_skip_a_step_keep_every_step_learning() -> None:
    c, script, ev = _counters()
    script.restore.__self__.now = None  # type: ignore[attr-defined]  # e.g. a group accounted per tensor
    assert all(_step(c, script, ev, 10 * i) for i in range(4))


def test_a_log_cut_elsewhere_replays_all_the_same() -> None:
    c, script, ev = _learnt()
    peaks = []
    hooked = script.forward_begins(("x", 8), 0)
    assert not hooked
    c.queue(ev.state, "fwd", 20)
    c.flush()  # a read (an abort's record): what the events so far prove happened, no more
    assert c._cur["cpu"][ACT] == 0
    c.queue(ev.state, "bwd", 21)
    c.flush()  # the activations saved before the backward began
    assert c._cur["cpu"][ACT] == 200 and c._cur["cpu"][GRAD] == 0
    c._add("cpu", OPT, 8)
    c._add("cpu", OPT, -8)
    c.queue(ev.state, "end", 22)
    c.flush()
    peaks.append(c._step.peak["cpu"])
    script.end_step()
    assert script.misses == 0 and script.replayed == 1
    assert peaks == [240] and c._cur["cpu"][ACT] == c._cur["cpu"][GRAD] == 0


def test_a_step_that_parts_from_its_script_is_exact_up_to_there() -> None:
    c, script, ev = _learnt()
    assert not script.forward_begins(("x", 8), 0)
    c.queue(ev.state, "fwd", 20)
    c.queue(ev.state, "bwd", 21)
    c._add("cpu", GRAD, 7)  # where the learnt step had none
    c.flush()
    assert script.misses == 1
    assert c._cur["cpu"][ACT] == 200 and c._step.peak["cpu"] == 207  # the forward's activations came
    script.end_step()
    c.flush()
    assert c._cur["cpu"][ACT] == 0 and c._cur["cpu"][GRAD] == 7  # the step ends with its own changes


def test_changes_after_the_script_ends_are_the_steps_own() -> None:
    c, script, ev = _learnt()
    assert not _step(c, script, ev, 20)
    before = list(c._cur["cpu"])
    hooked = script.forward_begins(("x", 8), 0)
    c.queue(ev.state, "fwd", 30)
    c.queue(ev.state, "bwd", 31)
    c.flush()
    c._add("cpu", OPT, 8)
    c._add("cpu", OPT, -8)
    c.queue(ev.state, "end", 32)
    c._add("cpu", OPT, 16)  # the step's own, after all its script
    c.flush()
    script.end_step()
    assert not hooked and script.misses == 0 and script.replayed == 2
    assert c._cur["cpu"][OPT] == before[OPT] + 16


def test_a_failure_half_way_through_a_replay_takes_out_what_it_put_in() -> None:
    errors: list[BaseException] = []
    c, script, ev = _learnt(errors)
    assert not script.forward_begins(("x", 8), 0)
    c.queue(ev.state, "fwd", 20)
    c.queue(ev.state, "bwd", 21)
    c.flush()  # replayed: the forward's activations came in
    assert c._cur["cpu"][ACT] == 200
    script._script.cuts = None  # type: ignore[union-attr,assignment]  # the next cut fails
    c.queue(ev.state, "end", 22)
    c.flush()
    script.end_step()
    c.flush()
    assert script.off and len(errors) == 1 and script.misses == 1
    assert c._cur["cpu"][ACT] == 0  # taken out again: nothing stays counted
    assert script._script is None and script.restore.__self__.resynced == 1  # type: ignore[attr-defined]
