"""Device allocator statistics for ``StepReport.allocator`` (device -> statistic -> value).

CUDA devices (key ``"cuda:N"``), from ``torch.cuda.memory_stats`` and ``torch.cuda.mem_get_info``:

==========================  ==================================================================
allocated_bytes             bytes handed out to tensors at the step end
reserved_bytes              bytes the caching allocator holds from the device (allocated + cached)
active_bytes                bytes in active blocks (allocated or awaiting a stream sync)
allocated_peak_bytes        the step's maximum of allocated_bytes (see "Peaks" below)
reserved_peak_bytes         the step's maximum of reserved_bytes
active_peak_bytes           the step's maximum of active_bytes
inactive_split_bytes        inactive, non-releasable bytes of split blocks (fragmentation)
device_total_bytes          total memory of the device (``mem_get_info()[1]``)
outside_pytorch_bytes       device memory in use that PyTorch's allocator does not hold: used
                            (``total - free`` from ``mem_get_info``) minus reserved bytes. The
                            CUDA context, NCCL buffers, cuBLAS/cuDNN workspaces and other
                            allocators of this process; on a GPU shared with other processes,
                            theirs too. Floored at 0
num_alloc_retries           cudaMalloc failures that flushed the cache and retried (process total)
num_ooms                    out-of-memory errors raised by the allocator (process total)
fragmentation_ratio         (reserved - allocated) / reserved; 0 when nothing is reserved
untracked_bytes             allocated - what the tracker's ledger accounts on that device;
                            signed: negative means the ledger counts more than the allocator
                            handed out (memory from another allocator, or a double count)
==========================  ==================================================================

The host (key ``"cpu"``), on every run: ``resident_bytes`` (the process RSS, from
``/proc/self/statm`` or psutil, read every ``rss_every``-th step, default 10). ``untracked_bytes``
is not reported for the host: RSS includes the interpreter, libraries and allocator caches, so "RSS
minus tensors" means nothing useful.

Peaks. Where CUDA is, the tracker owns the allocator's peak counters by default (``reset_peaks``,
``TrackerConfig``): ``window_edge()`` reads and resets them at every peak-window edge and
``step_stats()`` at the step end, so the ``*_peak_bytes`` values are the allocator's own peaks of
the step, temporaries between two hooks included. The training script's peak statistics stay its
own: while the probe holds them (``start()`` to ``stop()``), ``shadow_peaks`` makes every Python
reader of torch's peak statistics see what it would see without the tracker, and the script's own
resets leave the tracker's windows whole. The probe reads and resets through ``shadow_peaks``
(the unwrapped functions). With ``reset_peaks=False`` the tracker never touches the counters, and
the ``*_peak_bytes`` values are *sampled* maxima: ``AllocatorProbe.sample()`` reads the current
allocated / reserved / active bytes at every FSDP hook snapshot, and ``step_stats()`` folds in the
values at the step end; a transient peak between two hooks (inside one module's forward) is missed.
The tracker never empties the cache.

The pure arithmetic is in :func:`cuda_stats_from`, which takes a ``memory_stats()`` dict, so it
is tested on recorded dicts without a GPU.
"""

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
    """One CUDA device's statistics from plain data.

    Args:
        memory_stats: ``torch.cuda.memory_stats(device)`` (flat keys such as
            ``"allocated_bytes.all.current"``); missing keys read as 0 (the cudaMallocAsync
            backend reports some as 0 or not at all).
        mem_get_info: ``torch.cuda.mem_get_info(device)`` = (free, total); None leaves
            ``device_total_bytes`` out.
        tracked_total: bytes the ledger accounts on this device; None leaves ``untracked_bytes`` out.
        sampled_max: the step's sampled maxima, keys ``allocated_bytes`` / ``reserved_bytes`` /
            ``active_bytes``; each peak is max(sampled, current at step end).
        allocator_peaks: report the allocator's own ``*.all.peak`` values instead, each the larger
            of it and ``sampled_max`` (the peaks read where they were reset mid-step); only
            meaningful when peaks are reset at every step, i.e. ``reset_peaks=True``.
    """
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
    """Device memory in use beyond what the caching allocator reserved: (total - free) -
    reserved, floored at 0 (see ``outside_pytorch_bytes`` in the module docstring)."""
    free, total = mem_get_info
    return max(0, int(total) - int(free) - int(reserved))


