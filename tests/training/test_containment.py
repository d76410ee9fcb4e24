"""The tracker never breaks training: its own failures are logged once, counted, and survived."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH


class _FlakyExporter:
    """Raises for its first ``fail_steps`` reports, then works (the fault clears)."""

    def __init__(self, fail_steps: int) -> None:
        self.fail_steps = fail_steps
        self.received: list[int] = []

    def export(self, report: Any) -> None:
        if len(self.received) < self.fail_steps:
            self.received.append(-report.step)
            raise RuntimeError("exporter fault (injected)")
        self.received.append(report.step)

    def shutdown(self) -> None:
        pass


class _Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def export(self, report: Any) -> None:
        self.steps.append(report.step)

    def shutdown(self) -> None:
        pass


def _flaky(real: Any) -> Any:
    """``real`` that raises on every third call."""
    calls = {"n": 0}

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected tracker failure")
        return real()

    return flaky


@dataclass(frozen=True)
class ContainmentResult:
    untracked: list[float]  # losses without a tracker
    tracked: list[float]  # losses under the broken tracker
    errors_total: int
    logged: int  # log records of the injected tracker failure
    exporter_logged: int  # log records of the injected exporter fault
    flaky_received: list[int]  # steps the flaky exporter got, negative where it raised
    recorded_steps: list[int]  # steps the healthy exporter beside it got


def containment(opts_dict: dict[str, Any]) -> ContainmentResult:
    """Break the tracker's own code mid-run; training must go on and match an untracked twin."""
    rank = torch.distributed.get_rank()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("fsdp_mem_otel").addHandler(Keep())
    losses = {}
    flaky_exporter, recorder = _FlakyExporter(fail_steps=2), _Recorder()
    for tracked in (False, True):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        tracker = FSDPMemoryTracker(model, opt, mode="light", deep_every=2,
                                    exporters=[flaky_exporter, recorder]) if tracked else None
        if tracker is not None:
            tracker.attach()
            tracker.ledger.snap = _flaky(tracker.ledger.snap)  # type: ignore[method-assign]
        run = []
        for step in range(4):
            x = make_batch(step, BATCH, WIDTH, rank)
            run.append(train_step(model, opt, x))
            if tracker is not None:
                tracker.step()
        losses[tracked] = run
        if tracker is not None:
            errors = tracker.errors_total
            tracker.detach()
    return ContainmentResult(
        untracked=losses[False],
        tracked=losses[True],
        errors_total=errors,
        logged=sum(1 for r in records if "injected tracker failure" in str(r.msg % r.args if r.args else r.msg)),
        exporter_logged=sum(1 for r in records if "exporter fault" in str(r.msg % r.args if r.args else r.msg)),
        flaky_received=flaky_exporter.received,
        recorded_steps=recorder.steps,
    )


@dataclass(frozen=True)
class DisableResult:
    disabled: bool  # the tracker whose ledger always fails
    attached: bool
    errors_total: int
    exporter_broken_disabled: bool  # the tracker whose exporter always fails
    exporter_broken_errors: int


def disable_after_errors(opts_dict: dict[str, Any]) -> DisableResult:
    """With max_errors=5 and a ledger that always fails, the tracker detaches itself cleanly."""
    from fsdp_mem_otel.config import TrackerConfig

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=5))
    tracker.attach()

    class BrokenCounters(dict):  # type: ignore[type-arg]
        def get(self, *_: object) -> None:  # type: ignore[override]
            raise RuntimeError("always broken")

    tracker.ledger._cur = BrokenCounters(tracker.ledger._cur)  # every change the ledger replays fails
    for step in range(3):
        train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
        tracker.step()
    # a broken exporter, however often it fails, does not switch measuring off
    exporter_broken = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=3),
                                        exporters=[_FlakyExporter(fail_steps=10**6)]).attach()
    for step in range(5):
        train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
        exporter_broken.step()
    exporter_broken.detach()
    return DisableResult(disabled=tracker.disabled, attached=tracker.attached, errors_total=tracker.errors_total,
                         exporter_broken_disabled=exporter_broken.disabled,
                         exporter_broken_errors=exporter_broken.errors_total)


@dataclass(frozen=True)
class MidForwardResult:
    untracked: list[float]
    tracked: list[float]
    disabled: bool
    attached: bool
    hooks_restored: bool  # every hook and patch as before attach


def disable_inside_forward(opts_dict: dict[str, Any]) -> MidForwardResult:
    """The error limit reached inside a forward (max_errors=1, the first state event of a step
    fails): the tracker detaches itself there, while the module call runs the hooks it started
    with, and training goes on as untracked."""
    from fsdp_mem_otel.config import TrackerConfig
    from tests.oracles import fsdp_fingerprint

    rank = torch.distributed.get_rank()
    losses: dict[bool, list[float]] = {}
    for tracked in (False, True):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        run = [train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))]  # lazy init done
        before = fsdp_fingerprint(model, opt)
        tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=1)) if tracked else None
        if tracker is not None:
            tracker.attach()

            def broken() -> None:
                raise RuntimeError("injected tracker failure")

            tracker._sink._forward_begins = broken  # type: ignore[method-assign] # the root's first state
        for step in range(1, 3):
            run.append(train_step(model, opt, make_batch(step, BATCH, WIDTH, rank)))
            if tracker is not None:
                tracker.step()
        losses[tracked] = run
    assert tracker is not None
    return MidForwardResult(untracked=losses[False], tracked=losses[True], disabled=tracker.disabled,
                            attached=tracker.attached, hooks_restored=fsdp_fingerprint(model, opt) == before)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def mid_forward(request: pytest.FixtureRequest) -> list[MidForwardResult]:
    return run_ranks(disable_inside_forward, {"fsdp": request.param})


def test_detaching_itself_inside_a_forward_does_not_break_it(mid_forward: list[MidForwardResult],
                                                               rank: int) -> None:
    res = mid_forward[rank]
    assert res.tracked == res.untracked  # no exception reached training, results bit for bit
    assert res.disabled and not res.attached
    assert res.hooks_restored


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def contained(request: pytest.FixtureRequest) -> list[ContainmentResult]:
    return run_ranks(containment, {"fsdp": request.param})


def test_internal_failures_are_contained(contained: list[ContainmentResult], rank: int) -> None:
    res = contained[rank]
    assert res.tracked == res.untracked  # training unchanged, bit for bit
    assert res.errors_total > 2  # the injected ledger failures and the 2 exporter faults
    assert res.logged == 1  # one log line for one kind of failure
    # an exporter that raises: counted, logged once, the other exporters unaffected, and it
    # gets every later report once the fault clears
    assert res.exporter_logged == 1
    assert res.flaky_received == [-1, -2, 3, 4]
    assert res.recorded_steps == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def disabled() -> list[DisableResult]:
    return run_ranks(disable_after_errors, {"fsdp": 2})


def test_tracker_disables_itself_after_max_errors(disabled: list[DisableResult], rank: int) -> None:
    res = disabled[rank]
    assert res.disabled and not res.attached
    assert res.errors_total >= 5
    assert [res.exporter_broken_disabled, res.exporter_broken_errors] == [False, 5]  # counted, but measuring stays on
