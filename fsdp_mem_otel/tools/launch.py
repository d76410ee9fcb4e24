"""``python -m fsdp_mem_otel.tools.launch TORCHRUN-ARGS``: torchrun, for the commands that start ranks (demo).

A rank that fails prints its own one line (``cli_errors.run_command``) and exits non-zero;
torchrun would then add its ChildFailedError report (a traceback and a box per failed rank).
Here that becomes one line, and torchrun's own log of the failure is left out. With
``--debug`` (``FSDP_MEM_OTEL_DEBUG=1`` in the environment, which the ranks inherit) torchrun
reports as it does by itself.
"""

from __future__ import annotations

import logging
import sys

from fsdp_mem_otel.cli_errors import debug_enabled


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if debug_enabled():
        torchrun(argv)
        return 0
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        ranks = sorted(exc.failures)
        first = exc.failures[ranks[0]]
        print(f"fsdp-mem-otel: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed "
              f"(exit status {first.exitcode}); see the line{'s' if len(ranks) > 1 else ''} above",
              file=sys.stderr, flush=True)
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
