"""What the step's end leaves to be built when read (``StepReport.fill_later``): the module reports
and their order, the step peak, the live breakdown and the leak report; and the cheaper readings
beside them.

Oracle: the same thing built at once, at the step's end (how the tracker built them before). A
report read later (after the next step began, after several, on another thread, copied, pickled)
must equal it; the leak watch fed counters must equal the one fed breakdowns, and its growth the
definition's; the RSS read from ``/proc/self/statm`` must equal psutil's.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import random
import sys
import threading
import weakref
from typing import Any

import psutil
import pytest

from fsdp_mem_otel.schema import CATEGORY_KEYS, LIGHT, TOTAL, StepReport, breakdown_of
from fsdp_mem_otel.training import allocator
from fsdp_mem_otel.training.leaks import LeakWatch
from fsdp_mem_otel.training.light.counters import snap_of, totals_of
from tests.dist import run_ranks
from tests.training.test_deferred import _pair, _random_step, _reports


def _report(**later: Any) -> StepReport:
    report = StepReport(step=1, rank=0, world_size=1, mode=LIGHT, fsdp_version=2, peak={}, modules={})
    report.fill_later(**later)
    return report


# -- StepReport.fill_later -----------------------------------------------------------------------
def test_a_field_filled_later_is_built_once_at_its_first_read() -> None:
    calls: list[str] = []

    def peak() -> dict[str, dict[str, int]]:
        calls.append("peak")
        return {"cpu": {TOTAL: 7}}

    report = _report(peak=peak)
    assert "peak" not in report.__dict__ and not calls
    assert report.peak == {"cpu": {TOTAL: 7}} and report.peak is report.peak
    assert calls == ["peak"]
    assert report.peak_total() == 7 and report.to_dict()["peak"] == {"cpu": {TOTAL: 7}}
    assert report == _report(peak=peak) == StepReport(**{**_fields(report), "peak": {"cpu": {TOTAL: 7}}})
    with pytest.raises(AttributeError):
        report.no_such_field  # noqa: B018 - reading it is the test
    with pytest.raises(ValueError, match="deep_skipped"):  # a default would be read instead
        report.fill_later(deep_skipped=lambda: "compiled")


def _fields(report: StepReport) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}


def test_fields_filled_later_in_two_calls_are_all_built_and_an_assignment_wins() -> None:
    report = _report(peak=lambda: {"cpu": {TOTAL: 1}})
    report.fill_later(current=lambda: {"cpu": {TOTAL: 2}}, modules=lambda: {"never": "built"})
    report.modules = {}  # as the JSONL writer does to a copy
    assert (report.peak, report.current, report.modules) == ({"cpu": {TOTAL: 1}}, {"cpu": {TOTAL: 2}}, {})


def test_a_copy_or_a_pickle_carries_the_fields_built() -> None:
    report = _report(peak=lambda: {"cpu": {TOTAL: 3}}, current=lambda: {"cpu": {TOTAL: 4}})
    shallow = copy.copy(report)
    assert "_later" not in shallow.__dict__ and shallow.peak == {"cpu": {TOTAL: 3}}
    assert shallow.peak is report.peak  # a shallow copy shares what the original built
    for other in (pickle.loads(pickle.dumps(_report(peak=lambda: {"cpu": {TOTAL: 3}}))), copy.deepcopy(report)):
        assert other.peak == {"cpu": {TOTAL: 3}}


def test_readers_on_several_threads_build_a_field_once() -> None:
    calls: list[int] = []
    started = threading.Barrier(4)

    def modules() -> dict[str, Any]:
        calls.append(1)
        return {"m": len(calls)}

    report = _report(modules=modules)
    seen: list[Any] = []

    def read() -> None:
        started.wait()
        seen.append(report.modules)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and all(s is seen[0] for s in seen)


# -- what the tracker gives to fill_later, built later -------------------------------------------
@pytest.mark.parametrize("second_device", [False, True])
def test_modules_and_step_peak_built_after_the_next_step_began_equal_those_built_at_once(
        second_device: bool) -> None:
    sinks, errors = _pair()
    rng = random.Random(5)
    for _ in range(3):
        _random_step(sinks, rng, blocks=3, read_every=0, second_device=second_device)
        for sink in sinks:
            sink.end_step()
            sink.recorder.close_open_windows()
        modules = [sink.recorder.modules_later() for sink in sinks]
        peaks = [sink.ledger.step_end_later()[1] for sink in sinks]
        at_once = _reports(sinks[0]), sinks[0].ledger.step_peak()
        assert at_once[1] == sinks[1].ledger.step_peak()
        for sink in sinks:  # the next step begins, and runs
            sink.recorder.reset()
            sink.ledger.reset_step()
        _random_step(sinks, random.Random(9), blocks=2, read_every=0, second_device=second_device)
        for build, peak in zip(modules, peaks, strict=True):
            later = {key: (mod.snapshots, {s: len(t) for s, t in mod.times.items()}, mod.peak_totals)
                     for key, mod in build().items()}
            assert (later, peak()) == at_once
        for sink in sinks:
            sink.end_step()
            sink.recorder.close_open_windows()
            sink.recorder.reset()
            sink.ledger.reset_step()
    assert not errors


def test_totals_of_a_snapshot_are_each_devices_total() -> None:
    cur = {"cpu": [1] * (len(CATEGORY_KEYS) - 1) + [11], "cuda:0": [2] * (len(CATEGORY_KEYS) - 1) + [22]}
    assert totals_of(snap_of(cur)) == {"cpu": 11, "cuda:0": 22}
    assert totals_of(snap_of({"cpu": cur["cpu"]})) == {"cpu": 11} and totals_of(()) == {}


def _walk(rng: random.Random, devices: int) -> list[dict[str, list[int]]]:
    """Step-end counters: categories that stay, grow, grow every other step or wander."""
    out, cur = [], {f"cuda:{d}": [rng.randrange(1 << 20) for _ in CATEGORY_KEYS[:-1]] for d in range(devices)}
    for step in range(80):
        for counters in cur.values():
            counters[0] += rng.choice((0, 512))  # grows now and then
            counters[5] += 4096 if step % 2 else 0  # every other step
            counters[7] = rng.randrange(1 << 16)  # wanders
            counters[10] += 1000 if step < 40 else 0  # grows, then stops
        out.append({d: [*c, sum(c)] for d, c in cur.items()})
    return out


@pytest.mark.parametrize("devices", [0, 1, 2])
def test_the_leak_watch_fed_counters_reports_what_it_does_fed_breakdowns(devices: int) -> None:
    rng = random.Random(devices)
    by_counters, by_breakdowns = LeakWatch(window=20), LeakWatch(window=20)
    reports = []
    for i, cur in enumerate(_walk(rng, devices)):
        held = {"a": rng.choice((0, 0, 5)), "b": rng.choice((0, 7)), **{f"m{k}": -1 for k in range(i % 3)}}
        got = by_counters.observe_later(snap_of(cur), held)()
        assert got == by_breakdowns.observe(breakdown_of(cur), held), f"step {i}"
        reports.append(got)
    if devices:
        assert any(r is not None and r.growing for r in reports) and any(r is None for r in reports)


def _growing_by_definition(window: list[list[int]], min_steps: int) -> dict[str, float]:
    """Each category that, over ``window`` (step-end totals, oldest first), never fell and rose at
    least ``min_steps`` times and at half the steps or more, with its least-squares slope."""
    n, out = len(window), {}
    for i, key in enumerate(CATEGORY_KEYS):
        ys = [w[i] for w in window]
        pairs = list(zip(ys, ys[1:], strict=False))
        rises = sum(b > a for a, b in pairs)
        if n < 2 * min_steps or ys[-1] <= ys[0] or any(b < a for a, b in pairs) or rises < max(min_steps, (n - 1) // 2):
            continue
        sum_xy = sum(x * y for x, y in enumerate(ys))
        out[key] = (2 * sum_xy - (n - 1) * sum(ys)) / (n * (n * n - 1) / 6)
    return out


@pytest.mark.parametrize("window", [8, 20])
def test_the_growth_read_later_is_the_growth_by_its_definition_at_that_step(window: int) -> None:
    """Each step's leak report, built only after many more steps: categories that grow, stop, grow
    again, with the window full or not, as the definition gives over that step's window."""
    rng = random.Random(window)
    watch, ends, reports = LeakWatch(window=window, min_steps=3), [], []
    for i, cur in enumerate(_walk(rng, 1)):
        if i % 17 == 0:  # a category that grows in some stretches only
            cur["cuda:0"][3] = cur["cuda:0"][-1] // 7 + (i // 17) * 10
        cur["cuda:0"][-1] = sum(cur["cuda:0"][:-1])
        ends.append(cur["cuda:0"])
        reports.append(watch.observe_later(snap_of(cur), {"m": i % 2}))
    grown = 0
    for i, later in enumerate(reports):
        got, expected = later(), _growing_by_definition(ends[max(0, i + 1 - window):i + 1], 3)
        if expected or i % 2:
            assert got is not None and (got.growing, got.held) == (expected, {"m": 1} if i % 2 else {}), f"step {i}"
        else:
            assert got is None, f"step {i}"
        grown += bool(expected)
    assert grown > 10


