"""Shadow peaks: the training script keeps its own CUDA peak statistics while the tracker resets them.

With ``reset_peaks`` the tracker resets the allocator's peak counters at every window edge; the script reads them
too (``max_memory_allocated()``, torchtitan's ``DeviceMemoryMonitor``, HF's and Lightning's metrics). While a
tracker holds a ``PeakClient``, every reader sees the peak since *its own* last reset: what a tracker reads before
it resets goes into a per-device shadow maximum, which the wrapped readers merge and the script's reset clears; a
reset by anyone else first folds the live peaks into each tracker's pending maxima.

Where torch's readers go (torch 2.13-2.14): ``torch.cuda.memory_stats``, ``max_memory_*`` and ``memory_summary``
call ``torch.cuda.memory.memory_stats_as_nested_dict`` by its module-global name; ``reset_max_memory_*`` call
``torch.cuda.memory.reset_peak_memory_stats``; ``torch.accelerator.max_memory_*`` call
``torch.accelerator.memory.memory_stats``. These four are wrapped under their module's name and re-export
(``PATCHED``) from the first ``acquire()`` to the last ``release()``.

Not shadowed (the live counters, with the tracker's resets in them):
- C++ readers (``c10::cuda::CUDACachingAllocator::getDeviceStats``: extensions, other runtimes) and Python calling
  the C bindings (``torch._C._cuda_memoryStats``, ``torch._C._accelerator_getDeviceStats``);
- a name bound to one of the four wrapped functions before attach (``from torch.cuda.memory import
  memory_stats_as_nested_dict``, a ``functools.partial``); names bound to the readers above them follow;
- after the last tracker detaches, the shadow goes with the wrappers: a reader sees the peak since the tracker's
  last reset;
- NVML / nvidia-smi (no peak counters), and the host (pinned memory) allocator's statistics, never reset."""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: (module, attribute) of each function wrapped (two readers, two resets), under its module and its re-export
PATCHED: tuple[tuple[str, str], ...] = (
    ("torch.cuda.memory", "memory_stats_as_nested_dict"),
    ("torch.cuda", "memory_stats_as_nested_dict"),
    ("torch.cuda.memory", "reset_peak_memory_stats"),
    ("torch.cuda", "reset_peak_memory_stats"),
    ("torch.accelerator.memory", "memory_stats"),
    ("torch.accelerator", "memory_stats"),
    ("torch.accelerator.memory", "reset_peak_memory_stats"),
    ("torch.accelerator", "reset_peak_memory_stats"),
)

#: one device's nested peaks: ``memory_stats_as_nested_dict``'s shape, each counter dict replaced by its peak
Peaks = dict[Any, Any]

_lock = threading.RLock()
_clients: list[PeakClient] = []
#: the script's view: device index -> peaks folded in at trackers' resets since the script's last
_readers: dict[int, Peaks] = {}
#: (module, attribute, original, wrapper) of what is installed now
_installed: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = []
#: the originals the tracker reads and resets through while installed (None: look torch's up)
_raw_read: Callable[[int], dict[str, Any]] | None = None
_raw_reset: Callable[[int], None] | None = None


def fold(into: Peaks, stats: dict[Any, Any]) -> None:
    """Fold every ``peak`` of nested ``stats`` into ``into`` (the larger stays); hot: two levels unrolled."""
    for k, v in stats.items():
        if v.__class__ is not dict:
            continue
        if "peak" in v:  # counters straight under the statistic (oversize_allocations)
            p = v["peak"]
            if p > into.get(k, -1):
                into[k] = p
            continue
        sub = into.get(k)
        if sub is None:
            sub = into[k] = {}
        for k2, c in v.items():
            if c.__class__ is not dict:
                continue
            if "peak" in c:
                p = c["peak"]
                if p > sub.get(k2, -1):
                    sub[k2] = p
            else:
                deeper = sub.get(k2)
                if deeper is None:
                    deeper = sub[k2] = {}
                fold(deeper, c)


def apply(peaks: Peaks, stats: dict[Any, Any]) -> None:
    """Raise each ``peak`` of nested ``stats`` (in place) to ``peaks``' where that is larger."""
    for k, p in peaks.items():
        v = stats.get(k)
        if v.__class__ is not dict:  # gone (a private pool freed), or not a counter
            continue
        if p.__class__ is dict:
            apply(p, v)
        elif p > v.get("peak", p):
            v["peak"] = p


def apply_flat(peaks: Peaks, flat: dict[str, Any], prefix: str = "") -> None:
    """The same on a flat dict keyed as ``torch.accelerator.memory_stats`` keys it."""
    for k, p in peaks.items():
        key = f"{prefix}.{k}" if prefix else f"{k}"
        if p.__class__ is dict:
            apply_flat(p, flat, key)
        else:
            peak_key = key + ".peak"
            if peak_key in flat and p > flat[peak_key]:
                flat[peak_key] = p


