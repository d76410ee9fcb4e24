"""An OOM in the middle of a step: the report says where it happened and what memory held."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.schema import TOTAL
from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, block_param_bytes, reset_fsdp_iteration, settle


@dataclass(frozen=True)
class OomRun:
    reports: list[dict[str, Any]]  # StepReport.to_dict() of the 4 steps; the OOM is in the second


def oom_mid_step(opts_dict: dict[str, Any], where: str) -> OomRun:
    """Raise torch.OutOfMemoryError inside layers.1's forward or backward on step 2 (both ranks),
    recover as FSDP2 documents (reset_iter_state), and keep training under the tracker."""
    from fsdp_mem_otel.tools.demo import Block

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    block = [m for m in model.modules() if isinstance(m, Block)][1]
    armed = {"on": False}

    def boom(*_: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    tracker = FSDPMemoryTracker(model, opt, deep_every=2).attach()
    if where == "forward":  # runs after FSDP's unshard and the tracker's after_pre_forward
        block.register_forward_pre_hook(boom)
    else:  # fires after FSDP's pre-backward for this block
        block.register_forward_hook(lambda m, i, out: out.register_hook(lambda g: boom()) and None)
    reports = []
    for step in range(4):
        settle()
        armed["on"] = step == 1
        x = make_batch(step, BATCH, WIDTH, rank)
        try:
            with tracker.step_scope():
                train_step(model, opt, x, on_inputs=tracker.track_inputs)
        except torch.OutOfMemoryError:
            reset_fsdp_iteration(model)
            opt.zero_grad(set_to_none=True)
        reports.append(tracker.step().to_dict())
    tracker.detach()
    return OomRun(reports=reports)


# where the OOM is raised -> the state the report must name
WHERE_STATE = {"forward": "after_pre_forward", "backward": "after_pre_backward"}


@pytest.fixture(scope="module", params=list(WHERE_STATE))
def oom(request: pytest.FixtureRequest) -> tuple[str, list[OomRun]]:
    # FSDP2 only: FSDP1 has no supported recovery (reset_iter_state) after a mid-step exception.
    return request.param, run_ranks(oom_mid_step, {"fsdp": 2}, request.param)


def test_oom_inside_a_module_is_located_and_training_goes_on(oom: tuple[str, list[OomRun]], rank: int) -> None:
    where, per_rank = oom
    state = WHERE_STATE[where]
    ok, failed, *after = per_rank[rank].reports
    assert ok["aborted"] is None
    abort = failed["aborted"]
    assert abort["error"] == "OutOfMemoryError" and abort["oom"]
    assert abort["module"] == "layers.1" and abort["state"] == state
    live = abort["breakdown"]["cpu"]
    # layers.1 was unsharded when it failed: its full parameters are in the breakdown
    assert live["unsharded_param"] >= block_param_bytes()
    assert failed["peak"]["cpu"][TOTAL] >= live[TOTAL]
    for rep in after:  # tracked normally again
        assert rep["aborted"] is None and rep["errors_total"] == 0
        assert all(len(m["snapshots"]["after_post_backward"]) == 1 for m in rep["modules"].values())
