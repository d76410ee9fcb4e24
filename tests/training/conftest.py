"""Fixtures for every test under tests/training."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _peak_readers_given_back() -> Iterator[None]:
    """No test leaves torch's peak readers wrapped (a probe or tracker that took the allocator's
    peak counters and was never stopped or detached): every later test would read through the
    wrappers, and the tracker's raw reads would go to that test's fake allocator."""
    yield
    shadow = sys.modules.get("fsdp_mem_otel.training.shadow_peaks")
    if shadow is not None and shadow.installed():
        for client in list(shadow._clients):
            client.release()
        pytest.fail("torch's peak readers left wrapped: stop the probe (or detach the tracker) that took them")
