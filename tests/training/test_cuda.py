"""CUDA-only checks: the tracker against the caching allocator, and a real allocator OOM.

They run only where a GPU exists (one process, FSDP2 over a 1-rank NCCL group) and skip cleanly
elsewhere; CI has no GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_model(blocks: int, width: int):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel.tools.demo import BlockModel

    torch.manual_seed(0)
    model = BlockModel(blocks, width).cuda()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def test_deep_peak_matches_allocator_active_peak(one_rank_nccl) -> None:  # type: ignore[no-untyped-def]
    from fsdp_mem_otel.tools.demo import train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    model, opt = _cuda_model(4, 1024)
    x = torch.randn(256, 1024, device="cuda")
    train_step(model, opt, x)  # warm-up: lazy init, optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_stats()["active_bytes.all.current"]
    tracker = FSDPMemoryTracker(model, opt, mode="deep").attach()
    tracker.track_inputs(x)
    train_step(model, opt, x)
    torch.cuda.synchronize()
    report = tracker.step()
    active_peak = torch.cuda.memory_stats()["active_bytes.all.peak"]  # while attached: the script's own peak
    tracker.detach()
    tracked_peak = report.peak["cuda:0"]["total"]
    stats = report.allocator["cuda:0"]
    # Allocator blocks no tensor holds (cuBLAS workspaces: 65 MiB on an H200, a quarter of this
    # small model's peak) are the report's untracked_bytes; with them, everything the step
    # allocated is inside: within 1% of the allocator's own active peak.
    print("GPU-RESULT", json.dumps({"test": "deep_block_model", "tracked_peak": tracked_peak,
                                    "untracked_bytes": stats["untracked_bytes"], "active_peak": active_peak}))
    assert abs(tracked_peak + stats["untracked_bytes"] - active_peak) <= 0.01 * active_peak, (
        tracked_peak, stats["untracked_bytes"], active_peak, baseline)
    assert stats["allocated_bytes"] == torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()  # the driver's view: used - reserved lies outside PyTorch
    outside = total - free - torch.cuda.memory_reserved()
    assert abs(stats["outside_pytorch_bytes"] - outside) <= 64 * 2**20  # NCCL may allocate between reads
    assert stats["outside_pytorch_bytes"] > 0  # the CUDA context alone is hundreds of MiB
    assert stats["untracked_bytes"] == stats["allocated_bytes"] - report.current["cuda:0"]["total"]


def _nvml_process_bytes() -> int:
    """What NVML says this process holds on GPU 0 (its compute-process entry)."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
        assert mine and mine[0] is not None, f"NVML lists no usage for pid {os.getpid()}: {procs}"
        return int(mine[0])
    finally:
        pynvml.nvmlShutdown()


# where the OOM is raised -> the state the report must name (as tests/training/test_abort.py)
OOM_STATE = {"forward": "after_pre_forward", "backward": "after_pre_backward"}


@pytest.mark.parametrize("where", list(OOM_STATE))
def test_real_allocator_oom_is_located(one_rank_nccl, where: str) -> None:  # type: ignore[no-untyped-def]
    """A real cudaMalloc failure inside layers.1's forward or backward: the report names the module,
    the state and what was live; its outside-PyTorch bytes are NVML's figure for this process minus
    what PyTorch reserves; training catches the OOM and goes on, the tracker healthy."""
    from fsdp_mem_otel.tools.demo import Block, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
    from tests.oracles import reset_fsdp_iteration

    model, opt = _cuda_model(3, 256)
    block = [m for m in model.modules() if isinstance(m, Block)][1]
    armed = {"on": False}

    def allocate_too_much(*_: object) -> None:
        if armed["on"]:
            armed["on"] = False
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # real cudaMalloc failure

    tracker = FSDPMemoryTracker(model, opt).attach()
    if where == "forward":  # after FSDP's unshard and the tracker's after_pre_forward
        block.register_forward_pre_hook(allocate_too_much)
    else:  # after FSDP's pre-backward for this block
        block.register_forward_hook(lambda m, i, out: out.register_hook(lambda g: allocate_too_much()) and None)
    x = torch.randn(64, 256, device="cuda")
    reports, nvml_outside = [], None
    for step in range(3):
        armed["on"] = step == 1
        try:
            with tracker.step_scope():
                train_step(model, opt, x)
        except torch.OutOfMemoryError:
            nvml_outside = _nvml_process_bytes() - torch.cuda.memory_reserved()
            reset_fsdp_iteration(model)
            opt.zero_grad(set_to_none=True)
        reports.append(tracker.step())
    tracker.detach()
    abort = reports[1].aborted
    assert abort is not None and abort.oom and abort.error == "OutOfMemoryError"
    assert (abort.module, abort.state) == ("layers.1", OOM_STATE[where])
    live = abort.breakdown["cuda:0"]
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())  # unsharded: 1 rank
    assert live["unsharded_param"] >= block_bytes and live["total"] >= live["unsharded_param"]
    outside = abort.outside_pytorch_bytes["cuda:0"]
    print("GPU-RESULT", json.dumps({"test": f"oom_{where}", "outside_pytorch_bytes": outside,
                                    "nvml_process_minus_reserved": nvml_outside, "breakdown": live}))
    assert nvml_outside is not None and outside > 0  # the CUDA context alone is hundreds of MiB
    assert abs(outside - nvml_outside) <= 64 * 2**20, (outside, nvml_outside)
    assert reports[1].allocator["cuda:0"]["num_ooms"] >= 1
    for rep in reports[2:]:  # the next step: tracked as before the OOM
        assert rep.aborted is None and rep.errors_total == 0
        assert all(len(m.snapshots["after_post_backward"]) == 1 for m in rep.modules.values())
