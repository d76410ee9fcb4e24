"""Optimizer tracking: the torch optimizers behind what the user passes (the optimizer; a wrapper's ``.optimizer``
/ ``._optimizer``, as accelerate's and Lightning's; each of a container's ``.optimizers``, as torchtitan's), and
their state as memory. ``OptimizerWatch`` hooks their step: the optimizer phase for deep mode, new state tensors as
``optimizer_state``, and ``no_state`` (stepped with gradients, no state)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fsdp_mem_otel.schema import OPTIMIZER_STATE
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger
from fsdp_mem_otel.training.light.recorder import StepContext

_OPTIMIZER_STATE = INDEX[OPTIMIZER_STATE]
logger = logging.getLogger(__name__)
_MAX_DEPTH = 8


def unwrap_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` ([] for None); TypeError when there is none."""
    if optimizer is None:
        return []
    found = _unwrap(optimizer, 0)
    if found is None:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a wrapper holding one as .optimizer (accelerate's "
            "AcceleratedOptimizer, Lightning's LightningOptimizer), a container holding them as .optimizers "
            f"(torchtitan's OptimizersContainer), or None; got {type(optimizer).__name__}"
        )
    return list(dict.fromkeys(found))  # each once, in order


def _unwrap(obj: Any, depth: int) -> list[torch.optim.Optimizer] | None:
    if depth > _MAX_DEPTH:
        return None
    inner = getattr(obj, "optimizers", None)
    if isinstance(inner, (list, tuple)) and inner and all(x is not obj for x in inner):
        found: list[torch.optim.Optimizer] = []
        for o in inner:
            got = _unwrap(o, depth + 1)
            if got is None:
                return None
            found.extend(got)
        return found
    if isinstance(obj, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(obj):
        return [obj]
    for name in ("optimizer", "_optimizer"):
        held = getattr(obj, name, None)
        if held is not None and held is not obj:
            return _unwrap(held, depth + 1)
    return None


class OptimizerWatch:
    """Step hooks on each optimizer; their state tensors in the ledger as ``optimizer_state``."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], ledger: Ledger, context: StepContext,
                 on_error: Callable[[BaseException], None]) -> None:
        self.optimizers = optimizers
        self._ledger = ledger
        self._context = context
        self._on_error = on_error
        self._handles: list[Any] = []
        self._known: dict[int, weakref.ref[torch.Tensor]] = {}
        self._seen: list[tuple[int, int]] = []  # per optimizer (id, len) of its state at the last scan
        self._freed_seen = -1  # optimizer_state bytes the ledger had seen freed at the last scan
        #: the optimizers stepped with gradients present and held no state tensor (see step_end)
        self.no_state = False
        self._state_tensors = 0
        self._stepped_with_grads = False
        self._in_hook = False  # one of our step hooks runs
        self._off = False  # detached from inside a hook: the hooks do nothing until removed

    def attach(self) -> None:
        """Account the state there is and hook every optimizer's step (undone by ``detach``)."""
        self.track_state()
        for opt in self.optimizers:
            self._hook(opt)

    def add(self, optimizers: list[torch.optim.Optimizer], attached: bool) -> None:
        """Track ``optimizers`` too (those not tracked yet); hooked at once when ``attached``."""
        new = [o for o in optimizers if all(o is not known for known in self.optimizers)]
        self.optimizers.extend(new)
        if attached and new:
            self.track_state()
            for opt in new:
                self._hook(opt)

    def _hook(self, opt: torch.optim.Optimizer) -> None:
        self._handles.append(opt.register_step_pre_hook(self._on_pre))
        self._handles.append(opt.register_step_post_hook(self._on_post))
        self._handles.append(opt.register_load_state_dict_post_hook(self._state_replaced))

    def detach(self) -> None:
        """Remove the hooks; inside one, only switch them off (removing breaks the step; ``step_end`` does it)."""
        if self._in_hook:
            self._off = True
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self._off = False

    def params(self) -> list[torch.Tensor]:
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    def track_state(self) -> int:
        """Account state tensors not seen before (created once, updated in place); returns how many there are."""
        known, count = self._known, 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        count += 1
                        ref = known.get(id(value))
                        if ref is None or ref() is not value:
                            self._ledger.track(value, OPTIMIZER_STATE)
                            known[id(value)] = weakref.ref(value)
        self._state_tensors = count
        self._seen = [(id(opt.state), len(opt.state)) for opt in self.optimizers]
        self._freed_seen = self._ledger.freed[_OPTIMIZER_STATE]
        return count

    def _state_changed(self) -> bool:
        """Whether a scan could find new state tensors (a state resized or replaced, a tensor freed)."""
        if self._ledger.freed[_OPTIMIZER_STATE] != self._freed_seen:  # read without replaying the step's log
            return True
        seen = self._seen
        if len(seen) != len(self.optimizers):
            return True
        for (state_id, size), opt in zip(seen, self.optimizers, strict=True):
            if id(opt.state) != state_id or len(opt.state) != size:
                return True
        return False

    def _state_replaced(self, *_: Any) -> None:
        self._seen = []  # load_state_dict: scan after the next step
    def step_end(self) -> None:
        """At a step's end: notice (once, logged) an optimizer stepped with gradients and holding no state."""
        if self._off:
            self.detach()
        stepped, self._stepped_with_grads = self._stepped_with_grads, False
        if stepped and self._state_tensors == 0 and not self.no_state:
            self.no_state = True
            logger.warning(
                "fsdp_mem_otel: the optimizer (%s) stepped with gradients present but holds no state, so "
                "optimizer_state reads 0. Right for a stateless optimizer (SGD without momentum); otherwise pass "
                "the optimizer that holds the state (a container's optimizers are found through its .optimizers)",
                ", ".join(type(o).__name__ for o in self.optimizers))

    # -- hooks ---------------------------------------------------------------------------------
    def _on_pre(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._off:
            return None
        self._context.in_optimizer = True
        self._in_hook = True
        try:
            # step(closure): its forward and backward are not optimizer work (``args`` may lead with ``opt``)
            if kwargs.get("closure") is not None:
                return args, {**kwargs, "closure": self._outside_optimizer(kwargs["closure"])}
            first = 1 if args and args[0] is opt else 0
            if len(args) > first and callable(args[first]):
                return (*args[:first], self._outside_optimizer(args[first]), *args[first + 1:]), kwargs
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
        finally:
            self._in_hook = False
        return None

    def _outside_optimizer(self, closure: Any) -> Any:
        context = self._context

        def closure_outside_optimizer(*a: Any, **k: Any) -> Any:
            context.in_optimizer = False
            try:
                return closure(*a, **k)
            finally:
                context.in_optimizer = True

        return closure_outside_optimizer

    def _on_post(self, opt: Any, *_: Any) -> None:
        self._context.in_optimizer = False
        if self._off:
            return
        self._in_hook = True
        try:
            # state tensors are created once and updated in place: scan only when that may have changed
            count = self.track_state() if self._state_changed() else self._state_tensors
            if count == 0 and not self.no_state and not self._stepped_with_grads:
                self._stepped_with_grads = _has_grads(opt)
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
        finally:
            self._in_hook = False


def _has_grads(opt: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for g in opt.param_groups for p in g["params"])
