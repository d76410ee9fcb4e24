"""Storage accounting: bytes per device x category, with per-step and per-window peaks.

Bytes enter the ledger two ways. Tracked storages (parameters, optimizer state, saved
activations, and in deep mode every op's output) are held by a weak reference whose callback
subtracts their bytes when the storage is freed, so the ledger never keeps memory alive. Buffers
whose lifetime FSDP's own events tell (light mode's per-group accounts) are added and subtracted
as plain integers with ``add``. Each update is O(1): it touches one device's counters, the step
window and the innermost open window. Windows nest (a module's forward inside its parent's);
closing one folds its peak into the enclosing window, which is how per-module peaks stay O(1)
per update however many modules exist.

Counters are per device a list indexed like ``CATEGORY_KEYS`` (``total`` last): a snapshot copies
that list (``raw()``); the public ``{category: bytes}`` dicts are built only for reports.

The ledger knows tensors and storages but nothing about FSDP.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_mem_otel import env
from fsdp_mem_otel.schema import CATEGORY_KEYS, DeviceBreakdown, breakdown_of

# The CUDA caching allocator rounds every block up to 512 bytes (same rule as upstream MemTracker).
_CUDA_MIN_BLOCK = 512 if os.environ.get(env.PYTORCH_NO_CUDA_MEMORY_CACHING, "0") == "0" else 1

#: category key -> its index in a counter list
INDEX: dict[str, int] = {c: i for i, c in enumerate(CATEGORY_KEYS)}
_N = len(CATEGORY_KEYS)
_T = INDEX["total"]

#: device -> counters (a list indexed like CATEGORY_KEYS), as snapshots hold them
RawBreakdown = dict[str, list[int]]


def storages_of(t: torch.Tensor, fake_mode: Any = None) -> list[torch.UntypedStorage]:
    """The untyped storages behind ``t``, looking through wrapper subclasses such as DTensor.

    Fake tensors have no memory behind them, except those of ``fake_mode`` (an estimate's).
    """
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


class _Window:
    """The peak of one span of time: per device, the largest total and the counters then.

    Copying the counters at every new maximum would cost a copy per allocation while memory grows
    (every saved activation in a forward); instead a device whose peak *is* the current counters
    is marked live, and the ledger copies it only when those counters are about to change
    downwards (a free, a relabel), when a nested window opens, or when it is read.
    """

    __slots__ = ("live", "peak", "snap")

    def __init__(self, current: RawBreakdown) -> None:
        # one loop, no comprehensions: windows open on the hot path (a module's forward, backward)
        self.peak: dict[str, int] = {}
        self.snap: RawBreakdown = {}
        for d, c in current.items():
            self.peak[d] = c[_T]
            self.snap[d] = c[:]
        self.live: set[str] = set()

    def offer(self, device: str, total: int) -> None:
        if total > self.peak.get(device, -1):
            self.peak[device] = total
            self.live.add(device)

    def settle(self, current: RawBreakdown, device: str | None = None) -> None:
        """Copy the live peaks (all devices, or one) out of ``current`` before it changes."""
        if not self.live:
            return
        if device is None:
            for d in self.live:
                self.snap[d] = current[d][:]
            self.live.clear()
        elif device in self.live:
            self.snap[device] = current[device][:]
            self.live.discard(device)

    def absorb(self, inner: _Window) -> None:
        for device, total in inner.peak.items():
            if total > self.peak.get(device, -1):
                self.peak[device] = total
                self.snap[device] = inner.snap[device]
                self.live.discard(device)


class Ledger:
    """Live bytes per device and category, plus peaks for the step and for nested windows."""

    def __init__(self) -> None:
        # id(storage) -> [device, category index, nbytes, weakref, block, owner]; the weakref
        # callback drops the entry; block is the allocator's rounding (512 on CUDA, else 1);
        # owner: the FSDP module whose saved tensors, inputs or outputs these are (or None)
        self._entries: dict[int, list[Any]] = {}
        #: FSDP module -> bytes of the storages it owns (``track_new(..., owner=)``) alive now
        self.owner_bytes: dict[str, int] = {}
        self._cur: RawBreakdown = {}
        self._step = _Window({})
        self._windows: list[_Window] = []
        self._devices: dict[torch.device, tuple[str, int]] = {}  # device -> (name, block)
        self._on_free = _free_callback(self._entries, weakref.ref(self))
        # Light mode: every growth is a peak candidate. Deep mode turns this off and offers once
        # per op (offer_current), the instants upstream MemTracker evaluates, so both agree.
        self.offer_on_add = True
        # count_fake(): an estimate's fake tensors count as memory on this device
        self.fake_mode: Any = None
        self._fake_device: torch.device | None = None
        self.window_watch: Any = None  # told of window edges (allocator_temps.AllocatorTemps) or None

    def count_fake(self, fake_mode: Any, device: torch.device) -> None:
        """Account the tensors of ``fake_mode`` (a FakeTensorMode) as memory on ``device``
        (``fsdp-mem-otel estimate``); other fake tensors stay uncounted."""
        self.fake_mode, self._fake_device = fake_mode, device

    # -- integer accounts ----------------------------------------------------------------------
    def add(self, device: str, category: str, delta: int) -> None:
        """Add ``delta`` bytes (negative: subtract) to ``category`` on ``device`` directly, for
        buffers whose lifetime the caller knows (no storage is tracked)."""
        if delta:
            self._add(device, INDEX[category], delta)

    # -- tracked storages ----------------------------------------------------------------------
    def track(self, t: torch.Tensor, category: str, recategorize: bool = True) -> None:
        """Account the storages of ``t`` under ``category``.

        A storage seen before keeps its entry: its size is refreshed, and its category changes only
        when ``recategorize`` is true (explicit knowledge from FSDP beats per-op guesses).
        """
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
        """Account ``t`` under ``category`` only if its storage is not known yet (the hot path
        for saved activations: a known storage keeps its entry untouched); ``owner``: the FSDP
        module it belongs to, whose ``owner_bytes`` it counts in while alive."""
        cls = type(t)
        if (cls is torch.Tensor or cls is nn.Parameter) and t.layout is torch.strided:
            st = t.untyped_storage()
            if id(st) not in self._entries:
                self._new_entry(st, INDEX[category], None, owner)
            return
        for st in storages_of(t, self.fake_mode):
            if id(st) not in self._entries:
                self._new_entry(st, INDEX[category], None, owner)

    def knows(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` has an entry (tracked, or ``hold``-ed at 0 bytes)."""
        return id(st) in self._entries

    def hold(self, st: torch.UntypedStorage, category: str) -> None:
        """Give ``st`` an entry of 0 bytes under ``category`` unless it has one: a storage whose
        bytes an integer account carries, so that saved-tensor accounting knows it and passes."""
        if id(st) not in self._entries:
            self._new_entry(st, INDEX[category], 0)

    def forget(self, st: torch.UntypedStorage) -> None:
        """Set a known storage's bytes to 0, keeping the entry (its bytes move to an integer
        account, e.g. when deep mode hands back to light mode)."""
        entry = self._entries.get(id(st))
        if entry is not None and entry[2]:
            self._resize(entry, 0)

    def track_storage(self, st: torch.UntypedStorage, category: str, recategorize: bool) -> None:
        entry = self._entries.get(id(st))
        cat = INDEX[category]
        if entry is None:
            self._new_entry(st, cat)
            return
        n = rounded(st.nbytes(), entry[4])
        if n != entry[2]:
            self._resize(entry, n)
        if recategorize and entry[1] != cat:
            self._relabel(entry, cat)

    def track_storages(self, storages: list[torch.UntypedStorage], category: str) -> None:
        """``track_storage(st, category, True)`` for each storage (an FSDP group's buffers)."""
        entries = self._entries
        cat = INDEX[category]
        if all(entries.get(id(st), _NO_ENTRY)[1] == cat for st in storages):
            self.refresh_storages(storages)  # all known under this category: sizes only
            return
        for st in storages:
            self.track_storage(st, category, True)

    def _new_entry(self, st: torch.UntypedStorage, cat: int, nbytes: int | None = None,
                   owner: str | None = None) -> None:
        dev = st.device
        if dev.type == "meta" and self._fake_device is not None:  # a counted fake tensor's storage
            dev = self._fake_device
        known = self._devices.get(dev)
        if known is None:
            known = self._devices[dev] = (str(dev), device_block(dev))
        name, block = known
        key = id(st)
        n = rounded(st.nbytes(), block) if nbytes is None else nbytes
        self._entries[key] = [name, cat, n, weakref.KeyedRef(st, self._on_free, key), block, owner]
        if n:
            self._add(name, cat, n)
            if owner is not None:
                self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + n

    def _resize(self, entry: list[Any], n: int) -> None:
        """An entry's storage now has ``n`` bytes."""
        delta = n - entry[2]
        self._add(entry[0], entry[1], delta)
        entry[2] = n
        if entry[5] is not None:
            self.owner_bytes[entry[5]] += delta

    def _relabel(self, entry: list[Any], cat: int) -> None:
        device = entry[0]
        cats = self._cur[device]
        self._settle(device)
        cats[entry[1]] -= entry[2]
        cats[cat] += entry[2]
        entry[1] = cat
        if entry[5] is not None:  # named by FSDP, the optimizer, the inputs: no module's anymore
            self.owner_bytes[entry[5]] -= entry[2]
            entry[5] = None

    def relabel_guess(self, t: torch.Tensor, category: str, guesses: frozenset[str]) -> None:
        """Account ``t`` under ``category`` unless it already holds a category outside ``guesses``.

        Deep mode's collective rules use this: a buffer first seen as a per-op guess (activation,
        temp) becomes all_gather/reduce_scatter, but what an adapter named explicitly (FSDP1's
        unsharded grad doubling as the reduce-scatter input) keeps its name.
        """
        guessed = {INDEX[g] for g in guesses}
        for st in storages_of(t, self.fake_mode):
            entry = self._entries.get(id(st))
            self.track_storage(st, category, recategorize=entry is None or entry[1] in guessed)

    def refresh(self, t: torch.Tensor) -> None:
        """Re-read the sizes of ``t``'s storages (after ``resize_``), keeping their categories."""
        for st in storages_of(t, self.fake_mode):
            self.refresh_storage(st)

    def refresh_storage(self, st: torch.UntypedStorage) -> None:
        """Re-read one storage's size (deep mode's resize_ watch calls this)."""
        entry = self._entries.get(id(st))
        if entry is not None:
            n = rounded(st.nbytes(), entry[4])
            if n != entry[2]:
                self._resize(entry, n)

    def refresh_storages(self, storages: list[torch.UntypedStorage]) -> None:
        """``refresh_storage`` for each storage (an FSDP group's buffers after a reshard); the
        bytes change once per device and category, as FSDP resizes them all together."""
        entries = self._entries
        deltas: dict[tuple[str, int], int] = {}
        for st in storages:
            entry = entries.get(id(st))
            if entry is not None:
                n = rounded(st.nbytes(), entry[4])
                if n != entry[2]:
                    where = (entry[0], entry[1])
                    deltas[where] = deltas.get(where, 0) + n - entry[2]
                    if entry[5] is not None:
                        self.owner_bytes[entry[5]] += n - entry[2]
                    entry[2] = n
        for (device, cat), delta in deltas.items():
            if delta:
                self._add(device, cat, delta)

    def _add(self, device: str, cat: int, delta: int) -> None:
        # The hot path of every update: written out, no helper calls unless a window is live.
        cats = self._cur.get(device)
        if cats is None:
            cats = self._cur[device] = [0] * _N
        step = self._step
        windows = self._windows
        if delta < 0:  # the counters shrink: keep copies of the peaks they still are
            if device in step.live:
                step.settle(self._cur, device)
            if windows and device in windows[-1].live:
                windows[-1].settle(self._cur, device)
        cats[cat] += delta
        total = cats[_T] = cats[_T] + delta
        if delta > 0 and self.offer_on_add:
            if total > step.peak.get(device, -1):
                step.peak[device] = total
                step.live.add(device)
            if windows:
                inner = windows[-1]
                if total > inner.peak.get(device, -1):
                    inner.peak[device] = total
                    inner.live.add(device)

    def _settle(self, device: str) -> None:
        # Only the step window and the innermost window receive offers, so only they can be live.
        self._step.settle(self._cur, device)
        if self._windows:
            self._windows[-1].settle(self._cur, device)

    def offer_current(self) -> None:
        """Make the current counters a peak candidate for the step and the innermost window."""
        inner = self._windows[-1] if self._windows else None
        for device, cats in self._cur.items():
            self._step.offer(device, cats[_T])
            if inner is not None:
                inner.offer(device, cats[_T])

    # -- windows and peaks ---------------------------------------------------------------------
    def open_window(self) -> None:
        """Start a nested peak window (a module's forward or backward)."""
        if self._windows:
            self._windows[-1].settle(self._cur)  # it stops receiving offers now
        if self.window_watch is not None:
            self.window_watch.opened(self._cur)
        self._windows.append(_Window(self._cur))

    def close_window_raw(self) -> RawBreakdown:
        """End the innermost window; return its peak as raw counters (what a snapshot keeps; see
        ``as_breakdown``) and fold it into the enclosing one."""
        if not self._windows:
            return {}
        w = self._windows.pop()
        w.settle(self._cur)
        if self._windows:
            self._windows[-1].absorb(w)
        # the window is gone; its counter lists are replaced, never changed in place
        return w.snap if self.window_watch is None else self.window_watch.closed(len(self._windows), w.snap)

    def close_window_at(self, index: int) -> RawBreakdown:
        """End the window at ``index`` of the open ones (0 = outermost), which need not be the
        innermost: windows that overlap without nesting (modules whose backward spans cross).
        Its peak takes in what the windows opened after it have seen so far; returns it (raw)."""
        if index == len(self._windows) - 1 or index == -1:
            return self.close_window_raw()
        w = self._windows[index]
        for inner in self._windows[index + 1:]:
            inner.settle(self._cur)
            w.absorb(inner)
        del self._windows[index]
        if index > 0:
            self._windows[index - 1].absorb(w)
        snap = {d: c[:] for d, c in w.snap.items()}
        return snap if self.window_watch is None else self.window_watch.closed(index, snap)

    @property
    def open_windows(self) -> int:
        return len(self._windows)

    def raw(self) -> RawBreakdown:
        """A copy of the current counters (what a snapshot keeps)."""
        out = {}
        for d, c in self._cur.items():  # a loop, not a comprehension: no frame of its own (3.11)
            out[d] = c[:]
        return out

    def snapshot(self) -> DeviceBreakdown:
        """The current breakdown, ``{device: {category: bytes}}`` (a copy; also ``current``)."""
        return as_breakdown(self._cur)

    current = property(snapshot)

    def category_bytes(self, category: str) -> int:
        """Bytes of ``category`` now, summed over devices."""
        i = INDEX[category]
        return sum(c[i] for c in self._cur.values())

    def step_peak(self) -> DeviceBreakdown:
        self._step.settle(self._cur)
        peak = as_breakdown(self._step.snap)
        return peak if self.window_watch is None else self.window_watch.step_peak(peak)

    def reset_step(self) -> None:
        """Start a new step: the step peak restarts from what is live now; windows are dropped."""
        self._step = _Window(self._cur)
        self._windows.clear()

    # -- introspection -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)


_NO_ENTRY: list[Any] = [None, None]


def _free_callback(entries: dict[int, list[Any]], ledger_ref: weakref.ref[Ledger]) -> Any:
    """The weakref callback shared by all of a ledger's entries: drop the freed storage's bytes.

    One function per ledger (the storage's key travels on the KeyedRef) instead of a closure per
    entry; it holds the ledger weakly so a dropped tracker is collected.
    """

    def on_free(ref: weakref.KeyedRef) -> None:
        entry = entries.get(ref.key)
        if entry is None or entry[3] is not ref:
            return
        del entries[ref.key]
        ledger = ledger_ref()
        if ledger is not None and entry[2]:
            ledger._add(entry[0], entry[1], -entry[2])
            if entry[5] is not None:
                ledger.owner_bytes[entry[5]] -= entry[2]

    return on_free
