"""The tracker's saved-tensor hooks never outlive it on the thread's hook stack, whoever pushed
hooks above them; and they stay on for the rest of a ``saved_activations()`` block.

Oracles: autograd's own stack of default saved-tensor hooks (``_top_saved_tensors_default_hooks``:
empty after the run, as untracked), and bitwise equal training against an untracked twin.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch
from fsdp_mem_otel.training.light.activations import SavedTensorAccounting
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH

_top = torch._C._autograd._top_saved_tensors_default_hooks


def _ours_on_top(acts: SavedTensorAccounting) -> bool:
    top = _top(True)
    return top is not None and (getattr(top[0], "__self__", None) is acts
                                or getattr(top[0], "__qualname__", "").startswith("SavedTensorAccounting."))


@dataclass(frozen=True)
class StackResult:
    untracked: list[float]
    tracked: list[float]
    ours_after_forward: list[bool]  # per step: our hooks on top after the model call, inside the scope
    left_on_stack: bool  # a hook pair still on the thread's stack after detach
    disabled: bool


def scoped_model_call(opts_dict: dict[str, Any]) -> StackResult:
    """``with tracker.saved_activations():`` around the model call and the loss, the user's own
    ``save_on_cpu()`` around the model call inside it: ours stay pushed for the loss after the
    forward ends, and nothing of ours is left on the stack after detach."""
    rank = torch.distributed.get_rank()
    losses: dict[bool, list[float]] = {}
    ours_after: list[bool] = []
    for tracked in (False, True):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        tracker = FSDPMemoryTracker(model, opt).attach() if tracked else None
        run = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            x = make_batch(step, BATCH, WIDTH, rank)
            with tracker.saved_activations() if tracker is not None else contextlib.nullcontext():
                with torch.autograd.graph.save_on_cpu():
                    out = model(x)
                if tracker is not None:
                    ours_after.append(_ours_on_top(tracker._sink.activations))
                loss = out.square().mean()
            loss.backward()
            opt.step()
            run.append(loss.item())
            if tracker is not None:
                tracker.step()
        losses[tracked] = run
        if tracker is not None:
            tracker.detach()
    return StackResult(untracked=losses[False], tracked=losses[True], ours_after_forward=ours_after,
                       left_on_stack=_top(True) is not None, disabled=False)


def _failing_under_others(sink: Any) -> Any:
    """``sink._track_io`` that raises while hooks other than the sink's are on top."""
    track_io = sink._track_io

    def failing(key: str, state: str, tensors: object) -> None:
        if _top(True) is not None and not _ours_on_top(sink.activations):
            raise RuntimeError("injected tracker failure")
        track_io(key, state, tensors)

    return failing


def detach_under_checkpoint(opts_dict: dict[str, Any]) -> StackResult:
    """The error limit (max_errors=1) reached while checkpointing's hooks are pushed above ours
    (an FSDP module inside a checkpointed block): the tracker detaches there and takes its hooks
    out from under checkpointing's, which stay until checkpointing pops them."""
    from fsdp_mem_otel.tools.demo import train_step

    rank = torch.distributed.get_rank()
    losses: dict[bool, list[float]] = {}
    for tracked in (False, True):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=1)).attach() if tracked else None
        if tracker is not None:
            tracker._sink._track_io = _failing_under_others(tracker._sink)  # type: ignore[method-assign]
        run = []
        for step in range(3):
            run.append(train_step(model, opt, make_batch(step, BATCH, WIDTH, rank)))
            if tracker is not None:
                tracker.step()
        losses[tracked] = run
    assert tracker is not None
    return StackResult(untracked=losses[False], tracked=losses[True], ours_after_forward=[],
                       left_on_stack=_top(True) is not None, disabled=tracker.disabled and not tracker.attached)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def scoped(request: pytest.FixtureRequest) -> list[StackResult]:
    return run_ranks(scoped_model_call, {"fsdp": request.param})


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def under_checkpoint(request: pytest.FixtureRequest) -> list[StackResult]:
    return run_ranks(detach_under_checkpoint, {"fsdp": request.param, "nested": True, "inner_checkpoint": True})


def test_saved_activations_scope_keeps_its_hooks_and_leaves_none(scoped: list[StackResult], rank: int) -> None:
    res = scoped[rank]
    assert res.tracked == res.untracked  # the user's save_on_cpu still ran: same results, bit for bit
    assert res.ours_after_forward == [True, True, True]  # the forward's end left the scope's hooks alone
    assert not res.left_on_stack


def test_detaching_under_checkpointings_hooks_leaves_none_of_ours(under_checkpoint: list[StackResult],
                                                                   rank: int) -> None:
    res = under_checkpoint[rank]
    assert res.disabled  # the injected failure did fire under checkpointing's hooks
    assert res.tracked == res.untracked
    assert not res.left_on_stack