def raw_stats(device: int) -> dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict(device)`` as the allocator has it, unshadowed."""
    read = _raw_read
    return (read if read is not None else torch.cuda.memory_stats_as_nested_dict)(device)


def _reset_now(device: int) -> None:
    reset = _raw_reset
    (reset if reset is not None else torch.cuda.reset_peak_memory_stats)(device)


class PeakClient:
    """A tracker's hold on the peak counters (``acquire()``): it reads and resets through ``read_and_reset``."""

    def __init__(self) -> None:
        #: device index -> peaks folded in at others' resets since this client's last
        self.pending: dict[int, Peaks] = {}
        self.released = False

    def read_and_reset(self, device: int) -> dict[str, Any]:
        """``device``'s nested statistics with the peaks since this client's last reset, then reset."""
        with _lock:  # read, fold and reset as one: a reset in between would be folded twice or lost
            stats = raw_stats(device)
            if not stats:
                return stats
            fold(_readers.setdefault(device, {}), stats)
            for other in _clients:
                if other is not self:
                    fold(other.pending.setdefault(device, {}), stats)
            mine = self.pending.pop(device, None)
            _reset_now(device)
        if mine:
            apply(mine, stats)
        return stats

    def release(self) -> None:
        """Give the counters back; the last client's release uninstalls the wrappers. Idempotent."""
        release(self)


def acquire() -> PeakClient:
    """A new client; the first installs the wrappers (``PATCHED``)."""
    with _lock:
        if not _clients:
            _install()
        client = PeakClient()
        _clients.append(client)
        return client


def release(client: PeakClient) -> None:
    """``client.release()``."""
    with _lock:
        if client.released:
            return
        client.released = True
        if client in _clients:
            _clients.remove(client)
        if not _clients:
            _uninstall()


def installed() -> bool:
    """Whether the wrappers are in place now (some client holds the counters)."""
    return bool(_installed)


def _script_reset(device: int) -> None:
    """The script resets ``device``'s peaks: clients keep what they have not read; its shadow restarts."""
    stats = raw_stats(device)
    if stats:
        for client in _clients:
            fold(client.pending.setdefault(device, {}), stats)
    _readers.pop(device, None)


def _cuda_index(device: Any) -> int:
    from torch.cuda._utils import _get_device_index

    return int(_get_device_index(device, optional=True))


def _accelerator_index(device: Any) -> int:
    from torch.accelerator._utils import _get_device_index

    return int(_get_device_index(device, optional=True))


def _cuda_reader(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original)
    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        stats = original(device=device)
        if _readers and stats:
            idx = _cuda_index(device)
            with _lock:  # a tracker may fold into the shadow from another thread (autograd's)
                shadow = _readers.get(idx)
                if shadow:
                    apply(shadow, stats)
        return stats

    return memory_stats_as_nested_dict


def _accelerator_reader(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original)
    def memory_stats(device_index: Any = None, /) -> dict[str, Any]:
        stats = original(device_index)
        if _readers and stats:
            idx = _accelerator_index(device_index)
            with _lock:
                shadow = _readers.get(idx)
                if shadow:
                    apply_flat(shadow, stats)
        return stats

    return memory_stats


def _reset(original: Callable[..., None], index: Callable[[Any], int], keyword: bool) -> Callable[..., None]:
    def run(device: Any) -> None:
        try:
            idx = index(device)
        except Exception:  # noqa: BLE001 - a bad argument: torch's own reset raises its own error
            idx = None
        with _lock:
            if idx is not None:
                _script_reset(idx)
            return original(device=device) if keyword else original(device)

    if keyword:
        @functools.wraps(original)
        def reset_peak_memory_stats(device: Any = None) -> None:
            return run(device)
    else:
        @functools.wraps(original)
        def reset_peak_memory_stats(device_index: Any = None, /) -> None:  # type: ignore[misc]
            return run(device_index)

    return reset_peak_memory_stats


def _wrapper(module: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    accelerator = module.startswith("torch.accelerator")
    if name == "reset_peak_memory_stats":
        return _reset(original, _accelerator_index if accelerator else _cuda_index, keyword=not accelerator)
    return _accelerator_reader(original) if accelerator else _cuda_reader(original)


def _install() -> None:
    global _raw_read, _raw_reset
    for module_name, name in PATCHED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a torch without torch.accelerator.memory: nothing there to shadow
            continue
        original = getattr(module, name, None)
        if original is None:
            continue
        wrapper = _wrapper(module_name, name, original)
        _installed.append((module, name, original, wrapper))
        if (module_name, name) == ("torch.cuda", "memory_stats_as_nested_dict"):
            _raw_read = original
        elif (module_name, name) == ("torch.cuda", "reset_peak_memory_stats"):
            _raw_reset = original
    for module, name, _, wrapper in _installed:
        setattr(module, name, wrapper)


def _uninstall() -> None:
    global _raw_read, _raw_reset
    for module, name, original, wrapper in reversed(_installed):
        if getattr(module, name, None) is wrapper:
            setattr(module, name, original)
        else:
            logger.warning("fsdp_mem_otel: %s.%s was replaced while the tracker shadowed it; left as it is",
                           module.__name__, name)
    _installed.clear()
    _readers.clear()
    _raw_read = _raw_reset = None
