"""CUDA-only checks: the tracker against the caching allocator, and a real allocator OOM.

They run only where a GPU exists (one process, FSDP2 over a 1-rank NCCL group) and skip cleanly
elsewhere; CI has no GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def one_rank_group():  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from tests.dist import free_ports

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cuda_model(blocks: int, width: int):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import fully_shard

    from fsdp_mem_otel.training.demo import BlockModel

    torch.manual_seed(0)
    model = BlockModel(blocks, width).cuda()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def test_deep_peak_matches_allocator_active_peak(one_rank_group) -> None:  # type: ignore[no-untyped-def]
    from fsdp_mem_otel.training.demo import train_step
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
    tracker.detach()
    active_peak = torch.cuda.memory_stats()["active_bytes.all.peak"]
    tracked_peak = report.peak["cuda:0"]["total"]
    # Tensors the tracker cannot see (allocator-internal, NCCL, cuBLAS workspaces) stay outside;
    # everything the step allocated is inside: within 10% of the allocator's own active peak.
    assert abs(tracked_peak - active_peak) <= 0.10 * active_peak, (tracked_peak, active_peak, baseline)
    stats = report.allocator["cuda:0"]
    assert stats["allocated_bytes"] == torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()  # the driver's view: used - reserved lies outside PyTorch
    outside = total - free - torch.cuda.memory_reserved()
    assert abs(stats["outside_pytorch_bytes"] - outside) <= 64 * 2**20  # NCCL may allocate between reads
    assert stats["outside_pytorch_bytes"] > 0  # the CUDA context alone is hundreds of MiB
    assert stats["untracked_bytes"] == stats["allocated_bytes"] - report.current["cuda:0"]["total"]


def test_real_allocator_oom_is_located(one_rank_group) -> None:  # type: ignore[no-untyped-def]
    from fsdp_mem_otel.training.demo import Block, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    model, opt = _cuda_model(3, 256)
    block = [m for m in model.modules() if isinstance(m, Block)][1]
    armed = {"on": False}

    def allocate_too_much(*_: object) -> None:
        if armed["on"]:
            armed["on"] = False
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # real cudaMalloc failure

    tracker = FSDPMemoryTracker(model, opt).attach()
    block.register_forward_pre_hook(allocate_too_much)
    x = torch.randn(64, 256, device="cuda")
    reports = []
    for step in range(3):
        armed["on"] = step == 1
        try:
            with tracker.step_scope():
                train_step(model, opt, x)
        except torch.OutOfMemoryError:
            model.reset_iter_state()
            opt.zero_grad(set_to_none=True)
        reports.append(tracker.step())
    tracker.detach()
    abort = reports[1].aborted
    assert abort is not None and abort.oom and abort.error == "OutOfMemoryError"
    assert abort.module == "layers.1"
    assert abort.outside_pytorch_bytes["cuda:0"] > 0  # the CUDA context, NCCL, cuBLAS at that moment
    assert reports[1].allocator["cuda:0"]["num_ooms"] >= 1
    assert reports[2].aborted is None
