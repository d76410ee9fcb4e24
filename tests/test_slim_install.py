"""The package installed without torch, as in the sidecar image (deploy/docker/Dockerfile).

``scripts/setup.sh`` makes ``.venv-slim`` with a plain ``pip install .`` (no extras, no torch).
There, serve, report, rules and dashboards must run: the sidecar image and a laptop reading a
job's JSONL have no torch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist import free_ports
from tests.exporters import prom_workers
from tests.exporters.test_prometheus import value
from tests.exporters.test_sidecar import write_ranks
from tests.offline.test_report import synthetic, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
SLIM = ROOT / ".venv-slim" / "bin"


@pytest.fixture(scope="module")
def slim() -> Path:
    if not (SLIM / "fsdp-mem-otel").exists():
        pytest.fail(f"{SLIM} has no fsdp-mem-otel: run scripts/setup.sh")
    return SLIM


def run(*cmd: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_there_is_no_torch_and_the_package_is_not_this_checkout(slim: Path, tmp_path: Path) -> None:
    probe = ("import importlib.util, fsdp_mem_otel; "
             "print(importlib.util.find_spec('torch') is None, fsdp_mem_otel.__file__)")
    no_torch, where = run(slim / "python", "-c", probe, cwd=tmp_path).stdout.split()
    assert no_torch == "True"
    assert str(ROOT / ".venv-slim") in where  # installed, not imported from the checkout


def test_dashboards_and_rules(slim: Path, tmp_path: Path) -> None:
    run(slim / "fsdp-mem-otel", "dashboards", "--out", tmp_path / "slim", cwd=tmp_path)
    run(sys.executable, "-m", "fsdp_mem_otel.cli", "dashboards", "--out", tmp_path / "full", cwd=ROOT)
    names = sorted(p.name for p in (tmp_path / "full").glob("*.json"))
    assert names and names == sorted(p.name for p in (tmp_path / "slim").glob("*.json"))
    for name in names:
        assert json.loads((tmp_path / "slim" / name).read_text()) == json.loads((tmp_path / "full" / name).read_text())

    run(slim / "fsdp-mem-otel", "rules", "--out", tmp_path / "rules", "--k8s-out", tmp_path / "k8s",
        "--dashboards", tmp_path / "slim", cwd=tmp_path)
    rule_files = list((tmp_path / "rules").glob("*.yml"))
    assert rule_files
    run("promtool", "check", "rules", *rule_files, cwd=tmp_path)
    assert list((tmp_path / "k8s").glob("*.yaml"))


def test_report(slim: Path, tmp_path: Path) -> None:
    run_file = tmp_path / "run.jsonl"
    write_jsonl(run_file, [synthetic(step, rank=0) for step in range(1, 7)])
    run(slim / "fsdp-mem-otel", "report", run_file, "-o", tmp_path / "report.html", "-q", cwd=tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "Plotly" in page and "layers.0" in page


def test_serve_scraped_over_http(slim: Path, tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    for exp in write_ranks(ranks):
        exp.shutdown()
    port = free_ports(1)
    proc = subprocess.Popen(
        [str(slim / "fsdp-mem-otel"), "serve", "--dir", str(ranks), "--port", str(port), "--addr", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while prom_workers.try_get(f"http://127.0.0.1:{port}/metrics") != "ok":
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        text = prom_workers.get(f"http://127.0.0.1:{port}/metrics")
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank="0") == 0
        assert value(text, "fsdp_mem_sidecar_rank_stale", rank="1") == 0
        assert value(text, "fsdp_mem_step_peak_bytes", rank="1", device="cuda:0", category="total") == 2000
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
