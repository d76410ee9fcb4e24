"""Device allocator statistics for ``StepReport.allocator``: device -> statistic -> value. CUDA (``"cuda:N"``):
- ``allocated_bytes`` (handed out to tensors), ``reserved_bytes`` (the caching allocator's: allocated + cached),
  ``active_bytes`` (allocated or awaiting a stream sync) at the step end, and their step maxima ``*_peak_bytes``;
- ``inactive_split_bytes`` (non-releasable split blocks); ``fragmentation_ratio``: 1 - allocated / reserved;
- ``device_total_bytes``; ``outside_pytorch_bytes``: used (total - free) minus reserved, floored at 0 (CUDA
  context, NCCL, cuBLAS workspaces, other allocators and processes);
- ``num_alloc_retries`` (cudaMalloc failures that flushed the cache) and ``num_ooms``, process totals;
- ``untracked_bytes``: allocated - the ledger's bytes; negative: the ledger counts more (another allocator's).
The host (``"cpu"``): ``resident_bytes``, the RSS, every ``rss_every``-th step (RSS is far more than tensors).

Peaks. Where CUDA is, the tracker owns the allocator's peak counters by default (``reset_peaks``):
``window_edge()`` and ``step_stats()`` read and reset them, so ``*_peak_bytes`` are the allocator's own,
temporaries between hooks included; ``shadow_peaks`` keeps the script's peak statistics its own. With
``reset_peaks=False`` they are maxima sampled at every FSDP hook snapshot and the step end, missing transients
between hooks. The tracker never empties the cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fsdp_mem_otel.training import shadow_peaks

CPU_KEY = "cpu"

# memory_stats() keys read by cuda_stats_from
_ALLOCATED = "allocated_bytes.all.current"
_RESERVED = "reserved_bytes.all.current"
_ACTIVE = "active_bytes.all.current"
_INACTIVE_SPLIT = "inactive_split_bytes.all.current"
_ALLOCATED_PEAK = "allocated_bytes.all.peak"
_RESERVED_PEAK = "reserved_bytes.all.peak"
_ACTIVE_PEAK = "active_bytes.all.peak"
_RETRIES = "num_alloc_retries"
_OOMS = "num_ooms"

#: statistic -> memory_stats() key of the current value, for the three sampled statistics
SAMPLED: dict[str, str] = {"allocated_bytes": _ALLOCATED, "reserved_bytes": _RESERVED, "active_bytes": _ACTIVE}
_PEAK_OF = {
    "allocated_bytes": ("allocated_peak_bytes", _ALLOCATED_PEAK),
    "reserved_bytes": ("reserved_peak_bytes", _RESERVED_PEAK),
    "active_bytes": ("active_peak_bytes", _ACTIVE_PEAK),
}

#: every key a CUDA device's dict may hold
CUDA_KEYS: tuple[str, ...] = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "active_peak_bytes",
    "inactive_split_bytes",
    "device_total_bytes",
    "outside_pytorch_bytes",
    "num_alloc_retries",
    "num_ooms",
    "fragmentation_ratio",
    "untracked_bytes",
)
#: every key the host's dict may hold
CPU_KEYS: tuple[str, ...] = ("resident_bytes",)


def cuda_stats_from(
    memory_stats: Mapping[str, Any],
    mem_get_info: tuple[int, int] | None,
    tracked_total: int | None,
    sampled_max: Mapping[str, int] | None = None,
    *,
    allocator_peaks: bool = False,
) -> dict[str, float]:
    """One CUDA device's statistics from ``memory_stats`` (flat keys; missing: 0, as cudaMallocAsync omits some)
    and ``mem_get_info`` (None: no device total); ``tracked_total`` None: no ``untracked_bytes``. A peak is
    max(``sampled_max``, current), with ``allocator_peaks`` max(``*.all.peak``, ``sampled_max``)."""
    allocated = int(memory_stats.get(_ALLOCATED, 0))
    reserved = int(memory_stats.get(_RESERVED, 0))
    out: dict[str, float] = {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "active_bytes": int(memory_stats.get(_ACTIVE, 0)),
    }
    sampled = sampled_max or {}
    for stat, (peak_key, stats_key) in _PEAK_OF.items():
        if allocator_peaks:  # since the last reset, and the maxima read at earlier resets
            out[peak_key] = max(int(memory_stats.get(stats_key, out[stat])), int(sampled.get(stat, 0)))
        else:
            out[peak_key] = max(int(sampled.get(stat, 0)), int(out[stat]))
    out["inactive_split_bytes"] = int(memory_stats.get(_INACTIVE_SPLIT, 0))
    if mem_get_info is not None:
        out["device_total_bytes"] = int(mem_get_info[1])
        out["outside_pytorch_bytes"] = outside_pytorch_bytes(mem_get_info, reserved)
    out["num_alloc_retries"] = int(memory_stats.get(_RETRIES, 0))
    out["num_ooms"] = int(memory_stats.get(_OOMS, 0))
    out["fragmentation_ratio"] = (reserved - allocated) / reserved if reserved > 0 else 0.0
    if tracked_total is not None:
        out["untracked_bytes"] = allocated - int(tracked_total)
    return out


def outside_pytorch_bytes(mem_get_info: tuple[int, int], reserved: int) -> int:
    """Device memory in use beyond what the caching allocator reserved: (total - free) - reserved, floored at 0."""
    free, total = mem_get_info
    return max(0, int(total) - int(free) - int(reserved))


_process: Any = None  # psutil.Process of this process, made on first use
_STATM = "/proc/self/statm"
#: (pid, descriptor) of ``_STATM``, opened by that process: one ``pread`` a reading
_statm: tuple[int, int] | None = None


def resident_bytes() -> int | None:
    """This process's RSS in bytes (None: unreadable), from ``/proc/self/statm`` (cheaper) or psutil."""
    global _statm
    for _ in range(2):  # a descriptor closed under us (closerange) is opened again, once
        try:
            return _statm_rss()
        except (OSError, ValueError, IndexError):
            _statm = None  # not closed: its number may be another file's by now
    try:
        import psutil
    except ImportError:
        return None
    global _process
    pid = os.getpid()
    if _process is None or _process.pid != pid:  # re-made after a fork
        _process = psutil.Process(pid)
    return int(_process.memory_info().rss)


