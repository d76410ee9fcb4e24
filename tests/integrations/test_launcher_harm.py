"""Never harm: what ``fsdp_mem_otel.run`` installs leaves every unusual training as it would run
without it (losses and outputs bitwise, the same dynamo graphs and graph breaks), logs and counts
each case once, and raises nothing.

The cases run in one spawned rank (gloo, world size 1), each twice: as it is, then with the
launcher's attachment installed (``fsdp_mem_otel.integrations.auto.install``, what the launcher
and the environment bootstrap call), which is removed again after the case. Each case builds and
wraps its model after the installation, as a script run by the launcher does. The launcher
itself (a job without FSDP, the environment bootstrap, SIGTERM) runs in subprocesses below.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.tools.demo import BlockModel
from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, WIDTH, BATCH, STEPS = 2, 16, 4, 3


def _shard(model: nn.Module) -> nn.Module:
    import torch.distributed.fsdp as fsdp  # looked up at call time, as a script importing it after the launcher

    for block in model.layers:
        fsdp.fully_shard(block)
    return fsdp.fully_shard(model)


def _batches(n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH, WIDTH, generator=g) for _ in range(n)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return BlockModel(BLOCKS, WIDTH)


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], batches: list[torch.Tensor],
           after_step: Callable[[], Any] | None = None) -> list[float]:
    losses = []
    for x in batches:
        loss = model(x).pow(2).mean()
        loss.backward()
        for opt in optimizers:
            opt.step()
        if after_step is not None:
            after_step()
        for opt in optimizers:
            opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- the cases: each returns what must not change (losses, outputs) and what it wants checked ------
def case_no_fsdp() -> dict[str, Any]:
    from torch.nn.modules import module as module_globals
    from torch.optim import optimizer as optimizer_globals

    model = _model()
    losses = _train(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], _batches())
    return {"losses": losses, "global_hooks": len(module_globals._global_forward_pre_hooks)
            + len(optimizer_globals._global_optimizer_pre_hooks) + len(optimizer_globals._global_optimizer_post_hooks)}


def case_several_roots() -> dict[str, Any]:
    actor, critic = _shard(_model()), _shard(BlockModel(BLOCKS, WIDTH))  # an RL actor and its critic
    opt_a, opt_c = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (actor, critic))
    losses = []
    for x in _batches():
        loss = actor(x).pow(2).mean() + critic(x).mean().pow(2)
        loss.backward()
        opt_a.step()
        opt_c.step()
        opt_a.zero_grad()
        opt_c.zero_grad()
        losses.append(loss.item())
    return {"losses": losses}


def case_several_optimizers() -> dict[str, Any]:
    model = _shard(_model())
    blocks = [p for block in model.layers for p in block.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in blocks)]
    return {"losses": _train(model, [torch.optim.AdamW(blocks, lr=1e-2), torch.optim.SGD(rest, lr=1e-2)], _batches())}


def case_optimizer_before_wrap() -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the parameters FSDP then replaces
    return {"losses": _train(_shard(model), [optimizer], _batches())}


def case_never_stepped() -> dict[str, Any]:
    model = _shard(_model())
    with torch.no_grad():
        outputs = [model(x).sum().item() for x in _batches()]
    return {"losses": outputs}


def case_own_tracker() -> dict[str, Any]:
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with FSDPMemoryTracker(model, optimizer, exporters=[]) as tracker:
        reports: list[int] = []
        losses = _train(model, [optimizer], _batches(), after_step=lambda: reports.append(tracker.step().step))
    return {"losses": losses, "own_reports": reports}


def case_own_tracker_after_the_first_step() -> dict[str, Any]:
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(model, [optimizer], _batches(1))
    with FSDPMemoryTracker(model, optimizer, exporters=[]) as tracker:
        reports: list[int] = []
        losses += _train(model, [optimizer], _batches(STEPS)[1:],
                         after_step=lambda: reports.append(tracker.step().step))
    return {"losses": losses, "own_reports": reports}


def case_keeps_nothing_alive() -> dict[str, Any]:
    """Weak references to what each step made (the leaf the model is called with, the output, the
    loss; the batches themselves live in their list): none may outlive its step, the launcher's
    root pre-hook (which accounts the forward arguments as inputs) included."""
    import gc
    import weakref

    model = _shard(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    made: list[weakref.ref[torch.Tensor]] = []
    alive_after_each_step, losses = [], []
    for x in _batches(4):
        leaf = x.clone().requires_grad_(True)  # a leaf input, as a chunked loss feeds its head
        out = model(leaf)
        loss = out.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        made += [weakref.ref(t) for t in (leaf, out, loss)]
        del leaf, out, loss
        gc.collect()
        alive_after_each_step.append(sum(r() is not None for r in made))
    return {"losses": losses, "alive": alive_after_each_step}


def case_attach_fails() -> dict[str, Any]:
    from fsdp_mem_otel.training.adapters.fsdp2 import FSDP2Adapter

    original = FSDP2Adapter._attach

    def broken(self: Any) -> None:
        original(self)
        raise RuntimeError("injected: attach fails half-way")

    FSDP2Adapter._attach = broken  # type: ignore[method-assign]
    try:
        model = _shard(_model())
        return {"losses": _train(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], _batches())}
    finally:
        FSDP2Adapter._attach = original  # type: ignore[method-assign]


def _compiled(fsdp: bool) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    for block in model.layers:  # per block, fullgraph, before FSDP: as torchtitan compiles
        block.compile(backend="eager", fullgraph=True)
    if fsdp:
        _shard(model)
    else:
        model.compile(backend="eager")
    losses = _train(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], _batches())
    return {"losses": losses, "dynamo": {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}}


def case_compiled_fsdp() -> dict[str, Any]:
    return _compiled(fsdp=True)


def case_compiled_without_fsdp() -> dict[str, Any]:
    return _compiled(fsdp=False)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


@dataclass
class Case:
    plain: dict[str, Any]
    launched: dict[str, Any]
    counts: dict[str, int]
    steps: list[int] = field(default_factory=list)  # the launcher's reports
    errors: int = 0  # the launcher's tracker's own errors


def harm_cases(tmp: str) -> dict[str, Case]:
    """Rank body: every case plain, then with the launcher's attachment installed."""
    from fsdp_mem_otel.integrations import auto
    from fsdp_mem_otel.offline.jsonl_format import read_reports

    os.environ["FSDP_MEM_OTEL_PROMETHEUS"] = "0"
    out: dict[str, Case] = {}
    for name, fn in CASES.items():
        plain = fn()
        path = os.path.join(tmp, f"{name}.jsonl")
        os.environ["FSDP_MEM_OTEL_JSONL"] = path
        installed = auto.install(explicit=True)
        try:
            launched = fn()
            tracker = installed.tracker
            errors = tracker.errors_total if tracker is not None else 0
        finally:
            auto.uninstall()  # closes the root's tracker, as at exit
        counts = dict(installed.counts)
        steps = [r.step for r in read_reports(path)] if os.path.exists(path) else []
        out[name] = Case(plain, launched, counts, steps, errors)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    (result,) = run_ranks(harm_cases, str(tmp_path_factory.mktemp("harm")), world_size=1, timeout=400)
    return result


