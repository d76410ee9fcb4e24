"""The GPU tests' oracle (``tests.cuda_llama.AllocatorWindows``) kept in step with the tracker, on
CPU: it must see the tracker's peak windows as they happen, one reading per window the step log
holds, or the GPU accuracy tests (which CI cannot run) fail for the oracle's sake, not the
tracker's. The allocator is scripted: each reading is what the ledger counts then, plus a fixed
workspace no tensor holds, so a window's reading can be checked against the tracker's own peak.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH

WORKSPACE = 4096  # allocator bytes no tensor holds (cuBLAS workspaces on a GPU)


def oracle_against_tracker(mode: str) -> dict[str, Any]:
    """One warm-up and one watched step of the block model on one rank, the allocator scripted."""
    import tests.cuda_llama as oracle

    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker(model, opt, mode=mode).attach()

    def allocated() -> int:  # what the scripted allocator holds: the ledger's total now, and more
        return tracker.ledger.raw().get("cpu", [0])[-1] + WORKSPACE

    oracle._peaks = lambda: (allocated(), allocated())  # type: ignore[attr-defined]
    oracle.torch.cuda.reset_peak_memory_stats = lambda *a: None  # type: ignore[assignment]
    oracle.torch.cuda.memory_allocated = lambda *a: allocated()  # type: ignore[assignment]
    train_step(model, opt, make_batch(0, BATCH, WIDTH, 0))
    tracker.step()
    windows = oracle.AllocatorWindows(device="cpu")
    windows.watch(tracker)
    windows.start()
    train_step(model, opt, make_batch(1, BATCH, WIDTH, 0))
    deferred = tracker.ledger.pending is not None
    windows.read()
    allocator = windows.module_peaks(tracker)
    report = tracker.step()
    tracker.detach()
    return {"errors": report.errors_total, "deferred": deferred, "allocator": allocator,
            "tracked": oracle.tracked_module_peaks(report, "cpu"), "untracked": windows.untracked}


@pytest.mark.parametrize("mode", ["deep", "light"])
def test_the_oracle_reads_at_every_window_the_tracker_logs(mode: str) -> None:
    (got,) = run_ranks(oracle_against_tracker, mode, world_size=1)
    assert got["errors"] == 0
    assert not got["deferred"], "a watched ledger applies each change at once"
    tracked, allocator = got["tracked"], got["allocator"]
    assert set(allocator) == set(tracked) and len(tracked) == 2 * (BLOCKS + 1)  # each FSDP module, fwd + bwd
    for where, peak in tracked.items():
        active, allocated = allocator[where]
        # read at the edges only, the allocator's reading is at most the window's peak, and at least
        # what the window held when it closed: more than the workspace alone
        assert active == allocated and WORKSPACE < active <= peak + WORKSPACE, (where, active, peak)
    assert got["untracked"] and got["untracked"] == [WORKSPACE] * len(got["untracked"])
