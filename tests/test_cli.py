"""The README's demo command: a real 2-rank FSDP run under torchrun that prints per-module tables."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
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


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without any FSDP_MEM_OTEL_* / OTEL_* variable, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_MEM_OTEL_", "OTEL_"))}
    return {**base, "OMP_NUM_THREADS": "1", **extra}


def scrape_sidecar(directory: Path) -> str:
    """Serve ``directory`` with ``fsdp-mem-otel serve`` (its own process) and scrape it over HTTP."""
    import time
    import urllib.request

    port = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "fsdp_mem_otel.cli", "serve", "--dir", str(directory),
                               "--port", str(port), "--addr", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.read().decode()
            except OSError as exc:
                if server.poll() is not None or time.monotonic() > deadline:
                    detail = server.stderr.read() if server.stderr else ""
                    raise AssertionError(f"serve did not answer: {exc!r} {detail}") from exc
                time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(10)


def test_demo_launched_like_a_job_exports_the_estimate(tmp_path: Path) -> None:
    """The workflow of docs/estimate.md, on the demo: estimate, launch with FSDP_MEM_OTEL_ESTIMATE (and the
    rest of the job's environment), compare. The estimate gauges come back in a real scrape."""
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from tests.exporters.otel_workers import OTLPReceiver

    estimate = tmp_path / "estimate.jsonl"
    done = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "estimate", "--blocks", "2", "--world-size", "2",
                           "--optimizer", "adam", "--out", str(estimate)],  # the demo's model and optimizer
                          capture_output=True, text=True, env=job_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    est = json.loads(estimate.read_text().splitlines()[0])
    sidecar = tmp_path / "sidecar"
    with OTLPReceiver() as receiver:
        env = job_env(FSDP_MEM_OTEL_ESTIMATE=str(estimate), FSDP_MEM_OTEL_SIDECAR_DIR=str(sidecar),
                      FSDP_MEM_OTEL_SIDECAR_INTERVAL="0", FSDP_MEM_OTEL_JSONL=str(tmp_path / "run-{rank}.jsonl"),
                      FSDP_MEM_OTEL_DEEP_EVERY="3", FSDP_MEM_OTEL_JOB="demojob",
                      OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url)
        out = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "4", "--blocks", "2",
                              "--deep-every", "2"],  # the flag wins over FSDP_MEM_OTEL_DEEP_EVERY
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        spans = list(receiver.spans)
    text = out.stdout
    assert f"the estimate in {estimate} is exported beside the measurement" in text
    assert text.count("Step 4 (deep mode)") == 1 and "Step 2 (deep mode)" not in text  # the last step: once
    lines = {rank: [json.loads(x) for x in (tmp_path / f"run-{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)}
    for rank, reports in lines.items():
        assert [r["mode"] for r in reports] == ["light", "deep", "light", "deep"] and reports[0]["rank"] == rank

    # a real scrape of the rank files the demo wrote, through the sidecar: the estimate beside the measurement
    got = [s for fam in text_string_to_metric_families(scrape_sidecar(sidecar)) for s in fam.samples]
    for rank in (0, 1):
        mine = [s for s in got if s.labels.get("rank") == str(rank)]
        assert mine and all(s.labels["job_name"] == "demojob" for s in mine)
        est_peak = {s.labels["category"]: s.value for s in mine if s.name == "fsdp_mem_estimate_step_peak_bytes"}
        assert est_peak == {c: float(v) for c, v in est["peak"]["cpu"].items()}  # the estimate file's rank 0
        est_modules = {(s.labels["module"], s.labels["phase"]): s.value for s in mine
                       if s.name == "fsdp_mem_estimate_module_peak_bytes"}
        assert est_modules == {(key, phase): float(max(c["total"] for call in mod["snapshots"][f"peak_{phase}"]
                                                       for c in call.values()))
                               for key, mod in est["modules"].items() for phase in ("forward", "backward")}
        measured = [s.value for s in mine if s.name == "fsdp_mem_step_peak_bytes" and s.labels["category"] == "total"]
        assert measured == [float(lines[rank][-1]["peak"]["cpu"]["total"])]

    # OpenTelemetry with the library's defaults: a step span every step, module spans on step 1 only
    for rank in (0, 1):
        mine = [x for x in spans if x["resource"]["rank"] == rank]
        steps = sorted(x["attributes"]["fsdp.step"] for x in mine if x["name"] == "fsdp.step")
        assert steps == [1, 2, 3, 4], (rank, steps)
        module_steps = {x["attributes"]["fsdp.step"] for x in mine
                        if x["name"] == "fsdp.step" and x["attributes"]["fsdp.module_spans"]}
        assert module_steps == {1}

    # 3. what the estimate did not foresee
    cmp = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "compare", str(estimate),
                          str(tmp_path / "run-0.jsonl"), "--json"], capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr
    assert json.loads(cmp.stdout)["a"]["step_peak_bytes"] == est["peak"]["cpu"]["total"]


def test_demo_rejects_a_bad_environment_before_launching() -> None:
    out = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "1"],
                         capture_output=True, text=True, env=job_env(FSDP_MEM_OTEL_DEEP_EVERY="often"), timeout=60)
    assert out.returncode == 2 and "launching" not in out.stdout
    assert "FSDP_MEM_OTEL_DEEP_EVERY='often' is not accepted (a whole number of steps >= 0; 0: never)" in out.stderr


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