@pytest.mark.parametrize("name", list(CASES))
def test_training_runs_exactly_as_without_the_launcher(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    assert case.launched == case.plain  # losses and outputs bitwise; dynamo's counters (graphs, breaks)
    assert case.errors == 0
    assert case.counts.get("error", 0) == 0


#: case -> (what is counted, the launcher's reports)
EXPECTED: dict[str, tuple[dict[str, int], list[int]]] = {
    "no_fsdp": ({}, []),
    "several_roots": ({"several_roots": 1}, [1, 2, 3]),  # the actor, the first root to run
    "several_optimizers": ({"several_optimizers": 1}, [1, 2, 3]),
    # the optimizer steps parameters FSDP replaced: the root's forwards go into one last report
    "optimizer_before_wrap": ({"never_stepped": 1}, [1]),
    "never_stepped": ({"never_stepped": 1}, [1]),
    "own_tracker": ({"own_tracker": 1}, []),
    "own_tracker_after_the_first_step": ({"own_tracker": 1}, [1]),
    "keeps_nothing_alive": ({}, [1, 2, 3, 4]),
    "attach_fails": ({"attach_failed": 1}, []),
    "compiled_fsdp": ({}, [1, 2, 3]),
    "compiled_without_fsdp": ({}, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_is_counted_and_reported_as_expected(cases: dict[str, Case], name: str) -> None:
    counted, steps = EXPECTED[name]
    assert cases[name].counts == counted
    assert cases[name].steps == steps


def test_no_global_hook_without_fsdp(cases: dict[str, Case]) -> None:
    assert cases["no_fsdp"].launched["global_hooks"] == 0  # nothing but the two wrap points is installed


def test_nothing_a_step_made_outlives_it(cases: dict[str, Case]) -> None:
    # (the plain run's figures equal the launched run's: test_training_runs_exactly_as_without_the_launcher)
    assert cases["keeps_nothing_alive"].plain["alive"] == [0, 0, 0, 0]
    assert cases["keeps_nothing_alive"].launched["alive"] == [0, 0, 0, 0]


def test_the_trainings_own_tracker_keeps_working(cases: dict[str, Case]) -> None:
    assert cases["own_tracker"].launched["own_reports"] == [1, 2, 3]
    assert cases["own_tracker_after_the_first_step"].launched["own_reports"] == [1, 2]


def test_compiled_blocks_compile_as_without_the_launcher(cases: dict[str, Case]) -> None:
    dynamo = cases["compiled_fsdp"].launched["dynamo"]
    assert dynamo == cases["compiled_fsdp"].plain["dynamo"]
    assert dynamo["stats"]["unique_graphs"] >= 1  # the blocks did compile


# -- the launcher and the environment bootstrap, as processes --------------------------------------
SCRIPT = """
import sys
import torch

print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0].endswith("{folder}"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.ones(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(repr(loss.item()))
sys.exit(int(sys.argv[-1]))
"""

FSDP_SCRIPT = """
import os, signal, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.ones(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # evicted: the reports must be on disk all the same
"""


def _python(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "FSDP_MEM_OTEL_PROMETHEUS": "0", **(env or {})}
    for var in ("FSDP_MEM_OTEL_AUTO", "FSDP_MEM_OTEL_JSONL", "PYTHONPATH"):
        if env is None or var not in env:
            full.pop(var, None)
    return subprocess.run([sys.executable, *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_job_without_fsdp_runs_as_it_is(tmp_path: Path) -> None:
    """The script sees the ``__name__``, ``sys.argv`` and ``sys.path[0]`` it would see; its output
    and exit code are those of the plain run; the job is logged once as having no FSDP model."""
    from fsdp_mem_otel.run import bootstrap_dir

    folder = tmp_path / "job"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(SCRIPT.format(folder="job"))
    plain = _python([str(script), "--lr", "3"])
    launched = _python(["-m", "fsdp_mem_otel.run", str(script), "--lr", "3"])
    booted = _python([str(script), "--lr", "3"], env={"FSDP_MEM_OTEL_AUTO": "1", "PYTHONPATH": bootstrap_dir()})
    assert plain.returncode == launched.returncode == booted.returncode == 3
    assert "name __main__ argv ['--lr', '3'] path0 True" in plain.stdout
    assert launched.stdout == booted.stdout == plain.stdout
    assert launched.stderr.count("wrapped no model with FSDP") == 1
    assert "Traceback" not in launched.stderr + booted.stderr


def test_the_bootstrap_tracks_an_unchanged_command_and_sigterm_flushes(tmp_path: Path) -> None:
    """``FSDP_MEM_OTEL_AUTO=1`` and ``PYTHONPATH`` at the bootstrap: a plain ``python train.py``
    is tracked, one report per optimizer step, all on disk when SIGTERM ends the process; the
    environment's own ``sitecustomize`` still runs."""
    from fsdp_mem_otel.offline.jsonl_format import read_reports
    from fsdp_mem_otel.run import bootstrap_dir

    script = tmp_path / "train.py"
    script.write_text(FSDP_SCRIPT)
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("print('their sitecustomize ran', flush=True)\n")
    jsonl = tmp_path / "rank{rank}.jsonl"
    env = {"FSDP_MEM_OTEL_AUTO": "1", "PYTHONPATH": os.pathsep.join([bootstrap_dir(), str(theirs)]),
           "FSDP_MEM_OTEL_JSONL": str(jsonl)}
    proc = _python([str(script)], env=env)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["their sitecustomize ran", "trained"]
    reports = [r.to_dict() for r in read_reports(str(tmp_path / "rank0.jsonl"))]
    assert [r["step"] for r in reports] == [1, 2, 3]
    assert all(r["current"]["cpu"]["sharded_param"] > 0 and r["errors_total"] == 0 for r in reports)
    assert reports[0]["module_order"] == ["<root>", "0"]


def test_the_launcher_runs_modules_and_says_how_to_use_it() -> None:
    module = _python(["-m", "fsdp_mem_otel.run", "-m", "json.tool", "--help"])
    assert module.returncode == 0 and "json.tool" in module.stdout
    assert _python(["-m", "fsdp_mem_otel.run"]).returncode == 2
    assert _python(["-m", "fsdp_mem_otel.run", "missing.py"]).returncode == 2
    path = _python(["-m", "fsdp_mem_otel", "run", "--pythonpath"])
    assert path.returncode == 0 and Path(path.stdout.strip(), "sitecustomize.py").is_file()
    assert textwrap.dedent(path.stdout).strip().endswith(os.path.join("fsdp_mem_otel", "bootstrap"))
