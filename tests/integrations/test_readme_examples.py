"""The README's Hugging Face and Lightning examples, run as written on 2 real ranks (FSDP2 on CPU, gloo).

Each example's code block is taken from README.md or docs/ (docs/frameworks.md holds the
``CPUFSDPTrainer`` block and repeats the two examples) and executed verbatim; the test supplies only
what the README leaves to the reader: the model, the data, the Trainer's arguments (and, for the
HF example on CPU, the README's own ``CPUFSDPTrainer`` block where the example says ``Trainer``,
as the README says to). The callbacks are built as written, ``FSDPMemoryCallback()``, so they are
configured from the environment: the rank body sets ``FSDP_MEM_OTEL_JSONL`` (and switches the
Prometheus port off), and the reports are read back from those files. Oracle: one report per
optimizer step, and ``sharded_param`` at the step's end equal to numel x element size of the
rank's local shards.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HF_IMPORT = "from fsdp_mem_otel.integrations.hf import FSDPMemoryCallback"
HF_CPU_CLASS = "class CPUFSDPTrainer(Trainer)"
LIGHTNING_IMPORT = "from fsdp_mem_otel.integrations.lightning import FSDPMemoryCallback"
STEPS = 3


def readme_block(marker: str) -> str:
    """The one ```python block of README.md and docs/*.md that contains ``marker``, verbatim.

    A page may repeat a block of another page (docs/frameworks.md repeats README's examples): the
    copies must be identical, so that the one block tested is the one every page shows.
    """
    found = set()
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        found |= {b for b in blocks if marker in b}
    assert len(found) == 1, f"README.md and docs/: {len(found)} different python blocks contain {marker!r}"
    return found.pop()


@dataclass
class ExampleRun:
    steps: list[int]  # the steps of the rank's JSONL file
    sharded_param: list[int]  # each report's sharded_param at the step's end
    sharded_param_oracle: int  # numel x element size of the rank's local shards
    whole_model_bytes: int  # the same, unsharded
    module_keys: list[str]
    warnings: list[list[str]]
    errors: int


def _job_env(directory: str, name: str) -> None:
    """The rank's environment, as a job would set it: JSON lines, no metrics port, no collector."""
    for key in [k for k in os.environ if k.startswith(("FSDP_MEM_OTEL_", "OTEL_"))]:
        del os.environ[key]
    os.environ["FSDP_MEM_OTEL_PROMETHEUS"] = "0"
    os.environ["FSDP_MEM_OTEL_JSONL"] = os.path.join(directory, name + "-{rank}.jsonl")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, as the test says, also on a machine with GPUs


def _local_bytes(tensors: Any) -> int:
    out = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out += local.numel() * local.element_size()
    return out


def _result(path: str, model: Any, whole_model_bytes: int) -> ExampleRun:
    from fsdp_mem_otel.offline.jsonl_format import read_reports

    reports = list(read_reports(path))
    return ExampleRun(
        steps=[r.step for r in reports],
        sharded_param=[r.current["cpu"]["sharded_param"] for r in reports],
        sharded_param_oracle=_local_bytes(model.parameters()),
        whole_model_bytes=whole_model_bytes,
        module_keys=sorted(reports[-1].modules) if reports else [],
        warnings=[list(r.warnings) for r in reports],
        errors=max((r.errors_total for r in reports), default=-1),
    )


def hf_example(directory: str, example: str, cpu_trainer: str) -> ExampleRun:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    _job_env(directory, "hf")
    os.chdir(directory)

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=128))
    whole = _local_bytes(model.parameters())
    args = TrainingArguments(
        output_dir=directory, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    defined: dict[str, Any] = {}
    exec(compile(cpu_trainer, "README.md (CPUFSDPTrainer)", "exec"), defined)  # the README's code
    # "use it where the example says Trainer"; the example itself, as written:
    scope: dict[str, Any] = {"Trainer": defined["CPUFSDPTrainer"], "model": model, "args": args, "data": Tokens()}
    exec(compile(example, "README.md (Hugging Face example)", "exec"), scope)
    rank = torch.distributed.get_rank()
    return _result(os.path.join(directory, f"hf-{rank}.jsonl"), scope["trainer"].model, whole)


def lightning_example(directory: str, example: str) -> ExampleRun:
    import lightning.pytorch as pl
    import torch

    from fsdp_mem_otel.tools.demo import BlockModel

    _job_env(directory, "lightning")
    os.chdir(directory)  # Lightning's default logger and checkpoints go to the working directory

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = BlockModel(2, 32)

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
            return self(x).pow(2).mean()

        def on_train_batch_end(self, *_: Any) -> None:
            if self.trainer.global_step >= STEPS:  # the example's Trainer has no max_steps
                self.trainer.should_stop = True

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
    model = Module()
    whole = _local_bytes(BlockModel(2, 32).parameters())
    scope: dict[str, Any] = {"model": model, "loader": torch.utils.data.DataLoader(data, batch_size=4)}
    exec(compile(example, "README.md (Lightning example)", "exec"), scope)  # the README's code
    rank = torch.distributed.get_rank()
    return _result(os.path.join(directory, f"lightning-{rank}.jsonl"), model, whole)


def check(runs: list[ExampleRun], keys: set[str]) -> None:
    for run in runs:
        assert run.errors == 0
        assert run.steps == list(range(1, STEPS + 1))  # one report per optimizer step
        assert keys <= set(run.module_keys)  # FSDP really ran
        assert run.sharded_param == [run.sharded_param_oracle] * STEPS
        assert run.sharded_param_oracle < 0.75 * run.whole_model_bytes  # sharded over both ranks
        assert run.warnings == [[]] * STEPS


def test_the_hugging_face_example_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    runs = run_ranks(hf_example, str(tmp_path), readme_block(HF_IMPORT), readme_block(HF_CPU_CLASS), timeout=600)
    check(runs, {"<root>", "model.layers.0", "model.layers.1"})


def test_the_lightning_example_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    runs = run_ranks(lightning_example, str(tmp_path), readme_block(LIGHTNING_IMPORT), timeout=600)
    check(runs, {"<root>", "net.layers.0", "net.layers.1"})
