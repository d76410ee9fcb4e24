"""Storage accounting: which storages hold how many bytes of which category, on which device. Tracked storages are
held by weak references whose callbacks subtract their bytes when freed (no memory kept alive); buffers whose
lifetime FSDP's events tell are plain integers (``add``). Knows nothing about FSDP."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_mem_otel import env
from fsdp_mem_otel.schema import DeviceBreakdown, breakdown_of
from fsdp_mem_otel.training.light import log
from fsdp_mem_otel.training.light.counters import INDEX, Counters, RawBreakdown, Snap, snap_of

# The CUDA caching allocator rounds every block up to 512 bytes (same rule as upstream MemTracker).
_CUDA_MIN_BLOCK = 512 if os.environ.get(env.PYTORCH_NO_CUDA_MEMORY_CACHING, "0") == "0" else 1

__all__ = ["INDEX", "Ledger", "RawBreakdown", "as_breakdown", "device_block", "rounded", "storages_of"]


def storages_of(t: torch.Tensor, fake_mode: Any = None) -> list[torch.UntypedStorage]:
    """The storages behind ``t``, through wrapper subclasses (DTensor); fake tensors only of ``fake_mode``."""
    cls = type(t)
    if cls is torch.Tensor or cls is nn.Parameter:
        return [t.untyped_storage()] if t.layout is torch.strided else []
    if cls is DTensor:
        return storages_of(t._local_tensor, fake_mode)  # type: ignore[attr-defined]
    if cls is FakeTensor and fake_mode is not None and t.fake_mode is fake_mode:  # type: ignore[attr-defined]
        return [t.untyped_storage()] if t.layout is torch.strided else []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # DTensor also flattens its DeviceMesh
                out.extend(storages_of(inner, fake_mode))
        return out
    if isinstance(t, FakeTensor) or t.layout is not torch.strided or t.device.type == "meta":
        return []  # no real memory behind it
    return [t.untyped_storage()]


def rounded(n: int, block: int) -> int:
    """``n`` bytes as the allocator hands them out (CUDA: whole 512-byte blocks)."""
    return n if block == 1 or not n else -(-n // block) * block


def device_block(device: torch.device) -> int:
    """The allocator's rounding on ``device``: 512 bytes on CUDA (with caching), else 1."""
    return _CUDA_MIN_BLOCK if device.type == "cuda" else 1


as_breakdown = breakdown_of


