"""Never a silent figure: setups whose numbers mean less than they seem are logged once and said in
every report (``StepReport.warnings``) and in the ``fsdp_mem_setup_warning`` gauge.

Real 2-rank gloo runs. Oracles: numel x element size of what each rank holds (a mesh that shards
nothing leaves the whole model on every rank), the optimizers' own state tensors, and the same
setups done right, which must stay quiet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from fsdp_mem_otel.exporters.prometheus import StepReportCollector
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import WARNING_NOTHING_SHARDED, WARNING_OPTIMIZER_NO_STATE, StepReport
from fsdp_mem_otel.tools.demo import BlockModel, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import optimizer_state_bytes, sharded_param_bytes

BLOCKS, WIDTH, BATCH, STEPS = 2, 32, 8, 2


@dataclass
class WarnedRun:
    warnings: list[list[str]]  # per step
    gauge: dict[str, float]  # kind -> fsdp_mem_setup_warning after the last step
    sharded_param: int
    sharded_param_oracle: int
    whole_model_bytes: int
    optimizer_state: int
    optimizer_state_oracle: int
    logged: list[str]
    errors: int


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("fsdp_mem_otel"):
            self.messages.append(record.getMessage())


class _HiddenOptimizers(torch.optim.Optimizer):
    """A container that keeps its optimizers under a name the tracker cannot know."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._hidden = [torch.optim.Adam(params, lr=1e-3)]
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self._hidden:
            opt.step()


def _wrap(fsdp: int, mesh_shape: tuple[int, int]) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = BlockModel(BLOCKS, WIDTH)
    # ("dp", "tp") as Lightning's ModelParallelStrategy builds it: FSDP shards over "dp" only
    dp_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))["dp"]
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(model, mesh=dp_mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    strategy = ShardingStrategy.FULL_SHARD if dp_mesh.size() > 1 else ShardingStrategy.NO_SHARD
    return FSDP(model, device_mesh=dp_mesh, sharding_strategy=strategy, use_orig_params=True,
                device_id=torch.device("cpu"))


def warned_run(fsdp: int, mesh_shape: tuple[int, int], optimizer: str) -> WarnedRun:
    """Rank body: train ``STEPS`` steps under the tracker; what it warned about, and the oracles."""
    rank = torch.distributed.get_rank()
    whole = sum(p.numel() * p.element_size() for p in BlockModel(BLOCKS, WIDTH).parameters())
    model = _wrap(fsdp, mesh_shape)
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=1e-3)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3)  # no momentum: stateless, and said to be
    else:
        opt = _HiddenOptimizers(params)
    records = _Records()
    logging.getLogger("fsdp_mem_otel").addHandler(records)
    collector = StepReportCollector(Identity("j", rank, rank, 2, "h"))
    reports: list[StepReport] = []
    with FSDPMemoryTracker(model, opt) as tracker:
        for step in range(STEPS):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            reports.append(tracker.step())
            collector.update(reports[-1])
    logging.getLogger("fsdp_mem_otel").removeHandler(records)
    registry = CollectorRegistry()
    registry.register(collector)
    gauge = {s.labels["kind"]: s.value for f in _families(generate_latest(registry).decode())
             if f.name == "fsdp_mem_setup_warning" for s in f.samples}
    inner = opt._hidden if isinstance(opt, _HiddenOptimizers) else [opt]
    return WarnedRun(
        warnings=[r.warnings for r in reports],
        gauge=gauge,
        sharded_param=reports[-1].current["cpu"]["sharded_param"],
        sharded_param_oracle=sharded_param_bytes(model),
        whole_model_bytes=whole,
        optimizer_state=reports[-1].current["cpu"]["optimizer_state"],
        optimizer_state_oracle=sum(optimizer_state_bytes(o) for o in inner),
        logged=records.messages,
        errors=tracker.errors_total,
    )


def _families(text: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


@pytest.mark.parametrize("fsdp", [1, 2])
def test_a_mesh_that_shards_nothing_is_said(fsdp: int) -> None:
    for quiet, warned in zip(run_ranks(warned_run, fsdp, (2, 1), "adam"), run_ranks(warned_run, fsdp, (1, 2), "adam"),
                             strict=True):
        for run in (quiet, warned):
            assert run.errors == 0
            assert run.sharded_param == run.sharded_param_oracle
        # sharded over 2 ranks: half the model each (FSDP pads), and nothing said
        assert quiet.sharded_param < 0.75 * quiet.whole_model_bytes
        assert quiet.warnings == [[]] * STEPS
        assert quiet.gauge == {WARNING_OPTIMIZER_NO_STATE: 0.0, WARNING_NOTHING_SHARDED: 0.0}
        # a "dp" dimension of size 1: each rank holds the whole model; said from the first step on
        assert warned.sharded_param == warned.whole_model_bytes
        assert warned.warnings == [[WARNING_NOTHING_SHARDED]] * STEPS
        assert warned.gauge == {WARNING_OPTIMIZER_NO_STATE: 0.0, WARNING_NOTHING_SHARDED: 1.0}
        assert sum("shards nothing" in m for m in warned.logged) == 1
        assert not quiet.logged


def test_an_optimizer_without_state_is_said() -> None:
    for adam, sgd, hidden in zip(*(run_ranks(warned_run, 2, (2, 1), o) for o in ("adam", "sgd", "hidden")),
                                 strict=True):
        for run in (adam, sgd, hidden):
            assert run.errors == 0
        for run in (adam, sgd):
            assert run.optimizer_state == run.optimizer_state_oracle
        assert adam.optimizer_state > 0 and adam.warnings == [[]] * STEPS and not adam.logged
        # SGD without momentum holds no state: 0 is right, and said to be so
        assert sgd.optimizer_state == 0
        assert sgd.warnings == [[WARNING_OPTIMIZER_NO_STATE]] * STEPS
        # a container the tracker cannot see into: its optimizers hold state the report cannot show
        assert hidden.optimizer_state == 0 < hidden.optimizer_state_oracle
        assert hidden.warnings == [[WARNING_OPTIMIZER_NO_STATE]] * STEPS
        assert hidden.gauge[WARNING_OPTIMIZER_NO_STATE] == 1.0
        assert sum("holds no state" in m for m in hidden.logged) == 1
