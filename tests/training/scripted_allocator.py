"""A scripted CUDA caching allocator behind torch's own C entry points, for CPU-only tests.

``ScriptedAllocator.install(monkeypatch)`` replaces the C functions that ``torch/cuda/memory.py``
and ``torch/accelerator/memory.py`` call (``torch._C._cuda_memoryStats``,
``_cuda_resetPeakMemoryStats``, ``_cuda_emptyCache``, ``_accelerator_getDeviceStats``,
``_accelerator_resetPeakStats``, ...) and the few ``torch.cuda`` functions that say CUDA is there,
so torch's Python readers (``max_memory_allocated``, ``memory_stats``, ``memory_summary``,
``torch.accelerator.max_memory_allocated``, ...) run unchanged over counters the test moves with
``alloc`` / ``free`` / ``temp``. The nested dict has the shape torch's has: statistic -> pool
(all, large_pool, small_pool) -> current / peak / allocated / freed, plus the oversize counters,
the plain counts and one private pool (``reserved_bytes_by_private_pools``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

POOLS = ("all", "large_pool", "small_pool")
LARGE = 1 << 20  # a block of 1 MiB or more comes from the large pool
SEGMENT = 2 << 20  # reserved memory grows in segments of 2 MiB
PRIVATE_POOL = (0, 1)  # a MemPool id


class Counter:
    """One statistic of one pool: current, peak since the last reset, and the running totals."""

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, n: int) -> None:
        if n >= 0:
            self.current += n
            self.allocated += n
            self.peak = max(self.peak, self.current)
        else:
            self.current += n
            self.freed -= n

    def reset_peak(self) -> None:
        self.peak = self.current

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class Stat:
    """A statistic over the pools (``all`` is the sum of the two others)."""

    def __init__(self) -> None:
        self.pools = {p: Counter() for p in POOLS}

    def add(self, pool: str, n: int) -> None:
        self.pools[pool].add(n)
        self.pools["all"].add(n)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {p: c.as_dict() for p, c in self.pools.items()}

    def counters(self) -> list[Counter]:
        return list(self.pools.values())


class Device:
    """One device's counters."""

    BYTES = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes")
    COUNTS = ("allocation", "active", "segment", "inactive_split")

    def __init__(self) -> None:
        self.stats = {name: Stat() for name in (*self.BYTES, *self.COUNTS)}
        self.oversize = {"oversize_allocations": Counter(), "oversize_segments": Counter()}
        self.private = Stat()  # reserved bytes of PRIVATE_POOL
        self.blocks: dict[int, tuple[str, int]] = {}  # handle -> (pool, bytes)
        self.num_device_alloc = self.num_device_free = 0
        self.high_water = 0  # the test's own truth: allocated bytes' maximum since mark()

    def counters(self) -> list[Counter]:
        return [c for s in (*self.stats.values(), self.private) for c in s.counters()] + list(self.oversize.values())

    def nested(self, private: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {name: s.as_dict() for name, s in self.stats.items()}
        out.update({name: c.as_dict() for name, c in self.oversize.items()})
        out.update(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, max_split_size=-1,
                   num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free)
        if private:
            out["reserved_bytes_by_private_pools"] = {PRIVATE_POOL: self.private.as_dict()}
        return copy.deepcopy(out)


class ScriptedAllocator:
    """Devices 0 and 1; ``current`` is what ``torch.cuda.current_device()`` answers."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = [Device() for _ in range(devices)]
        self.current = 0
        self.resets: list[int] = []  # device of every peak reset, whoever asked
        self._next = 0

    # -- what the test does ---------------------------------------------------------------------
    def alloc(self, nbytes: int, device: int | None = None) -> int:
        """A block of ``nbytes`` handed out (reserved grows by whole segments when needed)."""
        d = self.devices[self.current if device is None else device]
        pool = "large_pool" if nbytes >= LARGE else "small_pool"
        for name in ("allocated_bytes", "active_bytes", "requested_bytes"):
            d.stats[name].add(pool, nbytes)
        d.stats["allocation"].add(pool, 1)
        d.stats["active"].add(pool, 1)
        need = d.stats["allocated_bytes"].pools[pool].current - d.stats["reserved_bytes"].pools[pool].current
        if need > 0:
            grow = -(-need // SEGMENT) * SEGMENT
            d.stats["reserved_bytes"].add(pool, grow)
            d.stats["segment"].add(pool, 1)
            d.num_device_alloc += 1
        d.high_water = max(d.high_water, d.stats["allocated_bytes"].pools["all"].current)
        self._next += 1
        d.blocks[self._next] = (pool, nbytes)
        return self._next

    def free(self, handle: int, device: int | None = None) -> None:
        d = self.devices[self.current if device is None else device]
        pool, nbytes = d.blocks.pop(handle)
        for name in ("allocated_bytes", "active_bytes", "requested_bytes"):
            d.stats[name].add(pool, -nbytes)
        d.stats["allocation"].add(pool, -1)
        d.stats["active"].add(pool, -1)

    def temp(self, nbytes: int, device: int | None = None) -> None:
        """An op's temporary: allocated and freed before the next hook (only the allocator sees it)."""
        self.free(self.alloc(nbytes, device), device)

    def pool_alloc(self, nbytes: int, device: int | None = None) -> None:
        """A private pool (a CUDA graph's) reserves ``nbytes`` more (negative: releases them)."""
        d = self.devices[self.current if device is None else device]
        d.private.add("large_pool", nbytes)

    def mark(self) -> None:
        """Restart the test's own high-water mark of allocated bytes on every device."""
        for d in self.devices:
            d.high_water = d.stats["allocated_bytes"].pools["all"].current

    def allocated(self, device: int = 0) -> int:
        return self.devices[device].stats["allocated_bytes"].pools["all"].current

    # -- torch's C entry points -----------------------------------------------------------------
    def _index(self, device: Any) -> int:
        return self.current if device is None else int(device)

    def memory_stats(self, device: Any) -> dict[str, Any]:
        return self.devices[self._index(device)].nested()

    def device_stats(self, device: Any) -> dict[str, Any]:
        return self.devices[self._index(device)].nested(private=False)

    def reset_peak(self, device: Any) -> None:
        idx = self._index(device)
        self.resets.append(idx)
        for c in self.devices[idx].counters():
            c.reset_peak()

    def empty_cache(self) -> None:
        """Reserved memory no block uses goes back to the device, segment by segment."""
        for d in self.devices:
            for pool in ("large_pool", "small_pool"):
                used = -(-d.stats["allocated_bytes"].pools[pool].current // SEGMENT) * SEGMENT
                spare = d.stats["reserved_bytes"].pools[pool].current - used
                if spare > 0:
                    d.stats["reserved_bytes"].add(pool, -spare)
                    d.stats["segment"].add(pool, -(spare // SEGMENT))
                    d.num_device_free += 1

    def install(self, mp: pytest.MonkeyPatch) -> None:
        c = torch._C
        mp.setattr(c, "_cuda_memoryStats", self.memory_stats, raising=False)
        mp.setattr(c, "_cuda_resetPeakMemoryStats", self.reset_peak, raising=False)
        mp.setattr(c, "_cuda_emptyCache", self.empty_cache, raising=False)
        mp.setattr(c, "_accelerator_getDeviceStats", self.device_stats, raising=False)
        mp.setattr(c, "_accelerator_resetPeakStats", self.reset_peak, raising=False)
        mp.setattr(c, "_accelerator_isAllocatorInitialized", lambda: True, raising=False)
        mp.setattr(c, "_accelerator_getDeviceIndex", lambda: self.current, raising=False)
        # CUDA is there and initialized (torch.cuda.memory's is_initialized reads this flag)
        mp.setattr(torch.cuda, "_initialized", True)
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "current_device", lambda: self.current)
        mp.setattr(torch.cuda, "device_count", lambda: len(self.devices))
        mp.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 41))
