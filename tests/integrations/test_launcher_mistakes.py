"""What a user gets wrong under ``torchrun -m fsdp_mem_otel.run`` (and the ``FSDP_MEM_OTEL_AUTO``
bootstrap) is said in one line, switches off only what it concerns, and never stops training; and
the launcher says what it tracks and where its reports went.

Three real 2-rank gloo jobs of a small FSDP2 training script, each with several mistakes, one per
rank or per part, so that each mistake is checked against the parts it must leave working:

- ``taken``: rank 0's Prometheus port is taken (by this test), rank 1's JSONL folder is a file.
  Rank 0 still writes its JSONL file; rank 1 still serves ``/metrics`` (the script scrapes it).
- ``bad``: a bad value for each part (``PROMETHEUS_PORT``, ``SIDECAR_INTERVAL``, ``DEEP_EVERY``),
  words in other cases (``MODE=Deep``, ``ACTIVATIONS=TRUE``, ``RESET_PEAKS=Auto``), and a JSONL
  path without ``{rank}``: each rank writes its own file, deep mode, nothing else.
- ``quiet``: through the bootstrap (a plain ``torchrun script.py``), ``FSDP_MEM_OTEL_QUIET=1`` and
  ``JSONL_MAX_BYTES=1GB``: JSONL off, the endpoint still answers, nothing announced, the mistake said.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_mem_otel.offline.jsonl_format import read_reports
from tests.dist import free_ports

ROOT = Path(__file__).resolve().parents[2]
WORLD, STEPS = 2, 3
#: what a rank prints when gloo aborts it in interpreter finalization (see test_launcher.py): retried once
FINALIZATION_ABORT = "terminate called without an active exception"

SCRIPT = """
import json, os, sys, urllib.request
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def say(line):  # one write: torchrun's ranks write to one pipe, unbuffered
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = Net()
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(__STEPS__):
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if str(rank) == os.environ.get("SCRAPE_RANK"):
    port = int(os.environ["FSDP_MEM_OTEL_PROMETHEUS_PORT"]) + int(os.environ["LOCAL_RANK"])
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    steps = [line for line in body.splitlines() if line.startswith("fsdp_mem_steps_total{")]
    say(f"rank {rank} scraped {json.dumps(steps[0].rsplit(' ', 1)[1] if steps else None)}")
dist.barrier()
say(f"trained rank {rank}")
dist.destroy_process_group()
""".replace("__STEPS__", str(STEPS))


@dataclass
class Job:
    tmp: Path
    log: str  # stdout and stderr of every process, together

    def once(self, line: str) -> None:
        assert self.log.splitlines().count(line) == 1, f"not exactly once: {line}\n{self.log[-4000:]}"

    def trained(self) -> None:
        assert "Traceback" not in self.log, self.log[-4000:]
        for rank in range(WORLD):
            assert f"trained rank {rank}" in self.log.splitlines(), self.log[-4000:]

    def steps(self, path: Path, rank: int) -> list[int]:
        reports = [r.to_dict() for r in read_reports(str(path))]
        assert all(r["rank"] == rank and r["errors_total"] == 0 for r in reports)
        return [r["step"] for r in reports]


def launch(tmp: Path, env: dict[str, str], launcher: bool = True) -> Job:
    """The script on 2 ranks with torchrun (under ``-m fsdp_mem_otel.run`` or, with ``launcher``
    False, as it is: the bootstrap's way); every FSDP_MEM_OTEL_* / OTEL_* variable but ``env``'s
    unset. Exit status 0 required; retried once only for gloo's abort in finalization."""
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
    cmd += ["-m", "fsdp_mem_otel.run"] if launcher else []
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_MEM_OTEL_", "OTEL_"))}
    full.pop("PYTHONPATH", None)
    full.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env)
    for attempt in (1, 2):
        proc = subprocess.run([*cmd, str(script)], cwd=tmp, env=full, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        if proc.returncode == 0 or attempt == 2 or FINALIZATION_ABORT not in proc.stdout:
            break
        warnings.warn(f"a rank aborted in interpreter finalization; running again\n{proc.stdout[-1500:]}",
                      stacklevel=2)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return Job(tmp, proc.stdout)


# -- (7) a port in use, a JSONL file that cannot be written -------------------------------------------
@pytest.fixture(scope="module")
def taken(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, int]]:
    tmp = tmp_path_factory.mktemp("taken")
    (tmp / "d1").write_text("a file where rank 1's folder should be")
    base = free_ports(WORLD)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base))  # rank 0's port (base + LOCAL_RANK 0)
        holder.listen()
        yield launch(tmp, {"FSDP_MEM_OTEL_PROMETHEUS_PORT": str(base), "FSDP_MEM_OTEL_PROMETHEUS_ADDR": "127.0.0.1",
                           "FSDP_MEM_OTEL_JSONL": str(tmp / "d{rank}" / "run.jsonl"), "SCRAPE_RANK": "1"}), base


