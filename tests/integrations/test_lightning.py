"""The shipped Lightning callback on 2 real ranks (FSDP2 on CPU, gloo), with gradient accumulation.

What is missing for FSDP on CPU in Lightning (measured with lightning 2.6): ``FSDPStrategy``
(FSDP1) refuses a CPU accelerator ("The strategy `fsdp` requires a GPU accelerator"). FSDP2 runs on
CPU through the documented ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``,
which is what this test trains with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from fsdp_mem_otel.tools.demo import BlockModel  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

BLOCKS, WIDTH, MICRO_BATCH, ACCUMULATION, STEPS = 2, 32, 4, 2, 3


@dataclass
class LightningRun:
    reports: list[dict[str, Any]]
    batches: int
    sharded_param_oracle: int
    whole_model_bytes: int
    optimizer_state_oracle: int
    keys: list[str]
    errors: int


def _local_bytes(tensors: Any) -> int:
    out = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out += local.numel() * local.element_size()
    return out


def lightning_training() -> LightningRun:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.integrations.lightning import FSDPMemoryCallback

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = BlockModel(BLOCKS, WIDTH)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.net.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            (x,) = batch
            return self(x).pow(2).mean()  # through __call__: the root's FSDP hooks unshard its head

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class CountBatches(pl.Callback):  # type: ignore[misc]
        batches = 0

        def on_train_batch_start(self, *_: Any) -> None:
            CountBatches.batches += 1

    reports: list[dict[str, Any]] = []
    callback = FSDPMemoryCallback(config=TrackerConfig(), exporters=[],
                                  on_report=lambda r: reports.append(r.to_dict()))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, accumulate_grad_batches=ACCUMULATION,
        # data_parallel_size: by default the strategy gives every device to tensor parallelism and
        # the "data_parallel" mesh has one rank, so fully_shard on it would shard nothing
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS, callbacks=[CountBatches(), callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1)))
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH))
    tracker = callback.tracker
    opt_state = tracker.optimizer.state
    return LightningRun(
        reports=reports,
        batches=CountBatches.batches,
        sharded_param_oracle=_local_bytes(module.parameters()),
        whole_model_bytes=_local_bytes(BlockModel(BLOCKS, WIDTH).parameters()),
        optimizer_state_oracle=_local_bytes(v for s in opt_state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor)),
        keys=tracker.module_keys,
        errors=tracker.errors_total,
    )


def test_lightning_callback_reports_once_per_optimizer_step() -> None:
    for run in run_ranks(lightning_training, timeout=600):
        assert run.errors == 0
        assert run.keys == ["<root>", "net.layers.0", "net.layers.1"]
        assert run.batches == STEPS * ACCUMULATION
        assert [r["step"] for r in run.reports] == list(range(1, STEPS + 1))  # one per optimizer step
        assert run.sharded_param_oracle < 0.75 * run.whole_model_bytes  # sharded over both ranks
        for report in run.reports:
            assert report["warnings"] == []
            end = report["current"]["cpu"]
            assert end["sharded_param"] == run.sharded_param_oracle
            assert end["optimizer_state"] == run.optimizer_state_oracle
            assert end["sharded_grad"] > 0  # closed before Lightning zeroes the grads
            assert end["inputs"] == MICRO_BATCH * WIDTH * 4  # the last micro-batch is still referenced
            layer = report["modules"]["net.layers.0"]["snapshots"]
            assert len(layer["before_pre_forward"]) == ACCUMULATION
            assert layer["after_post_forward"][0]["cpu"]["activation"] > 0
            # Adam's state exists from the first optimizer step on
            expected_state = 0 if report["step"] == 1 else run.optimizer_state_oracle
            assert [c["cpu"]["optimizer_state"] for c in layer["after_post_forward"]] == [expected_state] * ACCUMULATION
