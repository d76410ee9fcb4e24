"""What real training stacks do to the tracker, on 2 real ranks (FSDP1 and FSDP2): an attach that
fails half-way, optimizer wrappers, ``optimizer.step(closure)`` as Lightning calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, fsdp_fingerprint, settle


@dataclass
class RollbackResult:
    before: dict[str, Any]
    after: dict[str, Any]  # one fingerprint per injected failure
    attached: list[bool]
    errors: list[int]
    losses_untracked: list[float]
    losses_after_failed_attach: list[float]


class _Injected(RuntimeError):
    pass


def attach_rollback(fsdp: int) -> RollbackResult:
    """Make attach() fail at two points, half-way through the adapter and after it (the
    optimizer hooks); every hook and attribute must be as before, training unchanged."""
    rank = torch.distributed.get_rank()
    losses: dict[str, list[float]] = {}
    after, attached, errors = [], [], []
    before: dict[str, Any] = {}
    for run in ("untracked", "tracked"):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=fsdp))
        train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))  # lazy init done
        if run == "tracked":
            before = fsdp_fingerprint(model, opt)
            for point in ("adapter", "optimizer"):
                tracker = FSDPMemoryTracker(model, opt)
                if point == "adapter":  # the third FSDP module refuses its forward hook
                    victim = [m for m in model.modules() if hasattr(m, "_fsdp_wrapped_module")
                              or type(m).__name__.startswith("FSDP")][2]
                    victim.register_forward_hook = _raise  # type: ignore[method-assign]
                else:
                    opt.register_step_post_hook = _raise  # type: ignore[method-assign]
                tracker.attach()  # must not raise
                attached.append(tracker.attached)
                errors.append(tracker.errors_total)
                del (victim if point == "adapter" else opt).__dict__["register_forward_hook" if point == "adapter"
                                                                     else "register_step_post_hook"]
                after.append(fsdp_fingerprint(model, opt))
        losses[run] = [train_step(model, opt, make_batch(step, BATCH, WIDTH, rank)) for step in range(1, 4)]
    return RollbackResult(before, {"adapter": after[0], "optimizer": after[1]}, attached, errors,
                          losses["untracked"], losses["tracked"])


def _raise(*_: Any, **__: Any) -> Any:
    raise _Injected("injected attach failure")


@pytest.mark.parametrize("fsdp", [1, 2])
def test_failed_attach_is_rolled_back(fsdp: int) -> None:
    for res in run_ranks(attach_rollback, fsdp):
        assert res.attached == [False, False]
        assert res.errors == [1, 1]  # contained: logged and counted, not raised
        assert res.after["adapter"] == res.before
        assert res.after["optimizer"] == res.before
        assert res.losses_after_failed_attach == res.losses_untracked


@dataclass
class ClosureResult:
    plain: dict[str, Any]
    closure: dict[str, Any]
    errors: int


def closure_step(fsdp: int, mode: str) -> ClosureResult:
    """One training step of two identical models with identical histories, measured by a
    tracker each: as a plain loop, and through ``optimizer.step(closure)`` (Lightning's way)."""
    rank = torch.distributed.get_rank()
    reports = {}
    errors = 0
    for variant in ("plain", "closure"):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=fsdp))
        train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))  # optimizer state exists from here on
        x = make_batch(1, BATCH, WIDTH, rank)

        def closure() -> torch.Tensor:  # train_step's ops, in train_step's order
            opt.zero_grad(set_to_none=True)  # noqa: B023 - runs inside this iteration
            (chunk,) = x.chunk(1)  # noqa: B023
            loss = model(chunk).pow(2).mean()  # noqa: B023
            loss.backward()
            return loss

        with FSDPMemoryTracker(model, opt, mode=mode) as tracker:
            settle()
            if variant == "plain":
                train_step(model, opt, x)
            else:
                opt.step(closure)
            reports[variant] = tracker.step().to_dict()
        errors += tracker.errors_total
    return ClosureResult(reports["plain"], reports["closure"], errors)


@pytest.mark.parametrize("mode", ["light", "deep"])
@pytest.mark.parametrize("fsdp", [1, 2])
def test_closure_step_is_labelled_like_the_plain_loop(fsdp: int, mode: str) -> None:
    for res in run_ranks(closure_step, fsdp, mode):
        assert res.errors == 0
        plain, closure = res.plain, res.closure
        # the oracle: the plain loop's breakdown of the same step. The step peak's instant may
        # move with gloo's asynchronous frees (on a loaded CI machine by 8.5% of the total once,
        # a collective's buffers still alive or not), so totals agree within 10%, the optimizer
        # state (what a closure mislabels: +65% before the fix) within 1%; the exact checks are at
        # the module states below.
        ours, theirs = closure["peak"]["cpu"], plain["peak"]["cpu"]
        assert abs(ours["total"] - theirs["total"]) <= 0.10 * theirs["total"]
        assert abs(ours["optimizer_state"] - theirs["optimizer_state"]) <= 0.01 * theirs["optimizer_state"]
        # at every state of every module, what the closure could mislabel is labelled alike
        # (temporaries freed by gloo's asynchronous collectives may differ between two runs)
        for key, mod in plain["modules"].items():
            for state, calls in mod["snapshots"].items():
                if state.startswith("peak_"):  # a window's peak instant may move like the step's
                    continue
                for ours, theirs in zip(closure["modules"][key]["snapshots"][state], calls, strict=True):
                    for cat in ("activation", "optimizer_state", "inputs", "sharded_param"):
                        assert ours["cpu"][cat] == theirs["cpu"][cat], (key, state, cat)
