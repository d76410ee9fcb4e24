"""The ``fsdp-mem-otel`` command: demo | estimate | run | serve | rules | dashboards | report | compare (``USAGE``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from fsdp_mem_otel.cli_errors import DEBUG_FLAG, ArgumentParser, UsageError, run_command

USAGE = """usage: fsdp-mem-otel COMMAND [options]

commands:
  demo    run a real 2-rank FSDP training on CPU with the tracker; print per-module tables
  estimate  a FSDP2 job's per-rank, per-module memory before launch (FakeTensorMode, no GPU)
  run     run a training script unchanged with tracking attached to its FSDP model (torchrun: -m fsdp_mem_otel.run)
  serve   serve every rank's sidecar exposition files from one /metrics endpoint
  rules   write the Prometheus alert/recording rules, PrometheusRule and dashboard ConfigMaps
  dashboards  write the Grafana dashboards (JSON) built from the metric catalog
  report  turn JSONL step reports into one self-contained HTML page
  compare what grew between two runs (or an estimate and a run), per category and per module

`fsdp-mem-otel COMMAND --help` for a command's options. A mistake is reported in one line on stderr;
--debug (anywhere among the options) shows the traceback as well."""


def demo(argv: Sequence[str]) -> int:
    """Launch the demo's ranks under torchrun (gloo, CPU), after validating the options and the
    FSDP_MEM_OTEL_* environment here (the ranks read both, as a job does)."""
    from fsdp_mem_otel.tools.demo import add_demo_args, demo_configs

    p = ArgumentParser(
        prog="fsdp-mem-otel demo",
        description="Run a real FSDP training on CPU (gloo, one process per rank) with the tracker on, "
                    "configured like a job: the FSDP_MEM_OTEL_* and OTEL_* environment (see docs/environment.md's "
                    "table), the options below overriding it.",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    add_demo_args(p)
    args = p.parse_args(argv)
    try:
        demo_configs(args)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    from fsdp_mem_otel.cli_errors import check_writable
    from fsdp_mem_otel.tools.demo import jsonl_path

    if args.out:
        check_writable(jsonl_path(args.out, 0), "--out")
    if args.sidecar_dir:
        check_writable(args.sidecar_dir, "--sidecar-dir", directory=True)
    rank_args = list(argv)
    if "--nproc" in rank_args:  # the launcher's option, not the ranks'
        i = rank_args.index("--nproc")
        del rank_args[i : i + 2]
    rank_args = [a for a in rank_args if not a.startswith("--nproc=")]
    # torchrun through tools/launch.py: a rank that fails says so in one line (the rank's own),
    # not in torchrun's ChildFailedError report (--debug, passed on in the environment, shows both)
    cmd = [
        sys.executable, "-m", "fsdp_mem_otel.tools.launch", "--standalone", "--nproc-per-node", str(args.nproc),
        "-m", "fsdp_mem_otel.tools.demo", *rank_args,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launching {args.nproc} ranks: torchrun {' '.join(cmd[4:])}", flush=True)
    return subprocess.call(cmd, env=env)


def estimate(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.tools.estimate_cli import estimate_main

    return estimate_main(argv)


def run(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.run import main as run_main

    return run_main(argv, prog="fsdp-mem-otel run")


def serve(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.fleet.serve import serve_main

    return serve_main(argv)


def rules(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.fleet.rules_command import rules_main

    return rules_main(list(argv))


def dashboards(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.fleet.dashboards import dashboards_main

    return dashboards_main(list(argv))


def report(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.offline.report import report_main

    return report_main(list(argv))


def compare(argv: Sequence[str]) -> int:
    from fsdp_mem_otel.offline.compare import compare_main

    return compare_main(list(argv))


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "demo": demo, "estimate": estimate, "run": run, "serve": serve, "rules": rules, "dashboards": dashboards,
    "report": report, "compare": compare,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp-mem-otel COMMAND ...``; returns the exit status. A mistake (``UsageError``) is
    one line on stderr, exit 2; any other exception one line naming its type, exit 1; ``--debug``
    (anywhere among the options; for ``run``, before the script) adds the traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while args and args[0] == DEBUG_FLAG:  # before the command
        debug = True
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"fsdp-mem-otel: unknown command {command!r}; accepted: {', '.join(COMMANDS)}\n\n{USAGE}",
              file=sys.stderr)
        return 2
    if command == "run":  # the script's own arguments may hold --debug: only one before the script is ours
        while rest and rest[0] == DEBUG_FLAG:
            debug = True
            rest = rest[1:]
        return run_command(f"fsdp-mem-otel {command}", COMMANDS[command], rest, debug=debug, strip=False,
                           catch_all=False)
    return run_command(f"fsdp-mem-otel {command}", COMMANDS[command], rest, debug=debug)


if __name__ == "__main__":
    raise SystemExit(main())