def test_a_port_in_use_is_one_line_and_the_rest_goes_on(taken: tuple[Job, int]) -> None:
    job, base = taken
    job.trained()
    job.once(f"fsdp_mem_otel: Prometheus port {base} (FSDP_MEM_OTEL_PROMETHEUS_PORT={base} + LOCAL_RANK 0) is in use: "
             "metrics endpoint off for this rank; set FSDP_MEM_OTEL_PROMETHEUS_PORT to a free base port or "
             "FSDP_MEM_OTEL_PROMETHEUS=0")
    assert job.log.count("is in use") == 1  # rank 1's port was free
    assert job.steps(job.tmp / "d0" / "run.jsonl", 0) == [1, 2, 3]  # rank 0's JSONL goes on
    job.once("fsdp_mem_otel: tracking Net (FSDP2, 3 modules) in light mode; Prometheus endpoint off on rank 0 (see "
             f"above), JSONL {job.tmp}/d{{0..1}}/run.jsonl, spans off")


def test_a_jsonl_file_that_cannot_be_written_is_one_line_and_the_rest_goes_on(taken: tuple[Job, int]) -> None:
    job, _ = taken
    job.trained()
    job.once(f"fsdp_mem_otel: cannot write FSDP_MEM_OTEL_JSONL={job.tmp}/d1/run.jsonl (File exists: {job.tmp}/d1): "
             "JSONL off for this rank, the rest of tracking goes on; point FSDP_MEM_OTEL_JSONL at a file in a folder "
             "this job can write")
    assert f"rank 1 scraped {json.dumps(str(float(STEPS)))}" in job.log.splitlines()  # its endpoint: the last step
    assert (job.tmp / "d1").read_text() == "a file where rank 1's folder should be"


# -- (8) bad settings, (9) one JSONL path for several ranks, (10) what the launcher says ---------------
@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("bad")
    return launch(tmp, {
        "FSDP_MEM_OTEL_PROMETHEUS_PORT": "http", "FSDP_MEM_OTEL_SIDECAR_DIR": str(tmp / "sidecar"),
        "FSDP_MEM_OTEL_SIDECAR_INTERVAL": "-5", "FSDP_MEM_OTEL_DEEP_EVERY": "x", "FSDP_MEM_OTEL_MODE": "Deep",
        "FSDP_MEM_OTEL_ACTIVATIONS": "TRUE", "FSDP_MEM_OTEL_RESET_PEAKS": "Auto",
        "FSDP_MEM_OTEL_JSONL": str(tmp / "run.jsonl")})


