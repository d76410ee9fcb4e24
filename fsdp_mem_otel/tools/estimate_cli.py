"""The ``fsdp-mem-otel estimate`` command: ``estimate``'s options and tables, or, with --fit or
--compare-options, ``estimate_fit``'s search. It imports both; neither imports it, and
``estimate_fit`` imports ``estimate``, never the reverse."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_mem_otel.tools.estimate import config_from_args, estimate_parser, run_estimate, usage_errors
from fsdp_mem_otel.tools.estimate_fit import add_fit_arguments, fit_mode_errors, run_fit_mode


def estimate_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel estimate``: see ``estimate``'s module docstring; ``--help`` lists the options.
    Returns 0; 1 when ``--fit`` finds nothing that fits or --out could not be written after all; 2
    on a bad option or an estimate the model rejects, said in one line on stderr (a
    ``cli_errors.UsageError``; ``--debug`` adds the traceback)."""
    import sys

    from fsdp_mem_otel.cli_errors import run_command

    return run_command("fsdp-mem-otel estimate", _estimate_main, sys.argv[1:] if argv is None else argv,
                       catch_all=False)


def _estimate_main(argv: Sequence[str]) -> int:
    p = estimate_parser()
    add_fit_arguments(p)  # --fit, --compare-options: estimate_fit.py
    args = p.parse_args(argv)
    if (wrong := fit_mode_errors(args)) is not None:
        p.error(wrong)
    with usage_errors():
        config = config_from_args(args)
    if args.fit is not None or args.compare_options:
        return run_fit_mode(args, config)
    return run_estimate(args, config)
