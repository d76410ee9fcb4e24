"""FSDP2 (``torch.distributed.fsdp.fully_shard``) adapter.

Versions: CI runs the FSDP tests on torch 2.13.0 and 2.14.1, the package's range. The FSDP2 sources
of 2.13 and 2.14 differ (dtype handling of groups without trainable parameters, the forward unshard
path), but every name read below exists in both. The private
names it depends on are ``FSDPParamGroup.pre_backward/post_backward/unshard/wait_for_unshard/
reshard``, ``FSDPParam.sharded_param/_unsharded_param/all_gather_outputs/
_sharded_post_forward_param_data/unsharded_accumulated_grad``, ``_all_gather_result`` and
``comm_ctx.reduce_scatter_states``; the optional ones (``_reduce_scatter_process_group``,
``post_forward_mesh_info``, ``reduce_scatter_states``, ``_sharded_post_forward_param_data``) are
read with a default, so a version without them loses that category's bytes, not the step; a
missing wrapped method fails ``attach()``, which undoes itself and leaves training untracked.

Hook points:
- forward: FSDP's own pre- and post-forward hooks of a module are replaced, in their places in the
  module's hook dicts, by wrappers that report the states around them (as upstream
  ``FSDPMemTracker`` replaces them), plus one ``always_call`` forward hook of ours, last, so a
  forward that raises still ends: one hook added per module instead of four (their dispatch
  alone was ~1.5% of a dispatch-bound step: benchmarks/README.md). Detach puts FSDP's hooks back
  where a wrapper still stands. Where FSDP's hooks are not the single-module ones
  (``fully_shard([a, b])``, another tracker's wrappers, a version that keeps them elsewhere), and
  on the model itself (automatic attachment attaches inside its first forward), four
  hooks of ours stand around them instead, two before and two after (``prepend=True`` runs ours
  before FSDP's). Where FSDP's hooks change after attach (upstream ``FSDPMemTracker`` re-registers
  them when it enters and when it leaves) or someone replaces a wrapper of ours, the module's
  hooks are installed again around them at the step's end (``_ForwardHooks``).
- backward and communication: per ``FSDPParamGroup`` instance, ``pre_backward``,
  ``post_backward``, ``unshard``, ``wait_for_unshard`` and ``reshard`` are wrapped by instance
  attributes (as upstream ``FSDPMemTracker`` does for the first two). Detach deletes those
  attributes, so the class methods are what runs again. A group shared by several modules
  (``fully_shard([a, b])``) is wrapped once and reports its states for each of them.
- backward peak windows (deep steps): a module's ends where upstream ``FSDPMemTracker``'s does,
  when autograd has the gradients of the inputs its forward received (``_InputGradEnds``), which
  takes in the previous module's FSDP pre-backward; in light steps, at its post-backward.

What FSDP holds, by category (exact in light mode). Light mode counts each group's buffers as
integers moved by these events (``fsdp2_groups.LightGroup``: constant work per group, whatever its
number of parameters); deep steps, and a group whose events cannot tell its bytes (counted in
``fallback_groups``), track the same buffers per tensor (``TensorGroup``). Both release the
all-gather and reduce-scatter buffers when FSDP lets go of them, not when a communication thread
that still holds one frees it; on CUDA, per-tensor accounting keeps them until they are freed
(ProcessGroupNCCL holds a collective's tensors a while longer, and the allocator counts them).
- sharded_param: each FSDPParam's local shard (``sharded_param``), at attach; parameters FSDP does
  not manage (``ignored_params``) count here too, whole.
- unsharded_param: ``all_gather_outputs`` after ``wait_for_unshard``, until ``reshard``. With
  ``reshard_after_forward=<int>``, the smaller post-forward copies
  (``_sharded_post_forward_param_data``) FSDP keeps between forward and backward.
- all_gather: ``_all_gather_result.all_gather_output`` after ``unshard`` (the flat buffer; the
  all-gather input is a view into it), until the copy-out, or in forward the next group's
  copy-out (FSDP keeps it in ``comm_ctx.all_gather_state``) or the root's post-forward.
- unsharded_grad: ``unsharded_param.grad`` when ``post_backward`` starts; after it, what FSDP keeps
  unreduced (gradient accumulation without sync: the grad itself, or the reduce-dtype
  ``unsharded_accumulated_grad`` under mixed precision).
- sharded_grad: ``sharded_param.grad`` after ``post_backward`` (until ``zero_grad`` drops it, seen
  at the step's end or its first forward); grads of unmanaged parameters when autograd
  accumulates them.
- reduce_scatter: the input FSDP appends to ``comm_ctx.reduce_scatter_states`` in
  ``post_backward``, until it pops it or its final callback clears them. Where the shard group
  has one rank (HSDP with shard size 1, one rank) no reduce-scatter runs and the buffer is a
  plain copy: temp, as upstream FSDPMemTracker says.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from operator import methodcaller
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
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
    PEAK_BACKWARD,
    SHARDED_GRAD,
    SHARDED_PARAM,
)
from fsdp_mem_otel.training.adapters.base import EventSink, fsdp_module_keys, iter_tensors
from fsdp_mem_otel.training.adapters.fsdp2_groups import CommMirror, LightGroup, TensorGroup, WaitToken, reduce_category
from fsdp_mem_otel.training.compile_support import dynamo_safe
from fsdp_mem_otel.training.light.ledger import INDEX

_T = TypeVar("_T")
_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_AFTER_UNSHARD, _AFTER_RESHARD = methodcaller("after_unshard"), methodcaller("after_reshard")


logger = logging.getLogger(__name__)


def param_groups(module: nn.Module) -> list[Any]:
    """The FSDPParamGroups of one FSDP module: ``_fsdp_param_groups`` since torch 2.13; torch 2.11
    and 2.12 (the GPU machine's torch, benchmarks/README.md) keep at most one, ``_fsdp_param_group``."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class _SavedAttr(NamedTuple):
    """An instance attribute we replaced: whether it existed before, and its old value."""

    owner: Any
    name: str
    existed: bool
    value: Any
    wrapper: Any


#: set on a detached adapter's wrapper that another wrapper still calls (two trackers on one
#: model, detached out of order): (existed, value) of what it replaced, restored in its place
_REPLACED = "_fsdp_mem_otel_replaced"


def _restore(saved: _SavedAttr) -> None:
    existed, value = saved.existed, saved.value
    while existed:  # a detached tracker's wrapper: what it replaced instead
        try:
            replaced = getattr(value, _REPLACED, None)
        except Exception:  # noqa: BLE001 - someone's object with a strange __getattr__: it stays
            replaced = None
        if replaced is None:
            break
        existed, value = replaced
    if existed:
        setattr(saved.owner, saved.name, value)
    else:
        delattr(saved.owner, saved.name)


class _SwappedHook(NamedTuple):
    """A module hook of FSDP's we replaced in place: its dict, id, FSDP's function and ours."""

    hooks: dict[int, Any]
    hook_id: int
    original: Any
    wrapper: Any


def is_fsdp2(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


class FSDP2Adapter:
    """Turns FSDP2's hook points into tracker events for every FSDP module of ``model``."""

    fsdp_version = 2

    def __init__(self, model: nn.Module, sink: EventSink) -> None:
        self._model = model
        self._sink = sink
        self._modules = fsdp_module_keys(model, FSDPModule)
        self._handles: list[RemovableHandle] = []
        self._saved: list[_SavedAttr] = []
        self._forward = _ForwardHooks(sink, self._inputs_seen, model)
        self._accounts: list[_Accounts] = []
        self._mirrors: dict[int, CommMirror] = {}
        self._check_grads = True
        self._backward_ends = _InputGradEnds(sink)
        #: deep steps: every group accounted per tensor
        self.per_tensor = False

    def module_keys(self) -> list[str]:
        return [key for key, _ in self._modules]

    def persistent_tensors(self) -> Iterator[tuple[torch.Tensor, str]]:
        managed: set[int] = set()
        for _, group in self._groups():
            for fp in group.fsdp_params:  # their grads: the group accounts them (start())
                managed.add(id(fp.sharded_param))
                yield fp.sharded_param, SHARDED_PARAM
        for p in self._unmanaged_params(managed):
            yield p, SHARDED_PARAM
            if p.grad is not None:
                yield p.grad, SHARDED_GRAD
        for buf in self._model.buffers():
            yield buf, BUFFER

    def shards_nothing(self) -> bool:
        sizes = [group.mesh_info.shard_mesh_size for _, group in self._groups()]
        return bool(sizes) and all(n == 1 for n in sizes)

    def _unmanaged_params(self, managed: set[int]) -> list[nn.Parameter]:
        return [p for p in self._model.parameters() if id(p) not in managed]

    def _groups(self) -> Iterator[tuple[list[str], Any]]:
        """(keys of the modules sharing it, group) for each FSDPParamGroup, once."""
        keys_of: dict[int, list[str]] = {}
        groups: dict[int, Any] = {}
        for key, mod in self._modules:
            for group in param_groups(mod):
                keys_of.setdefault(id(group), []).append(key)
                groups[id(group)] = group
        for gid, group in groups.items():
            yield keys_of[gid], group

    # -- attach / detach -----------------------------------------------------------------------
    def attach(self) -> None:
        """Install hooks and patches; on failure, undo what was installed and re-raise."""
        try:
            self._attach()
        except BaseException:
            self.detach()
            raise

    def _attach(self) -> None:
        sink = self._sink
        groups = list(self._groups())
        # modules sharing one group (fully_shard([a, b])): per-module backward windows
        shared: dict[str, _SharedGroupWindows] = {}
        for keys, _ in groups:
            if len(keys) > 1:
                shared.update(dict.fromkeys(keys, _SharedGroupWindows(sink)))
        for key, mod in self._modules:  # one at a time: a failing registration leaves the others removable
            state = mod._get_fsdp_state()  # type: ignore[operator]
            self._forward.install(key, mod, state, shared.get(key), partial(self._forward_begins, state),
                                  partial(self._forward_ends, state))
        managed: set[int] = set()
        for keys, group in groups:
            managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
            self._patch_group(keys, group, shared.get(keys[0]))
        for p in self._unmanaged_params(managed):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(_grad_hook(sink)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._forward.restore()
        for s in reversed(self._saved):
            if s.owner.__dict__.get(s.name) is s.wrapper:
                _restore(s)
            else:  # someone wrapped ours since (another tracker): whoever restores ours restores past it
                setattr(s.wrapper, _REPLACED, (s.existed, s.value))
        self._saved.clear()
        self._accounts.clear()
        self._mirrors.clear()
        self._backward_ends.clear()

    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        existed = name in owner.__dict__
        self._saved.append(_SavedAttr(owner, name, existed, owner.__dict__.get(name), wrapper))
        setattr(owner, name, wrapper)

    def _patch_group(self, keys: list[str], group: Any, shared: _SharedGroupWindows | None) -> None:
        sink = self._sink
        acct = _Accounts(group, sink, self._mirror_of, self.per_tensor)
        self._accounts.append(acct)
        ends = self._backward_ends
        # the group's states are every member's; with several members the backward peak windows
        # are per module (``shared``), not the group's
        windowed = shared is None
        orig_post_backward, orig_wait = group.post_backward, group.wait_for_unshard
        orig_pre_backward = group.pre_backward
        light = acct.light

        # The wrappers below run at every FSDP event of every group: their containment and the
        # state events are written out (a helper frame per call cost ~0.3 us in place, at ~150
        # calls a step).
        def pre_backward(*args: Any, **kwargs: Any) -> Any:
            if group._training_state is _PRE_BACKWARD:
                return orig_pre_backward(*args, **kwargs)  # once per backward: FSDP's own guard
            try:
                for key in keys:
                    sink.backward_state(key, BEFORE_PRE_BACKWARD, windowed)
            except Exception as exc:  # noqa: BLE001 - the tracker must never break training
                sink.report_error(exc)
            out = orig_pre_backward(*args, **kwargs)
            try:
                for key in keys:
                    sink.backward_state(key, AFTER_PRE_BACKWARD, windowed)
            except Exception as exc:  # noqa: BLE001
                sink.report_error(exc)
            return out

        def post_backward(*args: Any, **kwargs: Any) -> Any:
            count = None
            try:
                count = acct.before_post_backward()
            except Exception as exc:  # noqa: BLE001
                sink.report_error(exc)
            try:
                for key in keys:
                    sink.backward_state(key, BEFORE_POST_BACKWARD, windowed)
            except Exception as exc:  # noqa: BLE001
                sink.report_error(exc)
            out = orig_post_backward(*args, **kwargs)
            try:
                acct.after_post_backward(count)
            except Exception as exc:  # noqa: BLE001
                sink.report_error(exc)
            try:
                if windowed:  # the window may end later (deep steps: calls are known then)
                    for key in keys:
                        sink.backward_state(key, AFTER_POST_BACKWARD, not (ends.calls and ends.defer(key)))
                else:
                    for key in keys:
                        sink.backward_state(key, AFTER_POST_BACKWARD, False)
                    shared.backward_ends()  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001
                sink.report_error(exc)
            return out

        def wait_for_unshard(*args: Any, **kwargs: Any) -> Any:
            if acct.current is light:  # what it needs is its own: one entry, after
                out = orig_wait(*args, **kwargs)
                try:
                    acct.after_wait()
                except Exception as exc:  # noqa: BLE001
                    sink.report_error(exc)
                return out
            before = _guarded_value(sink, acct.before_wait)
            out = orig_wait(*args, **kwargs)
            _guarded(sink, lambda: acct.after_tensors_wait(before))
            return out

        self._patch(group, "pre_backward", dynamo_safe(pre_backward))
        self._patch(group, "post_backward", dynamo_safe(post_backward))
        self._patch(group, "unshard", dynamo_safe(_then(sink, group.unshard, acct, _AFTER_UNSHARD)))
        self._patch(group, "wait_for_unshard", dynamo_safe(wait_for_unshard))
        self._patch(group, "reshard", dynamo_safe(_then(sink, group.reshard, acct, _AFTER_RESHARD)))

    # -- light mode's integer accounts --------------------------------------------------------
    def _mirror_of(self, comm: Any) -> CommMirror:
        # FSDP's lazy init gives every group the root's communication context: look it up at
        # each event, not once
        mirror = self._mirrors.get(id(comm))
        if mirror is None or mirror.comm is not comm:
            mirror = self._mirrors[id(comm)] = CommMirror(comm, self._sink)
        return mirror

    def start(self) -> None:
        """The tracker counts from now: light groups count what FSDP holds already (what steps
        learnt before holds no more)."""
        for acct in self._accounts:
            acct.sync()

    def use_tensors(self, on: bool) -> None:
        """Deep steps (``on``) account every group per tensor, as deep mode's per-op accounting
        sees the same storages; afterwards light groups take over again from the tensors."""
        if on == self.per_tensor:
            return
        self.per_tensor = on
        if on:
            for mirror in self._mirrors.values():
                mirror.drop_counts()
        for acct in self._accounts:
            acct.use_tensors(on)

    def reconcile(self) -> None:
        """Let go of what FSDP and ``zero_grad`` let go of without an event (the step ends)."""
        self._forward.reconcile()
        for mirror in self._mirrors.values():
            mirror.reconcile()
        for acct in self._accounts:
            acct.current.reconcile()
        self._check_grads = True
        self._backward_ends.clear()

    def _inputs_seen(self, key: str, args: Any, kwargs: Any) -> None:
        if self.per_tensor:  # a deep step
            _guarded(self._sink, lambda: self._backward_ends.forward(key, (args, kwargs)))

    # FSDP lets go of buffers without an event of its groups only outside a forward (the final
    # callback, zero_grad) and at its outermost post-forward (the deferred all-gather output):
    # inner modules' forwards leave the mirrors alone. Inside an FSDP forward, FSDP's shared state
    # context has an ``iter_forward_root`` (the root's pre-forward ran, its post-forward not yet).
    def _forward_begins(self, state: Any) -> None:
        if getattr(state._state_ctx, "iter_forward_root", None) is not None:
            return  # inside an FSDP forward
        for mirror in self._mirrors.values():
            mirror.reconcile()
        if self._check_grads:  # once per step, at its first forward: zero_grad ran before it
            self._check_grads = False
            for acct in self._accounts:
                acct.current.reconcile()

    def _forward_ends(self, state: Any) -> None:
        if getattr(state._state_ctx, "iter_forward_root", None) is not None:
            return  # inside an FSDP forward
        for mirror in self._mirrors.values():  # the root's post-forward frees the deferred output
            mirror.reconcile()

    @property
    def fallback_groups(self) -> int:
        """Groups that light mode accounts per tensor, because their events cannot say it."""
        return sum(acct.fell_back for acct in self._accounts)


class _ModuleHooks:
    """One FSDP module's forward hooks of ours: what ``_ForwardHooks`` installs and takes out."""

    __slots__ = ("begins", "ends", "fsdp_handles", "handles", "key", "live", "member", "mod", "replaced", "state",
                 "swapped")

    def __init__(self, key: str, mod: nn.Module, state: Any, member: _SharedGroupWindows | None,
                 begins: Callable[[], None], ends: Callable[[], None]) -> None:
        self.key, self.mod, self.state, self.member, self.begins, self.ends = key, mod, state, member, begins, ends
        self.handles: list[RemovableHandle] = []  # hooks of ours on the module, the always-call one included
        self.swapped: list[_SwappedHook] = []  # FSDP's pre- and post-forward hooks wrapped in place
        self.live = [True]  # the wrappers report while this holds (one that someone else still calls may not)
        self.fsdp_handles: tuple[Any, Any] = (None, None)  # FSDP's hook handles when installed
        self.replaced = False  # a wrapper of ours was found replaced (at a step's end)


def _fsdp_handles(state: Any) -> tuple[Any, Any]:
    return getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)


class _ForwardHooks:
    """An adapter's forward hooks: FSDP's own single-module pre- and post-forward hooks wrapped in
    their places, else three hooks of ours around them, and an always-call hook of ours after
    them that ends each forward. See the module docstring.

    At each step's end (``reconcile``), a module whose FSDP hooks were re-registered (new handles:
    upstream ``FSDPMemTracker`` entering or leaving) or whose wrapped hooks someone replaced gets
    its hooks installed again, around FSDP's hooks as they are now; that step's forward states of
    the module may have been missed or misplaced, and a warning says so (the first time for each
    module)."""

    def __init__(self, sink: EventSink, inputs_seen: Callable[[str, Any, Any], None], model: nn.Module) -> None:
        self._sink = sink
        # The model itself keeps hooks of ours: automatic attachment attaches inside its first
        # forward and runs the pre-hooks that call can no longer pick up (new ones: integrations/auto.py)
        self._model = model
        self._inputs_seen = inputs_seen
        self._modules: list[_ModuleHooks] = []
        self._warned: set[str] = set()

    def install(self, key: str, mod: nn.Module, state: Any, member: _SharedGroupWindows | None,
                begins: Callable[[], None], ends: Callable[[], None]) -> None:
        """Report ``mod``'s four forward states (``begins``/``ends``: the adapter's catching up)."""
        hooks = _ModuleHooks(key, mod, state, member, begins, ends)
        self._modules.append(hooks)  # first: a failure half-way leaves what it installed removable
        self._install(hooks)

    def reconcile(self) -> None:
        """At a step's end: install again the hooks of modules whose FSDP hooks changed since."""
        changed = []
        for hooks in self._modules:
            if hooks.swapped:
                self._check_folded(hooks, *hooks.swapped)
            handles = _fsdp_handles(hooks.state)
            if hooks.replaced or handles[0] is not hooks.fsdp_handles[0] or handles[1] is not hooks.fsdp_handles[1]:
                changed.append(hooks.key)
                try:
                    self._uninstall(hooks)
                    self._install(hooks)
                except Exception as exc:  # noqa: BLE001 - the other modules still get theirs
                    hooks.replaced = True  # tried again at the next step's end
                    self._sink.report_error(exc)
        new = [key for key in changed if key not in self._warned]
        if new:
            self._warned.update(new)
            logger.warning("fsdp_mem_otel: FSDP's forward hooks of %d module(s) (%s) changed since attach (another "
                           "memory tracker?); this step's forward states of them may be missing or misplaced, the "
                           "next steps' are taken around the hooks as they are now", len(new), ", ".join(new[:5]))

    def restore(self) -> None:
        """Take every hook of ours out and put FSDP's back where our wrappers still stand (detach)."""
        for hooks in self._modules:
            self._uninstall(hooks)
        self._modules.clear()

    def _install(self, hooks: _ModuleHooks) -> None:
        hooks.fsdp_handles = _fsdp_handles(hooks.state)
        hooks.replaced = False
        if hooks.member is not None or hooks.mod is self._model or not self._fold(hooks):
            self._add_forward_hooks(hooks)
        hooks.handles.append(hooks.mod.register_forward_hook(
            _io_hook(self._sink, hooks.key, AFTER_POST_FORWARD, first=hooks.ends), always_call=True))

    def _uninstall(self, hooks: _ModuleHooks) -> None:
        hooks.live[0] = False  # a wrapper someone else still calls (wrapped in theirs) passes through
        hooks.live = [True]
        for h in hooks.handles:
            h.remove()
        hooks.handles.clear()
        for swapped in reversed(hooks.swapped):
            if swapped.hooks.get(swapped.hook_id) is swapped.wrapper:
                swapped.hooks[swapped.hook_id] = swapped.original
        hooks.swapped.clear()

    def _add_forward_hooks(self, hooks: _ModuleHooks) -> None:
        """Hooks of ours around FSDP's forward hooks where they are not wrapped in place: before
        (``prepend``) and after its pre-hook, and before its post-hook (the always-call one comes
        after it)."""
        sink, key, mod, handles = self._sink, hooks.key, hooks.mod, hooks.handles
        if hooks.member is None:
            handles.append(mod.register_forward_pre_hook(
                _begin_hook(sink, key, hooks.begins, self._inputs_seen), prepend=True, with_kwargs=True))
        else:  # also sees the inputs, before FSDP's pre-forward wraps them
            handles.append(mod.register_forward_pre_hook(_member_pre_hook(sink, key, hooks.member, hooks.begins),
                                                         prepend=True, with_kwargs=True))
        handles.append(mod.register_forward_pre_hook(_inputs_hook(sink, key), with_kwargs=True))
        handles.append(mod.register_forward_hook(_io_hook(sink, key, BEFORE_POST_FORWARD, windows=hooks.member),
                                                 prepend=True))

    @staticmethod
    def _check_folded(hooks: _ModuleHooks, pre: _SwappedHook, post: _SwappedHook) -> None:
        # At a step's end, for a module whose FSDP hooks we wrapped in place: still ours? Someone
        # may have replaced them since, and its forwards' states went unseen: its hooks are
        # installed again.
        if pre.hooks.get(pre.hook_id) is not pre.wrapper or post.hooks.get(post.hook_id) is not post.wrapper:
            hooks.replaced = True

    def _fold(self, hooks: _ModuleHooks) -> bool:
        """Replace FSDP's single-module pre- and post-forward hooks of the module by wrappers that
        report the states before and after each; False (nothing replaced) where they are not
        where FSDP 2.13/2.14 keeps them."""
        mod, state, key = hooks.mod, hooks.state, hooks.key
        pre_handle, post_handle = hooks.fsdp_handles
        if pre_handle is None or post_handle is None or pre_handle is post_handle:
            return False  # fully_shard([a, b]) registers one handle for the group's hooks
        pre, post = mod._forward_pre_hooks.get(pre_handle.id), mod._forward_hooks.get(post_handle.id)
        if (pre is None or post is None
                or pre != getattr(state, "_pre_forward", None) or post != getattr(state, "_post_forward", None)
                or pre_handle.id not in mod._forward_pre_hooks_with_kwargs
                or post_handle.id in mod._forward_hooks_with_kwargs
                or post_handle.id in mod._forward_hooks_always_called):
            return False  # not FSDP's own there (another tracker's wrapper: ours go around it)
        for dicts, hook_id, original, wrapper in (
            (mod._forward_pre_hooks, pre_handle.id, pre, _folded_pre_hook(self._sink, key, pre, hooks.begins,
                                                                          self._inputs_seen, hooks.live)),
            (mod._forward_hooks, post_handle.id, post, _folded_post_hook(self._sink, key, post, hooks.live)),
        ):
            hooks.swapped.append(_SwappedHook(dicts, hook_id, original, wrapper))
            dicts[hook_id] = wrapper
        return True


class _Accounts:
    """One group's accounting: ``LightGroup`` in light mode, ``TensorGroup`` in deep steps and
    for good once the light one finds the group unfit (the fallback)."""

    __slots__ = ("_comm", "_mirror_cached", "_mirror_of", "_rs_cat", "_sink", "current", "fell_back", "light",
                 "tensors")

    def __init__(self, group: Any, sink: EventSink, mirror_of: Callable[[Any], CommMirror], per_tensor: bool) -> None:
        category = reduce_category(group)
        self._sink = sink
        self._mirror_of = mirror_of
        self._comm: Any = None
        self._mirror_cached: CommMirror | None = None
        self._rs_cat = INDEX[category]
        self.light = LightGroup(group, sink)
        self.tensors = TensorGroup(group, sink, category, getattr(group, "post_forward_mesh_info", None) is not None)
        self.fell_back = self.light.unfit is not None
        self.current: LightGroup | TensorGroup = self.tensors if per_tensor or self.fell_back else self.light

    def sync(self) -> None:
        self.current.sync()

    def use_tensors(self, on: bool) -> None:
        if self.fell_back:
            return
        if on:
            self.light.drop_counts()
            self.current = self.tensors
            self.tensors.sync()
        else:
            for t in self.light.tensors():
                self._sink.forget(t)
            self.current = self.light
            self.light.sync()

    def _fall_back(self) -> None:
        self.fell_back = True
        self.light.drop_counts()
        self.current = self.tensors
        self.tensors.sync()

    # -- events --------------------------------------------------------------------------------
    @property
    def _mirror(self) -> CommMirror:
        comm = self.light.group.comm_ctx
        if comm is not self._comm or self._mirror_cached is None:
            self._comm, self._mirror_cached = comm, self._mirror_of(comm)
        return self._mirror_cached

    def after_wait(self) -> None:
        """After ``wait_for_unshard``, light accounts: what FSDP's state was before the wait is
        the group's and the mirror's own (a pending all-gather seen, a deferred output held), so
        nothing is read before it."""
        light = self.light
        deferred = False
        if light.all_gather_seen:
            group = light.group
            mirror = self._mirror_cached  # ``_mirror`` written out (every all-gather)
            if group.comm_ctx is not self._comm or mirror is None:
                mirror = self._mirror
            deferred = mirror.waited(group._training_state is _FORWARD,
                                     mirror.deferred is not None, light.dev, light.pending_all_gather(), None)
        light.after_wait(deferred, None)

    def before_wait(self) -> WaitToken:
        """Before ``wait_for_unshard``, per-tensor accounts: FSDP's state then."""
        return self._mirror.before_wait(self.light.group, self.current is self.tensors)

    def after_tensors_wait(self, before: WaitToken | None) -> None:
        current = self.current
        deferred = False
        if before is not None:
            deferred = self._mirror.after_wait(before, self.light.dev, current.pending_all_gather())
        current.after_wait(deferred, before)

    def before_post_backward(self) -> int:
        self.current.before_post_backward()
        mirror = self._mirror_cached  # ``_mirror`` written out, as below
        if self.light.group.comm_ctx is not self._comm or mirror is None:
            mirror = self._mirror
        return mirror.rs_count()

    def after_post_backward(self, count: int | None) -> None:
        current, light = self.current, self.light
        appended = None
        if count is not None:
            mirror = self._mirror_cached
            if light.group.comm_ctx is not self._comm or mirror is None:
                mirror = self._mirror
            appended = mirror.after_post_backward(count, self._rs_cat, current is light, light.dev)
        current.after_post_backward(appended)
        if current is self.light and self.light.unfit is not None:
            self._fall_back()


def _then(sink: EventSink, orig: Callable[..., Any], acct: _Accounts,
          event: Callable[[Any], None]) -> Callable[..., Any]:
    """``orig``, then ``event`` on the group's current accounts (``_AFTER_*``: a C-level
    ``methodcaller``, no frame of ours); tracker failures never reach FSDP."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        try:
            event(acct.current)
        except Exception as exc:  # noqa: BLE001 - the tracker must never break training
            sink.report_error(exc)
        return out

    return wrapper


def _guarded(sink: EventSink, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tracker must never break training
        sink.report_error(exc)


def _guarded_value(sink: EventSink, fn: Callable[[], _T]) -> _T | None:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the tracker must never break training
        sink.report_error(exc)
        return None


def _begin_hook(sink: EventSink, key: str, first: Callable[[], None],
                inputs_seen: Callable[[str, Any, Any], None]) -> Callable[..., None]:
    """before_pre_forward, after ``first`` (the adapter's catching up with FSDP); then
    ``inputs_seen`` (which never raises) gets the inputs as the module receives them, before
    FSDP's pre-forward."""

    def hook(_module: Any, args: Any, kwargs: Any = None) -> None:  # None: see _inputs_hook
        _guarded(sink, first)
        sink.on_state(key, BEFORE_PRE_FORWARD)
        inputs_seen(key, args, kwargs)

    return dynamo_safe(hook)


class _InputGradEnds:
    """Deep steps: where a module's backward peak window ends, as upstream FSDPMemTracker's (its
    ModTracker) does: when autograd has computed the gradients of the inputs the module's forward
    received, not at FSDP's post-backward. Our hooks on those tensors run after the ones registered
    on them earlier, among them the previous module's FSDP pre-backward hook (its unshard, copy-out
    and backward prefetch), and right after upstream's, so the window takes those instants in, as
    upstream's does. A call whose inputs need no gradient ends at its post-backward; one whose
    input gradients this backward never computes, when the backward ends. No hook holds a tensor
    (``_when_all_grads``)."""

    _WAITING, _DEFERRED, _DONE = 0, 1, 2

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        #: module key -> its forward calls whose post-backward is still to come, newest last:
        #: [whether its inputs need a gradient, state] (empty in light steps)
        self.calls: dict[str, list[list[Any]]] = {}

    def forward(self, key: str, inputs: object) -> None:
        """Module ``key``'s forward received ``inputs`` (before FSDP's pre-forward wraps them)."""
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpoint recompute: no post-backward of its own
        needing = [t for t in iter_tensors(inputs) if t.requires_grad]
        call: list[Any] = [bool(needing), self._WAITING]
        self.calls.setdefault(key, []).append(call)
        if needing:
            _when_all_grads(needing, self._guarded(lambda: self._end(key, call)))

    def defer(self, key: str) -> bool:
        """At module ``key``'s after_post_backward: whether its backward window ends later, when
        the gradients of this call's inputs are computed (FSDP runs post-backwards newest call first)."""
        calls = self.calls.get(key)
        if not calls:
            return False  # a light step, or no forward seen
        call = calls.pop()
        if not call[0] or call[1] != self._WAITING or torch._C._current_graph_task_id() == -1:
            return False
        try:  # their gradients may never come (autograd.grad(..., inputs=)): at the latest, the backward's end
            torch.autograd.Variable._execution_engine.queue_callback(self._guarded(lambda: self._end(key, call)))
        except Exception as exc:  # noqa: BLE001
            self._sink.report_error(exc)
            return False
        call[1] = self._DEFERRED
        return True

    def _guarded(self, fn: Callable[[], None]) -> Callable[..., None]:
        sink = self._sink
        return dynamo_safe(lambda *_: _guarded(sink, fn))

    def _end(self, key: str, call: list[Any]) -> None:
        deferred, call[1] = call[1] == self._DEFERRED, self._DONE
        if deferred:  # the oldest: a later call of the same module may have opened its window since
            self._sink.end_window(key, PEAK_BACKWARD, oldest=True)

    def clear(self) -> None:
        """The step ends: forget its calls (a window still open closes with the step)."""
        for calls in self.calls.values():
            for call in calls:
                call[1] = self._DONE
        self.calls.clear()


def _folded_pre_hook(sink: EventSink, key: str, fsdp_pre: Callable[..., Any], first: Callable[[], None],
                     inputs_seen: Callable[[str, Any, Any], None], live: list[bool]) -> Callable[..., Any]:
    """FSDP's pre-forward hook ``fsdp_pre`` between before_pre_forward (after ``first``, the
    adapter's catching up; ``inputs_seen`` gets the inputs as the module receives them) and
    after_pre_forward (with the inputs FSDP hands on); only ``fsdp_pre`` once ``live[0]`` is False."""

    def hook(module: Any, args: Any, kwargs: Any) -> Any:
        if not live[0]:
            return fsdp_pre(module, args, kwargs)
        try:  # ``_guarded``, written out
            first()
        except Exception as exc:  # noqa: BLE001 - the tracker must never break training
            sink.report_error(exc)
        sink.on_state(key, BEFORE_PRE_FORWARD)
        inputs_seen(key, args, kwargs)
        out = fsdp_pre(module, args, kwargs)
        sink.on_state(key, AFTER_PRE_FORWARD, (args, kwargs) if out is None else out)
        return out

    return dynamo_safe(hook)


def _folded_post_hook(sink: EventSink, key: str, fsdp_post: Callable[..., Any], live: list[bool]) -> Callable[..., Any]:
    """before_post_forward with the module's outputs, then FSDP's post-forward hook ``fsdp_post``
    (after_post_forward is the ``always_call`` hook after it); only ``fsdp_post`` once ``live[0]``
    is False."""

    def hook(module: Any, args: Any, outputs: Any) -> Any:
        if live[0]:
            sink.on_state(key, BEFORE_POST_FORWARD, outputs)
        return fsdp_post(module, args, outputs)

    return dynamo_safe(hook)


def _inputs_hook(sink: EventSink, key: str) -> Callable[..., None]:
    """after_pre_forward, with the module's positional and keyword inputs."""

    # ``kwargs`` may be missing: a tracker that detaches itself inside a forward (its error limit
    # reached) removes this hook's handle, which also forgets that it takes them, and the running
    # call still holds the hooks it started with
    def hook(_module: Any, args: Any, kwargs: Any = None) -> None:
        sink.on_state(key, AFTER_PRE_FORWARD, (args, kwargs))

    return dynamo_safe(hook)


def _member_pre_hook(sink: EventSink, key: str, windows: _SharedGroupWindows,
                     first: Callable[[], None]) -> Callable[..., None]:
    """before_pre_forward of a module sharing its FSDP group: also marks where its backward ends."""

    def hook(_module: Any, args: Any, kwargs: Any = None) -> None:  # None: see _inputs_hook
        _guarded(sink, first)
        sink.on_state(key, BEFORE_PRE_FORWARD)
        _guarded(sink, lambda: windows.inputs(key, (args, kwargs)))

    return dynamo_safe(hook)


class _SharedGroupWindows:
    """Backward peak windows per module for modules sharing one FSDP group (``fully_shard([a, b])``).

    FSDP runs one pre-/post-backward for the whole group, so its states cannot tell the members
    apart. As upstream's ModTracker does, a member's backward starts when autograd computes the
    first gradient of its outputs and ends when it has computed the gradients of its inputs
    (hooks on the tensors as the member received and returned them, outside FSDP's own). Members'
    backward windows may overlap without nesting; any still open end with the group's
    post-backward. No hook holds a tensor: see ``_when_all_grads``.
    """

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._open: dict[int, str] = {}  # forward call -> member whose backward window is open
        self._calls = 0

    def inputs(self, key: str, inputs: object) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpoint recompute
        self._calls += 1
        call = self._calls
        needing_grad = [t for t in iter_tensors(inputs) if t.requires_grad]
        if needing_grad:
            _when_all_grads(needing_grad, self._guarded(lambda: self._end(call)))

    def outputs(self, key: str, outputs: object) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        call = self._calls
        needing_grad = [t for t in iter_tensors(outputs) if t.requires_grad]
        if needing_grad:
            # mode="any" keeps no tensor: its hook holds only ours
            hook = self._guarded(lambda: self._begin(call, key))
            torch.autograd.graph.register_multi_grad_hook(needing_grad, lambda _grad: hook(), mode="any")

    def _guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        sink = self._sink
        return dynamo_safe(lambda: _guarded(sink, fn))

    def _begin(self, call: int, key: str) -> None:
        self._open[call] = key
        self._sink.open_window(key, PEAK_BACKWARD)

    def _end(self, call: int) -> None:
        key = self._open.pop(call, None)
        if key is not None:
            self._sink.end_window(key, PEAK_BACKWARD)

    def backward_ends(self) -> None:
        for call in sorted(self._open, reverse=True):
            self._end(call)
        self._calls = 0


def _when_all_grads(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` once per backward, when autograd has computed the gradients of all of
    ``tensors`` that this backward computes: ``register_multi_grad_hook(mode="all")``, without
    its strong references. torch's keeps each tensor's gradient node in the hook it stores on the
    tensor; for a leaf that node is the gradient accumulator, which holds the leaf: a cycle
    through C++ that ``gc`` cannot break, so every leaf input (a chunked loss's detached chunks)
    would live for the rest of the run. Here the hook holds the tensors weakly and finds their
    nodes when the backward reaches the first of them."""
    refs = [weakref.ref(t) for t in tensors]
    pending: dict[int, int] = {}  # graph task -> gradients still to come

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        left = pending.get(task)
        if left is None:
            left = sum(
                1 for ref in refs
                if (t := ref()) is not None and torch._C._will_engine_execute_node(_grad_node(t))
            )
        left -= 1
        if left > 0:
            pending[task] = left
            return
        pending.pop(task, None)
        fn()

    safe_hook = dynamo_safe(hook)
    for t in tensors:
        t.register_hook(safe_hook)


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node that receives ``t``'s gradient: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _io_hook(sink: EventSink, key: str, state: str, windows: _SharedGroupWindows | None = None,
             first: Callable[[], None] | None = None) -> Callable[..., None]:
    """A forward hook passing the module's outputs with the state, after ``first``; for a module
    sharing its group, also marks where its backward will start."""

    def hook(_module: Any, _args: Any, outputs: Any) -> None:
        if first is not None:
            try:  # ``_guarded``, written out (every module's forward)
                first()
            except Exception as exc:  # noqa: BLE001 - the tracker must never break training
                sink.report_error(exc)
        sink.on_state(key, state, outputs)
        if windows is not None:
            _guarded(sink, lambda: windows.outputs(key, outputs))

    return dynamo_safe(hook)


def _grad_hook(sink: EventSink) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        sink.track(param.grad, SHARDED_GRAD)

    return dynamo_safe(hook)
