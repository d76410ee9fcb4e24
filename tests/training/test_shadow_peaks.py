"""Shadow peaks: with the tracker resetting the allocator's peak counters at every window edge, the
training script reads the peaks it would read without the tracker, and its own resets leave the
tracker's windows whole.

Driven through torch's own Python readers over a scripted allocator that replaces torch's C entry
points (``tests/training/scripted_allocator.py``), with real trackers attached to a real FSDP2
model on CPU (one rank, in process): the tracker's AllocatorProbe, AllocatorTemps and the shadow it
installs at attach are the code under test. Oracles: the same training loop without a tracker (what
the script must read), the allocator's own high-water mark per step (what the tracker must report),
and the same loop without the script's resets (the tracker's reports must not change).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.training import shadow_peaks, torch_range
from fsdp_mem_otel.training.allocator import AllocatorProbe
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.training.scripted_allocator import ScriptedAllocator

MiB = 1 << 20
WIDTH, STEPS = 8, 9
_ALLOC: list[ScriptedAllocator] = []  # the allocator the scripted ops move
_STEP = [0]


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-rank gloo group in this process, for FSDP2."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FSDP_MEM_OTEL_"):
            monkeypatch.delenv(name)


def _scripted(monkeypatch: pytest.MonkeyPatch) -> ScriptedAllocator:
    alloc = ScriptedAllocator()
    alloc.install(monkeypatch)
    _ALLOC[:] = [alloc]
    return alloc


@pytest.fixture
def originals() -> dict[tuple[str, str], Any]:
    """torch's functions that the shadow wraps, as they are before any tracker attaches."""
    assert not shadow_peaks.installed()
    return {(m, n): getattr(importlib.import_module(m), n) for m, n in shadow_peaks.PATCHED}


def _current(names: Iterator[tuple[str, str]] | Any) -> dict[tuple[str, str], Any]:
    return {(m, n): getattr(importlib.import_module(m), n) for m, n in names}


# -- a training step whose ops move the scripted allocator -------------------------------------------
class _Op(torch.autograd.Function):
    """Holds ``held`` bytes from forward to backward, and frees a temporary in each."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, held: int, temp_fwd: int, temp_bwd: int) -> torch.Tensor:
        alloc = _ALLOC[0]
        alloc.temp(temp_fwd)
        ctx.handle, ctx.temp_bwd = alloc.alloc(held), temp_bwd
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        alloc = _ALLOC[0]
        alloc.temp(ctx.temp_bwd)
        alloc.free(ctx.handle)
        return grad, None, None, None


class _Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, i = _STEP[0], self.index
        # peaks that move from step to step (up and down), large and small pool
        held = (1 + i) * MiB * (1 + s % 4)
        temp_fwd = (5 - s % 5) * 3 * MiB if i == 0 else MiB // 2
        temp_bwd = (s % 3) * 4 * MiB + 4096
        return x + self.lin(_Op.apply(x, held, temp_fwd, temp_bwd))


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(_Block(0), _Block(1))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _read() -> dict[str, Any]:
    """What a training script reads: the issue's four, and every other Python peak reader."""
    flat = torch.cuda.memory_stats()
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "active_bytes.all.peak": torch.cuda.memory_stats()["active_bytes.all.peak"],
        "accelerator.max_memory_allocated": torch.accelerator.max_memory_allocated(),
        "accelerator.max_memory_reserved": torch.accelerator.max_memory_reserved(),
        "peaks": {k: v for k, v in flat.items() if k.endswith(".peak")},
        "accelerator.peaks": {k: v for k, v in torch.accelerator.memory_stats().items() if k.endswith(".peak")},
        "nested": torch.cuda.memory_stats_as_nested_dict(),
        "summary": torch.cuda.memory_summary(),
        "device 1": torch.cuda.max_memory_allocated(1),
    }


