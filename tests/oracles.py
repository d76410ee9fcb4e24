"""Oracles shared by the distributed tests, independent of the tracker: numel x element size of
what FSDP holds, the unwrapped model's own module names, upstream FSDPMemTracker's snapshots in
our key names, and a fingerprint of every hook and patch the adapters touch.

Imported by the rank bodies in the test modules (run on ranks spawned by tests/dist.py), so it
must stay cheap to import: nothing here forks or builds a model at import time.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp_mem_otel.schema import TOTAL

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
    from fsdp_mem_otel.training.demo import Block, BlockModel, InnerLinear

    kinds = (Block, InnerLinear) if nested else (Block,)
    plain = BlockModel(blocks, 8)
    return ["<root>"] + [n for n, m in plain.named_modules() if isinstance(m, kinds)]


def block_param_bytes() -> int:
    """Unsharded bytes of one Block's parameters, from the unwrapped module."""
    from fsdp_mem_otel.training.demo import Block

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
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None:
            for i, group in enumerate(state()._fsdp_param_groups):
                assert isinstance(group, FSDPParamGroup)
                print_ids[f"{path}:group{i}"] = sorted(k for k in vars(group) if callable(vars(group)[k]))
    for name in ("_pre_backward_hook", "_post_backward_hook", "_post_backward_reshard_only_hook",
                 "_post_backward_final_callback", "_unshard", "_reshard"):
        print_ids[f"runtime:{name}"] = id(getattr(_runtime_utils, name))
    print_ids["resize_"] = id(torch.UntypedStorage.resize_)
    print_ids["dispatch_mode"] = repr(_get_current_dispatch_mode())
    print_ids["opt_hooks"] = [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)]
    return print_ids


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
    very same step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

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
