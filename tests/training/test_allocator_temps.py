"""Op temporaries from the allocator's peak counters (``reset_peaks=True``): the ledger's windows
mirrored on a scripted allocator (no GPU), against the arithmetic of what was allocated when."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fsdp_mem_otel.schema import ACTIVATION, TEMP, TOTAL
from fsdp_mem_otel.training.allocator import AllocatorProbe
from fsdp_mem_otel.training.allocator_temps import AllocatorTemps, allocator_temps
from fsdp_mem_otel.training.light.ledger import Ledger, as_breakdown
from tests.training.test_allocator import FakeCuda

DEV = "cuda:0"
WORKSPACE = 1000  # allocator bytes no tensor holds (cuBLAS workspaces): the baseline, left out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = FakeCuda()
    fake.install(monkeypatch)
    yield fake
    for probe in PROBES:  # give the peak counters back while the fake is still installed
        probe.stop()
    PROBES.clear()


PROBES: list[AllocatorProbe] = []


class Step:
    """A ledger whose tracked bytes the scripted allocator also holds, beside WORKSPACE."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.probe = AllocatorProbe([0], reset_peaks=True)
        PROBES.append(self.probe)
        self.ledger = Ledger()
        self.ledger.window_watch = AllocatorTemps(self.probe)
        self.extra = 0  # allocated, not tracked: temporaries
        self.probe.start()
        self._sync()

    def _sync(self) -> None:
        tracked = self.ledger.raw().get(DEV, [0] * 12)[-1]
        self.fake.set(WORKSPACE + tracked + self.extra, 10**6)

    def track(self, delta: int) -> None:
        self.ledger.add(DEV, ACTIVATION, delta)
        self._sync()

    def hold(self, nbytes: int) -> None:
        """Allocated, not tracked, and kept: a gradient on its way to the next module."""
        self.extra += nbytes
        self._sync()

    def temp(self, nbytes: int) -> None:
        """An op allocates ``nbytes`` and frees them before the next hook: only the allocator sees it."""
        self.extra += nbytes
        self._sync()
        self.extra -= nbytes
        self._sync()


def test_windows_and_step_get_what_only_the_allocator_saw(fake_cuda: FakeCuda) -> None:
    s = Step(fake_cuda)
    s.track(100)
    s.ledger.open_window()  # outer: baseline WORKSPACE
    s.track(50)
    s.ledger.open_window()  # inner
    s.temp(300)  # at 150 tracked: the allocator's peak is WORKSPACE + 450
    s.track(20)  # the ledger's own peak in both windows: 170
    inner = s.ledger.close_window_raw()
    outer = s.ledger.close_window_raw()
    for raw in (inner, outer):
        got = as_breakdown(raw)[DEV]
        assert got[TOTAL] == 450  # the allocator's peak less the baseline
        assert got[TEMP] == 450 - 170 and got[ACTIVATION] == 170  # the ledger's categories at its peak
    s.temp(1000)  # after the windows closed: the step's peak alone
    peak = s.ledger.step_peak()[DEV]
    assert peak[TOTAL] == 170 + 1000 and peak[TEMP] == 1000
    assert s.probe.step_stats({DEV: 170})[DEV]["allocated_peak_bytes"] == WORKSPACE + 1170  # every edge's


def test_what_is_held_across_a_window_edge_is_in_the_window(fake_cuda: FakeCuda) -> None:
    s = Step(fake_cuda)
    s.ledger.open_window()  # the step's first window: the baseline is WORKSPACE
    s.track(100)
    s.ledger.close_window_raw()
    s.hold(200)  # alive when the next window opens: in it, not in the baseline
    s.ledger.open_window()
    s.track(50)
    got = as_breakdown(s.ledger.close_window_raw())[DEV]
    assert (got[TOTAL], got[TEMP], got[ACTIVATION]) == (350, 200, 150)


def test_nothing_changes_where_the_ledger_saw_everything(fake_cuda: FakeCuda) -> None:
    s = Step(fake_cuda)
    s.ledger.open_window()
    s.track(400)
    s.track(-300)
    snap = s.ledger.raw()
    closed = s.ledger.close_window_raw()
    assert as_breakdown(closed)[DEV][TEMP] == 0 and as_breakdown(closed)[DEV][TOTAL] == 400
    assert s.ledger.step_peak()[DEV][TOTAL] == 400
    assert s.ledger.raw() == snap  # the live counters are never adjusted


def test_a_window_closed_out_of_order_gets_its_own_peak(fake_cuda: FakeCuda) -> None:
    s = Step(fake_cuda)
    s.ledger.open_window()  # 0: a module's backward
    s.temp(500)
    s.ledger.open_window()  # 1: the next module's, overlapping it
    s.temp(200)
    first = as_breakdown(s.ledger.close_window_at(0))[DEV]  # the outer one ends first
    second = as_breakdown(s.ledger.close_window_raw())[DEV]
    assert (first[TEMP], second[TEMP]) == (500, 200)


def test_off_without_reset_peaks_or_cuda(fake_cuda: FakeCuda) -> None:
    probe = AllocatorProbe([0])
    assert allocator_temps(probe, reset_peaks=False) is None
    assert isinstance(allocator_temps(probe, reset_peaks=True), AllocatorTemps)
    assert probe.window_edge() == {}  # without reset_peaks the user's peak counters stay untouched
    assert fake_cuda.resets == []
