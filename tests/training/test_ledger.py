"""Ledger accounting against numel x element size, on plain CPU tensors."""

import torch

from fsdp_mem_otel.schema import ACTIVATION, ALL_GATHER, TEMP, TOTAL
from fsdp_mem_otel.training.light.ledger import Ledger, as_breakdown


def test_track_counts_storage_once_and_frees_on_gc() -> None:
    ledger = Ledger()
    a = torch.empty(100, dtype=torch.float32)
    view = a[10:20]
    ledger.track(a, ACTIVATION)
    ledger.track(view, ACTIVATION)  # same storage: counted once
    assert ledger.current["cpu"][ACTIVATION] == a.numel() * a.element_size()
    del a, view
    assert ledger.current["cpu"][ACTIVATION] == 0
    assert len(ledger) == 0


def test_recategorize_moves_bytes_without_changing_total() -> None:
    ledger = Ledger()
    t = torch.empty(64, dtype=torch.bfloat16)
    ledger.track(t, TEMP)
    ledger.track(t, ALL_GATHER, recategorize=False)
    assert ledger.current["cpu"][TEMP] == 128
    ledger.track(t, ALL_GATHER)
    assert ledger.current["cpu"][TEMP] == 0
    assert ledger.current["cpu"][ALL_GATHER] == 128
    assert ledger.current["cpu"][TOTAL] == 128


def test_refresh_follows_storage_resize() -> None:
    ledger = Ledger()
    t = torch.empty(256)
    ledger.track(t, ACTIVATION)
    t.untyped_storage().resize_(0)
    ledger.refresh(t)
    assert ledger.current["cpu"][TOTAL] == 0
    t.untyped_storage().resize_(1024)
    ledger.refresh(t)
    assert ledger.current["cpu"][TOTAL] == 1024


def test_step_and_window_peaks_nest() -> None:
    ledger = Ledger()
    keep = torch.empty(10)  # 40 bytes live throughout
    ledger.track(keep, ACTIVATION)
    ledger.reset_step()
    ledger.open_window()  # outer
    ledger.open_window()  # inner
    big = torch.empty(100)
    ledger.track(big, TEMP)
    del big
    inner = as_breakdown(ledger.close_window_raw())
    assert inner["cpu"][TOTAL] == 440 and inner["cpu"][TEMP] == 400
    small = torch.empty(50)
    ledger.track(small, TEMP)
    outer = as_breakdown(ledger.close_window_raw())
    assert outer["cpu"][TOTAL] == 440  # the inner peak folded into the outer window
    assert ledger.step_peak()["cpu"][TOTAL] == 440
    ledger.reset_step()
    assert ledger.step_peak()["cpu"][TOTAL] == 240  # restarts from what is live: keep + small


def test_peak_breakdown_is_the_one_at_the_peak_instant() -> None:
    # The peak's breakdown is copied lazily: at the next free, relabel, nested window or read.
    ledger = Ledger()
    ledger.open_window()
    a = torch.empty(100)  # 400 B activation
    ledger.track(a, ACTIVATION)
    b = torch.empty(50)  # 200 B temp: total 600, the peak
    ledger.track(b, TEMP)
    ledger.track(b, ALL_GATHER)  # relabel at the peak: the peak keeps its old label
    del b  # 400
    c = torch.empty(25)  # 100 B: total 500, below the peak
    ledger.track(c, TEMP)
    window = as_breakdown(ledger.close_window_raw())["cpu"]
    assert (window[TOTAL], window[ACTIVATION], window[TEMP], window[ALL_GATHER]) == (600, 400, 200, 0)
    step = ledger.step_peak()["cpu"]
    assert step == window


def test_inner_window_peak_is_kept_when_the_outer_grows_later() -> None:
    ledger = Ledger()
    ledger.open_window()  # outer
    ledger.open_window()  # inner
    big = torch.empty(100)
    ledger.track(big, TEMP)  # 400, inner peak (live)
    inner = as_breakdown(ledger.close_window_raw())["cpu"]
    more = torch.empty(200)
    ledger.track(more, ACTIVATION)  # 1200: outer peak, after the inner closed
    outer = as_breakdown(ledger.close_window_raw())["cpu"]
    assert inner[TOTAL] == 400 and inner[ACTIVATION] == 0
    assert outer[TOTAL] == 1200 and outer[ACTIVATION] == 800 and outer[TEMP] == 400


def test_group_refresh_moves_bytes_once_and_exactly() -> None:
    ledger = Ledger()
    ts = [torch.empty(16) for _ in range(3)]
    storages = [t.untyped_storage() for t in ts]
    ledger.track_storages(storages, ACTIVATION)
    assert ledger.current["cpu"][TOTAL] == 3 * 64
    for st in storages:
        st.resize_(0)
    ledger.refresh_storages(storages)
    assert ledger.current["cpu"][TOTAL] == 0
    for st in storages:
        st.resize_(128)
    ledger.track_storages(storages, ACTIVATION)  # known, same category: sizes only
    assert ledger.current["cpu"][ACTIVATION] == 3 * 128
    ledger.track_storages(storages, TEMP)  # a new category relabels
    assert ledger.current["cpu"][TEMP] == 3 * 128 and ledger.current["cpu"][ACTIVATION] == 0
