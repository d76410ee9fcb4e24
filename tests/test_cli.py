"""The README's demo command: a real 2-rank FSDP run under torchrun that prints per-module tables."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.workers import _expected_module_keys


@pytest.mark.parametrize("fsdp", ["1", "2"])
def test_demo_runs_two_ranks_and_prints_module_table(fsdp: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "4", "--deep-every", "2", "--blocks", "3",
         "--fsdp", fsdp],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "step 4/4" in text and "tracker errors: 0" in text
    assert f"FSDP{fsdp}, rank 0 of 2" in text
    table = text[text.rindex("module  "):]
    for key in _expected_module_keys(3):
        assert f"\n{key} " in table, key


def test_demo_rejects_bad_options_before_launching() -> None:
    out = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--steps: expected a positive integer, got 0" in out.stderr


def test_demo_serves_prometheus_per_rank_and_writes_sidecar_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = free_port_pair()
    sidecar = tmp_path / "metrics"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = tmp_path / "run.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "3", "--blocks", "2",
         "--port", str(base), "--sidecar-dir", str(sidecar), "--out", str(run)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"http://127.0.0.1:{base}/metrics, http://127.0.0.1:{base + 1}/metrics" in out.stdout
    from fsdp_mem_otel.exporters.jsonl import read_reports

    assert f"fsdp-mem-otel report {tmp_path}/run.rank0.jsonl {tmp_path}/run.rank1.jsonl -o report.html" in out.stdout
    for rank in (0, 1):
        text = (sidecar / f"rank-{rank}.prom").read_text()
        assert 'fsdp_mem_steps_total{' in text and f'rank="{rank}"' in text
        reports = list(read_reports(tmp_path / f"run.rank{rank}.jsonl"))
        assert [r.step for r in reports] == [1, 2, 3] and {r.rank for r in reports} == {rank}
        # the sidecar file shows the last report's numbers
        assert 'category="total",device="cpu"' in text
        peak = reports[-1].peak["cpu"]["total"]
        assert any(line.startswith("fsdp_mem_step_peak_bytes{") and 'category="total"' in line
                   and line.endswith(f" {float(peak)}") for line in text.splitlines())


def test_tracker_from_env_configures_everything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fsdp_mem_otel.exporters.jsonl import read_reports
    from tests import workers
    from tests.dist import run_ranks

    base = free_port_pair()
    for rank, res in enumerate(run_ranks(workers.from_env_run, base, str(tmp_path))):
        assert res["modes"] == ["light", "deep"]
        assert res["kinds"] == ["JSONLExporter", "PrometheusExporter"]
        peak_line = [line for line in res["text"].splitlines()
                     if line.startswith("fsdp_mem_step_peak_bytes{") and 'category="total"' in line]
        assert len(peak_line) == 1 and 'job_name="envjob"' in peak_line[0] and f'rank="{rank}"' in peak_line[0]
        assert float(peak_line[0].rsplit(" ", 1)[1]) == res["peak"]
        assert [r.step for r in read_reports(tmp_path / f"run-{rank}.jsonl")] == [1, 2]


def free_port_pair() -> int:
    """A port p with p and p+1 free (the two ranks' endpoints)."""
    import socket

    from tests.dist import free_port

    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")
