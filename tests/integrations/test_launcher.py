"""``torchrun -m fsdp_mem_otel.run SCRIPT``: real training scripts, written without any reference to
this package (``tests/user_scripts``), each on 2 gloo ranks, run once as they are and once under the
launcher (HF Trainer and Lightning a third time with the shipped callback added, for comparison).

Oracles, all from the scripts' own output (``--out``: losses and the bytes of each rank's local
parameter shards) or from the plain run: a report for every optimizer step; ``sharded_param`` at
each step's end equal to numel x element size of the local shards (plus, where FSDP2 pads a shard,
exactly that padding); ``inputs`` non-zero; the losses bitwise those of the plain run; the HF and
Lightning reports equal, figure by figure, to those of the shipped callbacks (``inputs`` aside: the
launcher accounts what the model is called with, the Lightning callback the whole batch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.offline.jsonl_format import read_reports

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
WITH_CALLBACK = Path(__file__).with_name("with_callback.py")
WORLD = 2


@dataclass
class Script:
    file: str
    keys: list[str]  # the FSDP modules' keys, as the user's model names them
    callback: str | None = None  # "hf" / "lightning": also run with the shipped callback
    needs: str | None = None  # a package the script imports


SCRIPT_CASES = {
    "plain_fsdp2": Script("plain_fsdp2.py", ["<root>", "layers.0", "layers.1", "layers.2"]),
    "plain_fsdp1": Script("plain_fsdp1.py", ["<root>", "layers.0", "layers.1", "layers.2"]),
    "hf_trainer": Script("hf_trainer.py", ["<root>", "model.embed_tokens", "model.layers.0", "model.layers.1",
                                           "model.norm", "lm_head"], callback="hf", needs="transformers"),
    "lightning_fsdp2": Script("lightning_fsdp2.py", ["<root>", "blocks.0", "blocks.1", "blocks.2"],
                              callback="lightning", needs="lightning"),
    # torchtitan names its blocks in an nn.ModuleDict ("layers.0", ...), shards [norm, lm_head] as one group
    "torchtitan_llama3": Script("torchtitan_llama3.py", ["<root>", "tok_embeddings", *(f"layers.{i}" for i in range(6)),
                                                         "norm", "lm_head"], needs="torchtitan"),
}
# Where FSDP2 pads a shard, the tracker counts the padded storage each rank holds (the memory),
# the script numel x element size of what to_local() shows. lightning_fsdp2.py's head is
# Linear(64, 1): its one output row goes to rank 0, and rank 1 holds a padded row of weight and bias.
PADDING = {("lightning_fsdp2", 1): (64 + 1) * 4}
#: torchtitan: deep mode on step 3 (the others stay light), for the estimate check in test_estimate_torchtitan.py
TITAN_DEEP_EVERY = 3


@dataclass
class Run:
    outs: list[dict[str, Any]]  # per rank: what the script wrote
    reports: list[list[dict[str, Any]]]  # per rank: the JSONL reports, in order
    log: str


#: what a rank prints when gloo aborts it in interpreter finalization (below)
FINALIZATION_ABORT = "terminate called without an active exception"


def torchrun(script: Path, out_dir: Path, *, launcher: bool, prefix: tuple[str, ...] = (),
             env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Run:
    """Run ``script`` on 2 ranks with torchrun (``--standalone``: a free port), as it is or under
    ``-m fsdp_mem_otel.run``, reports to ``out_dir/rank{rank}.jsonl``.

    A run is retried once, from scratch, only where a rank aborted with FINALIZATION_ABORT after
    the run reached its end (a rank had written its output): the scripts leave their gloo process
    group for interpreter finalization to destroy (FSDP and Lightning keep it referenced past
    destroy_process_group), and a gloo worker thread that lets go of its last work then can abort
    the process, with or without the launcher (pytorch/pytorch#179291). It happened in about 1 CI
    run in 5 here, in a plain run. Any other failure, or the same abort twice, fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
    cmd += ["-m", "fsdp_mem_otel.run"] if launcher else []
    cmd += [*prefix, str(script), "--out", str(out_dir / "out.json"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "FSDP_MEM_OTEL_PROMETHEUS": "0",
                "FSDP_MEM_OTEL_JSONL": str(out_dir / "rank{rank}.jsonl"), **(env or {})}
    full_env.pop("FSDP_MEM_OTEL_AUTO", None)
    outs = [out_dir / f"out.rank{r}.json" for r in range(WORLD)]
    for attempt in (1, 2):
        shutil.rmtree(out_dir, ignore_errors=True)  # nothing of a first attempt is read
        out_dir.mkdir(parents=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=400)
        log = proc.stdout + proc.stderr
        # the run reached its end: a rank wrote its output (once one rank aborted, the agent may
        # stop the other, still finalizing, before it writes its own)
        finished = any(path.exists() for path in outs)
        if proc.returncode == 0 or attempt == 2 or not (finished and FINALIZATION_ABORT in log):
            break
        warnings.warn(f"{script.name}: a rank aborted in interpreter finalization after the run; "
                      f"running it again\n{log[-1500:]}", stacklevel=2)
    assert proc.returncode == 0, log[-6000:]
    reports = []
    for r in range(WORLD):
        path = out_dir / f"rank{r}.jsonl"
        reports.append([rep.to_dict() for rep in read_reports(str(path))] if path.exists() else [])
    return Run([json.loads(path.read_text()) for path in outs], reports, log)


@dataclass
class Runs:
    plain: Run
    launched: Run
    callback: Run | None


@pytest.fixture(scope="module", params=list(SCRIPT_CASES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Runs]:
    name = request.param
    case = SCRIPT_CASES[name]
    if case.needs:
        pytest.importorskip(case.needs)
    tmp = tmp_path_factory.mktemp(name)
    script = SCRIPTS / case.file
    env = {"FSDP_MEM_OTEL_DEEP_EVERY": str(TITAN_DEEP_EVERY)} if name == "torchtitan_llama3" else {}
    plain = torchrun(script, tmp / "plain", launcher=False)
    launched = torchrun(script, tmp / "launched", launcher=True, env=env)
    callback = None
    if case.callback:
        callback = torchrun(script, tmp / "callback", launcher=False, prefix=(str(WITH_CALLBACK), case.callback))
    return name, Runs(plain, launched, callback)


def test_training_is_bitwise_unchanged(runs: tuple[str, Runs]) -> None:
    name, r = runs
    assert r.plain.reports == [[], []]  # nothing of ours ran without the launcher
    for rank in range(WORLD):
        plain, launched = r.plain.outs[rank], r.launched.outs[rank]
        assert launched["losses"] == plain["losses"], (name, rank)  # JSON floats round-trip exactly
        assert launched["optimizer_steps"] == plain["optimizer_steps"] == len(plain["losses"]) > 0
        assert launched["sharded_param_bytes"] == plain["sharded_param_bytes"]


def test_a_report_for_every_optimizer_step(runs: tuple[str, Runs]) -> None:
    name, r = runs
    for rank in range(WORLD):
        out, reports = r.launched.outs[rank], r.launched.reports[rank]
        assert [rep["step"] for rep in reports] == list(range(1, out["optimizer_steps"] + 1)), name
        for rep in reports:
            assert rep["rank"] == rank and rep["world_size"] == WORLD
            assert rep["errors_total"] == 0 and rep["aborted"] is None
            assert rep["module_order"] == SCRIPT_CASES[name].keys
            end, peak = rep["current"]["cpu"], rep["peak"]["cpu"]
            assert end["sharded_param"] == out["sharded_param_bytes"] + PADDING.get((name, rank), 0), (name, rank)
            assert peak["inputs"] > 0
            assert end["sharded_grad"] > 0  # closed after the optimizer step, before the grads are zeroed
            assert rep["modules"]["<root>"]["snapshots"]["after_pre_forward"]  # the first call is measured too


def test_same_figures_as_the_shipped_callbacks(runs: tuple[str, Runs]) -> None:
    name, r = runs
    if r.callback is None:
        pytest.skip(f"{name} has no framework callback")
    for rank in range(WORLD):
        assert r.callback.outs[rank]["losses"] == r.plain.outs[rank]["losses"]
        ours, theirs = r.launched.reports[rank], r.callback.reports[rank]
        assert len(ours) == len(theirs) == r.plain.outs[rank]["optimizer_steps"]
        for a, b in zip(ours, theirs, strict=True):
            assert a["module_order"] == b["module_order"]
            for figures in ("current", "peak"):
                mine = {k: v for k, v in a[figures]["cpu"].items() if k not in ("inputs", "total")}
                cb = {k: v for k, v in b[figures]["cpu"].items() if k not in ("inputs", "total")}
                assert mine == cb, (name, rank, a["step"], figures)
            for key in a["modules"]:  # every module measured at the same states, as many times
                assert {s: len(v) for s, v in a["modules"][key]["snapshots"].items()} == {
                    s: len(v) for s, v in b["modules"][key]["snapshots"].items()}, (name, key)


def test_estimate_agrees_with_the_torchtitan_run(runs: tuple[str, Runs], tmp_path: Path) -> None:
    """``fsdp-mem-otel estimate`` on torchtitan's model (blocks in an nn.ModuleDict) with
    torchtitan's own AC, FSDP function, chunked loss and optimizers (tests/estimate_models.py),
    against the deep step of the real run above (rank 0, step 3)."""
    name, r = runs
    if name != "torchtitan_llama3":
        pytest.skip("the estimate is checked against the torchtitan run")
    out = tmp_path / "estimate.jsonl"
    models = "tests.estimate_models:torchtitan_"
    cmd = [sys.executable, "-m", "fsdp_mem_otel", "estimate", "--model", models + "llama3", "--wrap", models + "wrap",
           "--loss", models + "loss", "--optimizer", models + "optimizer", "--batch-shape", "2,64",
           "--input-dtype", "int64", "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--world-size", str(WORLD),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (estimate,) = [rep.to_dict() for rep in read_reports(str(out))]
    real = r.launched.reports[0][TITAN_DEEP_EVERY - 1]
    assert real["mode"] == estimate["mode"] == "deep"
    assert estimate["module_order"] == real["module_order"] == SCRIPT_CASES[name].keys
    est_peak, real_peak = estimate["peak"]["cpu"], real["peak"]["cpu"]
    for category, measured in real_peak.items():
        if measured >= 0.01 * real_peak["total"]:  # every category that matters at the peak, total included
            assert abs(est_peak[category] - measured) <= 0.02 * measured, (category, est_peak[category], measured)
    # module peaks: forward ones within 2% (measured: equal); backward ones within 10%: in the real
    # run gloo's reduce-scatter staging copies and the overlapping all-gathers are freed on gloo's
    # own schedule, which moves some blocks' backward peaks by 0-5% from run to run
    for key in real["module_order"]:
        for state, tolerance in (("peak_forward", 0.02), ("peak_backward", 0.10)):
            measured = max((s["cpu"]["total"] for s in real["modules"][key]["snapshots"].get(state, [])), default=0)
            guess = max((s["cpu"]["total"] for s in estimate["modules"][key]["snapshots"].get(state, [])), default=0)
            assert abs(guess - measured) <= tolerance * measured, (key, state, guess, measured)
