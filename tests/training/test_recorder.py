"""The step state machine driven directly, without FSDP or spawned ranks (milliseconds)."""

from __future__ import annotations

import enum
import gc
import types

import torch

from fsdp_mem_otel.exporters.peaks import all_calls
from fsdp_mem_otel.schema import (
    ACTIVATION,
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    POST_FORWARD_AC,
    PRE_FORWARD_AC,
    TEMP,
    TOTAL,
    CountedModuleReport,
)
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder

FWD = (BEFORE_PRE_FORWARD, AFTER_PRE_FORWARD, BEFORE_POST_FORWARD, AFTER_POST_FORWARD)
BWD = (BEFORE_PRE_BACKWARD, AFTER_PRE_BACKWARD, BEFORE_POST_BACKWARD, AFTER_POST_BACKWARD)


def _total(snap: dict[str, dict[str, int]]) -> int:
    return snap["cpu"][TOTAL] if snap else 0


def test_nested_forward_windows_give_each_module_its_own_peak() -> None:
    ledger = Ledger()
    rec = StepRecorder(ledger)
    keep = []
    rec.on_state("<root>", BEFORE_PRE_FORWARD)
    rec.on_state("<root>", AFTER_PRE_FORWARD)
    for i, size in enumerate((100, 300)):
        key = f"layers.{i}"
        rec.on_state(key, BEFORE_PRE_FORWARD)
        rec.on_state(key, AFTER_PRE_FORWARD)
        tmp = torch.empty(size)  # 4 * size bytes, freed before the module ends
        ledger.track(tmp, TEMP)
        del tmp
        kept = torch.empty(10)
        ledger.track(kept, ACTIVATION)
        keep.append(kept)
        rec.on_state(key, BEFORE_POST_FORWARD)
        rec.on_state(key, AFTER_POST_FORWARD)
    rec.on_state("<root>", BEFORE_POST_FORWARD)
    rec.on_state("<root>", AFTER_POST_FORWARD)
    peak0 = rec.modules["layers.0"].snapshots[PEAK_FORWARD]
    peak1 = rec.modules["layers.1"].snapshots[PEAK_FORWARD]
    assert _total(peak0[0]) == 400  # the temporary alone, before the kept 40 bytes
    assert _total(peak1[0]) == 40 + 1200  # layers.0's activation still live
    assert peak1[0]["cpu"][TEMP] == 1200
    assert _total(rec.modules["<root>"].snapshots[PEAK_FORWARD][0]) == 1240
    assert rec.modules["layers.1"].snapshots[AFTER_POST_FORWARD][0]["cpu"][ACTIVATION] == 80
    assert not rec.in_pass


def test_out_of_order_close_closes_inner_windows_first() -> None:
    ledger = Ledger()
    rec = StepRecorder(ledger)
    rec.on_state("a", BEFORE_PRE_BACKWARD)
    rec.on_state("b", BEFORE_PRE_BACKWARD)
    big = torch.empty(50)
    ledger.track(big, TEMP)
    rec.on_state("a", AFTER_POST_BACKWARD)  # FSDP finishes a before b: b's window closes too
    assert [s for s in rec.modules["b"].snapshots] == [BEFORE_PRE_BACKWARD, PEAK_BACKWARD]
    assert _total(rec.modules["b"].snapshots[PEAK_BACKWARD][0]) == 200
    assert _total(rec.modules["a"].snapshots[PEAK_BACKWARD][0]) == 200
    assert not rec.in_pass
    rec.on_state("b", AFTER_POST_BACKWARD)  # its window is gone: a snapshot, no second peak
    assert len(rec.modules["b"].snapshots[PEAK_BACKWARD]) == 1


def test_forward_states_in_backward_are_a_recompute() -> None:
    rec = StepRecorder(Ledger())
    for state in FWD:
        rec.on_state("outer", state, in_backward=True)
        if state == AFTER_PRE_FORWARD:
            assert rec.context.in_ac_recompute
            for inner_state in FWD:
                rec.on_state("inner", inner_state, in_backward=True)
            assert rec.context.in_ac_recompute  # the outermost recompute owns the flag
    assert not rec.context.in_ac_recompute
    assert set(rec.modules["outer"].snapshots) == {PRE_FORWARD_AC, POST_FORWARD_AC}
    assert set(rec.modules["inner"].snapshots) == {PRE_FORWARD_AC, POST_FORWARD_AC}
    assert not rec.in_pass  # a recompute opens no peak window


