"""Retention under the shipped HF Trainer and Lightning callbacks, on 2 real ranks (FSDP2 on CPU).

The oracle of tests/training/test_retention.py (``StorageSpy``: weak references to the storages of every
module's inputs and outputs, per optimizer step) around ``trainer.train()`` / ``trainer.fit()``,
the same training with and without the memory callback: at the end of each optimizer step (a
callback of the test's own, after the memory callback's) the storages of the step before are
counted, and after training ends and ``gc.collect()`` those of every step. Set up as
tests/integrations/test_hf.py and test_lightning.py do (see there why FSDP on CPU needs it).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from fsdp_mem_otel.tools.demo import BlockModel
from tests.dist import run_ranks
from tests.training.test_retention import StorageSpy

STEPS, ACCUMULATION, MICRO_BATCH = 3, 2, 2
BLOCKS, WIDTH = 2, 32


def _result(spy: StorageSpy, memory: Any) -> dict[str, Any]:
    steps = len(spy.seen) - 1  # the last list is the (empty) step after the last one
    gc.collect()
    tracker = memory.tracker if memory is not None else None
    return {"per_step": spy.counts, "after_end": [spy.alive(s) for s in range(steps)],
            "seen": [len(s) for s in spy.seen[:steps]], "errors": tracker.errors_total if tracker else 0,
            "keys": tracker.module_keys if tracker else []}


def hf_run(out_dir: str, tracked: bool) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, PartialState
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.integrations.hf import FSDPMemoryCallback
    from tests.integrations.test_hf import _trainer_class

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    spy = StorageSpy()

    class EndStep(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *_: Any, **__: Any) -> None:  # after on_optimizer_step, where the tracker steps
            spy.end_step()

    AcceleratorState._reset_state(reset_partial_state=True)  # a second Trainer in this process
    PartialState._reset_state()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=128))
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    memory = FSDPMemoryCallback(config=TrackerConfig(), exporters=[])
    callbacks = [memory, EndStep()] if tracked else [EndStep()]
    trainer = _trainer_class()(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    with spy:
        trainer.train()
    return _result(spy, memory if tracked else None)


def lightning_run(tracked: bool) -> dict[str, Any]:
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

            mesh = self.device_mesh["data_parallel"]  # type: ignore[index]
            for block in self.net.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            (x,) = batch
            return self(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    spy = StorageSpy()

    class EndStep(pl.Callback):  # type: ignore[misc]
        last = 0

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step != self.last:  # this micro-batch ran the optimizer step
                self.last = trainer.global_step
                spy.end_step()

    memory = FSDPMemoryCallback(config=TrackerConfig(), exporters=[])
    trainer = pl.Trainer(
        # data_parallel_size=2: the default mesh is all tensor-parallel, so FSDP would shard nothing
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accumulate_grad_batches=ACCUMULATION,
        max_steps=STEPS, callbacks=[memory, EndStep()] if tracked else [EndStep()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1)))
    with spy:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH))
    return _result(spy, memory if tracked else None)


def frameworks(out_dir: str) -> dict[str, dict[str, Any]]:
    """Rank body: each framework's run without and with the memory callback."""
    out: dict[str, dict[str, Any]] = {}
    if _have("transformers") and _have("accelerate"):
        out["hf"] = {"untracked": hf_run(out_dir, False), "tracked": hf_run(out_dir, True)}
    if _have("lightning"):
        out["lightning"] = {"untracked": lightning_run(False), "tracked": lightning_run(True)}
    return out


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(frameworks, str(tmp_path_factory.mktemp("hf")), timeout=600)


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_callback_keeps_no_step_alive(framework: str, rank: int, framework_runs: list[dict[str, Any]]) -> None:
    if framework not in framework_runs[rank]:
        pytest.skip(f"{framework} is not installed")
    res = framework_runs[rank][framework]
    tracked, untracked = res["tracked"], res["untracked"]
    assert tracked["errors"] == 0
    assert len(tracked["keys"]) > 1  # the callback tracked an FSDP model with sharded blocks
    assert len(untracked["seen"]) == STEPS and all(n > 0 for n in untracked["seen"])
    assert tracked["per_step"] == untracked["per_step"], (tracked, untracked)
    assert tracked["after_end"] == untracked["after_end"], (tracked, untracked)
    assert tracked["after_end"][0] == untracked["after_end"][0] == 0  # the first step's forwards: all freed