def test_a_field_that_fails_to_build_reads_empty_and_its_error_goes_to_on_error() -> None:
    from fsdp_mem_otel.training.tracker import _failed_later

    class Tracker:
        def __init__(self) -> None:
            self.errors: list[tuple[BaseException, bool]] = []

        def report_error(self, exc: BaseException, may_disable: bool = True) -> None:
            self.errors.append((exc, may_disable))

    def fails() -> Any:
        raise KeyError("gone")

    tracker = Tracker()
    on_error = functools.partial(_failed_later, weakref.ref(tracker))
    report = _report(modules=fails, leak=fails, peak=lambda: {"cpu": {TOTAL: 1}})
    report.fill_later(on_error, module_order=fails)
    assert (report.modules, report.leak, report.module_order, report.peak) == ({}, None, [], {"cpu": {TOTAL: 1}})
    assert [(type(e), may) for e, may in tracker.errors] == [(KeyError, False)] * 3  # never towards detaching
    assert pickle.loads(pickle.dumps(report)) == report  # no function, no tracker travels with it
    del tracker  # held weakly: a report kept does not keep its tracker
    assert on_error.args[0]() is None
    with pytest.raises(KeyError):  # without on_error, the reader gets the failure
        _report(modules=fails).modules  # noqa: B018