def test_a_bad_setting_switches_off_its_part_only_said_once_naming_the_variable(bad: Job) -> None:
    bad.trained()
    bad.once("fsdp_mem_otel: FSDP_MEM_OTEL_PROMETHEUS_PORT='http' is not accepted (a port in 1..65535, the first "
             "rank's; each rank serves it + LOCAL_RANK): Prometheus endpoint off, the rest of tracking goes on")
    bad.once("fsdp_mem_otel: FSDP_MEM_OTEL_SIDECAR_INTERVAL='-5' is not accepted (a number of seconds >= 0, e.g. 15; "
             "0: every step): sidecar file off, the rest of tracking goes on")
    bad.once("fsdp_mem_otel: FSDP_MEM_OTEL_DEEP_EVERY='x' is not accepted (a whole number of steps >= 0; 0: never): "
             "using the default (0)")
    assert bad.log.count("is not accepted") == 3  # on rank 0 only; MODE, ACTIVATIONS, RESET_PEAKS accepted
    assert "sidecar_interval_seconds" not in bad.log and "prometheus_port" not in bad.log
    assert not (bad.tmp / "sidecar").exists()
    for rank in range(WORLD):
        reports = [r.to_dict() for r in read_reports(str(bad.tmp / f"run.rank{rank}.jsonl"))]
        assert [(r["step"], r["mode"], r["rank"]) for r in reports] == [(s, "deep", rank) for s in (1, 2, 3)]


def test_one_jsonl_path_on_several_ranks_becomes_a_file_per_rank(bad: Job) -> None:
    bad.once(f"fsdp_mem_otel: FSDP_MEM_OTEL_JSONL={bad.tmp}/run.jsonl has no {{rank}} and 2 ranks write: each rank "
             f"writes its own file, {bad.tmp}/run.rank{{0..1}}.jsonl (put {{rank}} in the path to name them yourself)")
    assert not (bad.tmp / "run.jsonl").exists()
    assert [bad.steps(bad.tmp / f"run.rank{rank}.jsonl", rank) for rank in range(WORLD)] == [[1, 2, 3]] * WORLD


def test_the_launcher_says_what_it_tracks_and_where_reports_went(bad: Job) -> None:
    bad.once(f"fsdp_mem_otel: tracking Net (FSDP2, 3 modules) in deep mode; Prometheus off, JSONL "
             f"{bad.tmp}/run.rank{{0..1}}.jsonl, spans off")
    bad.once(f"fsdp_mem_otel: 3 step reports on rank 0: JSONL {bad.tmp}/run.rank0.jsonl; 0 tracker errors")
    assert bad.log.count("fsdp_mem_otel: tracking ") == bad.log.count(" step reports ") == 1


# -- FSDP_MEM_OTEL_QUIET, through the bootstrap ---------------------------------------------------------
@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Job:
    from fsdp_mem_otel.run import bootstrap_dir

    tmp = tmp_path_factory.mktemp("quiet")
    return launch(tmp, {"FSDP_MEM_OTEL_AUTO": "1", "PYTHONPATH": bootstrap_dir(), "FSDP_MEM_OTEL_QUIET": "1",
                        "FSDP_MEM_OTEL_JSONL": str(tmp / "r{rank}.jsonl"), "FSDP_MEM_OTEL_JSONL_MAX_BYTES": "1GB",
                        "FSDP_MEM_OTEL_PROMETHEUS_PORT": str(free_ports(WORLD)),
                        "FSDP_MEM_OTEL_PROMETHEUS_ADDR": "127.0.0.1", "SCRAPE_RANK": "0"}, launcher=False)


def test_quiet_silences_what_it_says_not_the_mistakes(quiet: Job) -> None:
    quiet.trained()
    assert "fsdp_mem_otel: tracking " not in quiet.log and " step reports" not in quiet.log
    quiet.once("fsdp_mem_otel: FSDP_MEM_OTEL_JSONL_MAX_BYTES='1GB' is not accepted (a whole number of bytes, e.g. "
               "1073741824; 0: never rotate): JSONL off, the rest of tracking goes on")
    assert list(quiet.tmp.glob("r*.jsonl*")) == []
    assert f"rank 0 scraped {json.dumps(str(float(STEPS)))}" in quiet.log.splitlines()  # the endpoint goes on
