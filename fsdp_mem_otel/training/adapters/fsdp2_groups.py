"""FSDP2's per-group buffers in the ledger: two ways to account one ``FSDPParamGroup``.

``LightGroup`` (light mode) does constant work per group event, whatever the number of
parameters: each buffer's size is learnt from the tensors the first time it exists (again only
when FSDP re-creates it), and FSDP's own events add and subtract those integers:

==========================  =====================================================================
event                       what changes
==========================  =====================================================================
unshard                     + the flat all-gather output (all_gather)
wait_for_unshard            - that output, at once or, in forward, at the next group's copy-out
                            (FSDP keeps it in ``comm_ctx.all_gather_state``); + the unsharded
                            parameters (unsharded_param); - the post-forward shards
reshard                     - the unsharded parameters; + post-forward shards with
                            ``reshard_after_forward=<int>`` (unsharded_param)
post_backward, before       + the gradients of the parameters that require one (unsharded_grad)
post_backward, after        with gradient sync: - those and the accumulated ones, + the
                            reduce-scatter input (reduce_scatter, or temp with one rank per shard
                            group), + the sharded gradients unless held already (sharded_grad);
                            without: kept, or converted to the reduce dtype (mixed precision)
any event, step end         - reduce-scatter inputs and deferred all-gather outputs FSDP let go of;
                            - sharded gradients ``zero_grad`` dropped
==========================  =====================================================================

Where an event says what the learnt figures cannot (a step whose reduce-scatter input differs from
the learnt one: a parameter without a gradient; all-gather extensions), the group falls back to
``TensorGroup`` for good, and the adapter counts it (``fallback_groups``).

``TensorGroup`` looks at the tensors at every event (today's deep steps and the fallback): the
storages are tracked (weak references), relabelled and re-read; deep mode's dispatch mode sees the
same storages per op, so both agree on them.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from fsdp_mem_otel.schema import (
    ALL_GATHER,
    REDUCE_SCATTER,
    SHARDED_GRAD,
    TEMP,
    UNSHARDED_GRAD,
    UNSHARDED_PARAM,
)
from fsdp_mem_otel.training.adapters.base import EventSink
from fsdp_mem_otel.training.light.ledger import INDEX, device_block, rounded, storages_of

_AG, _UP, _UG, _SG = INDEX[ALL_GATHER], INDEX[UNSHARDED_PARAM], INDEX[UNSHARDED_GRAD], INDEX[SHARDED_GRAD]
#: training states in which a group's post-backward finds gradients (its pre-backward ran, or a
#: grouped module's partial forward); IDLE: FSDP's final callback calls it for a group not used
_PRE_BACKWARD, _FORWARD = TrainingState.PRE_BACKWARD, TrainingState.FORWARD  # identity: an Enum hashes in Python
#: what ``FSDPParamGroup.is_unsharded`` / ``is_sharded_post_forward`` compare, read directly (a
#: property is a frame: ~0.3 us in place, at ~70 events a step)
_UNSHARDED, _SHARDED_POST_FORWARD = ShardedState.UNSHARDED, ShardedState.SHARDED_POST_FORWARD


def _distinct_bytes(tensors: Any) -> tuple[int, str]:
    """Bytes of the distinct storages behind ``tensors`` (None skipped), and their device."""
    seen: dict[int, int] = {}
    device = ""
    for t in tensors:
        if t is None:
            continue
        for st in storages_of(t):
            if id(st) not in seen:
                seen[id(st)] = rounded(st.nbytes(), device_block(st.device))
                device = str(st.device)
    return sum(seen.values()), device


def _storage_bytes(t: torch.Tensor) -> int:
    n = t.untyped_storage().nbytes()
    return rounded(n, device_block(t.device)) if t.is_cuda else n


class _Held:
    """A buffer FSDP's communication context holds: its bytes as counted here (0 where the
    tracker accounts it per tensor) and a weak reference to it, to forget it then."""

    __slots__ = ("cat", "dev", "nbytes", "ref")

    def __init__(self, dev: str, cat: int, nbytes: int, ref: weakref.ref[torch.UntypedStorage] | None) -> None:
        self.dev, self.cat, self.nbytes, self.ref = dev, cat, nbytes, ref


class WaitToken(NamedTuple):
    """What ``wait_for_unshard`` started from."""

    had_result: bool  # an all-gather was pending
    forward: bool  # in forward, where FSDP defers freeing the output to the next copy-out
    was_deferred: bool  # an earlier output was deferred
    output: weakref.ref[torch.UntypedStorage] | None  # the pending output's storage (per-tensor accounting)


class CommMirror:
    """What one FSDP root's communication context holds: the all-gather output FSDP defers to
    the next copy-out in forward, and the reduce-scatter inputs it retains. Every group's events
    pass through it, so it stays aligned with FSDP's own state; it releases each buffer when FSDP
    lets go of it (whatever thread of the communication backend still holds it), as light mode's
    integers and as per-tensor accounting's entries (forgotten then), so both agree. On CUDA,
    per-tensor entries stay until the storage is freed, as the allocator counts them."""

    def __init__(self, comm: Any, sink: EventSink) -> None:
        self.comm = comm
        self._sink = sink
        self.deferred: _Held | None = None
        self.rs: list[_Held] = []  # per retained reduce-scatter input, oldest first
        self._newest_rs: weakref.ref[torch.Tensor] | None = None

    def _release(self, held: _Held) -> None:
        if held.nbytes:
            self._sink.add(held.dev, held.cat, -held.nbytes)
        elif held.ref is not None and (t := held.ref()) is not None and t.device.type != "cuda":
            # On CUDA a storage accounted per tensor stays until it is freed: the allocator counts
            # what ProcessGroupNCCL still holds of a collective's input after FSDP let go of it.
            self._sink.forget(t)

    def reconcile(self) -> None:
        """Let go of what FSDP let go of since: the deferred all-gather output (the root's
        post-forward frees it) and the oldest reduce-scatter inputs (popped, or cleared by the
        final callback)."""
        if self.deferred is not None and getattr(self.comm, "all_gather_state", None) is None:
            self._release_deferred()
        states = _reduce_scatter_states(self.comm)
        while len(self.rs) > len(states):
            self._release(self.rs.pop(0))

    def _release_deferred(self) -> None:
        held, self.deferred = self.deferred, None
        if held is not None:
            self._release(held)

    def before_wait(self, group: Any, per_tensor: bool) -> WaitToken:
        result = group._all_gather_result
        return WaitToken(result is not None, group._training_state is _FORWARD,
                         self.comm.all_gather_state is not None,
                         weakref.ref(result.all_gather_output.untyped_storage())
                         if per_tensor and result is not None else None)

    def after_wait(self, before: WaitToken, dev: str, nbytes: int) -> bool:
        """After ``wait_for_unshard`` that began as ``before`` says: see ``waited``."""
        if not before.had_result:
            return False  # FSDP returned early
        return self.waited(before.forward, before.was_deferred, dev, nbytes, before.output)

    def waited(self, forward: bool, was_deferred: bool, dev: str, nbytes: int,
               output: weakref.ref[torch.UntypedStorage] | None) -> bool:
        """After a ``wait_for_unshard`` that had an all-gather result (``forward``: in forward;
        ``was_deferred``: an earlier output was deferred then): whether the group's all-gather
        output (``nbytes`` counted by the group, or 0; ``output``: its storage where accounted per
        tensor) is now the deferred one, which this mirror then releases in its time."""
        held = self.deferred  # ``_release_deferred`` written out (every wait in forward)
        if forward and was_deferred and held is not None:
            self.deferred = None
            self._release(held)  # FSDP freed the previous output first
            held = None
        if self.comm.all_gather_state is not None and (forward or not was_deferred):
            if held is not None:
                self.deferred = None
                self._release(held)
            self.deferred = _Held(dev, _AG, nbytes, output)
            return True
        return False

    def rs_count(self) -> int:
        return len(_reduce_scatter_states(self.comm))

    def after_post_backward(self, count_before: int, category: int, counted: bool, dev: str) -> int | None:
        """After a post-backward that began with ``count_before`` retained inputs: mirror the
        oldest ones FSDP released and the one it appended, on the group's device ``dev`` (FSDP
        allocates it there; ``str(t.device)`` cost ~3 us a call in place); returns the appended
        bytes (counted here when ``counted``), None when it appended none."""
        states = _reduce_scatter_states(self.comm)
        t = states[-1].reduce_scatter_input if states else None
        appended = t is not None and (self._newest_rs is None or self._newest_rs() is not t)
        released = count_before + appended - len(states)
        while released > 0 and self.rs:
            self._release(self.rs.pop(0))
            released -= 1
        if t is None or not appended:
            return None
        st = t.untyped_storage()  # ``_storage_bytes`` written out
        n = rounded(st.nbytes(), device_block(t.device)) if t.is_cuda else st.nbytes()
        self._newest_rs = weakref.ref(t)
        self.rs.append(_Held(dev, category, n if counted else 0, None if counted else weakref.ref(st)))
        if counted:
            self._sink.add(dev, category, n)
        return n

    def drop_counts(self) -> None:
        """Subtract what is counted (per-tensor accounting takes over): the buffers stay held."""
        for held in ([self.deferred] if self.deferred is not None else []) + self.rs:
            if held.nbytes:
                self._sink.add(held.dev, held.cat, -held.nbytes)
                held.nbytes = 0


class TensorGroup:
    """One group's buffers through its tensors, at every event (deep steps, the fallback)."""

    def __init__(self, group: Any, sink: EventSink, reduce_category: str, post_forward_shards: bool) -> None:
        self.group = group
        self.params: list[Any] = list(group.fsdp_params)
        self._sink = sink
        self._reduce_category = reduce_category
        self._post_forward_shards = post_forward_shards
        self._first: Any = None
        self._storages: list[torch.UntypedStorage] = []

    def unsharded_storages(self) -> list[torch.UntypedStorage]:
        """The storages FSDP allocates once per parameter and resizes between full and 0 at every
        unshard / reshard: the list is rebuilt only when the first output is a new tensor."""
        outputs = self.params[0].all_gather_outputs if self.params else []
        first = outputs[0] if outputs else None
        if first is not self._first:
            self._storages = [t.untyped_storage() for fp in self.params for t in fp.all_gather_outputs]
            self._first = first
        return self._storages

    def sync(self) -> None:
        """Account what the group holds now (taking over from integer accounts)."""
        group, sink = self.group, self._sink
        sink.track_all([fp.sharded_param.grad for fp in self.params], SHARDED_GRAD)
        sink.track_all([getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in self.params]
                       + [fp.unsharded_accumulated_grad for fp in self.params], UNSHARDED_GRAD)
        if group.is_unsharded:
            sink.track_storages(self.unsharded_storages(), UNSHARDED_PARAM)
        self.after_reshard()
        if group._all_gather_result is not None:
            sink.track(group._all_gather_result.all_gather_output, ALL_GATHER)

    def after_unshard(self) -> None:
        if self.group._all_gather_result is not None:
            self._sink.track(self.group._all_gather_result.all_gather_output, ALL_GATHER)

    def pending_all_gather(self) -> int:
        return 0  # its tensor carries the bytes

    def after_wait(self, deferred: bool, before: WaitToken | None) -> None:
        sink = self._sink
        if not deferred and before is not None and before.output is not None:
            output = before.output()  # freed by FSDP now, whoever else still holds it
            if output is not None and self.group._all_gather_result is None:
                sink.forget(output)
        sink.track_storages(self.unsharded_storages(), UNSHARDED_PARAM)

    def after_reshard(self) -> None:
        self._sink.refresh_storages(self.unsharded_storages())
        if self._post_forward_shards:
            self._sink.track_all([getattr(fp, "_sharded_post_forward_param_data", None) for fp in self.params],
                                 UNSHARDED_PARAM)

    def before_post_backward(self) -> None:
        self._sink.track_all([getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in self.params]
                             + [fp.unsharded_accumulated_grad for fp in self.params], UNSHARDED_GRAD)

    def after_post_backward(self, reduce_scatter_bytes: int | None) -> None:
        sink = self._sink
        sink.track_all([fp.sharded_param.grad for fp in self.params], SHARDED_GRAD)
        # kept unreduced (accumulation without gradient sync)
        sink.track_all([fp.unsharded_accumulated_grad for fp in self.params], UNSHARDED_GRAD)
        sink.refresh_storages(self.unsharded_storages())
        states = getattr(self.group.comm_ctx, "reduce_scatter_states", None)
        if states and reduce_scatter_bytes is not None:  # the one just appended
            sink.track(states[-1].reduce_scatter_input, self._reduce_category)

    def reconcile(self) -> None:
        return None


