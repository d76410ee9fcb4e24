"""The README's demo command: a real 2-rank FSDP run under torchrun that prints per-module tables."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fsdp_mem_otel.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.tracker import FSDPMemoryTracker
from tests.dist import free_ports, run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, expected_module_keys


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
    for key in expected_module_keys(3):
        assert f"\n{key} " in table, key


def test_demo_rejects_bad_options_before_launching() -> None:
    out = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--steps: expected a positive integer, got 0" in out.stderr


def test_demo_serves_prometheus_per_rank_and_writes_sidecar_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = free_ports(2)
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


@dataclass(frozen=True)
class FromEnvResult:
    modes: list[str]  # each step's report mode
    peak: int  # the last report's cpu total peak
    text: str  # this rank's /metrics
    kinds: list[str]  # the exporters from_env() made, by class name


def from_env_run(base_port: int, directory: str) -> FromEnvResult:
    """FSDPMemoryTracker.from_env() in a job configured only through environment variables."""
    import urllib.request

    rank = torch.distributed.get_rank()
    os.environ.update({
        "FSDP_MEM_OTEL_MODE": "light", "FSDP_MEM_OTEL_DEEP_EVERY": "2", "FSDP_MEM_OTEL_JOB": "envjob",
        "FSDP_MEM_OTEL_PROMETHEUS_PORT": str(base_port), "FSDP_MEM_OTEL_PROMETHEUS_ADDR": "127.0.0.1",
        "FSDP_MEM_OTEL_JSONL": os.path.join(directory, "run-{rank}.jsonl"),
    })
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker.from_env(model, opt)
    reports = []
    with tracker:
        for step in range(2):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            reports.append(tracker.step().to_dict())
        torch.distributed.barrier()
        with urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10) as r:
            text = r.read().decode()
    tracker.close()
    return FromEnvResult(modes=[r["mode"] for r in reports], peak=reports[-1]["peak"]["cpu"]["total"], text=text,
                         kinds=sorted(type(e).__name__ for e in tracker.exporters))


@pytest.fixture(scope="module")
def from_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[FromEnvResult]]:
    """The JSONL directory and the per-rank results of one from_env_run on 2 ranks."""
    directory = tmp_path_factory.mktemp("from_env")
    return directory, run_ranks(from_env_run, free_ports(2), str(directory))


def test_tracker_from_env_configures_everything(from_env: tuple[Path, list[FromEnvResult]], rank: int) -> None:
    from fsdp_mem_otel.exporters.jsonl import read_reports

    directory, per_rank = from_env
    res = per_rank[rank]
    assert res.modes == ["light", "deep"]
    assert res.kinds == ["JSONLExporter", "PrometheusExporter"]
    peak_line = [line for line in res.text.splitlines()
                 if line.startswith("fsdp_mem_step_peak_bytes{") and 'category="total"' in line]
    assert len(peak_line) == 1 and 'job_name="envjob"' in peak_line[0] and f'rank="{rank}"' in peak_line[0]
    assert float(peak_line[0].rsplit(" ", 1)[1]) == res.peak
    assert [r.step for r in read_reports(directory / f"run-{rank}.jsonl")] == [1, 2]
