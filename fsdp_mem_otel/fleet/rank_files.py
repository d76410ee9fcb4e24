"""The sidecar directory's file names: one ``rank-<rank>.prom`` per rank. Standard library only.

Written by ``PrometheusExporter(sidecar_dir=...)``, read by ``fsdp-mem-otel serve``. Names are
parsed strictly (ASCII digits, no leading zeros), so ``rank-03.prom`` or a name with other
Unicode digits can never pose as rank 3.
"""

from __future__ import annotations

import re

RANK_FILE_RE = re.compile(r"rank-(0|[1-9][0-9]*)\.prom", re.ASCII)


def rank_file_name(rank: int) -> str:
    """The file name of ``rank``'s exposition."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0; got {rank!r}")
    return f"rank-{rank}.prom"


def rank_of(name: str) -> int | None:
    """The rank a file name belongs to, or None for any other name."""
    m = RANK_FILE_RE.fullmatch(name)
    return int(m.group(1)) if m else None
