"""The torch versions this package is tested with, and the one warning for the others: the adapters and
``shadow_peaks`` read torch internals that change without notice, so on an untested version the tracker says so at
attach (one log line per process, and ``WARNING_TORCH_UNTESTED`` in every report)."""

from __future__ import annotations

import logging
import re

import torch

logger = logging.getLogger(__name__)

#: (major, minor) of the oldest and the newest torch release the test suite runs on
TESTED_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 14))
#: ``StepReport.warnings``: torch is outside ``TESTED_RANGE``
WARNING_TORCH_UNTESTED = "torch_untested"
UNTESTED = ("fsdp_mem_otel: torch %s is outside the tested range %s; FSDP internals the tracker reads may have "
            "changed, so a category can read 0 or a peak reader can go unshadowed without another warning")

_warned = False


def tested_range() -> str:
    """``TESTED_RANGE`` as people write it: "2.13-2.14"."""
    (a, b), (c, d) = TESTED_RANGE
    return f"{a}.{b}-{c}.{d}"


def is_tested(version: str) -> bool:
    """Whether torch ``version`` ("2.13.0+cu130", "2.15.0.dev20260101") is in ``TESTED_RANGE``; unparsable: no."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return False
    major_minor = (int(m.group(1)), int(m.group(2)))
    return TESTED_RANGE[0] <= major_minor <= TESTED_RANGE[1]


def check_torch(version: str | None = None) -> bool:
    """True where torch ``version`` (default: the imported one) is untested; logs ``UNTESTED`` once a process."""
    global _warned
    version = str(torch.__version__) if version is None else version
    if is_tested(version):
        return False
    if not _warned:
        _warned = True
        logger.warning(UNTESTED, version, tested_range())
    return True
