"""Error containment and aborted steps driven directly, without FSDP or ranks."""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_mem_otel.schema import BEFORE_PRE_FORWARD
from fsdp_mem_otel.training.allocator import AllocatorProbe
from fsdp_mem_otel.training.containment import ErrorPolicy, StepAborts, is_oom
from fsdp_mem_otel.training.light.ledger import Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder


def _raise(kind: type[Exception], msg: str) -> Exception:
    try:
        raise kind(msg)
    except Exception as exc:  # noqa: BLE001
        return exc


def test_failures_are_counted_logged_once_and_disable_after_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    disabled: list[int] = []
    policy = ErrorPolicy(3, lambda: disabled.append(1))
    with caplog.at_level(logging.WARNING, logger="fsdp_mem_otel"):
        for _ in range(2):
            policy.report(_raise(RuntimeError, "same place"))
        policy.report(_raise(ValueError, "exporter"), may_disable=False)  # counted, not towards the limit
        assert (policy.total, policy.disabled, disabled) == (3, False, [])
        policy.report(_raise(RuntimeError, "same place"))
    assert (policy.total, policy.disabled, disabled) == (4, True, [1])
    policy.report(_raise(RuntimeError, "same place"))
    assert disabled == [1]  # once
    same_kind = [r for r in caplog.records if "same place" in r.getMessage()]
    assert len(same_kind) == 1


def test_no_limit_never_disables() -> None:
    policy = ErrorPolicy(0, lambda: pytest.fail("disabled"))
    for _ in range(50):
        policy.report(_raise(RuntimeError, "x"))
    assert policy.total == 50 and not policy.disabled


def test_an_abort_keeps_where_the_step_stopped_and_what_was_live() -> None:
    ledger = Ledger()
    recorder = StepRecorder(ledger)
    aborts = StepAborts(recorder, ledger, AllocatorProbe(), lambda exc: pytest.fail(str(exc)))
    recorder.on_state("layers.1", BEFORE_PRE_FORWARD)
    live = torch.empty(256)
    ledger.track(live, "activation")
    aborts.record(torch.OutOfMemoryError("CUDA out of memory (injected)"))
    aborts.record(RuntimeError("a later one does not replace the first"))
    abort = aborts.take()
    assert abort is not None and (abort.error, abort.oom, abort.module, abort.state) == (
        "OutOfMemoryError", True, "layers.1", BEFORE_PRE_FORWARD)
    assert abort.breakdown["cpu"]["activation"] == live.numel() * 4
    assert aborts.take() is None  # the next step starts clean
    aborts.incomplete()  # a pass still open (layers.1's window)
    incomplete = aborts.take()
    assert incomplete is not None and incomplete.error == "IncompleteStep" and not incomplete.oom
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) and not is_oom(ValueError("x"))
