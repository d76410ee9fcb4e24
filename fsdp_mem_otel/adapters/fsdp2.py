"""FSDP2 (``torch.distributed.fsdp.fully_shard``) adapter.

Versions: CI runs the FSDP tests on torch 2.13.0 and 2.14.1; the package allows 2.11 through 2.14
(2.11 and 2.12 untested). The FSDP2 sources of 2.13 and 2.14 differ (dtype handling of groups
without trainable parameters, the forward unshard path), but every name read below exists in both. The private
names it depends on are ``FSDPParamGroup.pre_backward/post_backward/unshard/wait_for_unshard/
reshard``, ``FSDPParam.sharded_param/_unsharded_param/all_gather_outputs/
_sharded_post_forward_param_data/unsharded_accumulated_grad``, ``_all_gather_result`` and
``comm_ctx.reduce_scatter_states``; the optional ones (``_reduce_scatter_process_group``,
``post_forward_mesh_info``, ``reduce_scatter_states``, ``_sharded_post_forward_param_data``) are
read with a default, so a version without them loses that category's bytes, not the step; a
missing wrapped method fails ``attach()``, which undoes itself and leaves training untracked.

Hook points:
- forward: four module hooks per FSDP module, two around FSDP's own pre-forward hook and two
  around its post-forward hook (FSDP registers its pre-hook with ``prepend=True``; ours, registered
  later with ``prepend=True``, runs before it). The last one is ``always_call`` so a forward that
  raises still ends. Nothing of FSDP's is replaced.
- backward and communication: per ``FSDPParamGroup`` instance, ``pre_backward``,
  ``post_backward``, ``unshard``, ``wait_for_unshard`` and ``reshard`` are wrapped by instance
  attributes (as upstream ``FSDPMemTracker`` does for the first two). Detach deletes those
  attributes, so the class methods are what runs again. A group shared by several modules
  (``fully_shard([a, b])``) is wrapped once and reports its states for each of them.

What FSDP tells us, by category (exact in light mode):
- sharded_param: each FSDPParam's local shard (``sharded_param``), at attach; parameters FSDP does
  not manage (``ignored_params``) count here too, whole.
- unsharded_param: ``all_gather_outputs`` storages after ``wait_for_unshard``; resized to 0 on
  ``reshard`` (re-read then). With ``reshard_after_forward=<int>``, the smaller post-forward copies
  (``_sharded_post_forward_param_data``) FSDP keeps between forward and backward.
- all_gather: ``_all_gather_result.all_gather_output`` after ``unshard`` (the flat buffer; the
  all-gather input is a view into it), until FSDP drops it.
- unsharded_grad: ``unsharded_param.grad`` when ``post_backward`` starts; after it, what FSDP keeps
  unreduced (gradient accumulation without sync: the grad itself, or the reduce-dtype
  ``unsharded_accumulated_grad`` under mixed precision).
- sharded_grad: ``sharded_param.grad`` after ``post_backward``; grads of unmanaged parameters when
  autograd accumulates them.
- reduce_scatter: the newest ``comm_ctx.reduce_scatter_states`` input after ``post_backward``,
  until FSDP releases it. Where the shard group has one rank (HSDP with shard size 1, one rank)
  no reduce-scatter runs and the buffer is a plain copy: temp, as upstream FSDPMemTracker says.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.utils.hooks import RemovableHandle

from fsdp_mem_otel.adapters.base import EventSink, fsdp_module_keys, iter_tensors
from fsdp_mem_otel.compile_support import dynamo_safe
from fsdp_mem_otel.schema import (
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    ALL_GATHER,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    BUFFER,
    PEAK_BACKWARD,
    REDUCE_SCATTER,
    SHARDED_GRAD,
    SHARDED_PARAM,
    TEMP,
    UNSHARDED_GRAD,
    UNSHARDED_PARAM,
)


class _SavedAttr(NamedTuple):
    """An instance attribute we replaced: whether it existed before, and its old value."""

    owner: Any
    name: str
    existed: bool
    value: Any
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

    def module_keys(self) -> list[str]:
        return [key for key, _ in self._modules]

    def persistent_tensors(self) -> Iterator[tuple[torch.Tensor, str]]:
        managed: set[int] = set()
        for _, group in self._groups():
            for fp in group.fsdp_params:
                managed.add(id(fp.sharded_param))
                yield fp.sharded_param, SHARDED_PARAM
                if fp.sharded_param.grad is not None:
                    yield fp.sharded_param.grad, SHARDED_GRAD
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
            state = mod._get_fsdp_state()  # type: ignore[operator]
            for group in state._fsdp_param_groups:
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
        handles = self._handles  # one at a time: a failing registration leaves the others removable
        for key, mod in self._modules:
            member = shared.get(key)
            if member is None:
                handles.append(mod.register_forward_pre_hook(_state_hook(sink, key, BEFORE_PRE_FORWARD),
                                                             prepend=True))
            else:  # also sees the inputs, before FSDP's pre-forward wraps them
                handles.append(mod.register_forward_pre_hook(_member_pre_hook(sink, key, member), prepend=True,
                                                             with_kwargs=True))
            handles.append(mod.register_forward_pre_hook(_inputs_hook(sink, key), with_kwargs=True))
            handles.append(mod.register_forward_hook(_io_hook(sink, key, BEFORE_POST_FORWARD, 2, member),
                                                     prepend=True))
            handles.append(mod.register_forward_hook(_io_hook(sink, key, AFTER_POST_FORWARD, 2), always_call=True))
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
        for s in reversed(self._saved):
            if s.owner.__dict__.get(s.name) is not s.wrapper:
                continue  # someone replaced our wrapper since: leave theirs alone
            if s.existed:
                setattr(s.owner, s.name, s.value)
            else:
                delattr(s.owner, s.name)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        existed = name in owner.__dict__
        self._saved.append(_SavedAttr(owner, name, existed, owner.__dict__.get(name), wrapper))
        setattr(owner, name, wrapper)

    def _patch_group(self, keys: list[str], group: Any, shared: _SharedGroupWindows | None) -> None:
        sink = self._sink
        view = _GroupView(group)
        fsdp_params = view.fsdp_params
        rs_group = getattr(group, "_reduce_scatter_process_group", None)
        reduce_category = TEMP if rs_group is None or rs_group.size() == 1 else REDUCE_SCATTER
        post_forward_shards = getattr(group, "post_forward_mesh_info", None) is not None

        def on_state(state: str) -> Callable[[], None]:
            # the group's states are every member's; with several members the backward peak
            # windows are per module (``shared``), not the group's
            windowed = shared is None

            def emit() -> None:
                for key in keys:
                    sink.on_state(key, state, None, windowed)
                if shared is not None and state == AFTER_POST_BACKWARD:
                    shared.backward_ends()

            return emit

        before_pre_backward, after_pre_backward = on_state(BEFORE_PRE_BACKWARD), on_state(AFTER_PRE_BACKWARD)
        emit_before_post_backward, emit_after_post_backward = (
            on_state(BEFORE_POST_BACKWARD), on_state(AFTER_POST_BACKWARD))

        def before_post_backward() -> None:
            sink.track_all([getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in fsdp_params]
                           + [fp.unsharded_accumulated_grad for fp in fsdp_params], UNSHARDED_GRAD)
            emit_before_post_backward()

        def after_post_backward() -> None:
            sink.track_all([fp.sharded_param.grad for fp in fsdp_params], SHARDED_GRAD)
            # kept unreduced (accumulation without gradient sync)
            sink.track_all([fp.unsharded_accumulated_grad for fp in fsdp_params], UNSHARDED_GRAD)
            sink.refresh_storages(view.unsharded_storages())
            states = getattr(group.comm_ctx, "reduce_scatter_states", None)
            if states:
                sink.track(states[-1].reduce_scatter_input, reduce_category)
            emit_after_post_backward()

        def after_unshard() -> None:
            if group._all_gather_result is not None:
                sink.track(group._all_gather_result.all_gather_output, ALL_GATHER)

        def after_wait_for_unshard() -> None:
            sink.track_storages(view.unsharded_storages(), UNSHARDED_PARAM)

        def after_reshard() -> None:
            sink.refresh_storages(view.unsharded_storages())
            if post_forward_shards:
                sink.track_all([getattr(fp, "_sharded_post_forward_param_data", None) for fp in fsdp_params],
                               UNSHARDED_PARAM)

        wrappers: dict[str, tuple[Callable[[], None] | None, Callable[[], None] | None]] = {
            "pre_backward": (before_pre_backward, after_pre_backward),
            "post_backward": (before_post_backward, after_post_backward),
            "unshard": (None, after_unshard),
            "wait_for_unshard": (None, after_wait_for_unshard),
            "reshard": (None, after_reshard),
        }
        for name, (before, after) in wrappers.items():
            orig = getattr(group, name)
            wrapper = _around(sink, orig, before, after)
            if name == "pre_backward":
                # Runs once per output tensor that needs grad; FSDP acts on the first call only.
                wrapper = _unless_in_pre_backward(group, wrapper, orig)
            self._patch(group, name, dynamo_safe(wrapper))


class _GroupView:
    """One FSDPParamGroup's parameters and unsharded-parameter storages, looked up once.

    FSDP2 allocates each parameter's ``all_gather_outputs`` once and resizes their storages
    between full and 0 at every unshard / reshard; the storage objects stay, so the list is
    rebuilt only when the first output tensor is a different object.
    """

    __slots__ = ("_first", "_storages", "fsdp_params")

    def __init__(self, group: Any) -> None:
        self.fsdp_params: list[Any] = list(group.fsdp_params)
        self._first: Any = None
        self._storages: list[torch.UntypedStorage] = []

    def unsharded_storages(self) -> list[torch.UntypedStorage]:
        outputs = self.fsdp_params[0].all_gather_outputs if self.fsdp_params else []
        first = outputs[0] if outputs else None
        if first is not self._first:
            self._storages = [t.untyped_storage() for fp in self.fsdp_params for t in fp.all_gather_outputs]
            self._first = first
        return self._storages


def _around(
    sink: EventSink,
    orig: Callable[..., Any],
    before: Callable[[], None] | None,
    after: Callable[[], None] | None,
) -> Callable[..., Any]:
    """``orig`` with tracker work before and after it; tracker failures never reach FSDP."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            _guarded(sink, before)
        out = orig(*args, **kwargs)
        if after is not None:
            _guarded(sink, after)
        return out

    return wrapper