class Ledger(Counters):
    """Live bytes per device and category (``Counters``), from tracked storages and integer accounts."""

    def __init__(self) -> None:
        #: id(storage) -> ``_Entry``, dropped by its weak-reference callback; saved-tensor accounting reads it
        self.entries: dict[int, _Entry] = {}
        #: FSDP module -> bytes of the storages it owns (``track_new(..., owner=)``) alive now
        self.owner_bytes: dict[str, int] = {}
        super().__init__()
        #: bytes of tracked storages freed, per category (read without flushing the log)
        self.freed = [0] * len(INDEX)
        self._devices: dict[torch.device, tuple[str, int]] = {}  # device -> (name, block)
        self._on_free = _free_callback(self.entries, weakref.ref(self))
        # count_fake(): an estimate's fake tensors count as memory on this device
        self.fake_mode: Any = None
        self._fake_device: torch.device | None = None

    def count_fake(self, fake_mode: Any, device: torch.device) -> None:
        """Count ``fake_mode``'s tensors as memory on ``device`` (``fsdp-mem-otel estimate``); other fakes not."""
        self.fake_mode, self._fake_device = fake_mode, device
        self._devices.clear()  # meta storages count on ``device`` from now on

    # -- integer accounts ----------------------------------------------------------------------
    def add(self, device: str, category: str, delta: int) -> None:
        """Add ``delta`` bytes (negative: subtract) to ``category`` on ``device``, no storage tracked."""
        if delta:
            self.add_at(device, INDEX[category], delta)

    # -- tracked storages ----------------------------------------------------------------------
    def track(self, t: torch.Tensor, category: str, recategorize: bool = True) -> None:
        """Account ``t``'s storages under ``category``; known ones relabelled only with ``recategorize``."""
        cls = type(t)
        if (cls is torch.Tensor or cls is nn.Parameter) and t.layout is torch.strided:
            self.track_storage(t.untyped_storage(), category, recategorize)
            return
        for st in storages_of(t, self.fake_mode):
            self.track_storage(st, category, recategorize)

    def track_all(self, tensors: list[Any], category: str) -> None:
        """``track(t, category)`` for each tensor of ``tensors`` that is not None."""
        for t in tensors:
            if t is not None:
                self.track(t, category)

    def track_new(self, t: torch.Tensor, category: str, owner: str | None = None) -> None:
        """Account ``t`` only if its storage is new (saved activations' hot path); ``owner``: its FSDP module."""
        self.track_new_at(t, INDEX[category], owner)

    def track_new_at(self, t: torch.Tensor, cat: int, owner: str | None = None) -> None:
        """``track_new`` by category index (``INDEX``)."""
        cls = type(t)
        if (cls is torch.Tensor or cls is nn.Parameter) and t.layout is torch.strided:
            st = t.untyped_storage()
            if id(st) not in self.entries:
                self.new_entry(st, cat, None, owner)
            return
        for st in storages_of(t, self.fake_mode):
            if id(st) not in self.entries:
                self.new_entry(st, cat, None, owner)

    def knows(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` has an entry (tracked, or ``hold``-ed at 0 bytes)."""
        return id(st) in self.entries

    def hold(self, st: torch.UntypedStorage, category: str) -> None:
        """Give ``st`` a 0-byte entry unless it has one (an integer account carries its bytes)."""
        if id(st) not in self.entries:
            self.new_entry(st, INDEX[category], 0)

    def forget(self, st: torch.UntypedStorage) -> None:
        """Set a known storage's bytes to 0, keeping the entry (an integer account takes them over)."""
        entry = self.entries.get(id(st))
        if entry is not None and entry.nbytes:
            self._resize(entry, 0)

    def track_storage(self, st: torch.UntypedStorage, category: str, recategorize: bool) -> None:
        entry = self.entries.get(id(st))
        cat = INDEX[category]
        if entry is None:
            self.new_entry(st, cat)
            return
        n = rounded(st.nbytes(), entry.block)
        if n != entry.nbytes:
            self._resize(entry, n)
        if recategorize and entry.cat != cat:
            self._relabel(entry, cat)

    def track_storages(self, storages: list[torch.UntypedStorage], category: str) -> None:
        """``track_storage(st, category, True)`` for each storage (an FSDP group's buffers)."""
        entries = self.entries
        cat = INDEX[category]
        if all((e := entries.get(id(st))) is not None and e.cat == cat for st in storages):
            self.refresh_storages(storages)  # all known under this category: sizes only
            return
        for st in storages:
            self.track_storage(st, category, True)

    def new_entry(self, st: torch.UntypedStorage, cat: int, nbytes: int | None = None,
                  owner: str | None = None) -> None:
        """Track ``st``, new, under ``cat``: ``nbytes`` or its rounded size; the hot path, helpers written out."""
        dev = st.device
        known = self._devices.get(dev)
        if known is None:
            counted = self._fake_device if dev.type == "meta" and self._fake_device is not None else dev
            known = self._devices[dev] = (str(counted), device_block(counted))  # a counted fake: its device
        name, block = known
        key = id(st)
        if nbytes is None:
            n = st.nbytes()
            if block != 1 and n:
                n = -(-n // block) * block  # ``rounded``
        else:
            n = nbytes
        entry = self.entries[key] = _Entry(st, self._on_free)
        entry.key, entry.device, entry.cat, entry.nbytes, entry.block, entry.owner = key, name, cat, n, block, owner
        if n:
            pending = self.pending
            if pending is not None:
                log.change(pending, name, cat, n)
            else:
                self.add_at(name, cat, n)
            if owner is not None:
                self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + n

    def _resize(self, entry: _Entry, n: int) -> None:
        """An entry's storage now has ``n`` bytes."""
        delta = n - entry.nbytes
        self.add_at(entry.device, entry.cat, delta)
        entry.nbytes = n
        if entry.owner is not None:
            self.owner_bytes[entry.owner] += delta

    def _relabel(self, entry: _Entry, cat: int) -> None:
        # Two changes (queued where deferring): the total dips and comes back, so its live peaks are kept first.
        n = entry.nbytes
        if n:
            self.add_at(entry.device, entry.cat, -n)
            self.add_at(entry.device, cat, n)
        entry.cat = cat
        if entry.owner is not None:  # named by FSDP, the optimizer, the inputs: no module's anymore
            self.owner_bytes[entry.owner] -= entry.nbytes
            entry.owner = None

    def relabel_guess(self, t: torch.Tensor, category: str, guesses: frozenset[str]) -> None:
        """Account ``t`` under ``category`` unless an adapter named it (its category is outside ``guesses``)."""
        guessed = {INDEX[g] for g in guesses}
        for st in storages_of(t, self.fake_mode):
            entry = self.entries.get(id(st))
            self.track_storage(st, category, recategorize=entry is None or entry.cat in guessed)

    def refresh(self, t: torch.Tensor) -> None:
        """Re-read the sizes of ``t``'s storages (after ``resize_``), keeping their categories."""
        for st in storages_of(t, self.fake_mode):
            self.refresh_storage(st)

    def refresh_storage(self, st: torch.UntypedStorage) -> None:
        """Re-read one storage's size (deep mode's resize_ watch calls this)."""
        entry = self.entries.get(id(st))
        if entry is not None:
            n = rounded(st.nbytes(), entry.block)
            if n != entry.nbytes:
                self._resize(entry, n)

    def refresh_storages(self, storages: list[torch.UntypedStorage]) -> None:
        """``refresh_storage`` for each storage, one change per device and category (an FSDP reshard)."""
        entries = self.entries
        deltas: dict[tuple[str, int], int] = {}
        for st in storages:
            entry = entries.get(id(st))
            if entry is not None:
                n = rounded(st.nbytes(), entry.block)
                if n != entry.nbytes:
                    where = (entry.device, entry.cat)
                    deltas[where] = deltas.get(where, 0) + n - entry.nbytes
                    if entry.owner is not None:
                        self.owner_bytes[entry.owner] += n - entry.nbytes
                    entry.nbytes = n
        for (device, cat), delta in deltas.items():
            if delta:
                self.add_at(device, cat, delta)

    # -- reading --------------------------------------------------------------------------------
    def step_end_later(self) -> tuple[Snap, Callable[[], DeviceBreakdown]]:
        """The counters now (a ``Snap``) and ``step_peak()`` as a function built when called."""
        if self.window_watch is not None:
            peak = self.step_peak()
            return self.snap(), lambda: peak
        self.flush()
        self._step.settle(self._cur)
        return snap_of(self._cur), functools.partial(breakdown_of, snap_of(self._step.snap or {}))

    # -- introspection -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """A tracked storage: a weak reference carrying its counts, one object per storage (fewer for the collector to
    promote), built in C (``KeyedRef``'s Python ``__init__`` costs ~0.25 us)."""

    __slots__ = ("block", "cat", "device", "key", "nbytes", "owner")
    key: int  # id() of the storage
    device: str  # the device's name
    cat: int  # category index (``INDEX``)
    nbytes: int  # as counted (rounded to the allocator's block)
    block: int  # the allocator's rounding: 512 on CUDA (with caching), else 1
    owner: str | None  # the FSDP module whose saved tensors, inputs or outputs these are


def _free_callback(entries: dict[int, _Entry], ledger_ref: weakref.ref[Ledger]) -> Any:
    """One weakref callback for all a ledger's entries: drop the freed bytes. Holds the ledger weakly."""

    def on_free(ref: _Entry) -> None:
        key = ref.key
        if entries.get(key) is not ref:  # an entry made since for a new storage at the same address
            return
        del entries[key]
        n = ref.nbytes
        ledger = ledger_ref()
        if ledger is not None and n:
            ledger.freed[ref.cat] += n
            pending = ledger.pending
            if pending is not None:
                log.change(pending, ref.device, ref.cat, -n)
            else:
                ledger.add_at(ref.device, ref.cat, -n)
            if ref.owner is not None:
                ledger.owner_bytes[ref.owner] -= n

    return on_free