def test_location_names_the_innermost_running_module() -> None:
    rec = StepRecorder(Ledger())
    assert rec.location() == ("", "")
    rec.on_state("<root>", BEFORE_PRE_FORWARD)
    rec.on_state("layers.0", BEFORE_PRE_FORWARD)
    rec.on_state("layers.0", AFTER_PRE_FORWARD)
    assert rec.location() == ("layers.0", AFTER_PRE_FORWARD)
    rec.close_open_windows()  # step end with the pass still open (an abort)
    assert not rec.in_pass
    assert rec.location() == ("<root>", PEAK_FORWARD)
    rec.reset()
    assert rec.location() == ("", "") and rec.modules == {}


def test_phases_follow_the_states() -> None:
    rec = StepRecorder(Ledger())
    phases = []
    for state in FWD + BWD:
        rec.on_state("m", state)
        phases.append(rec.context.phase)
    assert phases == ["pre_forward", "forward", "post_forward", "forward",
                      "pre_backward", "backward", "post_backward", "post_backward"]
    rec.reset()
    assert rec.context.phase == "idle"


def test_one_snapshot_per_call_with_times() -> None:
    rec = StepRecorder(Ledger())
    for _ in range(3):  # a module called three times (gradient accumulation, reuse)
        for state in FWD:
            rec.on_state("m", state)
    mod = rec.modules["m"]
    assert all(len(mod.snapshots[s]) == 3 for s in (*FWD, PEAK_FORWARD))
    assert all(len(mod.times[s]) == len(mod.snapshots[s]) for s in mod.snapshots)
    assert mod.times[BEFORE_PRE_FORWARD] == sorted(mod.times[BEFORE_PRE_FORWARD])


def test_overlapping_windows_end_alone() -> None:
    # Backward windows of modules sharing an FSDP group overlap without nesting.
    ledger = Ledger()
    rec = StepRecorder(ledger)
    rec.open_window("b", PEAK_BACKWARD)
    x = torch.empty(100)  # 400 B while only b is open
    ledger.track(x, TEMP)
    rec.open_window("a", PEAK_BACKWARD)
    y = torch.empty(50)  # 600 B with a open too
    ledger.track(y, TEMP)
    del x, y  # 0 B
    rec.end_window("b", PEAK_BACKWARD)  # b ends first although a opened later
    z = torch.empty(25)  # 100 B, a only
    ledger.track(z, TEMP)
    rec.end_window("a", PEAK_BACKWARD)
    assert _total(rec.modules["b"].snapshots[PEAK_BACKWARD][0]) == 600
    assert _total(rec.modules["a"].snapshots[PEAK_BACKWARD][0]) == 600  # y's moment is a's too
    assert not rec.in_pass
    rec.open_window("c", PEAK_BACKWARD)
    rec.end_window("nope", PEAK_BACKWARD)  # not open: nothing happens
    assert rec.windows == [("c", PEAK_BACKWARD)]


def test_each_modules_peak_totals_are_those_of_its_snapshots() -> None:
    """The recorder hands exporters each module's largest forward and backward peak (two integers,
    computed at the step's end): equal to what the built snapshot dicts say, over two calls of
    one module (the larger wins) and a module that never ran backward (None)."""
    ledger = Ledger()
    rec = StepRecorder(ledger)
    keep = []
    for size in (300, 100):  # "a" runs twice, its first call the larger
        for state in FWD[:2]:
            rec.on_state("a", state)
        tmp = torch.empty(size)
        ledger.track(tmp, TEMP)
        del tmp
        for state in FWD[2:]:
            rec.on_state("a", state)
    for state in FWD[:2]:
        rec.on_state("b", state)
    kept = torch.empty(25)
    ledger.track(kept, ACTIVATION)
    keep.append(kept)
    for state in FWD[2:]:
        rec.on_state("b", state)
    for state in BWD:
        rec.on_state("a", state)
    modules = rec.modules
    for key, mod in modules.items():
        dicts = mod.snapshots  # built here from the counters, independently of the recorder's walk
        want = tuple(max(_total(s) for s in dicts[p]) if p in dicts else None for p in (PEAK_FORWARD, PEAK_BACKWARD))
        assert mod.peak_totals == want, key
    assert modules["a"].peak_totals == (1200, 100)  # the 300-float temporary; backward: "b"'s 100 bytes
    assert modules["b"].peak_totals == (100, None)


