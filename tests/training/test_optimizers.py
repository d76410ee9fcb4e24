"""Optimizer tracking driven directly on plain torch optimizers, without FSDP or ranks.

Oracle: numel x element size of the optimizers' own state tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepContext
from fsdp_mem_otel.training.optimizers import OptimizerWatch, unwrap_optimizers


def _state_bytes(*opts: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for o in opts for s in o.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class _Wrapper:  # accelerate's AcceleratedOptimizer holds it as .optimizer
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


class _Container(torch.optim.Optimizer):  # torchtitan's OptimizersContainer keeps them in .optimizers
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.optimizers = [torch.optim.Adam(params[:1]), torch.optim.SGD(params[1:], lr=0.1, momentum=0.9)]
        super().__init__(params, {})

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()


def _train(model: nn.Module, opt: object) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # type: ignore[attr-defined]


def test_wrappers_and_containers_are_unwrapped() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    adam = torch.optim.Adam(model.parameters())
    assert unwrap_optimizers(_Wrapper(_Wrapper(adam))) == [adam]
    container = _Container(list(model.parameters()))
    assert unwrap_optimizers(container) == container.optimizers
    assert unwrap_optimizers(None) == []
    with pytest.raises(TypeError, match="optimizer must be"):
        unwrap_optimizers(object())


def test_state_of_every_inner_optimizer_is_accounted_and_scanned_only_on_change() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    container = _Container(list(model.parameters()))
    ledger = Ledger()
    watch = OptimizerWatch(unwrap_optimizers(container), ledger, StepContext(), lambda exc: pytest.fail(str(exc)))
    watch.attach()
    scans = 0
    scan = watch.track_state

    def counted() -> int:
        nonlocal scans
        scans += 1
        return scan()

    watch.track_state = counted  # type: ignore[method-assign]
    for _ in range(3):
        _train(model, container)
        watch.step_end()
    assert ledger.current["cpu"]["optimizer_state"] == _state_bytes(*container.optimizers) > 0
    assert scans == 2  # state created by each optimizer's first step; unchanged afterwards
    assert not watch.no_state
    container.optimizers[0].load_state_dict(container.optimizers[0].state_dict())  # new state tensors
    _train(model, container)
    assert ledger.current["cpu"]["optimizer_state"] == _state_bytes(*container.optimizers)
    watch.detach()


def test_an_optimizer_without_state_is_noticed() -> None:
    model = nn.Linear(8, 8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state
    watch = OptimizerWatch([sgd], Ledger(), StepContext(), lambda exc: pytest.fail(str(exc)))
    watch.attach()
    watch.step_end()
    assert not watch.no_state  # it has not stepped yet
    _train(model, sgd)
    watch.step_end()
    assert watch.no_state


def test_a_closure_runs_outside_the_optimizer_phase() -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    context = StepContext()
    watch = OptimizerWatch([opt], Ledger(), context, lambda exc: pytest.fail(str(exc)))
    watch.attach()
    phases: list[bool] = []

    def closure() -> torch.Tensor:
        phases.append(context.in_optimizer)
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert phases == [False] and not context.in_optimizer


def test_detaching_from_inside_a_step_hook_leaves_the_step_whole() -> None:
    """The tracker detaches itself when its error limit is reached, which can happen inside its
    optimizer hook: the optimizer iterates its hooks then, so removing one there raised
    ``OrderedDict mutated during iteration`` out of ``optimizer.step()``. Now the hooks switch
    off there and are removed at the step's end."""
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    ledger = Ledger()
    watch: OptimizerWatch

    def broken(*_: object) -> None:
        raise RuntimeError("broken")

    errors: list[BaseException] = []

    def on_error(exc: BaseException) -> None:
        errors.append(exc)
        watch.detach()  # what the error policy does at its limit

    watch = OptimizerWatch([opt], ledger, StepContext(), on_error)
    watch.attach()
    users = opt.register_step_post_hook(lambda *_: None)  # a hook after ours: iteration goes on
    ledger.track = broken  # type: ignore[method-assign]  # the state scan's first tracking fails
    _train(model, opt)  # raised before
    assert len(errors) == 1 and len(opt._optimizer_step_post_hooks) == 2
    _train(model, opt)  # switched off: no second failure
    assert len(errors) == 1
    watch.step_end()
    assert not opt._optimizer_step_pre_hooks and list(opt._optimizer_step_post_hooks) == [users.id]
