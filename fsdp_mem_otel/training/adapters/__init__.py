"""FSDP adapters: the only code that touches FSDP internals, one module per generation."""

from __future__ import annotations

from torch import nn

from fsdp_mem_otel.training.adapters.base import Adapter, EventSink, module_keys

__all__ = ["Adapter", "EventSink", "make_adapter", "module_keys"]


def make_adapter(model: nn.Module, sink: EventSink) -> Adapter:
    """The adapter for the FSDP generation ``model`` is wrapped with.

    Raises ValueError when the model has no FSDP module, or modules of both generations.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    has_v2 = any(isinstance(m, FSDPModule) for m in model.modules())
    has_v1 = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    if has_v1 and has_v2:
        raise ValueError("model mixes FSDP1 and FSDP2 modules; wrap it with one generation only")
    if has_v2:
        from fsdp_mem_otel.training.adapters.fsdp2 import FSDP2Adapter

        return FSDP2Adapter(model, sink)
    if has_v1:
        from fsdp_mem_otel.training.adapters.fsdp1 import FSDP1Adapter

        return FSDP1Adapter(model, sink)
    raise ValueError(
        f"model ({type(model).__name__}) contains no FSDP module; supported: FSDP2 "
        "(torch.distributed.fsdp.fully_shard) and FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel)"
    )
