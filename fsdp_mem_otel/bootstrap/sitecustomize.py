"""Automatic attachment from the environment: ``FSDP_MEM_OTEL_AUTO=1`` with ``PYTHONPATH`` set to
this folder (``python -m fsdp_mem_otel.run --pythonpath`` prints it).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one.
With ``FSDP_MEM_OTEL_AUTO`` set to 1/true/yes/on this one calls ``fsdp_mem_otel.run.enable()``:
nothing is imported from torch here, and the attachment is installed when the process imports
``torch.distributed.fsdp``, so processes that never do (torchrun's agent, data-loader workers)
only carry an import hook that waits. Without the variable it does nothing. Either way it then
runs the ``sitecustomize`` that this folder shadows, if the environment has one, as Python would
have. Standard library only; it never stops the process (a failure is printed to stderr).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _enable() -> None:
    # env.FSDP_MEM_OTEL_AUTO, spelled out: importing the package is left for when it is set
    if os.environ.get("FSDP_MEM_OTEL_AUTO", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from fsdp_mem_otel.run import enable

        enable(explicit=False)
    except Exception as exc:  # noqa: BLE001 - never stop the process
        sys.stderr.write(f"fsdp_mem_otel: FSDP_MEM_OTEL_AUTO is set but automatic tracking is off: {exc!r}\n")


def _chain() -> None:
    """Run the ``sitecustomize`` further down ``sys.path`` (the environment's own), if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_enable()
_chain()
