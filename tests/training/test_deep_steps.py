"""Deep-mode control driven directly, without FSDP or ranks: which steps go deep and when."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fsdp_mem_otel.config import TrackerConfig
from fsdp_mem_otel.schema import DEEP, DEEP_SKIPPED_COMPILED, LIGHT
from fsdp_mem_otel.training.deep import DeepMode
from fsdp_mem_otel.training.deep_steps import DeepSteps
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepContext, StepRecorder
from fsdp_mem_otel.training.light.sink import Sink


class _Adapter:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def use_tensors(self, on: bool) -> None:
        self.calls.append(on)


def _steps(model: nn.Module, **config: object) -> tuple[DeepSteps, Sink, _Adapter, list[BaseException]]:
    ledger = Ledger()
    errors: list[BaseException] = []
    sink = Sink(ledger, StepRecorder(ledger), errors.append)
    sink.active = True
    adapter = _Adapter()
    return DeepSteps(TrackerConfig(**config), model, ledger, StepContext(), sink, adapter, errors.append), \
        sink, adapter, errors


def test_a_deep_step_goes_deep_at_its_first_forward_and_back_at_its_end() -> None:
    deep, sink, adapter, errors = _steps(nn.Linear(2, 2), deep_every=2)
    deep.begin(1)
    assert not sink.forward_pending and deep.step_mode == LIGHT
    deep.begin(2)
    assert sink.forward_pending and not deep.active  # armed, not on: no caller has run yet
    sink.on_state("<root>", "before_pre_forward")
    assert deep.active and isinstance(_get_current_dispatch_mode(), DeepMode) and deep.step_mode == DEEP
    kept = torch.ones(3) * 2  # an op under the dispatch mode: accounted (12 bytes at least)
    assert sink.ledger.current["cpu"]["total"] >= kept.numel() * 4
    deep.end()
    assert not deep.active and _get_current_dispatch_mode() is None
    assert adapter.calls == [True, False] and errors == []


def test_a_deep_step_that_fails_half_way_in_goes_back_to_light_entirely() -> None:
    # The adapter fails to switch to per-tensor accounting after the dispatch mode was entered:
    # nothing of the deep step may stay (the mode on the thread, integer offers off, the sink deep).
    deep, sink, adapter, errors = _steps(nn.Linear(2, 2), deep_every=2)

    def failing(on: bool) -> None:
        adapter.calls.append(on)
        if on:
            raise RuntimeError("use_tensors failed")

    adapter.use_tensors = failing  # type: ignore[method-assign]
    deep.begin(2)
    sink.on_state("<root>", "before_pre_forward")
    assert [str(e) for e in errors] == ["use_tensors failed"]
    assert _get_current_dispatch_mode() is None and not deep.active and deep.step_mode == LIGHT
    assert sink.ledger.offer_on_add and not sink.deep and sink.ledger.pending is not None
    assert adapter.calls == [True, False]  # what it switched before failing is switched back
    sink.on_state("<root>", "after_pre_forward", ((torch.ones(2),), {}))  # its inputs decide: it learns
    assert sink.activations.active  # the forward goes on as a light one: saved tensors counted
    deep.end()  # the step's end: nothing left to undo
    sink.end_step()
    assert adapter.calls == [True, False] and len(errors) == 1
    adapter.use_tensors = lambda on: adapter.calls.append(on)  # type: ignore[method-assign]
    deep.begin(4)  # the next deep step goes deep as usual
    sink.on_state("<root>", "before_pre_forward")
    assert deep.active and isinstance(_get_current_dispatch_mode(), DeepMode)
    deep.end()
    sink.end_step()
    assert _get_current_dispatch_mode() is None and len(errors) == 1


def test_a_compiled_caller_keeps_the_step_light_and_says_why() -> None:
    model = nn.Linear(2, 2)
    deep, sink, adapter, _ = _steps(model, mode="deep")

    def forward_under_compile(x: torch.Tensor) -> torch.Tensor:
        sink.on_state("<root>", "before_pre_forward")  # as the model's hook would run
        return x + 1

    deep.begin(1)
    torch.compile(forward_under_compile, backend="eager")(torch.ones(2))
    assert (deep.step_mode, deep.skipped, deep.skipped_total) == (LIGHT, DEEP_SKIPPED_COMPILED, {"compiled": 1})
    assert not deep.active and adapter.calls == []
    deep.end()
    deep.begin(2)  # known now: skipped before any forward
    assert not sink.forward_pending and deep.skipped == DEEP_SKIPPED_COMPILED
    sink.end_step()  # as step() does: the light step's saved-tensor hooks, pushed at its first state, go
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_compiled_regions_skip_or_run_eagerly_on_request() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].compile(backend="eager")
    deep, sink, _, _ = _steps(model, mode="deep")
    deep.begin(1)
    assert deep.skipped == DEEP_SKIPPED_COMPILED and not deep.active
    eager, _, adapter, errors = _steps(model, mode="deep", deep_when_compiled="eager")
    eager.begin(1)  # the whole step, from its start
    assert eager.active and eager.step_mode == DEEP
    eager.end()
    assert adapter.calls == [True, False] and errors == []


def test_steps_not_allowed_stay_light() -> None:
    deep, sink, _, _ = _steps(nn.Linear(2, 2), mode="deep")
    deep.begin(1, allowed=False)  # a tracker that disabled itself
    assert not sink.forward_pending and deep.step_mode == LIGHT
