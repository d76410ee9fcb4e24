"""Living beside ``torch.compile``: hooks dynamo never traces, compiled regions found, eager deep steps. Hooks run
inside compiled blocks (``fullgraph=True``, as torchtitan does), where dynamo would trace them and break the
graph; ``torch._dynamo.disable`` costs ~0.5 us a call even eagerly, so the tracker's modules go on dynamo's skip
list, as ``torch.nn`` does. Where that fails, ``dynamo_safe`` wraps hooks in ``torch.compiler.disable``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])

# Every module whose functions run inside hooks; not the demo model (fsdp_mem_otel.tools.demo): tests compile it.
_HOOK_MODULES = (
    "fsdp_mem_otel.training.light.activations",
    "fsdp_mem_otel.training.adapters",
    "fsdp_mem_otel.training.allocator",
    "fsdp_mem_otel.training.compile_support",
    "fsdp_mem_otel.training.deep",
    "fsdp_mem_otel.integrations._session",
    "fsdp_mem_otel.integrations.auto",
    "fsdp_mem_otel.training.light.ledger",
    "fsdp_mem_otel.training.optimizers",
    "fsdp_mem_otel.training.shadow_peaks",  # torch's peak readers, wrapped: called from anywhere
    "fsdp_mem_otel.schema",
    "fsdp_mem_otel.training.light.sink",
    "fsdp_mem_otel.training.light.recorder",
    "fsdp_mem_otel.training.tracker",
)
_skipped: bool | None = None  # None: not tried yet


def keep_out_of_dynamo() -> bool:
    """Put the tracker's modules on dynamo's skip list (once); False where that failed."""
    global _skipped
    if _skipped is None:
        try:
            from torch._dynamo import trace_rules

            for name in _HOOK_MODULES:
                trace_rules.add(name)
            _skipped = True
        except Exception:  # noqa: BLE001 - a torch without this private API: wrap hooks instead
            logger.warning("fsdp_mem_otel: dynamo skip list unavailable; hooks are wrapped in "
                           "torch.compiler.disable instead", exc_info=True)
            _skipped = False
    return _skipped


def dynamo_safe(fn: _F) -> _F:
    """``fn`` as a hook dynamo never traces: itself on the skip list, else ``torch.compiler.disable``'d."""
    if keep_out_of_dynamo():
        return fn
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]


def compiled_regions(model: nn.Module) -> list[str]:
    """Paths of ``model``'s modules running compiled code (in place, wrapped, or a forward); "": the model."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = []
    for path, mod in model.named_modules():
        forward = mod.__dict__.get("forward")
        if (
            isinstance(mod, OptimizedModule)
            or getattr(mod, "_compiled_call_impl", None) is not None
            or getattr(forward, "_torchdynamo_orig_callable", None) is not None
        ):
            found.append(path)
    return found


def called_from_compiled_code() -> bool:
    """Whether compiled code runs up this thread's stack (dynamo's frame callback is set only then)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        return get_eval_frame_callback() is not None
    except Exception:  # noqa: BLE001 - a torch without it: unknown, so assume compiled
        logger.debug("fsdp_mem_otel: dynamo's frame callback unavailable", exc_info=True)
        return True


def force_eager() -> Callable[[], None]:
    """Run compiled code eagerly from now on (``set_stance("force_eager")``); returns the undo."""
    stance = torch.compiler.set_stance("force_eager")  # takes effect at construction
    return lambda: stance.__exit__(None, None, None)