class LightGroup:
    """One group's buffers as integers moved by FSDP's events (see the module docstring)."""

    def __init__(self, group: Any, sink: EventSink) -> None:
        self.group = group
        self.params: list[Any] = list(group.fsdp_params)
        self._sink = sink
        self.dev = str(group.device)
        self._trainable = [fp for fp in self.params if fp.sharded_param.requires_grad]
        #: why this group cannot be accounted from its events (None: it can)
        self.unfit: str | None = None
        if any(hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") for fp in self.params):
            self.unfit = "all-gather extensions"
        # what is counted now (bytes)
        self._unsharded = self._post_forward = self._pending_ag = 0
        self._grads = self._accumulated = self._sharded_grads = 0
        self._sg_dev = self.dev
        #: the sharded gradients were sized from what existed at ``sync``, not after a
        #: post-backward: some parameters may have had none then
        self._sg_from_sync = False
        #: FSDP holds an all-gather result that ``wait_for_unshard`` has not consumed yet (seen at
        #: unshard or sync; its bytes, where counted, are ``_pending_ag``)
        self.all_gather_seen = False
        # learnt sizes (None: not learnt yet)
        self._full: int | None = None
        self._first_output: weakref.ref[torch.Tensor] | None = None
        self._post_forward_full: int | None = None
        self._grads_full: int | None = None
        self._accumulated_full: int | None = None
        self._sharded_grads_full: tuple[int, str] | None = None
        self._rs_full: int | None = None
        self._ag_numel, self._ag_dtype, self._ag_bytes = -1, None, 0  # the last all-gather output's

    # -- learning sizes (once per buffer, per-parameter work allowed here) ----------------------
    def _unsharded_bytes(self) -> int:
        outputs = self.params[0].all_gather_outputs if self.params else []
        first = outputs[0] if outputs else None
        known = self._first_output() if self._first_output is not None else None
        if self._full is None or first is not known:
            storages = {id(st): st for fp in self.params for t in fp.all_gather_outputs
                        for st in storages_of(t)}
            self._full = sum(rounded(st.nbytes(), device_block(st.device)) for st in storages.values())
            for st in storages.values():  # known to the ledger: autograd saves them (weights)
                self._sink.hold(st, UNSHARDED_PARAM)
            self._first_output = weakref.ref(first) if first is not None else None
        return self._full

    # -- events -----------------------------------------------------------------------------------
    def after_unshard(self) -> None:
        result = self.group._all_gather_result
        if result is not None and not self._pending_ag:
            self.all_gather_seen = True
            out = result.all_gather_output  # a new flat tensor per all-gather, the same shape each time
            if out.numel() != self._ag_numel or out.dtype is not self._ag_dtype:
                self._ag_numel, self._ag_dtype, self._ag_bytes = out.numel(), out.dtype, _storage_bytes(out)
            self._pending_ag = self._ag_bytes
            self._sink.add(self.dev, _AG, self._pending_ag)

    def pending_all_gather(self) -> int:
        return self._pending_ag

    def after_wait(self, deferred: bool, before: WaitToken | None) -> None:
        sink = self._sink
        if self.all_gather_seen and self.group._all_gather_result is None:
            if self._pending_ag and not deferred:  # freed at the end of the copy-out
                sink.add(self.dev, _AG, -self._pending_ag)
            self._pending_ag = 0
            self.all_gather_seen = False
        if self.group._sharded_state is _UNSHARDED:
            if not self._unsharded:
                # ``_unsharded_bytes``, its usual case written out: FSDP keeps its all-gather
                # outputs from one unshard to the next, so the figure learnt on them holds
                full, known = self._full, self._first_output
                outputs = self.params[0].all_gather_outputs if self.params else ()
                if full is None or known is None or not outputs or outputs[0] is not known():
                    full = self._unsharded_bytes()
                self._unsharded = full
                sink.add(self.dev, _UP, full)
            if self._post_forward:
                sink.add(self.dev, _UP, -self._post_forward)
                self._post_forward = 0

    def after_reshard(self) -> None:
        sharded_state, sink = self.group._sharded_state, self._sink
        if sharded_state is _UNSHARDED:
            return
        if self._unsharded:
            sink.add(self.dev, _UP, -self._unsharded)
            self._unsharded = 0
        if sharded_state is _SHARDED_POST_FORWARD and not self._post_forward:
            if self._post_forward_full is None:
                self._post_forward_full, _ = _distinct_bytes(
                    getattr(fp, "_sharded_post_forward_param_data", None) for fp in self.params)
            self._post_forward = self._post_forward_full
            sink.add(self.dev, _UP, self._post_forward)

    def before_post_backward(self) -> None:
        state = self.group._training_state
        if state is not _PRE_BACKWARD and state is not _FORWARD:
            return  # not used in this backward: no gradients (FSDP's call from its final callback)
        if self._grads or not self._trainable:
            return
        if getattr(getattr(self._trainable[0], "_unsharded_param", None), "grad", None) is None:
            # No gradient for the first parameter in this backward (a module that returned its
            # input, a branch not taken): the learnt size does not hold, so count the parameters'
            # own; where some have one, the group cannot be accounted from its events.
            grads, _ = _distinct_bytes(
                getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in self._trainable)
            if grads:
                self.unfit = "a parameter without a gradient in a step, or with one"
        else:
            if self._grads_full is None:
                self._grads_full, _ = _distinct_bytes(
                    getattr(getattr(fp, "_unsharded_param", None), "grad", None) for fp in self._trainable)
            grads = self._grads_full
        if grads:
            self._grads = grads
            self._sink.add(self.dev, _UG, grads)

    def after_post_backward(self, reduce_scatter_bytes: int | None) -> None:
        group, sink = self.group, self._sink
        if group.reduce_grads:
            sink.add(self.dev, _UG, -(self._grads + self._accumulated))
            self._grads = self._accumulated = 0
            if reduce_scatter_bytes is not None:
                if self._rs_full is None:
                    self._rs_full = reduce_scatter_bytes
                elif reduce_scatter_bytes != self._rs_full:
                    self.unfit = "a parameter without a gradient in a step, or with one"
            if self._sg_from_sync:  # sized once more, now that this backward made its gradients
                self._sg_from_sync, self._sharded_grads_full = False, None
                sink.add(self._sg_dev, _SG, -self._sharded_grads)
                self._sharded_grads = 0
            if not self._sharded_grads and self.params[0].sharded_param.grad is not None:
                self._learn_sharded_grads()
                sink.add(self._sg_dev, _SG, self._sharded_grads)
        elif self._grads and self.params[0].unsharded_accumulated_grad is not None:
            # mixed precision: FSDP keeps the gradients in the reduce dtype until it reduces
            if self._accumulated_full is None:
                self._accumulated_full, _ = _distinct_bytes(fp.unsharded_accumulated_grad for fp in self._trainable)
            sink.add(self.dev, _UG, self._accumulated_full - self._accumulated - self._grads)
            self._accumulated, self._grads = self._accumulated_full, 0

    def _learn_sharded_grads(self) -> None:
        if self._sharded_grads_full is None:
            self._sharded_grads_full = _distinct_bytes(fp.sharded_param.grad for fp in self._trainable)
        self._sharded_grads, dev = self._sharded_grads_full
        self._sg_dev = dev or self.dev

    def reconcile(self) -> None:
        """At step boundaries: let go of what was let go of without an event of ours: sharded
        gradients ``zero_grad`` dropped, and what ``reset_iter_state`` dropped after an exception
        (it reshards and discards the pending all-gather and the unsharded gradients directly)."""
        group, sink = self.group, self._sink
        if self._sharded_grads and self.params[0].sharded_param.grad is None:
            sink.add(self._sg_dev, _SG, -self._sharded_grads)
            self._sharded_grads = 0
        if self._unsharded and not group.is_unsharded:
            sink.add(self.dev, _UP, -self._unsharded)
            self._unsharded = 0
        if self._post_forward and not group.is_sharded_post_forward:
            sink.add(self.dev, _UP, -self._post_forward)
            self._post_forward = 0
        if self.all_gather_seen and group._all_gather_result is None:
            sink.add(self.dev, _AG, -self._pending_ag)
            self._pending_ag = 0
            self.all_gather_seen = False
        if (self._grads or self._accumulated) and self._trainable:
            first = self._trainable[0]
            if getattr(getattr(first, "_unsharded_param", None), "grad", None) is None \
                    and first.unsharded_accumulated_grad is None:
                sink.add(self.dev, _UG, -(self._grads + self._accumulated))
                self._grads = self._accumulated = 0

    # -- hand-over --------------------------------------------------------------------------------
    def sync(self) -> None:
        """Count what the group holds now (at attach, and when per-tensor accounting hands back)."""
        group = self.group
        self.all_gather_seen = group._all_gather_result is not None  # uncounted: it was pending before
        if group.is_unsharded and not self._unsharded:
            self._unsharded = self._unsharded_bytes()
            self._sink.add(self.dev, _UP, self._unsharded)
        if not self._sharded_grads and self.params and self.params[0].sharded_param.grad is not None:
            self._learn_sharded_grads()
            self._sink.add(self._sg_dev, _SG, self._sharded_grads)
            self._sg_from_sync = True

    def drop_counts(self) -> None:
        """Subtract everything counted (before per-tensor accounting takes over)."""
        sink = self._sink
        sink.add(self.dev, _UP, -(self._unsharded + self._post_forward))
        sink.add(self.dev, _AG, -self._pending_ag)
        sink.add(self.dev, _UG, -(self._grads + self._accumulated))
        sink.add(self._sg_dev, _SG, -self._sharded_grads)
        self._unsharded = self._post_forward = self._pending_ag = 0
        self._grads = self._accumulated = self._sharded_grads = 0
        self.all_gather_seen = False

    def tensors(self) -> list[torch.Tensor]:
        """What per-tensor accounting tracked that integers now carry (its bytes are forgotten)."""
        out: list[torch.Tensor] = []
        for fp in self.params:
            for t in (fp.sharded_param.grad, fp.unsharded_accumulated_grad,
                      getattr(getattr(fp, "_unsharded_param", None), "grad", None),
                      getattr(fp, "_sharded_post_forward_param_data", None)):
                if t is not None:
                    out.append(t)
            out.extend(fp.all_gather_outputs)
        return out


def reduce_category(group: Any) -> str:
    """Where the group's unreduced-gradient buffer goes: reduce_scatter, or temp where its shard
    group has one rank (no reduce-scatter runs: a plain copy, as upstream FSDPMemTracker says)."""
    rs_group = getattr(group, "_reduce_scatter_process_group", None)
    return TEMP if rs_group is None or rs_group.size() == 1 else REDUCE_SCATTER


def _reduce_scatter_states(comm: Any) -> list[Any]:
    """The reduce-scatter states FSDP retains, oldest first: ``reduce_scatter_states`` since torch
    2.13; torch 2.11 and 2.12 (the GPU machine's torch) keep only the newest, ``reduce_scatter_state``."""
    states = getattr(comm, "reduce_scatter_states", None)
    if states is not None:
        return states
    state = getattr(comm, "reduce_scatter_state", None)
    return [] if state is None else [state]
