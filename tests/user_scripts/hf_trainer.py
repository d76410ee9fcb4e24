"""A tiny Llama (random weights, built from a config: nothing is downloaded) trained with the
transformers `Trainer` and FSDP2, on CPU.

Run on CPU with 2 ranks:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 hf_trainer.py --out losses.json

Every rank writes losses.rank{RANK}.json with the loss the Trainer logs for each optimizer step
(logging_steps=1: the step's loss, averaged over the ranks), the bytes of its local parameter
shards and the number of optimizer steps.
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, SEQ = 128, 16


class CPUFSDPTrainer(Trainer):
    """accelerate never picks FSDP on MULTI_CPU: it drops the FSDP plugin and trains with DDP.
    Put the plugin back (FSDP2 runs on CPU with gloo)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if getattr(state, "fsdp_plugin", None) is None and self.args.fsdp_plugin_args is not None:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class RecordLosses(TrainerCallback):
    """Keeps the loss the Trainer logs at each optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def rank_file(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="JSON file to write (one per rank: .rank{RANK} is inserted)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ,
    ))
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=args.grad_accum,
            max_steps=args.steps,
            learning_rate=1e-3,
            use_cpu=True,
            ddp_backend="gloo",
            fsdp=True,
            fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                         "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        recorder = RecordLosses()
        trainer = CPUFSDPTrainer(model=model, args=training_args, train_dataset=RandomTokens(),
                                 callbacks=[recorder])
        trainer.train()

    rank = training_args.process_index
    local_shards = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    result = {
        "losses": recorder.losses,
        "sharded_param_bytes": sum(t.numel() * t.element_size() for t in local_shards),
        "optimizer_steps": recorder.steps,
    }
    if args.out:
        with open(rank_file(args.out, rank), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