def _reset_quietly(reset: Callable[[], None]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reset_max_memory_allocated says it resets all
        reset()


#: the script's resets, in turn: torch.cuda's, its deprecated alias, torch.accelerator's
SCRIPT_RESETS: tuple[Callable[[], None], ...] = (
    torch.cuda.reset_peak_memory_stats,
    lambda: torch.cuda.reset_max_memory_allocated(0),
    torch.accelerator.reset_peak_memory_stats,
)


@dataclass
class Run:
    reads: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    raw_peaks: list[int] = field(default_factory=list)  # the live C counter at each step-end read
    truth: list[int] = field(default_factory=list)  # allocated bytes' high-water mark of each step
    reports: dict[str, list[Any]] = field(default_factory=dict)


def _train(alloc: ScriptedAllocator, models: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
           trackers: dict[str, FSDPMemoryTracker], *, script_resets: bool = True,
           detach_after: dict[str, int] | None = None) -> Run:
    """STEPS steps of each model in turn; the script reads after the forward (windows open) and
    after the step, and resets every third step (and once mid-step); step 4 empties the cache, steps
    5-7 hold a private pool's memory. ``detach_after``: tracker -> the step after which it detaches."""
    run = Run(reports={name: [] for name in trackers})
    x = torch.ones(4, WIDTH)
    for step in range(1, STEPS + 1):
        _STEP[0] = step
        alloc.mark()
        losses = []
        for model, _ in models.values():
            out = model(x)
            alloc.temp(40 * MiB if step == 2 else 2 * MiB)  # the loss's float32 logits, outside every module
            losses.append(out.sum())
        run.reads.append((step, "mid", _read()))
        if script_resets and step == 5:
            _reset_quietly(torch.cuda.reset_peak_memory_stats)  # mid-step, while the windows are open
        if step == 5:
            alloc.pool_alloc(6 * MiB)
        if step == 7:
            alloc.pool_alloc(-6 * MiB)
        for loss, (_, opt) in zip(losses, models.values(), strict=True):
            loss.backward()
            opt.step()
            opt.zero_grad()
        if step == 4:
            torch.cuda.empty_cache()
        for name, tracker in trackers.items():
            if tracker.attached:
                run.reports[name].append(tracker.step())
            if detach_after and detach_after.get(name) == step:
                tracker.detach()
        run.truth.append(alloc.devices[0].high_water)
        run.raw_peaks.append(torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"])
        run.reads.append((step, "end", _read()))
        if script_resets and step % 3 == 0:
            _reset_quietly(SCRIPT_RESETS[step // 3 % 3])
    return run


def _peaks(report: Any) -> dict[str, Any]:
    """What a tracker reported of its step: allocator peaks, the step's peak breakdown, module peaks."""
    cuda = report.allocator["cuda:0"]
    return {
        "allocator": {k: cuda[k] for k in ("allocated_peak_bytes", "reserved_peak_bytes", "active_peak_bytes")},
        "peak": report.peak,
        "modules": {k: (m.peak_total("peak_forward"), m.peak_total("peak_backward"))
                    for k, m in report.modules.items()},
    }


# -- the training loop -------------------------------------------------------------------------------
def test_a_loop_reads_the_same_peaks_with_and_without_a_resetting_tracker(
        group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch, originals: dict[tuple[str, str], Any]) -> None:
    alloc = _scripted(monkeypatch)
    alone = _train(alloc, {"m": _model()}, {})

    alloc = _scripted(monkeypatch)
    models = {"m": _model()}
    tracker = FSDPMemoryTracker(*models["m"]).attach()  # the default config: reset_peaks where CUDA is
    try:
        assert tracker._probe.reset_peaks and shadow_peaks.installed()
        tracked = _train(alloc, models, {"m": tracker})
        resets = list(alloc.resets)
    finally:
        tracker.detach()
    assert _current(shadow_peaks.PATCHED) == originals  # detach put torch's functions back

    # the tracker reset at every window edge (several per step), and the script saw none of it
    assert len(resets) > 4 * STEPS
    assert tracked.reads == alone.reads
    # not by luck: the live counter lost what the tracker's resets took, the script's view has it
    ended = [r for _, when, r in tracked.reads if when == "end"]
    assert any(raw < r["max_memory_allocated"] for raw, r in zip(tracked.raw_peaks, ended, strict=True))
    # the tracker's own figures are the allocator's peaks of each step
    assert [r.allocator["cuda:0"]["allocated_peak_bytes"] for r in tracked.reports["m"]] == tracked.truth
    assert [r.allocator["cuda:0"]["active_peak_bytes"] for r in tracked.reports["m"]] == tracked.truth
    # and light mode's step peak on the device includes the temporaries (step 2's 40 MiB logits)
    assert tracked.reports["m"][1].peak["cuda:0"]["temp"] >= 40 * MiB
    assert all(not r.errors_total for r in tracked.reports["m"])


def test_the_scripts_resets_leave_the_trackers_windows_whole(
        group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    reports = {}
    for script_resets in (True, False):
        alloc = _scripted(monkeypatch)
        models = {"m": _model()}
        tracker = FSDPMemoryTracker(*models["m"]).attach()
        try:
            run = _train(alloc, models, {"m": tracker}, script_resets=script_resets)
        finally:
            tracker.detach()
        reports[script_resets] = [_peaks(r) for r in run.reports["m"]]
    assert reports[True] == reports[False]


def test_two_trackers_attached_and_detached_out_of_order(
        group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch, originals: dict[tuple[str, str], Any]) -> None:
    """Trackers a and b on two models trained in turn: a detaches after step 6 (while b goes on),
    b after step 9. The script reads what it reads with no tracker; each tracker reports what it
    reports alone; after a's detach the wrappers stay (b holds them), after b's torch's are back."""
    alloc = _scripted(monkeypatch)
    alone = _train(alloc, {"a": _model(0), "b": _model(1)}, {})
    single = {}
    for name in ("a", "b"):
        alloc = _scripted(monkeypatch)
        models = {"a": _model(0), "b": _model(1)}
        tracker = FSDPMemoryTracker(*models[name]).attach()
        try:
            single[name] = _train(alloc, models, {name: tracker}, detach_after={"a": 6})
        finally:
            tracker.detach()

    alloc = _scripted(monkeypatch)
    models = {"a": _model(0), "b": _model(1)}
    trackers = {name: FSDPMemoryTracker(*models[name]).attach() for name in ("a", "b")}
    installed_after_a: list[bool] = []
    detach_a = trackers["a"].detach

    def detach_a_then_look() -> None:
        detach_a()
        installed_after_a.append(shadow_peaks.installed())
        assert _current(shadow_peaks.PATCHED) != originals  # b still shadows

    trackers["a"].detach = detach_a_then_look  # type: ignore[method-assign]
    try:
        both = _train(alloc, models, trackers, detach_after={"a": 6})
    finally:
        detach_a()  # (a no-op once detached)
        trackers["b"].detach()
    assert installed_after_a == [True]
    assert _current(shadow_peaks.PATCHED) == originals  # the last detach put torch's functions back
    assert both.reads == alone.reads
    for name in ("a", "b"):
        assert [_peaks(r) for r in both.reports[name]] == [_peaks(r) for r in single[name].reports[name]]
    assert len(both.reports["a"]) == 6 and len(both.reports["b"]) == STEPS


def test_opting_out_leaves_the_counters_and_functions_alone(
        group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch, originals: dict[tuple[str, str], Any]) -> None:
    monkeypatch.setenv("FSDP_MEM_OTEL_RESET_PEAKS", "0")
    alloc = _scripted(monkeypatch)
    models = {"m": _model()}
    tracker = FSDPMemoryTracker(*models["m"]).attach()
    try:
        assert tracker.config.reset_peaks is False and not tracker._probe.reset_peaks
        assert _current(shadow_peaks.PATCHED) == originals
        run = _train(alloc, models, {"m": tracker}, script_resets=False)
    finally:
        tracker.detach()
    assert alloc.resets == []  # only the tracker could have reset: the script did not
    # sampled at FSDP hooks: the temporaries between hooks are missed
    sampled = [r.allocator["cuda:0"]["allocated_peak_bytes"] for r in run.reports["m"]]
    assert all(s <= t for s, t in zip(sampled, run.truth, strict=True)) and sampled != run.truth


# -- the shadow against probes directly ---------------------------------------------------------------
@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> Iterator[ScriptedAllocator]:
    alloc = _scripted(monkeypatch)
    probes: list[AllocatorProbe] = []
    alloc.probes = probes  # type: ignore[attr-defined]
    yield alloc
    for probe in probes:
        probe.stop()


def _probe(alloc: ScriptedAllocator) -> AllocatorProbe:
    probe = AllocatorProbe([0], reset_peaks=True)
    alloc.probes.append(probe)  # type: ignore[attr-defined]
    probe.start()
    return probe


def _edge_peak(probe: AllocatorProbe) -> int:
    return probe.window_edge()["cuda:0"][0]


def test_script_reset_mid_window_keeps_the_window(scripted: ScriptedAllocator) -> None:
    probe = _probe(scripted)
    base = scripted.allocated()
    scripted.temp(10 * MiB)
    torch.cuda.reset_peak_memory_stats()  # the script's, inside the tracker's window
    assert torch.cuda.max_memory_allocated() == base  # the script's peak restarted at its reset
    scripted.temp(3 * MiB)
    assert _edge_peak(probe) == base + 10 * MiB  # the tracker's window still has the 10 MiB
    assert torch.cuda.max_memory_allocated() == base + 3 * MiB
    scripted.temp(MiB)
    assert _edge_peak(probe) == base + MiB  # and the next window is its own


def test_each_probe_keeps_its_own_window_and_the_last_release_restores(
        scripted: ScriptedAllocator, originals: dict[tuple[str, str], Any]) -> None:
    a, b = _probe(scripted), _probe(scripted)
    base = scripted.allocated()
    scripted.temp(8 * MiB)
    assert _edge_peak(a) == base + 8 * MiB
    scripted.temp(4 * MiB)
    assert _edge_peak(b) == base + 8 * MiB  # since b's last reset: before a's
    assert _edge_peak(a) == base + 4 * MiB  # since a's last
    assert torch.cuda.max_memory_allocated() == base + 8 * MiB  # the script's: since forever
    a.stop()  # out of order: the first taken, given back first
    assert shadow_peaks.installed() and _current(shadow_peaks.PATCHED) != originals
    scripted.temp(2 * MiB)
    assert _edge_peak(b) == base + 2 * MiB
    assert torch.cuda.max_memory_allocated() == base + 8 * MiB
    b.stop()
    assert not shadow_peaks.installed()
    assert _current(shadow_peaks.PATCHED) == originals
    b.stop()  # twice: harmless
    assert _current(shadow_peaks.PATCHED) == originals


def test_wrappers_look_like_torchs_functions(scripted: ScriptedAllocator,
                                             originals: dict[tuple[str, str], Any]) -> None:
    _probe(scripted)
    for key, original in originals.items():
        wrapper = _current([key])[key]
        assert wrapper is not original and wrapper.__wrapped__ is original
        assert wrapper.__name__ == original.__name__ and wrapper.__doc__ == original.__doc__
        assert inspect.signature(wrapper) == inspect.signature(original), key
    # a bad argument gets torch's own error
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.reset_peak_memory_stats("cpu")
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.max_memory_allocated("cpu")


def test_a_function_replaced_meanwhile_is_left_in_place(scripted: ScriptedAllocator,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    probe = _probe(scripted)
    wrapper = torch.cuda.memory_stats_as_nested_dict

    def theirs(device: Any = None) -> dict[str, Any]:
        return wrapper(device)

    torch.cuda.memory_stats_as_nested_dict = theirs
    try:
        with caplog.at_level(logging.WARNING, logger=shadow_peaks.__name__):
            probe.stop()
        assert torch.cuda.memory_stats_as_nested_dict is theirs
        assert "torch.cuda.memory_stats_as_nested_dict was replaced" in caplog.text
    finally:
        torch.cuda.memory_stats_as_nested_dict = wrapper.__wrapped__  # type: ignore[attr-defined]


def test_every_peak_entry_is_shadowed_on_every_device(scripted: ScriptedAllocator) -> None:
    scripted.temp(20 * MiB)
    scripted.temp(4096)
    scripted.pool_alloc(6 * MiB)
    scripted.pool_alloc(-6 * MiB)
    scripted.temp(3 * MiB, device=1)
    before = {d: torch.cuda.memory_stats(d) for d in (0, 1)}
    summary = torch.cuda.memory_summary(0)
    probe = AllocatorProbe([0, 1], reset_peaks=True)
    scripted.probes.append(probe)  # type: ignore[attr-defined]
    probe.start()  # resets both devices' counters
    probe.window_edge()
    assert scripted.resets == [0, 1, 0, 1]
    raw = torch._C._cuda_memoryStats(0)
    assert raw["reserved_bytes_by_private_pools"][(0, 1)]["all"]["peak"] == 0  # the live counters lost them
    for d in (0, 1):
        assert torch.cuda.memory_stats(d) == before[d]
    assert torch.cuda.memory_summary(0) == summary
    assert any(k.startswith("reserved_bytes_by_private_pools") and k.endswith(".peak") and v == 6 * MiB
               for k, v in before[0].items())
    assert {k: v for k, v in torch.accelerator.memory_stats(1).items() if k.endswith(".peak")} == {
        k: v for k, v in before[1].items() if k.endswith(".peak") and not k.startswith("reserved_bytes_by")}


# -- torch versions ----------------------------------------------------------------------------------
def test_tested_range() -> None:
    assert torch_range.tested_range() == "2.13-2.14"
    for version in ("2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.14.0a0+git1234"):
        assert torch_range.is_tested(version), version
    for version in ("2.12.1", "2.15.0", "2.15.0.dev20260101", "3.0.0", "nightly"):
        assert not torch_range.is_tested(version), version


def test_an_untested_torch_warns_once_and_every_report_says_so(
        group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch_range, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    trackers = [FSDPMemoryTracker(*_model(i), config=TrackerConfig()) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger=torch_range.__name__):
        for t in trackers:
            t.attach()
    try:
        reports = [t.step() for t in trackers]
    finally:
        for t in trackers:
            t.detach()
    records = [r for r in caplog.records if r.name == torch_range.__name__]
    assert len(records) == 1  # once per process, however many trackers
    assert "torch 2.15.0 is outside the tested range 2.13-2.14" in records[0].getMessage()
    assert all(torch_range.WARNING_TORCH_UNTESTED in r.warnings for r in reports)


def test_a_tested_torch_says_nothing(group: None, clean_env: None, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch_range, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    tracker = FSDPMemoryTracker(*_model())
    with caplog.at_level(logging.WARNING, logger=torch_range.__name__):
        tracker.attach()
    try:
        report = tracker.step()
    finally:
        tracker.detach()
    assert torch_range.WARNING_TORCH_UNTESTED not in report.warnings
    assert not [r for r in caplog.records if r.name == torch_range.__name__]
