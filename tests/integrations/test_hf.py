"""The shipped transformers Trainer callback on 2 real ranks (FSDP2 on CPU, gloo).

What is missing for FSDP on CPU in transformers/accelerate (measured with transformers 5.23,
accelerate 1.15): ``TrainingArguments(fsdp=..., use_cpu=True)`` trains with DDP, not FSDP.
``accelerate.state.AcceleratorState.__init__`` switches to ``DistributedType.FSDP`` only from an
accelerator's multi-device type (MULTI_GPU, MULTI_XPU, ...), never from MULTI_CPU, and drops the
FSDP plugin without a word; with the plugin forced, accelerate's FSDP1 path raises "There are
currently no available devices found". The smallest override, below, is a Trainer subclass that
puts the FSDP plugin back after ``create_accelerator_and_postprocess`` (FSDP2 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from tests.dist import run_ranks  # noqa: E402

MICRO_BATCH, ACCUMULATION, STEPS = 2, 2, 3


@dataclass
class HFRun:
    reports: list[dict[str, Any]]
    sharded_param_oracle: int
    optimizer_state_oracle: int
    optimizer_type: str
    callback_optimizer_type: str
    keys: list[str]
    errors: int


def _trainer_class() -> Any:
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from transformers import Trainer

    class CPUFSDPTrainer(Trainer):  # type: ignore[misc]
        """Trainer that keeps FSDP on CPU (see the module docstring for why it is needed)."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            if getattr(state, "fsdp_plugin", None) is None and self.args.fsdp_plugin_args is not None:
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                state.distributed_type = DistributedType.FSDP
                self.is_fsdp_enabled = True

    return CPUFSDPTrainer


def hf_training(out_dir: str) -> HFRun:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.integrations.hf import FSDPMemoryCallback

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    seen: dict[str, str] = {}

    class SeeOptimizer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            seen["optimizer"] = type(optimizer).__name__

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=128))
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
        fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    reports: list[dict[str, Any]] = []
    callback = FSDPMemoryCallback(config=TrackerConfig(), exporters=[],
                                  on_report=lambda r: reports.append(r.to_dict()))
    trainer = _trainer_class()(model=model, args=args, train_dataset=Tokens(), callbacks=[SeeOptimizer(), callback])
    trainer.train()
    tracker = callback.tracker
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    opt_state = tracker.optimizer.state
    return HFRun(
        reports=reports,
        sharded_param_oracle=sum(t.numel() * t.element_size() for t in local),
        optimizer_state_oracle=sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local")
                                   else v.numel() * v.element_size()
                                   for s in opt_state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        optimizer_type=type(tracker.optimizer).__name__,
        callback_optimizer_type=seen["optimizer"],
        keys=tracker.module_keys,
        errors=tracker.errors_total,
    )


def test_trainer_callback_reports_once_per_optimizer_step(tmp_path: Any) -> None:
    for run in run_ranks(hf_training, str(tmp_path), timeout=600):
        assert {"<root>", "model.layers.0", "model.layers.1"} <= set(run.keys)  # FSDP really ran
        assert run.callback_optimizer_type == "AcceleratedOptimizer"  # what the Trainer hands callbacks
        assert run.optimizer_type == "AdamW"  # unwrapped by the tracker
        assert run.errors == 0
        assert [r["step"] for r in run.reports] == list(range(1, STEPS + 1))
        for report in run.reports:
            end = report["current"]["cpu"]
            assert end["sharded_param"] == run.sharded_param_oracle
            assert end["optimizer_state"] == run.optimizer_state_oracle
            assert end["sharded_grad"] > 0  # the step closed before the Trainer zeroed the grads
            assert end["inputs"] > 0
            layer = report["modules"]["model.layers.0"]["snapshots"]
            assert len(layer["before_pre_forward"]) == ACCUMULATION  # both micro-batches in one report
            assert layer["after_post_forward"][0]["cpu"]["activation"] > 0
