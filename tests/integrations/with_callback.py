"""Run a user script (tests/user_scripts) with the shipped framework callback added to every
Trainer it builds, without editing the script: the figures the launcher is compared with.

    torchrun --nproc-per-node 2 tests/integrations/with_callback.py hf|lightning SCRIPT.py [ARGS]

The callback is configured from the environment (``FSDPMemoryCallback()``), like the launcher.
"""

from __future__ import annotations

import sys
from typing import Any


def add_callback(kind: str) -> None:
    """Every ``Trainer`` of ``kind`` ("hf": transformers, "lightning") built from now on gets
    ``FSDPMemoryCallback()`` after the callbacks it is given."""
    if kind == "hf":
        import transformers

        from fsdp_mem_otel.integrations.hf import FSDPMemoryCallback

        cls: Any = transformers.Trainer
    elif kind == "lightning":
        import lightning.pytorch as pl

        from fsdp_mem_otel.integrations.lightning import FSDPMemoryCallback

        cls = pl.Trainer
    else:
        raise SystemExit(f"unknown kind {kind!r}: hf or lightning")
    init = cls.__init__

    def __init__(self: Any, *args: Any, callbacks: Any = None, **kwargs: Any) -> None:
        init(self, *args, callbacks=[*(callbacks or []), FSDPMemoryCallback()], **kwargs)

    cls.__init__ = __init__


if __name__ == "__main__":
    from fsdp_mem_otel.run import run_script

    add_callback(sys.argv[1])
    run_script(sys.argv[2], sys.argv[3:])
