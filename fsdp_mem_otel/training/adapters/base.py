"""What every FSDP adapter provides, and what it may call on the tracker.

An adapter is the only code that knows FSDP internals. It turns FSDP's own hook points into
``sink.on_state(module_key, state)`` calls and tells the sink which tensors FSDP holds, by
category (``sink.track(tensor, category)``) or that their storage was resized
(``sink.refresh(tensor)``). It must save what it patches and restore exactly that on detach.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_mem_otel.schema import ROOT_KEY

# Attributes under which wrappers hold the module they wrap: FSDP1, activation checkpointing and
# CPU offload wrappers, torch.compile's OptimizedModule, Lightning Fabric's _FabricModule.
_WRAPPER_ATTRS = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module", "_orig_mod", "_forward_module"}
)
# DDP, DataParallel and accelerate-style wrappers hold it as ``module``: a wrapper segment only
# when the parent is nothing but that wrapper (no parameters, buffers or other children).
_GENERIC_WRAPPER_ATTR = "module"


def is_wrapper_segment(parent: nn.Module, name: str, child: nn.Module) -> bool:
    """Whether ``parent.<name>`` is the module a wrapper wraps (a segment users never wrote)."""
    if name in _WRAPPER_ATTRS:
        return True
    if name != _GENERIC_WRAPPER_ATTR or parent._parameters or parent._buffers:
        return False
    return all(c is child for c in parent.children())


def module_keys(model: nn.Module) -> dict[nn.Module, str]:
    """Every module of ``model`` -> its key: its path in the user's model, wrapper segments
    (see ``is_wrapper_segment``) dropped, the top-most module named ``<root>``."""
    keys: dict[nn.Module, str] = {model: ROOT_KEY}

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in parent.named_children():
            if child in keys:
                continue
            if not is_wrapper_segment(parent, name, child):
                path_of_child = f"{path}.{name}" if path else name
            else:
                path_of_child = path
            keys[child] = path_of_child or ROOT_KEY
            visit(child, path_of_child)

    visit(model, "")
    return keys


class EventSink(Protocol):
    """The tracker, as adapters see it. None of these raise into FSDP."""

    def on_state(self, key: str, state: str, tensors: object = None, windowed: bool = True) -> None:
        """Module ``key`` reached ``state`` (one of model.STATES, forward ones also in AC);
        ``tensors``: the module's inputs (pre-forward) or outputs (post-forward) at that state;
        ``windowed=False``: the state opens or closes no peak window (see ``open_window``)."""

    def backward_state(self, key: str, state: str, windowed: bool = True) -> None:
        """``on_state`` for a state of ``BACKWARD_STATES`` reported from FSDP's backward hooks."""

    def open_window(self, key: str, peak_state: str) -> None:
        """Start module ``key``'s ``peak_state`` window where FSDP's states cannot mark it."""

    def close_window(self, key: str, peak_state: str) -> None:
        """End module ``key``'s ``peak_state`` window."""

    def end_window(self, key: str, peak_state: str, oldest: bool = False) -> None:
        """End module ``key``'s latest (``oldest``: earliest) ``peak_state`` window alone (windows
        that overlap, not nest)."""

    def add(self, device: str, cat: int, delta: int) -> None:
        """Add ``delta`` bytes to category index ``cat`` on ``device`` (integer accounts)."""

    def hold(self, st: torch.UntypedStorage, category: str) -> None:
        """Make ``st`` known at 0 bytes: an integer account carries its bytes."""

    def forget(self, obj: torch.Tensor | torch.UntypedStorage) -> None:
        """A storage, or a tensor's storages, keep their entries at 0 bytes: FSDP let go of it, or
        an integer account takes its bytes over."""

    def track(self, tensor: torch.Tensor | None, category: str) -> None:
        """Account ``tensor``'s storages under ``category`` (re-categorizing known ones)."""

    def track_all(self, tensors: list[torch.Tensor | None], category: str) -> None:
        """``track`` for each of ``tensors`` (None entries skipped), in one call."""

    def track_storages(self, storages: list[torch.UntypedStorage], category: str) -> None:
        """Account storages FSDP keeps (and resizes) under ``category``."""

    def refresh(self, tensor: torch.Tensor | None) -> None:
        """``tensor``'s storages may have been resized: re-read their sizes."""

    def refresh_storages(self, storages: list[torch.UntypedStorage]) -> None:
        """``storages`` may have been resized: re-read their sizes."""

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

    def shards_nothing(self) -> bool:
        """Every FSDP module's shard group has one rank (or no sharding strategy): nothing sharded."""

    def start(self) -> None:
        """The tracker counts from now (after attach): account what FSDP holds already."""

    def use_tensors(self, on: bool) -> None:
        """Deep steps (``on``): account FSDP's buffers per tensor, as deep mode's ops see them."""

    def reconcile(self) -> None:
        """Step end: let go of what FSDP and ``zero_grad`` let go of without an event."""

    @property
    def fallback_groups(self) -> int:
        """Groups light mode accounts per tensor because their events cannot say their bytes."""


_Tensor = torch.Tensor


def tensors_in(obj: object) -> list[torch.Tensor]:
    """The tensors inside nested lists, tuples and dicts, in order, as a list (the hot path's
    ``iter_tensors``: a forward hook's ``(args, kwargs)`` at every FSDP module). Exact types are
    tried before ``isinstance`` (a tensor's is ~3x slower, and a container is checked against it):
    subclasses of each still count."""
    cls = type(obj)
    if cls is _Tensor:
        return [obj]  # type: ignore[list-item]
    if cls is tuple:
        pair: tuple[Any, ...] = obj  # type: ignore[assignment]
        if len(pair) == 2:  # a forward pre-hook's ``((x,), {})``, the usual call of a block: no walk
            args, kwargs = pair
            if type(args) is tuple and len(args) == 1 and type(kwargs) is dict and not kwargs \
                    and type(args[0]) is _Tensor:
                return [args[0]]
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        cls = type(o)
        if cls is tuple or cls is list:
            stack.extend(reversed(o))  # type: ignore[call-overload]
        elif cls is dict:
            if o:
                stack.extend(reversed(list(o.values())))  # type: ignore[attr-defined]
        elif cls is _Tensor or isinstance(o, _Tensor):
            out.append(o)  # type: ignore[arg-type]
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
    return out


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


def fsdp_module_keys(model: nn.Module, is_fsdp: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """(key, module) for each FSDP-wrapped module in ``model``, in named_modules() order. Keys
    are unique: where two FSDP modules would share one (a wrapper named ``module`` around an FSDP
    module that is FSDP itself), the later keeps its full path."""
    keys = module_keys(model)
    out: list[tuple[str, nn.Module]] = []
    used: set[str] = set()
    for path, mod in model.named_modules():
        module: nn.Module = mod  # isinstance() below narrows ``mod`` to the FSDP mixin type
        if not isinstance(mod, is_fsdp):
            continue
        key = keys[module]
        if key in used:
            key = path or ROOT_KEY
        used.add(key)
        out.append((key, module))
    return out