def _unless_in_pre_backward(
    group: Any, tracked: Callable[..., Any], orig: Callable[..., Any]
) -> Callable[..., Any]:
    def pre_backward(*args: Any, **kwargs: Any) -> Any:
        if group._training_state == TrainingState.PRE_BACKWARD:
            return orig(*args, **kwargs)
        return tracked(*args, **kwargs)

    return pre_backward


def _guarded(sink: EventSink, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the tracker must never break training
        sink.report_error(exc)


def _state_hook(sink: EventSink, key: str, state: str) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        sink.on_state(key, state)

    return dynamo_safe(hook)


def _inputs_hook(sink: EventSink, key: str) -> Callable[..., None]:
    """after_pre_forward, with the module's positional and keyword inputs."""

    def hook(_module: Any, args: Any, kwargs: Any) -> None:
        sink.on_state(key, AFTER_PRE_FORWARD, (args, kwargs))

    return dynamo_safe(hook)


def _member_pre_hook(sink: EventSink, key: str, windows: _SharedGroupWindows) -> Callable[..., None]:
    """before_pre_forward of a module sharing its FSDP group: also marks where its backward ends."""

    def hook(_module: Any, args: Any, kwargs: Any) -> None:
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


def _io_hook(sink: EventSink, key: str, state: str, index: int,
             windows: _SharedGroupWindows | None = None) -> Callable[..., None]:
    """A forward hook passing the module's outputs (``index`` 2 of its arguments) with the state;
    for a module sharing its group, also marks where its backward will start."""

    def hook(*args: Any) -> None:
        sink.on_state(key, state, args[index])
        if windows is not None:
            _guarded(sink, lambda: windows.outputs(key, args[index]))

    return dynamo_safe(hook)


def _grad_hook(sink: EventSink) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        sink.track(param.grad, SHARDED_GRAD)

    return dynamo_safe(hook)