def _statm_rss() -> int:
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:  # first, or in a forked child (the parent's file: left open)
        _statm = (pid, os.open(_STATM, os.O_RDONLY))
    return int(os.pread(_statm[1], 256, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resolve_reset_peaks(setting: bool | None) -> bool:
    """``TrackerConfig.reset_peaks`` as the probe takes it: None (default) is on where CUDA is; a bool wins."""
    return torch.cuda.is_available() if setting is None else bool(setting)


def flat_stats(nested: Mapping[str, Any]) -> dict[str, Any]:
    """The flat keys ``cuda_stats_from`` reads, from ``memory_stats_as_nested_dict``."""
    out: dict[str, Any] = {}
    for stat, value in nested.items():
        if isinstance(value, dict):
            pool = value.get("all")
            if isinstance(pool, dict):
                for counter, v in pool.items():
                    out[f"{stat}.all.{counter}"] = v
        else:
            out[stat] = value
    return out


def _cuda_index(device: str | int | torch.device) -> int:
    if isinstance(device, bool):
        raise TypeError(f"devices must hold CUDA devices (int, 'cuda:N' or torch.device); got {device!r}")
    if isinstance(device, int):
        idx = device
    else:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"devices must hold CUDA devices; got {device!r}")
        idx = dev.index if dev.index is not None else 0
    if idx < 0:
        raise ValueError(f"devices must hold CUDA device indexes >= 0; got {device!r}")
    return idx


class AllocatorProbe:
    """Reads the device allocator for ``StepReport.allocator``; errors propagate. ``devices``: CUDA devices to
    watch (None: the current one, plus each "cuda:N" the ledger reports). ``reset_peaks``: the allocator's own
    peaks, reset at every window edge and step end; else sampled maxima. ``rss_every``: RSS period."""

    def __init__(self, devices: Iterable[str | int | torch.device] | None = None, *, reset_peaks: bool = False,
                 rss_every: int = 10) -> None:
        if not isinstance(reset_peaks, bool):
            raise TypeError(f"reset_peaks must be a bool; got {type(reset_peaks).__name__}")
        if devices is not None and isinstance(devices, (str, int, torch.device)):
            raise TypeError("devices must be an iterable of devices (e.g. [0] or ['cuda:0']), not a single device")
        self.reset_peaks = reset_peaks
        self._rss_every = max(1, int(rss_every))
        self._steps = 0
        self._rss: int | None = None
        self._cuda = torch.cuda.is_available()
        self._auto = devices is None
        #: device index -> report key ("cuda:N")
        self._devices: dict[int, str] = {}
        if devices is not None:
            for d in devices:
                idx = _cuda_index(d)
                self._devices[idx] = f"cuda:{idx}"
        #: device key -> statistic -> the step's sampled maximum
        self._max: dict[str, dict[str, int]] = {}
        #: with reset_peaks, from start() to stop(): the hold on the peak counters
        self._peaks: shadow_peaks.PeakClient | None = None
        #: device indexes whose peaks this probe has reset once
        self._reset_once: set[int] = set()

    @property
    def devices(self) -> list[str]:
        """Keys ("cuda:N") of the CUDA devices watched now."""
        self._discover()
        return list(self._devices.values())

    def _discover(self) -> None:
        if self._auto and not self._devices and self._cuda and torch.cuda.is_initialized():
            idx = torch.cuda.current_device()
            self._devices[idx] = f"cuda:{idx}"

    def start(self) -> None:
        """At attach: maxima restart; with ``reset_peaks``, take the peak counters and reset them."""
        if not self._cuda:
            return
        if self.reset_peaks and self._peaks is None:
            self._peaks = shadow_peaks.acquire()
        self._discover()
        for idx, key in self._devices.items():
            if self._peaks is not None:
                self._peaks.read_and_reset(idx)
                self._reset_once.add(idx)
            self._max.pop(key, None)
        self.sample()

    def stop(self) -> None:
        """At detach: give the peak counters back (the last holder restores torch's functions)."""
        peaks, self._peaks = self._peaks, None
        self._reset_once.clear()
        if peaks is not None:
            peaks.release()

    @property
    def sampler(self) -> Callable[[], None] | None:
        """``sample``, or None where it does nothing (no CUDA, or peaks reset per step)."""
        return self.sample if self._cuda and not self.reset_peaks else None

    def sample(self) -> None:
        """Fold the current allocated / reserved / active bytes into the step's maxima."""
        if not self._cuda or self.reset_peaks:
            return
        if not self._devices:
            self._discover()
            if not self._devices:
                return
        for idx, key in self._devices.items():
            # Straight from C: torch.cuda.memory_allocated() builds and sorts the full flat dict per value.
            stats = shadow_peaks.raw_stats(idx)
            if not stats:
                continue
            allocated = stats["allocated_bytes"]["all"]["current"]
            reserved = stats["reserved_bytes"]["all"]["current"]
            active = stats["active_bytes"]["all"]["current"]
            m = self._max.get(key)
            if m is None:
                self._max[key] = {"allocated_bytes": allocated, "reserved_bytes": reserved, "active_bytes": active}
                continue
            if allocated > m["allocated_bytes"]:
                m["allocated_bytes"] = allocated
            if reserved > m["reserved_bytes"]:
                m["reserved_bytes"] = reserved
            if active > m["active_bytes"]:
                m["active_bytes"] = active

    def _read_and_reset(self, peaks: shadow_peaks.PeakClient, idx: int) -> dict[str, Any]:
        """Nested statistics with the peaks since this probe's last reset, then reset (first reset: current)."""
        stats = peaks.read_and_reset(idx)
        if stats and idx not in self._reset_once:
            self._reset_once.add(idx)
            for value in stats.values():
                if isinstance(value, dict) and isinstance(value.get("all"), dict) and "current" in value["all"]:
                    value["all"]["peak"] = value["all"]["current"]
        return stats

    def window_edge(self) -> dict[str, tuple[int, int]]:
        """At a window edge, with ``reset_peaks``: device -> (allocated peak since the last edge, allocated)."""
        out: dict[str, tuple[int, int]] = {}
        peaks = self._peaks
        if peaks is None:
            return out
        self._discover()
        for idx, key in self._devices.items():
            stats = self._read_and_reset(peaks, idx)
            if not stats:
                continue
            m = self._max.setdefault(key, {})
            for stat in SAMPLED:
                peak = stats[stat]["all"]["peak"]
                if peak > m.get(stat, 0):
                    m[stat] = peak
            out[key] = (stats["allocated_bytes"]["all"]["peak"], stats["allocated_bytes"]["all"]["current"])
        return out

    def outside_pytorch(self) -> dict[str, int]:
        """Bytes in use outside PyTorch's allocator now, per device (an OOM's: NCCL, cuBLAS, context)."""
        out: dict[str, int] = {}
        if not self._cuda or not torch.cuda.is_initialized():
            return out
        self._discover()
        for idx, key in self._devices.items():
            free, total = torch.cuda.mem_get_info(idx)
            reserved = int(flat_stats(shadow_peaks.raw_stats(idx)).get(_RESERVED, 0))
            out[key] = outside_pytorch_bytes((int(free), int(total)), reserved)
        return out

    def step_stats(self, tracked_total: Mapping[str, int]) -> dict[str, dict[str, float]]:
        """Statistics at the step end, restarting the maxima; ``tracked_total``: device -> ledger bytes."""
        out: dict[str, dict[str, float]] = {}
        if self._cuda:
            if self._auto:
                for key in tracked_total:
                    if key.startswith("cuda"):
                        idx = _cuda_index(key)
                        self._devices.setdefault(idx, f"cuda:{idx}")
            self._discover()
            peaks = self._peaks
            if self._devices and torch.cuda.is_initialized():
                for idx, key in self._devices.items():
                    nested = self._read_and_reset(peaks, idx) if peaks is not None else shadow_peaks.raw_stats(idx)
                    stats = flat_stats(nested)
                    info: tuple[int, int] | None
                    try:
                        free, total = torch.cuda.mem_get_info(idx)
                        info = (int(free), int(total))
                    except RuntimeError:  # e.g. a driver that refuses cudaMemGetInfo
                        info = None
                    out[key] = cuda_stats_from(
                        stats,
                        info,
                        tracked_total.get(key),
                        self._max.get(key),
                        allocator_peaks=self.reset_peaks,
                    )
                    # The next step's maxima start from what is live at its start (= now).
                    cur = {s: int(stats.get(k, 0)) for s, k in SAMPLED.items()}
                    self._max[key] = cur
        if self._steps % self._rss_every == 0 or self._rss is None:
            self._rss = resident_bytes()
        self._steps += 1
        if self._rss is not None:
            out[CPU_KEY] = {"resident_bytes": self._rss}
        return out