def test_only_fields_without_a_class_attribute_can_be_filled_later() -> None:
    from fsdp_mem_otel.schema import _FILLED_LATER

    assert all(not hasattr(StepReport, name) for name in _FILLED_LATER)
    assert set(_FILLED_LATER) == {"peak", "current", "modules", "module_order", "leak"}


# -- the tracker, training ------------------------------------------------------------------------
def _plain(report: StepReport) -> dict[str, Any]:
    data = report.to_dict()
    data["modules"] = {k: (m["snapshots"], m["times"], report.modules[k].peak_totals)  # type: ignore[attr-defined]
                       for k, m in data["modules"].items()}
    return data


def reports_read_later(steps: int) -> list[str]:
    """Train ``steps`` steps keeping every batch (the inputs grow: a leak report every step); build
    each report's later fields at once beside it, read the report only after the run; the steps
    whose report differs."""
    import torch.distributed as dist

    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
    from tests.oracles import BATCH, BLOCKS, WIDTH

    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt).attach()
    kept, reports, at_once = [], [], []
    for step in range(steps):
        x = make_batch(step, BATCH, WIDTH, dist.get_rank())
        tracker.track_inputs(x)
        kept.append(x)
        train_step(model, opt, x)
        report = tracker.step()
        later = report.__dict__["_later"]
        assert set(later) == {"module_order", "peak", "current", "leak", "modules"}
        assert not set(later) & set(report.__dict__)  # none built yet
        assert report.__dict__["_later_error"].args[0]() is tracker
        given = {k: v for k, v in report.__dict__.items() if k not in ("_later", "_later_error")}
        at_once.append(_plain(StepReport(**given, **{name: build() for name, build in later.items()})))
        reports.append(report)
    tracker.detach()
    assert tracker.errors_total == 0
    assert any(r.leak is not None and r.leak.growing for r in reports)
    return [f"step {r.step}" for r, plain in zip(reports, at_once, strict=True) if _plain(r) != plain]


def test_training_reports_read_after_the_next_steps_began_equal_those_read_at_once() -> None:
    for differences in run_ranks(reports_read_later, 14):
        assert differences == []


# -- allocator: the RSS ---------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux only")
def test_resident_bytes_from_statm_are_psutils() -> None:
    for _ in range(3):  # the RSS moves: equal on one of a few tries
        if allocator.resident_bytes() == psutil.Process(os.getpid()).memory_info().rss:
            return
    raise AssertionError("resident_bytes() never equalled psutil's RSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux only")
def test_resident_bytes_open_statm_again_in_a_forked_child_or_when_it_was_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    allocator.resident_bytes()
    assert allocator._statm is not None
    parents = os.open(os.devnull, os.O_RDONLY)  # a file of another process's, as after a fork
    monkeypatch.setattr(allocator, "_statm", (-1, parents))
    assert allocator.resident_bytes() and allocator._statm[0] == os.getpid()
    os.close(parents)
    os.close(allocator._statm[1])  # closed under the probe (closerange)
    value = allocator.resident_bytes()
    assert value is not None and abs(value - psutil.Process().memory_info().rss) < 64 << 20


def test_resident_bytes_without_statm_come_from_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_STATM", "/nonexistent/statm")
    monkeypatch.setattr(allocator, "_statm", None)
    value = allocator.resident_bytes()
    assert value is not None and abs(value - psutil.Process().memory_info().rss) < 64 << 20