def _tracked_from(root: object) -> int:
    """How many objects the cyclic collector tracks among those reachable from ``root`` (code,
    modules and enum members such as the states left out: they are the program's, not the step's)."""
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, enum.Enum)
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        todo.extend(r for r in gc.get_referents(obj) if gc.is_tracked(r) and not isinstance(r, skip))
    return len(seen)


def _step(modules: int, backward: bool = True) -> tuple[StepRecorder, Ledger]:
    ledger = Ledger()
    ledger.defer(True)
    rec = StepRecorder(ledger)
    keys = [f"layers.{i}" for i in range(modules)]
    for key in keys:
        for state in FWD:
            rec_state(ledger, rec, key, state)
    for key in reversed(keys) if backward else ():
        for state in BWD:
            rec_state(ledger, rec, key, state)
    return rec, ledger


def rec_state(ledger: Ledger, rec: StepRecorder, key: str, state: str) -> None:
    ledger.add("cpu", ACTIVATION, 100)
    ledger.add("cuda:0", TEMP, 512)  # two devices: each snapshot holds both
    rec.on_state(key, state)
    ledger.add("cuda:0", TEMP, -512)


def _promote() -> None:
    """What reaches the collector's oldest generation: what survives a generation-0 collection
    and then a generation-1 one."""
    gc.collect(0)
    gc.collect(1)


def test_the_steps_snapshots_leave_the_collector_nothing_to_promote() -> None:
    """A step keeps a snapshot per module state (hundreds) until its report is read: containers
    the collector tracks would be promoted to its oldest generation and bring on full collections
    (~175 ms each at 64 blocks). By the time they could be promoted, the step's snapshots are
    untracked, however many there are, and a module's report holds no container per state."""
    gc.collect()
    small, big = _step(10), _step(40)
    small[1].flush()
    big[1].flush()
    _promote()
    assert _tracked_from(big[0]) == _tracked_from(small[0])  # 300 more snapshots, none tracked
    reports = {10: small[0].modules, 40: big[0].modules}
    _promote()
    per_module = (_tracked_from(reports[40]) - _tracked_from(reports[10])) / 30
    assert per_module <= 2  # the report and its attributes; not 10 states' lists and dicts
    fewer_states = _step(40, backward=False)[0].modules
    _promote()
    assert _tracked_from(fewer_states) == _tracked_from(reports[40])  # per state: nothing
    # counted as the JSONL writer counts them every step, from the positions: nothing sorted
    assert all_calls(reports[40]) == 40 * len((*FWD, *BWD, PEAK_FORWARD, PEAK_BACKWARD))
    second = reports[40]["layers.1"]
    starts = second.times_of(BEFORE_PRE_FORWARD)  # as the Prometheus exporter reads a forward's time
    assert all(isinstance(m, CountedModuleReport) and m._counters is None for m in reports[40].values())
    assert len(starts) == 1 and starts == second.times[BEFORE_PRE_FORWARD]  # sorted now, the same
    # and read, the reports hold every state's snapshot, with both devices
    mod = reports[40]["layers.0"]
    assert sorted(mod.snapshots) == sorted((*FWD, *BWD, PEAK_FORWARD, PEAK_BACKWARD))
    last = mod.snapshots[AFTER_POST_BACKWARD][0]
    assert last["cpu"][ACTIVATION] == 100 * 8 * 40 and last["cuda:0"][TEMP] == 512
    assert mod.times[AFTER_POST_BACKWARD] and mod.peak_totals == (max(512, 100 * 4), 100 * 8 * 40)  # per device


def test_a_snapshot_that_raises_leaves_the_log_in_step() -> None:
    ledger = Ledger()
    rec = StepRecorder(ledger)
    real_snap, calls = ledger.snap, [0]

    def snap_failing_once() -> tuple[object, ...]:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")
        return real_snap()

    ledger.snap = snap_failing_once  # type: ignore[method-assign]
    rec.on_state("m", BEFORE_PRE_FORWARD)
    try:
        rec.on_state("m", AFTER_PRE_FORWARD)
    except RuntimeError:
        pass
    rec.on_state("m", BEFORE_POST_FORWARD)
    # the failed state is left out whole; the others keep their own snapshots and times
    assert rec.logged == [("m", BEFORE_PRE_FORWARD), ("m", BEFORE_POST_FORWARD)]
    assert [s for s, t in rec.modules["m"].times.items() if t] == [BEFORE_PRE_FORWARD, BEFORE_POST_FORWARD]
