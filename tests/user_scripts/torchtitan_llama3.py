"""torchtitan's Llama3 debug model trained by torchtitan's own Trainer, on CPU.

Run on CPU with 2 ranks:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 torchtitan_llama3.py --out losses.json

Every rank writes losses.rank{RANK}.json with the loss torchtitan's Trainer logs for each
optimizer step (its global average loss over both ranks), the bytes of its local parameter
shards and the number of optimizer steps.
"""

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, replace

import torch
import torchtitan.components.metrics as titan_metrics
import torchtitan.distributed.parallel_dims as titan_parallel_dims
import torchtitan.distributed.utils as titan_dist_utils
import torchtitan.tools.utils as titan_utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer

SEQ_LEN, LOCAL_BATCH = 64, 2


# --- torchtitan on a machine without accelerators --------------------------------------------
class CPUDeviceModule:
    """torch.cpu, as torchtitan uses its device module (current_device() is an index)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


class CPUMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor reads CUDA memory statistics; the CPU has none."""

    device_name = "cpu"

    def get_peak_stats(self):
        return titan_metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self):
        pass


def use_cpu() -> None:
    # torchtitan picks its device when it is imported and falls back to "cuda" when there is
    # no accelerator: point the modules that read it at the CPU (so the backend is gloo)
    titan_utils.device_type, titan_utils.device_module = "cpu", CPUDeviceModule()
    titan_dist_utils.device_type, titan_dist_utils.device_module = "cpu", titan_utils.device_module
    titan_parallel_dims.device_type = "cpu"
    titan_metrics.build_device_memory_monitor = CPUMemoryMonitor
    # torchtitan 0.3.0 calls torch.distributed.set_timeout (after the first step), which
    # torch 2.13 has only as a private function
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout


# --- a tokenizer and a data loader of random tokens (no downloads) ---------------------------
class RandomTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, tokenizer_path: str | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokenLoader(BaseDataLoader):
    """Batches of random tokens, different on each data-parallel rank, the same every run."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        seed: int = 1234

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps=None):
        self.config, self.dp_rank = config, dp_rank
        self.seq_len, self.batch_size = seq_len, local_batch_size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.config.seed + self.dp_rank)
        while True:
            tokens = torch.randint(0, self.config.vocab_size, (self.batch_size, self.seq_len + 1),
                                   generator=generator)
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def parallelize_llama_on_cpu(model, **kwargs):
    """torchtitan's own parallelize_llama; then every FSDP module reduces with SUM (gloo has
    no PREMUL_SUM, which FSDP uses for torchtitan's gradient divide factor of 1)."""
    model = parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def rank_file(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="JSON file to write (one per rank: .rank{RANK} is inserted)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (slow on CPU)")
    parser.add_argument("--mixed-precision-param", choices=["bfloat16", "float32"], default="bfloat16",
                        help="FSDP's unsharded parameter dtype (torchtitan's default: bfloat16)")
    args = parser.parse_args()

    init_logger()
    use_cpu()
    # torchtitan's debug model, with its loss (ChunkedLossWrapper), AdamW and selective AC
    config = llama3_debugmodel()
    # flex attention has no backward on CPU: use SDPA in every layer
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = replace(config.model_spec, parallelize_fn=parallelize_llama_on_cpu)
    config.tokenizer = RandomTokenizer.Config()
    config.dataloader = RandomTokenLoader.Config()
    config.training.steps = args.steps
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = LOCAL_BATCH  # 2 x 64 tokens: 8 chunks for the loss
    config.training.mixed_precision_param = args.mixed_precision_param
    config.training.disable_cuda_graphs = True
    config.parallelism.data_parallel_shard_degree = 2
    config.parallelism.spmd_backend = "partial_dtensor"  # "spmd_types" fails in fully_shard
    config.compile.enable = args.compile
    config.checkpoint.enable = False
    config.validator.enable = False
    config.debug.seed = 0
    config.optimizer.implementation = "foreach"  # "fused" (the default) is CUDA-only

    losses = []
    with tempfile.TemporaryDirectory() as dump_folder:
        config.dump_folder = dump_folder
        trainer = Trainer(config)
        log = trainer.metrics_processor.log

        def record_loss(step, global_avg_loss, *rest, **kwargs):
            losses.append(global_avg_loss)
            return log(step, global_avg_loss, *rest, **kwargs)

        trainer.metrics_processor.log = record_loss  # called once per optimizer step
        try:
            trainer.train()
        finally:
            trainer.close()

    rank = torch.distributed.get_rank()
    local_shards = [p.to_local() if isinstance(p, DTensor) else p
                    for part in trainer.model_parts for p in part.parameters()]
    result = {
        "losses": losses,
        "sharded_param_bytes": sum(t.numel() * t.element_size() for t in local_shards),
        "optimizer_steps": trainer.step,
    }
    if args.out:
        with open(rank_file(args.out, rank), "w") as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
