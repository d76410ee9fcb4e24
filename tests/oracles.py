"""Oracles shared by the distributed tests, independent of the tracker: numel x element size of
what FSDP holds, the unwrapped model's own module names, upstream FSDPMemTracker's snapshots in
our key names, and a fingerprint of every hook and patch the adapters touch.

Imported by the rank bodies in the test modules (run on ranks spawned by tests/dist.py), so it
must stay cheap to import: nothing here forks or builds a model at import time.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_mem_otel.schema import TOTAL
from fsdp_mem_otel.training.adapters.fsdp2 import param_groups

#: the demo model the distributed tests train: BLOCKS blocks of WIDTH features, BATCH rows a step
BLOCKS, WIDTH, BATCH = 3, 64, 16


def settle() -> None:
    """Free cyclic garbage now and keep the collector out of the next step.

    FSDP keeps some buffers in reference cycles; when the cyclic collector happens to run inside
    a step, memory is freed at a different point, so two identical steps would differ.
    """
    gc.collect()
    gc.disable()


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def sharded_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards, by numel x element size of what model.parameters() holds."""
    return sum(_bytes(p) for p in model.parameters())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def grad_bytes(model: nn.Module) -> int:
    return sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def expected_module_keys(blocks: int, nested: bool = False) -> list[str]:
    """Oracle for module keys: the unwrapped model's own names of what gets sharded."""
    from fsdp_mem_otel.tools.demo import Block, BlockModel, InnerLinear

    kinds = (Block, InnerLinear) if nested else (Block,)
    plain = BlockModel(blocks, 8)
    return ["<root>"] + [n for n, m in plain.named_modules() if isinstance(m, kinds)]


def block_param_bytes() -> int:
    """Unsharded bytes of one Block's parameters, from the unwrapped module."""
    from fsdp_mem_otel.tools.demo import Block

    return sum(p.numel() * p.element_size() for p in Block(WIDTH).parameters())


def upstream_snapshot(snap: dict[Any, dict[Any, int]]) -> dict[str, dict[str, int]]:
    """Upstream's {device: {_FSDPRefType: bytes}} in our key names."""
    names = {
        "Sharded Param": "sharded_param",
        "Unsharded Param": "unsharded_param",
        "Buffer": "buffer",
        "Sharded Grad": "sharded_grad",
        "Unsharded Grad": "unsharded_grad",
        "Activation": "activation",
        "Temp": "temp",
        "All Gather": "all_gather",
        "Reduce Scatter": "reduce_scatter",
        "OptState": "optimizer_state",
        "Inputs": "inputs",
        "Total": TOTAL,
    }
    out = {}
    for dev, cats in snap.items():
        out[str(dev)] = {names[getattr(k, "value", k)]: int(v) for k, v in cats.items()}
    return out


def fsdp_fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Identity of every hook, patched attribute and global the adapters touch."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    print_ids: dict[str, Any] = {}
    for path, m in model.named_modules():
        print_ids[f"{path}:pre"] = [id(h) for h in m._forward_pre_hooks.values()]
        print_ids[f"{path}:post"] = [id(h) for h in m._forward_hooks.values()]
        if hasattr(m, "_get_fsdp_state"):
            for i, group in enumerate(param_groups(m)):
                assert isinstance(group, FSDPParamGroup)
                print_ids[f"{path}:group{i}"] = sorted(k for k in vars(group) if callable(vars(group)[k]))
    for name in ("_pre_backward_hook", "_post_backward_hook", "_post_backward_reshard_only_hook",
                 "_post_backward_final_callback", "_unshard", "_reshard"):
        print_ids[f"runtime:{name}"] = id(getattr(_runtime_utils, name))
    print_ids["resize_"] = id(torch.UntypedStorage.resize_)
    print_ids["dispatch_mode"] = repr(_get_current_dispatch_mode())
    print_ids["opt_hooks"] = [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)]
    return print_ids


