"""The sink's calls that put FSDP's buffers in the ledger, as integers (``add``) or as tensors: ``LedgerCalls``,
the base of ``sink.Sink``. Each is contained (failures go to ``report_error``); nothing while detached."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_mem_otel.training.light import log
from fsdp_mem_otel.training.light.ledger import Ledger, storages_of


class LedgerCalls:
    """FSDP buffers into ``ledger``; never raises."""

    ledger: Ledger
    report_error: Callable[[BaseException], None]
    #: events are accounted only while active (the tracker attached)
    active: bool

    def add(self, device: str, cat: int, delta: int) -> None:
        """Add ``delta`` bytes to category index ``cat`` on ``device`` (sized and timed by FSDP's events)."""
        if self.active and delta:
            pending = self.ledger.pending
            if pending is not None:  # ``Counters.add_at`` without its frame: ~170 calls a step
                log.change(pending, device, cat, delta)
                return
            try:
                self.ledger.add_at(device, cat, delta)
            except Exception as exc:  # noqa: BLE001
                self.report_error(exc)

    def hold(self, st: torch.UntypedStorage, category: str) -> None:
        """Make ``st`` known to the ledger at 0 bytes (an integer account carries its bytes)."""
        try:
            self.ledger.hold(st, category)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def forget(self, obj: torch.Tensor | torch.UntypedStorage) -> None:
        """Keep a storage's (or a tensor's) entries at 0 bytes: FSDP let go, or an integer account took over."""
        try:
            for st in [obj] if isinstance(obj, torch.UntypedStorage) else storages_of(obj, self.ledger.fake_mode):
                self.ledger.forget(st)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def track(self, tensor: torch.Tensor | None, category: str) -> None:
        """Account ``tensor``'s storages under ``category`` (re-categorizing known ones)."""
        if tensor is None or not self.active:
            return
        try:
            self.ledger.track(tensor, category)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def track_all(self, tensors: list[torch.Tensor | None], category: str) -> None:
        """``track`` for each of ``tensors`` (None entries skipped), in one call."""
        if not self.active:
            return
        try:
            self.ledger.track_all(tensors, category)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def track_storages(self, storages: list[torch.UntypedStorage], category: str) -> None:
        """Account storages FSDP keeps (and resizes) under ``category``."""
        if not self.active:
            return
        try:
            self.ledger.track_storages(storages, category)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def refresh(self, tensor: torch.Tensor | None) -> None:
        """``tensor``'s storages may have been resized: re-read their sizes."""
        if tensor is None or not self.active:
            return
        try:
            self.ledger.refresh(tensor)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

    def refresh_storages(self, storages: list[torch.UntypedStorage]) -> None:
        """``storages`` may have been resized: re-read their sizes."""
        if not self.active:
            return
        try:
            self.ledger.refresh_storages(storages)
        except Exception as exc:  # noqa: BLE001
            self.report_error(exc)

