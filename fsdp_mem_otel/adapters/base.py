"""What every FSDP adapter provides, and what it may call on the tracker.

An adapter is the only code that knows FSDP internals. It turns FSDP's own hook points into
``sink.on_state(module_key, state)`` calls and tells the sink which tensors FSDP holds, by
category (``sink.track(tensor, category)``) or that their storage was resized
(``sink.refresh(tensor)``). It must save what it patches and restore exactly that on detach.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from fsdp_mem_otel.model import ROOT_KEY

# Wrapper segments that FSDP1 and activation-checkpoint wrappers insert into module paths.
_WRAPPER_SEGMENTS = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module", "_orig_mod"}
)


def module_key(path: str) -> str:
    """The user's path for a module: wrapper segments dropped, the root named ``<root>``."""
    parts = [p for p in path.split(".") if p and p not in _WRAPPER_SEGMENTS]
    return ".".join(parts) if parts else ROOT_KEY


class EventSink(Protocol):
    """The tracker, as adapters see it. None of these raise into FSDP."""

    def on_state(self, key: str, state: str) -> None:
        """Module ``key`` reached ``state`` (one of model.STATES, forward ones also in AC)."""

    def track(self, tensor: torch.Tensor | None, category: str) -> None:
        """Account ``tensor``'s storages under ``category`` (re-categorizing known ones)."""

    def refresh(self, tensor: torch.Tensor | None) -> None:
        """``tensor``'s storages may have been resized: re-read their sizes."""

    def report_error(self, exc: BaseException) -> None:
        """An adapter's own code failed inside an FSDP hook: log once, count, carry on."""


class Adapter(Protocol):
    """One FSDP generation's view of a model."""

    fsdp_version: int

    def attach(self) -> None:
        """Install hooks and patches."""

    def detach(self) -> None:
        """Remove every hook and restore every patched attribute to the original object."""

    def module_keys(self) -> list[str]:
        """Keys of the FSDP modules, in named_modules() order."""

    def persistent_tensors(self) -> Iterator[tuple[torch.Tensor, str]]:
        """(tensor, category) for what outlives a step: sharded params and grads, buffers."""


def iter_tensors(obj: object) -> Iterable[torch.Tensor]:
    """Tensors inside nested lists, tuples and dicts (what FSDP hooks receive as args/outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)


def fsdp_module_paths(model: nn.Module, is_fsdp: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """(path, module) for each FSDP-wrapped module in ``model``, in named_modules() order."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, is_fsdp)]  # type: ignore[misc]