class _ViewedStorages(TorchDispatchMode):
    """Weak references to the storages of the views made while it is on, except ``known`` ones."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self._known = known
        self.refs: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        res = func(*args, **(kwargs or {}))
        if func.is_view:
            for t in res if isinstance(res, (tuple, list)) else (res,):
                st = t.untyped_storage()
                if st.data_ptr() not in self._known:
                    self.refs.append(weakref.ref(st))
        return res


def prompt_gloo_reduce_scatter() -> Any:
    """FSDP2's default reduce-scatter, returning only once gloo has freed the buffer it made.

    gloo's reduce-scatter all-reduces a clone of its input and copies this rank's chunk out of it
    in ``wait``; the clone is freed when both the caller and gloo's worker thread have let go of
    the work, and the worker does so when it gets to it: in most steps before FSDP's next op, in
    some after the next module's unshard. Upstream FSDPMemTracker counts the clone until it is
    freed, so its peaks would depend on that thread's timing (ours end it with FSDP's
    post-backward). With this reduce-scatter the clone is freed before FSDP's post-backward goes
    on, in every step: the oracle's figures are the same in every run.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class PromptReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            assert not async_op
            work = super().__call__(output_tensor, input_tensor, group, op, True)
            known = {output_tensor.untyped_storage().data_ptr(), input_tensor.untyped_storage().data_ptr()}
            with _ViewedStorages(known) as seen:
                work.wait()
            del work
            deadline = time.monotonic() + 30
            while any(r() is not None for r in seen.refs):
                assert time.monotonic() < deadline, "gloo's worker kept the reduce-scatter's clone for 30 s"
                time.sleep(1e-4)  # lets the worker thread take the GIL and free it
            return None

    return PromptReduceScatter()


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors (Python's or C++'s) hold ``t``'s storage right now."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def prompt_gloo_all_gather() -> Any:
    """FSDP2's default all-gather, returning only once gloo's worker thread has let go of the output.

    gloo's worker keeps the work (and the chunks of the output it wrote) for a moment after it
    marks the work done. FSDP drops the all-gather output after copying it out (wait_for_unshard),
    but the memory goes only when the worker has let go too: at once in most steps, some ops later
    in others. Upstream FSDPMemTracker counts the output until it is freed, so its peaks would
    depend on that thread's timing. This one waits for the work and for the worker's release where
    the all-gather is issued: the output is then freed where FSDP drops it, in every step.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class PromptAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            users = _storage_users(output_tensor)
            work = super().__call__(output_tensor, input_tensor, group, True)
            assert work is not None
            work.wait()
            del work
            deadline = time.monotonic() + 30
            while _storage_users(output_tensor) > users:
                assert time.monotonic() < deadline, "gloo's worker kept the all-gather's output for 30 s"
                time.sleep(1e-4)  # lets the worker thread take the GIL and let go
            return None

    return PromptAllGather()


def late_gloo_reduce_scatter() -> Any:
    """FSDP2's default reduce-scatter, whose work (and so gloo's clone of the input) stays alive
    until the next reduce-scatter, or ``release()``: gloo's worker thread at its slowest, on purpose."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class LateReduceScatter(DefaultReduceScatter):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[Any] = []

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            self.held.clear()
            work = super().__call__(output_tensor, input_tensor, group, op, True)
            work.wait()
            self.held.append(work)
            return None

        def release(self) -> None:
            self.held.clear()

    return LateReduceScatter()


def use_all_gather(model: nn.Module, comm: Any) -> None:
    """Every FSDP2 group of ``model`` still on FSDP's default all-gather all-gathers with ``comm``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in param_groups(m):
                if type(group._all_gather_comm) is DefaultAllGather:
                    group._all_gather_comm = comm


def use_reduce_scatter(model: nn.Module, comm: Any, only_default: bool = False) -> None:
    """Every FSDP2 group of ``model`` reduce-scatters with ``comm`` (``only_default``: the groups
    still on FSDP's default one)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in param_groups(m):
                if not only_default or type(group._reduce_scatter_comm) is DefaultReduceScatter:
                    group._reduce_scatter_comm = comm


class UpstreamStep(NamedTuple):
    light: dict[str, Any]  # our light tracker's StepReport.to_dict()
    deep: dict[str, Any]  # our deep tracker's, the same step
    upstream: Any  # upstream's FSDPMemTracker, after the step
    errors: int  # our trackers' errors_total
    module_keys: list[str]  # our module keys


def step_under_upstream(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                        step: Callable[[], Any]) -> UpstreamStep:
    """``step()`` once under upstream FSDPMemTracker with our deep and light trackers attached
    inside its context (our hooks run first, our windows enclose upstream's): the three see the
    very same step, whose all-gathers and reduce-scatters let go of gloo's buffers before they
    return (``prompt_gloo_all_gather``, ``prompt_gloo_reduce_scatter``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    use_reduce_scatter(model, prompt_gloo_reduce_scatter(), only_default=True)
    use_all_gather(model, prompt_gloo_all_gather())
    settle()
    upstream = FSDPMemTracker(model, opt)
    upstream.track_inputs((x,))
    with upstream:
        deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
        light = FSDPMemoryTracker(model, opt, mode="light").attach()
        deep.track_inputs(x)
        light.track_inputs(x)
        step()
        light_report, deep_report = light.step().to_dict(), deep.step().to_dict()
        light.detach()
        deep.detach()
    return UpstreamStep(light_report, deep_report, upstream, light.errors_total + deep.errors_total,
                        light.module_keys)


def reset_fsdp_iteration(model: nn.Module) -> None:
    """FSDP2's recovery after an exception mid-step: ``reset_iter_state()`` on the root (torch 2.13+).
    Torch 2.11 and 2.12 (the GPU machine's torch) have none: the same steps, by hand, on their names."""
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()  # type: ignore[operator]
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    root = model._get_fsdp_state()  # type: ignore[operator]
    stream = root._device_handle.current_stream()
    ctx = root._comm_ctx
    for name in ("all_gather_state", "reduce_scatter_state"):
        pending = getattr(ctx, name, None)
        if pending is not None and pending.event is not None:
            stream.wait_event(pending.event)
        setattr(ctx, name, None)
    ctx.post_forward_order.clear()
    for state in root._state_ctx.all_states:
        state._training_state = TrainingState.IDLE
        for group in param_groups(state._modules[0]):
            result = group._all_gather_result
            if result is not None:
                if result.all_gather_event is not None:
                    stream.wait_event(result.all_gather_event)
                if isinstance(result.all_gather_work, torch.distributed.distributed_c10d.Work):
                    result.all_gather_work.wait()
                group._all_gather_result = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False