_process: Any = None  # psutil.Process of this process, made on first use
_STATM = "/proc/self/statm"
#: (pid, descriptor) of ``_STATM`` opened by that process: one ``pread`` a reading, not an open,
#: a read and a close (on /proc, tens of microseconds at a step's end)
_statm: tuple[int, int] | None = None


def resident_bytes() -> int | None:
    """Resident set size of this process in bytes (None where it cannot be read): from
    ``/proc/self/statm`` where there is one (Linux; what psutil reads there, for a fraction of its
    cost), else from psutil."""
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
    """``TrackerConfig.reset_peaks`` as the probe takes it: None (the default) is on where CUDA is
    available, an explicit bool wins."""
    return torch.cuda.is_available() if setting is None else bool(setting)


def flat_stats(nested: Mapping[str, Any]) -> dict[str, Any]:
    """The keys ``cuda_stats_from`` reads, flat (``"allocated_bytes.all.current"``), from
    ``memory_stats_as_nested_dict``: every statistic's ``all`` counters and the plain counts."""
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
    """Reads the device allocator for ``StepReport.allocator``.

    Args:
        devices: CUDA devices to watch (int, "cuda:N" or torch.device). None (default): the
            current CUDA device once CUDA is initialized, plus every "cuda:N" the ledger reports
            to ``step_stats``. Ignored on a machine without CUDA.
        reset_peaks: report the allocator's own peaks, read and reset at every window edge
            (``window_edge``) and step end, with the training script's view of them shadowed
            (``shadow_peaks``) from ``start()`` to ``stop()``. False: sampled maxima, and the
            counters are never touched. The tracker passes ``resolve_reset_peaks(config)``.
        rss_every: read the process RSS at every ``rss_every``-th step (a system call of tens
            of microseconds); the steps between report the last reading.

    ``sample()`` is called at every FSDP hook snapshot and costs one ``memory_stats`` C call per
    watched CUDA device (nothing on CPU, nothing with ``reset_peaks``); ``step_stats()`` once per
    step. Nothing here empties the cache. Errors propagate: the tracker contains and counts them.
    """

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
        #: device indexes whose peaks this probe has reset once (a device found later starts then)
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
        """Begin the first step (the tracker calls this at attach): maxima restart from now; with
        ``reset_peaks``, the probe takes the peak counters (the script's view shadowed) and resets them."""
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
        """Give the peak counters back (the tracker calls this at detach): the last holder puts
        torch's functions back. Afterwards nothing is reset; ``start()`` takes them again."""
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
            # The nested dict straight from C: torch.cuda.memory_allocated() would build, flatten
            # and sort the full flat dict for each of the three values.
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
        """The nested statistics with the peaks since this probe's last reset, then reset. A device
        reset here for the first time (found after ``start()``) reports its peaks as its current
        values: what it held before the tracker started is the script's, not this step's."""
        stats = peaks.read_and_reset(idx)
        if stats and idx not in self._reset_once:
            self._reset_once.add(idx)
            for value in stats.values():
                if isinstance(value, dict) and isinstance(value.get("all"), dict) and "current" in value["all"]:
                    value["all"]["peak"] = value["all"]["current"]
        return stats

    def window_edge(self) -> dict[str, tuple[int, int]]:
        """With ``reset_peaks`` (between ``start()`` and ``stop()``): read and reset each watched
        device's peaks (``AllocatorTemps`` calls this at every peak-window edge); device key ->
        (allocated peak since the last edge, allocated now). The three peaks also go into the
        step's maxima, which ``step_stats`` reports with the allocator's peak since the last edge."""
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
        """Now, per watched CUDA device: bytes in use outside PyTorch's allocator (for an OOM's
        breakdown: what NCCL, cuBLAS and the CUDA context held when memory ran out)."""
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
        """Statistics at the step end, device -> statistic -> value; restarts the step maxima.

        ``tracked_total``: device key ("cuda:0", "cpu") -> bytes the ledger accounts there.
        """
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
