"""README's quickstart, ``bash scripts/demo.sh``: a re-run with nothing changed starts the demo at once.

CI runs the script first on a fresh clone (``.ci/run``), so the setup half is exercised there; here
the script runs twice in this checkout and the second run must skip the setup: no setup line, and
the demo's launch line within seconds (a pip install that finds everything installed already takes
longer than the bound, so a skipped check fails the test).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_LINE = "launching 2 ranks"
SETUP_LINE = "demo: setting up"
#: seconds from the command to the demo's launch line on a re-run (the CLI's own start-up)
RERUN_BOUND_S = 5.0


def _run_demo() -> tuple[float, str, str]:
    """(seconds to the launch line, stdout, stderr) of one ``bash scripts/demo.sh`` with a short demo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_MEM_OTEL_", "OTEL_"))}
    env["FSDP_MEM_OTEL_PROMETHEUS"] = "0"
    started = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/demo.sh", "--steps", "2", "--blocks", "2"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    to_launch = time.monotonic() - started
    rest, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return to_launch, first + rest, err


def test_demo_rerun_skips_the_setup_and_prints_the_tables() -> None:
    _run_demo()  # sets .venv up if this checkout's .venv was not set up by the quickstart
    to_launch, out, err = _run_demo()
    assert SETUP_LINE not in err
    assert out.startswith(LAUNCH_LINE), out[:300]
    assert to_launch < RERUN_BOUND_S, f"the re-run took {to_launch:.1f} s to launch the demo"
    assert "at step peak" in out and "module" in out  # the category and module tables
    stamp = (ROOT / ".venv" / ".demo-setup").read_text().split()
    assert stamp == ["torch==2.13.0", hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]]
