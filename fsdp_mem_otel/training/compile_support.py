"""Living beside ``torch.compile``: hooks dynamo never traces, compiled regions found, eager deep steps.

The tracker's hooks run inside compiled programs: a forward hook on a block compiled in place
(``block.compile(fullgraph=True)``, as torchtitan does) is a Python frame that dynamo would try to
compile, and a call like ``time.perf_counter`` inside it then fails the ``fullgraph`` block or
adds graph breaks. FSDP2 wraps its own hooks in ``torch._dynamo.disable``; that costs about half
a microsecond per call even in eager training. Instead, the tracker's modules are put on dynamo's
skip list, as ``torch.nn`` is: dynamo runs their frames as they are, with no tracing and no cost
outside compiled regions. Where that registration is not possible, each hook is wrapped in
``torch.compiler.disable(recursive=True)`` instead (``dynamo_safe``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])

# Every module whose functions run inside hooks, optimizer hooks or saved-tensor hooks. The demo
# model (fsdp_mem_otel.tools.demo) is not here: users and tests compile it.
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
    """``fn`` as a hook dynamo never traces: itself when the skip list holds the tracker's
    modules, else wrapped in ``torch.compiler.disable(recursive=True)``."""
    if keep_out_of_dynamo():
        return fn
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]


def compiled_regions(model: nn.Module) -> list[str]:
    """Paths (``named_modules()``) of the modules of ``model`` that run compiled code: compiled in
    place (``module.compile()``), wrapped by ``torch.compile(module)``, or whose ``forward`` was
    replaced by a compiled function. "" is the model itself."""
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
    """Whether code that ``torch.compile`` compiled is running further up this thread's stack (an
    outer ``torch.compile(model)``, a compiled training step): dynamo's frame callback is set
    only while such code runs."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback

        return get_eval_frame_callback() is not None
    except Exception:  # noqa: BLE001 - a torch without it: unknown, so assume compiled
        logger.debug("fsdp_mem_otel: dynamo's frame callback unavailable", exc_info=True)
        return True


def force_eager() -> Callable[[], None]:
    """Run ``torch.compile``'d code eagerly from now on (``set_stance("force_eager")``); returns
    the function that puts the previous stance back."""
    stance = torch.compiler.set_stance("force_eager")  # takes effect at construction
    return lambda: stance.__exit__(None, None, None)
