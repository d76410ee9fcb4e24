"""Adapter for FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``).

Tested on torch 2.13.0 and 2.14.1, the package's range (CI runs the FSDP tests on both; the
runtime functions patched exist in both under the same names) (CPU, gloo, 2 ranks) with
``use_orig_params`` True and False, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, bf16 param mixed
precision, and activation checkpointing applied inside and outside the FSDP wrappers.

Hook points:

* Forward: forward pre-hooks and forward hooks on each FSDP wrapper (outside
  ``FullyShardedDataParallel.forward``, i.e. around ``_root_pre_forward``/``_pre_forward`` and
  ``_post_forward``) and on its ``_fsdp_wrapped_module`` (inside). FSDP itself is not patched.
  Forward hooks use ``always_call`` so an aborted forward (non-reentrant checkpoint stops its
  recompute early by raising) still closes its states.
* Backward: one process-wide patch of module globals in ``torch.distributed.fsdp._runtime_utils``,
  shared by all attached adapters and passing straight through for FSDP states no adapter owns.
  FSDP looks these names up at call time: ``_pre_backward_hook`` (bound each forward by
  ``_register_pre_backward_hooks``), ``_post_backward_hook`` and
  ``_post_backward_reshard_only_hook`` (bound each forward while ``_post_backward_hook_state`` is
  unset, which ``_finalize_params`` ensures every iteration), ``_post_backward_final_callback``
  (queued each backward), and ``_unshard``/``_reshard`` (forward, backward and prefetch paths;
  prefetching unshards *another* module's flat parameter). A patch installed mid-iteration takes
  effect from the next forward. ``summon_full_params`` binds its own ``_unshard`` and is not seen.

What each category means for FSDP1, as reported here:

* ``sharded_param``: each ``FlatParameter``'s local shard (``_local_shard``, padded; the pinned CPU
  copy under CPU offload), plus any parameter FSDP does not manage (ignored modules).
* ``unsharded_param``: the padded unsharded flat parameter ``_full_param_padded`` (low precision
  under param mixed precision; ``_full_prec_full_param_padded`` when full precision is forced).
  ``use_orig_params`` views share its storage. With NO_SHARD the flat parameter is never
  gathered, so this is 0 except for the low-precision compute copy ``_mp_shard`` under mixed
  precision.
* ``all_gather``: always 0 from this adapter. FSDP1 all-gathers straight into
  ``_full_param_padded``, so the gathered bytes are reported as ``unsharded_param``. (Under mixed
  precision the all-gather input ``_mp_shard`` lives only inside ``_unshard`` and is not reported.)
* ``unsharded_grad``: the flat parameter's ``.grad`` as autograd produced it (unpadded, unsharded),
  taken at ``before_post_backward``; also a ``.grad`` accumulated unsharded under ``no_sync()``.
* ``reduce_scatter``: not reported. Its input is the unsharded grad itself, or an ``F.pad`` copy
  when the numel does not divide by the world size (deep mode only); its output becomes the
  sharded grad.
* ``sharded_grad``: ``_saved_grad_shard`` (sharded strategies; moved to ``.grad`` by the
  post-backward final callback), ``.grad`` (NO_SHARD) or ``_cpu_grad`` (CPU offload); the grads
  of parameters FSDP does not manage (``ignored_modules``) when autograd accumulates them.
* ``buffer``: every buffer of the model (re-tracked after the root's pre-forward, where lazy init
  and mixed precision may replace buffer storages).

A module without a flat parameter (e.g. a root whose parameters all live in children) gets
``before_post_backward``/``after_post_backward`` around the post-backward final callback, as do
modules whose post-backward hook did not run; FSDP reshards those there (``_catch_all_reshard``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed.fsdp._runtime_utils as _ru
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.hooks import RemovableHandle

from fsdp_mem_otel.schema import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    BUFFER,
    SHARDED_GRAD,
    SHARDED_PARAM,
    UNSHARDED_GRAD,
    UNSHARDED_PARAM,
)
from fsdp_mem_otel.training.adapters.base import EventSink, fsdp_module_keys
from fsdp_mem_otel.training.compile_support import dynamo_safe

# Attributes of a FlatParameter that hold unsharded parameter data while unsharded.
_UNSHARDED_ATTRS = ("_full_param_padded", "_full_prec_full_param_padded")


class _RuntimeFns(NamedTuple):
    """The patched ``_runtime_utils`` globals (attribute name = ``"_" + field``)."""

    pre_backward_hook: Callable[..., Any]
    post_backward_hook: Callable[..., Any]
    post_backward_reshard_only_hook: Callable[..., Any]
    post_backward_final_callback: Callable[..., Any]
    unshard: Callable[..., Any]
    reshard: Callable[..., Any]


_LOCK = threading.Lock()
_OWNERS: dict[Any, list[FSDP1Adapter]] = {}  # FSDP state (the FSDP module) -> adapters tracking it
_ATTACHED: set[FSDP1Adapter] = set()
_PATCH: tuple[_RuntimeFns, _RuntimeFns] | None = None  # (originals, wrappers) while installed


def _make_wrappers(orig: _RuntimeFns) -> _RuntimeFns:
    """Wrappers around ``orig`` that dispatch to the adapter owning the FSDP state, if any.

    Each wrapper closes over ``orig``, so hooks FSDP bound while patched keep working after the
    patch is removed. Adapter methods never raise; FSDP's own exceptions pass through unchanged.
    """

    def pre_backward_hook(state: Any, module: Any, handle: Any, *args: Any) -> Any:
        emitted = [a for a in _OWNERS.get(state, ()) if a._pre_backward_begin(state, handle)]
        out = orig.pre_backward_hook(state, module, handle, *args)
        for a in reversed(emitted):
            a._pre_backward_end(state, handle)
        return out

    def _post(fn: Callable[..., Any]) -> Callable[..., Any]:
        def post_backward(state: Any, handle: Any, *args: Any) -> Any:
            adapters = list(_OWNERS.get(state, ()))
            for a in adapters:
                a._post_backward_begin(state, handle)
            out = fn(state, handle, *args)
            for a in reversed(adapters):
                a._post_backward_end(state, handle)
            return out

        return post_backward

    def post_backward_final_callback(state: Any, module: Any) -> Any:
        groups: dict[FSDP1Adapter, list[Any]] = {}
        for s in getattr(state, "_all_fsdp_states", None) or [state]:
            for adapter in _OWNERS.get(s, ()):
                groups.setdefault(adapter, []).append(s)
        begun = [(a, a._final_begin(states), states) for a, states in groups.items()]
        out = orig.post_backward_final_callback(state, module)
        for a, pending, states in reversed(begun):
            a._final_end(pending, states)
        return out

    def unshard(state: Any, handle: Any, *args: Any) -> Any:
        out = orig.unshard(state, handle, *args)
        for adapter in _OWNERS.get(state, ()):  # ``handle`` may be another module's (prefetch)
            adapter._track_unsharded(handle)
        return out

    def reshard(state: Any, handle: Any, *args: Any) -> Any:
        out = orig.reshard(state, handle, *args)
        for adapter in _OWNERS.get(state, ()):
            adapter._refresh_unsharded(handle)
        return out

    return _RuntimeFns(
        pre_backward_hook=dynamo_safe(pre_backward_hook),
        post_backward_hook=dynamo_safe(_post(orig.post_backward_hook)),
        post_backward_reshard_only_hook=dynamo_safe(_post(orig.post_backward_reshard_only_hook)),
        post_backward_final_callback=dynamo_safe(post_backward_final_callback),
        unshard=dynamo_safe(unshard),
        reshard=dynamo_safe(reshard),
    )


def _install() -> None:
    global _PATCH
    if _PATCH is not None:
        return
    originals = _RuntimeFns(*(getattr(_ru, "_" + f) for f in _RuntimeFns._fields))
    wrappers = _make_wrappers(originals)
    for f in _RuntimeFns._fields:
        setattr(_ru, "_" + f, getattr(wrappers, f))
    _PATCH = (originals, wrappers)


def _uninstall() -> None:
    global _PATCH
    if _PATCH is None:
        return
    originals, wrappers = _PATCH
    for f in _RuntimeFns._fields:
        if getattr(_ru, "_" + f) is getattr(wrappers, f):  # leave a later patch on top alone
            setattr(_ru, "_" + f, getattr(originals, f))
    _PATCH = None


class FSDP1Adapter:
    """Turns FSDP1 hook points of ``model`` into sink states and categorized tensors."""

    fsdp_version = 1

    def __init__(self, model: nn.Module, sink: EventSink) -> None:
        """``model`` holds ``FullyShardedDataParallel`` modules (usually it is the FSDP root)."""
        self._model = model
        self._sink = sink
        self._keys: dict[Any, str] = {}
        self._hooks: list[RemovableHandle] = []
        self._pre_bw_seen: set[Any] = set()  # modules without a handle that ran pre-backward
        self._pending_post_bw: dict[Any, None] = {}  # ran pre-backward, not post-backward yet
        self._attached = False
        self._scan()

    def _scan(self) -> None:
        self._keys = {m: key for key, m in fsdp_module_keys(self._model, FSDP)}

    # -- Adapter protocol ---------------------------------------------------------------------
    def attach(self) -> None:
        """Register forward hooks on every FSDP module and join the process-wide backward patch;
        on failure, undo what was installed and re-raise."""
        if self._attached:
            return
        self._scan()
        self._attached = True  # from here on, detach() undoes whatever got installed
        try:
            hooks = self._hooks  # one at a time: a failing registration leaves the others removable
            for m in self._keys:
                inner = m._fsdp_wrapped_module
                hooks.append(m.register_forward_pre_hook(self._fwd_hook(m, BEFORE_PRE_FORWARD), prepend=True))
                hooks.append(inner.register_forward_pre_hook(self._fwd_hook(m, AFTER_PRE_FORWARD), with_kwargs=True))
                hooks.append(inner.register_forward_hook(
                    self._fwd_hook(m, BEFORE_POST_FORWARD), prepend=True, always_call=True))
                hooks.append(m.register_forward_hook(self._fwd_hook(m, AFTER_POST_FORWARD), always_call=True))
            for p in self._unmanaged_params():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(dynamo_safe(self._on_grad)))
            with _LOCK:
                _ATTACHED.add(self)
                for m in self._keys:
                    _OWNERS.setdefault(m, []).append(self)
                _install()
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Remove every hook; restore the patched globals when the last adapter detaches."""
        if not self._attached:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with _LOCK:
            for m in self._keys:
                owners = _OWNERS.get(m, [])
                if self in owners:
                    owners.remove(self)
                if not owners:
                    _OWNERS.pop(m, None)
            _ATTACHED.discard(self)
            if not _ATTACHED:
                _uninstall()
        self._pre_bw_seen.clear()
        self._pending_post_bw.clear()
        self._attached = False

    def module_keys(self) -> list[str]:
        """Keys of the FSDP modules, in named_modules() order."""
        return list(self._keys.values())

    def persistent_tensors(self) -> Iterator[tuple[torch.Tensor, str]]:
        """Local flat-param shards, existing grads, unmanaged params and all buffers."""
        for m in self._keys:
            handle = m._handle
            if handle is not None:
                fp = handle.flat_param
                yield getattr(fp, "_local_shard", fp), SHARDED_PARAM
                yield from _flat_grads(fp)
        for p in self._unmanaged_params():
            yield p, SHARDED_PARAM
            if p.grad is not None:
                yield p.grad, SHARDED_GRAD
        for b in self._model.buffers():
            yield b, BUFFER

    # FSDP1 accounts per FlatParameter handle (one per group) in every mode
    fallback_groups = 0

    def start(self) -> None:
        return None

    def use_tensors(self, on: bool) -> None:
        return None

    def reconcile(self) -> None:
        return None

    def shards_nothing(self) -> bool:
        handles = [m._handle for m in self._keys if m._handle is not None]
        return bool(handles) and all(
            not h.uses_sharded_strategy or h.process_group.size() == 1 for h in handles)

    def _unmanaged_params(self) -> list[nn.Parameter]:
        """Parameters no FSDP module manages (those of ``ignored_modules``)."""
        managed: set[int] = set()
        for m in self._keys:
            handle = m._handle
            if handle is not None:
                fp = handle.flat_param
                managed.add(id(fp))
                for attr in ("_params", "_shared_params"):  # use_orig_params: views into fp
                    managed.update(id(p) for p in getattr(fp, attr, None) or ())
        return [p for p in self._model.parameters() if id(p) not in managed]

    def _on_grad(self, param: torch.Tensor) -> None:
        try:
            self._sink.track(param.grad, SHARDED_GRAD)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    # -- forward ------------------------------------------------------------------------------
    def _fwd_hook(self, state: Any, which: str) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            tensors = None
            if which == AFTER_PRE_FORWARD:
                self._track_unsharded(state._handle)
                if getattr(state, "_is_root", False):  # lazy init / mixed precision re-cast them
                    self._track_buffers()
                tensors = args[1:3]  # positional and keyword inputs, as FSDP's pre-forward left them
            elif which == AFTER_POST_FORWARD:
                self._refresh_unsharded(state._handle)
                tensors = args[2]  # the outputs
            elif which == BEFORE_POST_FORWARD:
                tensors = args[2]
            self._on_state(state, which, tensors)

        return dynamo_safe(hook)

    # -- backward (called from the process-wide wrappers; none of these raise) ----------------
    def _pre_backward_begin(self, state: Any, handle: Any) -> bool:
        """Emit before_pre_backward if FSDP's hook will do real work; say whether it did."""
        if handle is not None:
            if getattr(handle, "_ran_pre_backward_hook", False):  # FSDP returns early
                return False
        elif state in self._pre_bw_seen:  # no handle: FSDP runs it per output tensor
            return False
        else:
            self._pre_bw_seen.add(state)
        self._pending_post_bw[state] = None
        self._on_state(state, BEFORE_PRE_BACKWARD)
        return True

    def _pre_backward_end(self, state: Any, handle: Any) -> None:
        self._track_unsharded(handle)
        self._on_state(state, AFTER_PRE_BACKWARD)

    def _post_backward_begin(self, state: Any, handle: Any) -> None:
        self._pending_post_bw.pop(state, None)
        self._track_grads(handle, unsharded=True)
        self._on_state(state, BEFORE_POST_BACKWARD)

    def _post_backward_end(self, state: Any, handle: Any) -> None:
        self._refresh_unsharded(handle)
        self._track_grads(handle)
        self._on_state(state, AFTER_POST_BACKWARD)

    def _final_begin(self, states: list[Any]) -> list[Any]:
        """Before the final callback: open post-backward for modules whose hook never ran."""
        pending = [s for s in states if s in self._pending_post_bw]
        for s in pending:
            self._on_state(s, BEFORE_POST_BACKWARD)
        return pending

    def _final_end(self, pending: list[Any], states: list[Any]) -> None:
        """After the final callback (catch-all reshard, grads moved to ``.grad``)."""
        for s in reversed(pending):
            self._refresh_unsharded(s._handle)
            self._track_grads(s._handle)
            self._on_state(s, AFTER_POST_BACKWARD)
        for s in states:
            self._pending_post_bw.pop(s, None)
            self._pre_bw_seen.discard(s)

    # -- sink calls, each guarded so our errors never reach FSDP ------------------------------
    def _on_state(self, state: Any, which: str, tensors: object = None) -> None:
        try:
            self._sink.on_state(self._keys[state], which, tensors)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    def _track_buffers(self) -> None:
        try:
            for b in self._model.buffers():
                self._sink.track(b, BUFFER)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    def _track_grads(self, handle: Any, unsharded: bool = False) -> None:
        """The flat param's grads: as autograd left it (``unsharded``), or as FSDP keeps them."""
        try:
            if handle is None:
                return
            fp = handle.flat_param
            if unsharded:
                if fp.grad is not None:
                    self._sink.track(fp.grad, UNSHARDED_GRAD)
                return
            for t, category in _flat_grads(fp):
                self._sink.track(t, category)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    # -- tensor bookkeeping -------------------------------------------------------------------
    def _track_unsharded(self, handle: Any) -> None:
        try:
            if handle is None:
                return
            fp = handle.flat_param
            for name in _UNSHARDED_ATTRS:
                t = getattr(fp, name, None)
                if t is not None:
                    self._sink.track(t, UNSHARDED_PARAM)
            mp = getattr(fp, "_mp_shard", None)
            if mp is not None:
                if handle.uses_sharded_strategy:  # all-gather input, freed by post_unshard
                    self._sink.refresh(mp)
                else:  # NO_SHARD: the low-precision copy is the compute parameter
                    self._sink.track(mp, UNSHARDED_PARAM)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    def _refresh_unsharded(self, handle: Any) -> None:
        try:
            if handle is None:
                return
            fp = handle.flat_param
            for name in (*_UNSHARDED_ATTRS, "_mp_shard"):
                t = getattr(fp, name, None)
                if t is not None:
                    self._sink.refresh(t)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._report(exc)

    def _report(self, exc: BaseException) -> None:
        report = getattr(self._sink, "report_error", None)
        if report is not None:
            report(exc)


def _flat_grads(fp: Any) -> Iterable[tuple[torch.Tensor, str]]:
    """Gradients a FlatParameter holds now, categorized (see the module docstring)."""
    for name in ("_cpu_grad", "_saved_grad_shard"):
        g = getattr(fp, name, None)
        if g is not None:
            yield g, SHARDED_GRAD
    g = fp.grad
    if g is not None:
        shard = getattr(fp, "_local_shard", fp)
        yield g, SHARDED_GRAD if g.numel() == shard.numel() else UNSHARDED_GRAD
