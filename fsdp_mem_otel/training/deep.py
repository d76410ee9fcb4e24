"""Deep mode: per-op accounting through a TorchDispatchMode, during deep steps only. Every op's outputs count under
the step's category (optimizer state in ``optimizer.step``, temp in backward outside AC recompute, else activation)
and collectives relabel their buffers, as upstream ``FSDPMemTracker``, but O(1) per op. A buffer a collective's
backend allocates itself (gloo's reduce-scatter clones its input), freed by a worker thread whenever, ends when
FSDP's post-backward returns (``release_backend_buffers``): peaks do not depend on thread timing."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_mem_otel.schema import ACTIVATION, ALL_GATHER, OPTIMIZER_STATE, REDUCE_SCATTER, TEMP
from fsdp_mem_otel.training.light.recorder import POST_BACKWARD, PRE_BACKWARD, PRE_FORWARD, StepContext

if TYPE_CHECKING:
    from fsdp_mem_otel.training.light.ledger import Ledger

logger = logging.getLogger(__name__)
_ALL_GATHER_OPS = frozenset({torch.ops.c10d._allgather_base_.default})
_REDUCE_SCATTER_OPS = frozenset({torch.ops.c10d._reduce_scatter_base_.default})
_GATHER_PHASES = frozenset({PRE_FORWARD, PRE_BACKWARD})
_GUESSES = frozenset({ACTIVATION, TEMP})
_in_backward = torch._C._current_graph_task_id


class DeepMode(TorchDispatchMode):
    """Accounts every op's output storages in ``ledger`` as ``context`` says; failures go to ``on_error``."""

    def __init__(self, ledger: Ledger, context: StepContext, on_error: Callable[[BaseException], None]) -> None:
        super().__init__()
        self._ledger = ledger
        self._context = context
        self._on_error = on_error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if DTensor in types:
            return NotImplemented  # let DTensor desugar to local ops, which come back here
        res = func(*args, **(kwargs or {}))
        ctx = self._context
        try:
            ledger = self._ledger
            if ctx.in_optimizer:
                category = OPTIMIZER_STATE
            elif _in_backward() != -1 and not ctx.in_ac_recompute:
                category = TEMP
            else:
                category = ACTIVATION
            if func in _ALL_GATHER_OPS:
                if ctx.phase in _GATHER_PHASES:
                    ledger.relabel_guess(args[0], ALL_GATHER, _GUESSES)
            elif func in _REDUCE_SCATTER_OPS:
                if ctx.phase == POST_BACKWARD:
                    ledger.relabel_guess(args[1], REDUCE_SCATTER, _GUESSES)
                    if ctx.backend_buffers is None:
                        ctx.backend_buffers = []
            elif ctx.backend_buffers is not None and func.is_view:
                _note_unseen(ledger, res, ctx.backend_buffers)
            _track_outputs(ledger, res, category)
            ledger.offer_current()
        except Exception as exc:  # noqa: BLE001 - never break training
            self._on_error(exc)
        return res


def _track_outputs(ledger: Ledger, res: Any, category: str) -> None:
    if isinstance(res, torch.Tensor):
        if not isinstance(res, FakeTensor) or res.fake_mode is ledger.fake_mode:
            ledger.track(res, category, recategorize=False)
    elif isinstance(res, (tuple, list)):
        for r in res:
            _track_outputs(ledger, r, category)


def _note_unseen(ledger: Ledger, res: Any, found: list[weakref.ref[torch.UntypedStorage]]) -> None:
    """Weak references to the storages of ``res`` (a view op's outputs) the ledger has never seen."""
    for t in res if isinstance(res, (tuple, list)) else (res,):
        if type(t) is torch.Tensor and t.layout is torch.strided:
            st = t.untyped_storage()
            if not ledger.knows(st) and all(r() is not st for r in found):
                found.append(weakref.ref(st))


def release_backend_buffers(ledger: Ledger, context: StepContext) -> None:
    """FSDP's post-backward returned: its reduce-scatter's backend buffers leave the accounts, freed or not."""
    found, context.backend_buffers = context.backend_buffers, None
    for ref in found or ():
        st = ref()
        if st is not None:
            ledger.forget(st)


class _ResizeWatch:
    """One process-wide ``UntypedStorage.resize_`` wrapper (FSDP frees with it, outside the dispatcher)."""

    def __init__(self) -> None:
        self._ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()
        self._orig: Any = None
        self._wrapper: Any = None

    def add(self, ledger: Ledger) -> None:
        self._ledgers.add(ledger)
        if self._wrapper is None:
            orig = torch.UntypedStorage.resize_
            ledgers = self._ledgers

            def resize_(st: torch.UntypedStorage, size: int) -> Any:
                out = orig(st, size)
                for lg in list(ledgers):
                    try:
                        lg.refresh_storage(st)
                    except Exception:  # noqa: BLE001 - never break the caller's resize
                        logger.debug("fsdp_mem_otel: resize accounting failed", exc_info=True)
                return out

            self._orig, self._wrapper = orig, resize_
            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]

    def discard(self, ledger: Ledger) -> None:
        self._ledgers.discard(ledger)
        if not self._ledgers and self._wrapper is not None:
            if torch.UntypedStorage.resize_ is self._wrapper:
                torch.UntypedStorage.resize_ = self._orig  # type: ignore[method-assign]
            self._orig = self._wrapper = None

    @property
    def installed(self) -> bool:
        return self._wrapper is not None


RESIZE_WATCH = _ResizeWatch()
