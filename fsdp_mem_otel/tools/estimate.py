"""``fsdp-mem-otel estimate``: a job's per-rank, per-module memory before it is launched.

The model is built under ``FakeTensorMode`` (shapes and dtypes, no data, no memory) and sharded
with FSDP2 over a fake process group of the target world size (one process, no GPUs, collectives
that move nothing). Warm-up and measured training steps then run under the tracker in deep mode,
which counts every fake tensor as if it were allocated, so the result is the StepReport that
rank 0 of the real job would report for that step: the step peak and each FSDP module's forward
and backward peaks, by category. ``estimate()`` returns it; the command writes it as JSONL for
``fsdp-mem-otel compare ESTIMATE.jsonl RUN.jsonl`` and ``FSDP_MEM_OTEL_ESTIMATE`` and prints tables
(``estimate_parser()``, ``run_estimate()``; ``estimate_cli.estimate_main`` runs the command, with
``estimate_fit``'s --fit and --compare-options: this module imports neither).

What it cannot see (nor can the tracker on a real run): memory outside PyTorch's tensors, such
as the CUDA context, NCCL's and cuBLAS's workspaces, and the caching allocator's own rounding
beyond 512-byte blocks and its fragmentation. On CUDA, ``torch.cuda.memory_reserved()`` runs
above the estimate by what the allocator caches and fragments; ``memory_allocated()`` is what
the estimate predicts. FSDP1 is not supported (see ``FSDP1_UNSUPPORTED``). ``device="cpu"``
(the default) runs CPU kernels' shapes, which can differ from CUDA kernels' (attention
backends save different intermediates); ``device="cuda"`` needs a visible GPU, yet allocates
nothing on it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fsdp_mem_otel.checks import check_bool, check_int
from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.schema import StepReport

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
INPUT_DTYPES = {**DTYPES, "int64": torch.int64, "long": torch.int64}
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
DEVICES = ("cpu", "cuda")
FSDP1_UNSUPPORTED = (
    "FSDP1 (FullyShardedDataParallel) is not supported by estimate: FSDP1 decides by comparing "
    "storage data pointers, which fake tensors do not have, so its memory under FakeTensorMode is "
    "not the real one. Wrap with FSDP2 (torch.distributed.fsdp.fully_shard) to estimate"
)
Factory = str | Callable[..., Any] | None


@dataclass(frozen=True)
class EstimateConfig:
    """What to estimate; every argument is checked when the config is built.

    Attributes:
        model: ``"module:function"`` (or a callable) returning the unwrapped model, built on the
            default device; None: the demo ``BlockModel(blocks, width)``.
        blocks, width: the demo model's size (used only when ``model`` is None).
        wrap: ``"module:function"`` (or a callable) sharding the model with FSDP2, called as
            ``wrap(model, mesh=..., mp_policy=..., reshard_after_forward=...)`` (pass them on to
            ``fully_shard``) and returning the model (or None: the model it was given); None: the
            built-in policy, ``fully_shard`` each block (the modules of the model's first
            ``nn.ModuleList`` or ``nn.ModuleDict``: torchtitan keeps its blocks in a ModuleDict), then
            the root.
        loss: ``"module:function"`` (or a callable) ``loss(model, batch) -> scalar tensor``;
            None: ``model(batch).pow(2).mean()``.
        batch_shape: the input's shape per rank (None: ``(32, width)``, the demo model's only).
        input_dtype: the input's dtype: float32/bf16/fp16, or int64 (token ids).
        world_size: ranks of the job; ``mesh``: (replicate, shard) for HSDP, product = world_size.
        param_dtype, reduce_dtype: FSDP2's MixedPrecisionPolicy (fp32/bf16/fp16; None: unset).
        reshard_after_forward: FSDP2's reshard policy. activation_checkpointing: wrap each block
            (see ``wrap``) in ``checkpoint_wrapper``.
        optimizer, lr: adamw (default), adam or sgd, and its learning rate; or ``"module:function"``
            (or a callable) building the optimizer from the wrapped model, ``optimizer(model, lr=lr)``
            (a framework's own: torchtitan's ``OptimizersContainer``, foreach AdamW, ...).
        warmup_steps: steps before the measured one (the first creates optimizer state).
        device: "cpu" (default; runs anywhere) or "cuda" (a visible GPU; nothing is allocated on it).
    """

    model: Factory = None
    blocks: int = 4
    width: int = 64
    wrap: Factory = None
    loss: Factory = None
    batch_shape: tuple[int, ...] | None = None
    input_dtype: str = "float32"
    world_size: int = 8
    mesh: tuple[int, int] | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    optimizer: Factory = "adamw"
    lr: float = 1e-3
    warmup_steps: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("model", "wrap", "loss"):
            _check_factory(name, getattr(self, name))
        check_int("blocks", self.blocks, 1)
        check_int("width", self.width, 1)
        check_int("world_size", self.world_size, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        check_bool("activation_checkpointing", self.activation_checkpointing)
        _check_choice("input_dtype", self.input_dtype, INPUT_DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES, optional=True)
        _check_choice("reduce_dtype", self.reduce_dtype, DTYPES, optional=True)
        if not callable(self.optimizer) and not (isinstance(self.optimizer, str) and ":" in self.optimizer):
            _check_choice("optimizer", self.optimizer, [*OPTIMIZERS, "'module:function'"])
        _check_factory("optimizer", self.optimizer if self.optimizer not in OPTIMIZERS else None)
        _check_choice("device", self.device, DEVICES)
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not self.lr > 0:
            raise ValueError(f"lr must be a number > 0; got {self.lr!r}")
        if self.batch_shape is None:
            if self.model is not None:
                raise ValueError("batch_shape is required with a model of your own (e.g. (8, 2048) for 8 "
                                 "sequences of 2048 token ids); only the demo model has a default")
        elif not isinstance(self.batch_shape, tuple) or not self.batch_shape or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.batch_shape):
            raise ValueError(f"batch_shape must be a non-empty tuple of positive integers; got {self.batch_shape!r}")
        if self.mesh is not None:
            if not isinstance(self.mesh, tuple) or len(self.mesh) != 2 or any(
                    isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.mesh):
                raise ValueError(f"mesh must be (replicate, shard), two positive integers; got {self.mesh!r}")
            if math.prod(self.mesh) != self.world_size:
                raise ValueError(f"mesh {self.mesh[0]}x{self.mesh[1]} has {math.prod(self.mesh)} ranks but "
                                 f"world_size is {self.world_size}; their product must equal world_size")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.batch_shape if self.batch_shape is not None else (32, self.width)


def _check_factory(name: str, value: object) -> None:
    if value is None or callable(value):
        return
    if not isinstance(value, str) or ":" not in value or not all(value.rsplit(":", 1)):
        raise ValueError(f"{name} must be 'module:function' (e.g. 'mypkg.models:build') or "
                         f"'path/to/file.py:function', a callable or None; got {value!r}")


def _check_choice(name: str, value: object, accepted: Sequence[str] | dict[str, Any], optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in accepted:
        names = ", ".join(accepted) + (" or None" if optional else "")
        raise ValueError(f"{name} must be one of {names}; got {value!r}")


class OptionError(ValueError):
    """A value of ``EstimateConfig`` (the field ``option``) that the job rejects; the command line
    names it as ``--option`` (``cli_message``, with ``cli_detail`` where the detail names other
    fields)."""

    def __init__(self, option: str, detail: str, cli_detail: str | None = None) -> None:
        super().__init__(f"{option} {detail}")
        self.option, self.detail = option, detail
        self.cli_detail = detail if cli_detail is None else cli_detail

    def cli_message(self) -> str:
        return f"--{self.option.replace('_', '-')} {self.cli_detail}"


#: the forms a ``"module:function"`` argument takes, as the errors say them
FACTORY_FORMS = "accepted: module.path:callable (importable from the current folder or PYTHONPATH) or " \
                "path/to/file.py:callable"


def _import_file(path: str) -> Any:
    """The module in the file ``path`` (its folder put on sys.path first, as ``python path`` does)."""
    import importlib.util
    import sys

    full = os.path.abspath(path)
    name = os.path.splitext(os.path.basename(full))[0]
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == full:
        return loaded
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def _is_file_spec(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def load_callable(name: str, spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """``spec`` itself if callable, else the callable that ``"module:function"`` names
    (``function`` may be dotted): the module imported from the current folder (put on the import
    path, as ``python -m`` and torchrun do) or PYTHONPATH, or from a file (``"path/to/file.py:function"``).
    An ``OptionError`` (a ValueError) naming ``name`` when it cannot be found."""
    import sys

    if callable(spec):
        return spec
    module_name, attr = spec.rsplit(":", 1)
    try:
        if _is_file_spec(module_name):
            if not os.path.isfile(module_name):
                raise OptionError(name, f"{spec!r}: no such file {module_name!r}; {FACTORY_FORMS}")
            obj: Any = _import_file(module_name)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            obj = importlib.import_module(module_name)
    except OptionError:
        raise
    except ImportError as exc:
        raise OptionError(name, f"{spec!r}: cannot import module {module_name!r} ({exc}); {FACTORY_FORMS}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say how, in one line
        raise OptionError(name, f"{spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        what = "no callable" if obj is None else f"{type(obj).__name__}, not a callable, at"
        raise OptionError(name, f"{spec!r}: module {module_name!r} has {what} {attr!r}; {FACTORY_FORMS}")
    return obj


def call_factory(name: str, spec: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``load_callable(name, spec)(*args, **kwargs)``; what it raises becomes an OptionError
    naming ``name`` (a ValueError it raised about FSDP1 passes through)."""
    fn = load_callable(name, spec)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if isinstance(exc, ValueError) and str(exc) == FSDP1_UNSUPPORTED:
            raise
        label = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
        raise OptionError(name, f"{label!r}: calling it raised {type(exc).__name__}: {exc}") from exc


def demo_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The default loss: ``model(batch).pow(2).mean()`` (the demo's)."""
    out = model(batch)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not a tensor: pass loss='module:function' "
                        "computing the loss from (model, batch)")
    return out.pow(2).mean()


def blocks_of(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The model's blocks: its first non-empty ``nn.ModuleList`` or ``nn.ModuleDict`` (named_modules()
    order; torchtitan keeps its blocks in a ModuleDict)."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList | nn.ModuleDict) and len(m):
            return m
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of blocks: the built-in wrap "
                     "policy and activation_checkpointing need one; pass wrap='module:function' (and checkpoint there)")


def _blocks(container: nn.ModuleList | nn.ModuleDict) -> list[tuple[str, nn.Module]]:
    if isinstance(container, nn.ModuleDict):
        return list(container.items())
    return [(str(i), m) for i, m in enumerate(container)]


def per_block_fsdp2(model: nn.Module, **fsdp_kwargs: Any) -> nn.Module:
    """The built-in wrap policy: ``fully_shard`` each block, then the root (like the demo's wrap)."""
    from torch.distributed.fsdp import fully_shard

    for _, block in _blocks(blocks_of(model)):
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing: each block in ``checkpoint_wrapper`` (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = blocks_of(model)
    for name, block in _blocks(blocks):
        blocks.register_module(name, checkpoint_wrapper(block))


def fsdp_kwargs(config: EstimateConfig, mesh: Any) -> dict[str, Any]:
    """The keyword arguments ``fully_shard`` gets for ``config`` on ``mesh``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype] if config.param_dtype else None,
                              reduce_dtype=DTYPES[config.reduce_dtype] if config.reduce_dtype else None)
    return {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": config.reshard_after_forward}


def build(config: EstimateConfig, mesh: Any,
          before_wrap: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer as ``config`` describes them (on the current device
    and fake mode, if any); ``before_wrap(model)`` is called on the model as built. Raises
    ValueError for FSDP1 or a wrap that applies no FSDP2, OptionError when a factory fails."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if config.model is None:
        from fsdp_mem_otel.tools.demo import BlockModel

        model = BlockModel(config.blocks, config.width)
    else:
        model = call_factory("model", config.model)
        if not isinstance(model, nn.Module):
            raise OptionError("model", f"{config.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    if before_wrap is not None:
        before_wrap(model)
    if config.activation_checkpointing:
        checkpoint_blocks(model)
    wrap = per_block_fsdp2 if config.wrap is None else load_callable("wrap", config.wrap)
    try:
        wrapped = wrap(model, **fsdp_kwargs(config, mesh))
    except Exception as exc:
        if config.wrap is not None and not (_raised_in_fsdp1(exc) or any(
                isinstance(m, FullyShardedDataParallel) for m in model.modules())):
            raise OptionError("wrap", f"{config.wrap!r}: calling it raised {type(exc).__name__}: {exc}") from exc
        if _raised_in_fsdp1(exc) or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise ValueError(FSDP1_UNSUPPORTED) from exc
        raise
    wrapped = model if wrapped is None else wrapped
    if any(isinstance(m, FullyShardedDataParallel) for m in wrapped.modules()):
        raise ValueError(FSDP1_UNSUPPORTED)
    if not any(isinstance(m, FSDPModule) for m in wrapped.modules()):
        raise ValueError(f"wrap {config.wrap!r} applied no FSDP2 (fully_shard) to the model")
    if isinstance(config.optimizer, str) and config.optimizer in OPTIMIZERS:
        return wrapped, OPTIMIZERS[config.optimizer](wrapped.parameters(), lr=config.lr)
    factory = cast("str | Callable[..., Any]", config.optimizer)  # not None: EstimateConfig checked it
    return wrapped, call_factory("optimizer", factory, wrapped, lr=config.lr)


def _raised_in_fsdp1(exc: BaseException) -> bool:
    """Whether ``exc`` came out of FSDP1's constructor (which fails on fake tensors)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("fsdp", "fully_sharded_data_parallel.py")):
            return True
        tb = tb.tb_next
    return False


def emulate_gloo(model: nn.Module) -> None:
    """On CPU the job's backend is gloo, whose reduce-scatter allocates what the fake process
    group does not: have each FSDP module's default reduce-scatter allocate it too."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from fsdp_mem_otel.training.adapters.fsdp2 import param_groups

    comm = _gloo_reduce_scatter_class()()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            groups = param_groups(m)
            if len(groups) == 1 and type(groups[0]._reduce_scatter_comm) is DefaultReduceScatter:
                m.set_custom_reduce_scatter(comm)


def _gloo_reduce_scatter_class() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class GlooReduceScatter(DefaultReduceScatter):
        """ProcessGroupGloo's reduce-scatter all-reduces a clone of the input; waiting for it
        copies this rank's chunk of the clone out, and the clone is freed after that."""

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            staging = input_tensor.clone()
            output_tensor.copy_(staging.chunk(group.size())[group.rank()])
            return work

    return GlooReduceScatter


def make_mesh(config: EstimateConfig) -> Any:
    """The device mesh of ``config`` over the initialized process group (1-D, or HSDP 2-D)."""
    from torch.distributed.device_mesh import init_device_mesh

    if config.mesh is None:
        return init_device_mesh(config.device, (config.world_size,))
    return init_device_mesh(config.device, config.mesh, mesh_dim_names=("replicate", "shard"))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """One step as the estimate runs it: zero_grad(set_to_none), loss, backward, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    optimizer.step()


def estimate(config: EstimateConfig) -> StepReport:
    """Rank 0's StepReport (deep mode) of step ``warmup_steps + 1`` of the job ``config``
    describes, computed in this process without GPUs (see the module docstring for what it
    cannot see). Needs torch.distributed not to be initialized in this process; leaves it so."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_mem_otel.config import TrackerConfig
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    if not isinstance(config, EstimateConfig):
        raise TypeError(f"config must be an EstimateConfig; got {type(config).__name__}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' needs a visible CUDA device (nothing is allocated on it); "
                         "use device 'cpu' on a machine without one")
    if dist.is_initialized():
        raise RuntimeError("estimate runs its own fake process group: call it where torch.distributed is not "
                           "initialized (not inside a training job)")
    loss_fn = demo_loss if config.loss is None else load_callable("loss", config.loss)
    device = torch.device(config.device, 0) if config.device == "cuda" else torch.device("cpu")
    excepthook = sys.excepthook  # init_process_group prefixes every later traceback line with [rank0]
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake_log.level  # a meta kernel that rejects an input logs its traceback there, then raises
    fake_log.setLevel(logging.CRITICAL)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.world_size)
    try:
        mesh = make_mesh(config)  # outside fake mode: the mesh holds real rank numbers
        with FakeTensorMode() as fake_mode, device:
            batch = _batch(config)
            model, optimizer = build(config, mesh, before_wrap=lambda m: check_input(m, batch, loss_fn, config))
            if config.device == "cpu":
                emulate_gloo(model)
            tracker = FSDPMemoryTracker(model, optimizer, config=TrackerConfig(mode="deep", max_errors=0))
            tracker.ledger.count_fake(fake_mode, device)
            with tracker:
                for _ in range(config.warmup_steps + 1):
                    tracker.track_inputs(batch)
                    try:
                        train_step(model, optimizer, batch, loss_fn)
                    except Exception as exc:
                        raise _step_error(config, exc) from exc
                    report = tracker.step()
            if tracker.errors_total:
                raise RuntimeError(f"the tracker failed {tracker.errors_total} times during the estimate; "
                                   f"last: {tracker.failures}")
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        fake_log.setLevel(fake_level)
    report.allocator = {}  # the allocator ran nothing: no statistics
    return report


def _step_error(config: EstimateConfig, exc: BaseException) -> OptionError:
    """The training step failed on the fake batch: the model (or loss) rejects its shape or dtype."""
    shape, dtype = config.input_shape, config.input_dtype
    loss = " (and --loss)" if config.loss is not None else ""
    what = f"the training step raised {type(exc).__name__}: {' '.join(str(exc).split())}"
    return OptionError(
        "batch_shape", f"{shape} with input_dtype {dtype}: {what}; give a batch shape and dtype the model takes",
        f"{','.join(map(str, shape))} with --input-dtype {dtype}: {what}; give a --batch-shape and --input-dtype "
        f"the model takes{loss} (--debug shows where it raised)")


class _FirstLayer(Exception):
    """Raised by the pre-hook of the first layer the forward reaches, to stop it there."""

    def __init__(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        super().__init__(name)
        self.name, self.module, self.args = name, module, args


#: the most bytes of parameters ``check_input`` materializes for its real forward
CHECK_MAX_BYTES = 256 << 20


def check_input(model: nn.Module, batch: torch.Tensor, loss_fn: Callable[[nn.Module, torch.Tensor], Any],
                config: EstimateConfig) -> None:
    """An OptionError (``input_dtype``) when the first layer the batch reaches rejects it on real
    tensors. Fake tensors run meta kernels, and some are laxer than the real ones: the meta
    ``addmm`` takes an int64 input into float32 weights, which the CPU kernel refuses ("mat1
    and mat2 must have the same dtype"), so the estimate would run where the job fails. The
    forward is run under ``model``'s fake mode up to that layer (a torch.nn layer without
    children, whose real kernels exist on CPU), which is then called once for real, on CPU, with
    zeros: its parameters (if at most ``CHECK_MAX_BYTES``), and its inputs (cut to one sample
    past ``CHECK_MAX_BYTES``), cast as FSDP2's mixed precision casts them (``param_dtype``). A
    layer whose fake forward fails already is left to the estimate's step to report."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    names = {m: n for n, m in model.named_modules()}

    def stop(module: nn.Module, args: tuple[Any, ...]) -> None:
        if not any(True for _ in module.children()):
            try:
                module.forward(*args)  # under fake tensors: a shape it rejects is the step's to report
            except Exception:  # noqa: BLE001
                raise _FirstLayer("", module, ()) from None
            raise _FirstLayer(names.get(module, "?"), module, args)

    handle = nn.modules.module.register_module_forward_pre_hook(stop)
    try:
        loss_fn(model, batch)
    except _FirstLayer as found:
        first = found
    except Exception:  # noqa: BLE001 - not this check's to report: the estimate's step says it, in full
        return
    else:
        return
    finally:
        handle.remove()
    module = first.module
    if not first.name or not type(module).__module__.startswith("torch.nn."):
        return  # a layer of the model's own: its kernels may exist only on the target device
    state = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    if sum(t.numel() * t.element_size() for _, t in state) > CHECK_MAX_BYTES:
        return
    param_dtype = DTYPES[config.param_dtype] if config.param_dtype else None
    sample = sum(a.numel() * a.element_size() for a in first.args if isinstance(a, torch.Tensor)) > CHECK_MAX_BYTES

    def real(t: Any, sample: bool) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dtype = param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype
        shape = (1, *t.shape[1:]) if sample and t.dim() > 1 else tuple(t.shape)
        return torch.zeros(shape, dtype=dtype, device="cpu")

    with unset_fake_temporarily():
        tensors = {n: real(t, False) for n, t in state}
        args = tuple(real(a, sample) for a in first.args)
        if not all(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in tensors.values()):
            return
        training = module.training
        module.train(False)
        try:
            with torch.no_grad():
                torch.func.functional_call(module, tensors, args)
        except Exception as exc:  # noqa: BLE001 - the real kernel's refusal is the answer
            given = config.input_dtype
            layer = f"the model's first layer, {first.name} ({type(module).__name__}),"
            why = " ".join(str(exc).split())
            hint = ("int64 is for token ids into an embedding; a layer taking features wants float32, bf16 or fp16"
                    if INPUT_DTYPES[given] == torch.int64 else
                    "token ids into an embedding want int64; else the dtype of the model's parameters")
            raise OptionError("input_dtype", f"{given}: {layer} rejects the batch on a real forward: {why}; give "
                              f"the input_dtype it takes ({hint})",
                              f"{given}: {layer} rejects the batch on a real forward: {why}; give the --input-dtype "
                              f"it takes ({hint})") from exc
        finally:
            module.train(training)


def _batch(config: EstimateConfig) -> torch.Tensor:
    dtype = INPUT_DTYPES[config.input_dtype]
    if dtype == torch.int64:
        return torch.zeros(config.input_shape, dtype=dtype)
    return torch.randn(config.input_shape, dtype=dtype)


@dataclass(frozen=True)
class ScaleRow:
    """One world size of ``scale()``: bytes per rank at the step peak."""

    world_size: int
    sharded_param: int
    optimizer_state: int
    step_peak: int


def scale(config: EstimateConfig, world_sizes: Sequence[int]) -> list[ScaleRow]:
    """``estimate()`` at each world size (the mesh, if any, keeps its replicate degree)."""
    rows = []
    for ws in world_sizes:
        mesh = None if config.mesh is None else (config.mesh[0], ws // config.mesh[0])
        report = estimate(replace(config, world_size=ws, mesh=mesh))
        dev = max(report.peak, key=lambda d: report.peak[d].get("total", 0))
        peak = report.peak[dev]
        rows.append(ScaleRow(ws, peak["sharded_param"], peak["optimizer_state"], peak["total"]))
    return rows


def write_jsonl(report: StepReport, path: str) -> None:
    """Write ``report`` as the only line of ``path`` (replacing the file), with its side index,
    as the JSONL exporter writes them; an OSError (naming the file) when that fails."""
    from fsdp_mem_otel.offline.jsonl_format import encode, index_line, index_path

    data, line = encode(report)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    for target, payload in ((path, line), (index_path(path), index_line(data, 0, len(line)))):
        tmp = f"{target}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def scale_table(rows: Sequence[ScaleRow]) -> str:
    """The rows of ``scale()`` as a plain-text table."""
    from fsdp_mem_otel.offline.table import human_bytes, render_table

    head = ("world size", "sharded params", "optimizer state", "step peak")
    return render_table(head, [(str(r.world_size), human_bytes(r.sharded_param), human_bytes(r.optimizer_state),
                                human_bytes(r.step_peak)) for r in rows])


def _ints(text: str) -> tuple[int, ...]:
    """'8,2048' -> (8, 2048), for argparse (the config checks the values)."""
    try:
        return tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas (e.g. 8,2048); got {text!r}") from None


CANNOT_SEE = (
    "Not in the estimate: the CUDA context, NCCL and cuBLAS workspaces, and the caching allocator's "
    "fragmentation; on CUDA, torch.cuda.memory_allocated() is what it predicts and memory_reserved() runs above it.")


def estimate_parser() -> argparse.ArgumentParser:
    """``fsdp-mem-otel estimate``'s parser with the estimate's own options; ``estimate_cli`` adds
    those of ``estimate_fit`` (--fit, --compare-options) and runs the command."""
    from fsdp_mem_otel.checks import int_at_least

    p = ArgumentParser(
        prog="fsdp-mem-otel estimate",
        description="Estimate a FSDP2 job's per-rank, per-module memory before launching it: the model is built "
                    "under FakeTensorMode and trained in one process over a fake process group of the target "
                    "world size, under the tracker in deep mode. No GPU needed.")
    p.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="returns the unwrapped model (default: the demo's BlockModel of --blocks x --width)")
    p.add_argument("--blocks", type=int_at_least(1), default=4, help="demo model blocks (default 4)")
    p.add_argument("--width", type=int_at_least(1), default=64, help="demo model width (default 64)")
    p.add_argument("--wrap", default=None, metavar="MODULE:FUNCTION",
                   help="wrap(model, mesh=, mp_policy=, reshard_after_forward=) applying fully_shard (default: "
                        "each module of the model's first nn.ModuleList or nn.ModuleDict, then the root)")
    p.add_argument("--loss", default=None, metavar="MODULE:FUNCTION",
                   help="loss(model, batch) -> scalar (default: model(batch).pow(2).mean())")
    p.add_argument("--batch-shape", type=_ints, default=None, metavar="B,...",
                   help="the input's shape per rank, e.g. 8,2048 (default for the demo model: 32,WIDTH)")
    p.add_argument("--input-dtype", default="float32", choices=sorted(INPUT_DTYPES), help="default float32")
    p.add_argument("--world-size", type=int_at_least(1), default=8, help="ranks of the job (default 8)")
    p.add_argument("--mesh", type=_ints, default=None, metavar="R,S",
                   help="HSDP mesh: replicate x shard ranks (product = --world-size)")
    p.add_argument("--param-dtype", default=None, choices=sorted(DTYPES), help="mixed precision: parameter dtype")
    p.add_argument("--reduce-dtype", default=None, choices=sorted(DTYPES), help="mixed precision: reduce dtype")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep parameters unsharded between forward and backward")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="checkpoint_wrapper around each module of the model's first nn.ModuleList or nn.ModuleDict")
    p.add_argument("--optimizer", default="adamw", metavar="|".join(sorted(OPTIMIZERS)) + "|MODULE:FUNCTION",
                   help="default adamw; MODULE:FUNCTION builds it from the wrapped model: optimizer(model, lr=LR)")
    p.add_argument("--lr", type=float, default=1e-3, help="default 0.001")
    p.add_argument("--warmup-steps", type=int_at_least(0), default=1,
                   help="steps before the measured one (default 1: the first creates the optimizer state)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="kernels whose shapes are estimated (default cpu; cuda needs a visible GPU, allocates nothing)")
    p.add_argument("--out", default=None, metavar="ESTIMATE.jsonl",
                   help="write the estimate's StepReport for compare, report and FSDP_MEM_OTEL_ESTIMATE")
    p.add_argument("--world-sizes", type=_ints, default=None, metavar="N,...",
                   help="also estimate at these world sizes and print bytes per rank for each")
    return p


def config_from_args(args: argparse.Namespace) -> EstimateConfig:
    """The EstimateConfig that ``estimate_parser()``'s options describe (ValueError/TypeError when
    the config rejects them)."""
    return EstimateConfig(
        model=args.model, blocks=args.blocks, width=args.width, wrap=args.wrap, loss=args.loss,
        batch_shape=args.batch_shape, input_dtype=args.input_dtype, world_size=args.world_size,
        mesh=args.mesh, param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
        reshard_after_forward=not args.no_reshard_after_forward,
        activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer, lr=args.lr,
        warmup_steps=args.warmup_steps, device=args.device)


def run_estimate(args: argparse.Namespace, config: EstimateConfig) -> int:
    """``fsdp-mem-otel estimate`` without --fit or --compare-options: estimate ``config`` (and at
    each of --world-sizes), print the tables, write --out (checked before the estimate runs);
    returns 0. A rejected option raises ``UsageError``; a failed write too, after the tables."""
    from fsdp_mem_otel.cli_errors import UsageError, check_writable
    from fsdp_mem_otel.offline.table import module_table, peak_table

    if args.out:
        check_writable(args.out, "--out")
    with usage_errors():
        print(f"estimating world size {config.world_size} ...", file=sys.stderr, flush=True)
        report = estimate(config)
        rows = []
        for ws in args.world_sizes or ():
            print(f"estimating world size {ws} ...", file=sys.stderr, flush=True)
            rows += scale(config, [ws])
    print(f"Estimate for rank 0 of {config.world_size}, step {report.step}:")
    print(peak_table(report))
    print()
    print(module_table(report))
    if rows:
        print("\nBytes per rank at the step peak, by world size:")
        print(scale_table(rows))
    print(f"\n{CANNOT_SEE}", flush=True)
    if args.out:
        try:
            write_jsonl(report, args.out)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: writing the estimate failed ({exc.strerror or exc}); the estimate is "
                             "printed above: give an --out in a folder you can write to", code=1) from exc
        print(f"Written to {args.out}: launch with FSDP_MEM_OTEL_ESTIMATE={args.out}, then "
              f"fsdp-mem-otel compare {args.out} RUN.rank0.jsonl")
    return 0


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Turn what ``EstimateConfig`` and ``estimate()`` raise about the user's options (OptionError,
    ValueError, TypeError) into ``UsageError``s naming the command-line options."""
    from fsdp_mem_otel.cli_errors import UsageError

    try:
        yield
    except OptionError as exc:
        raise UsageError(exc.cli_message()) from exc
    except (ValueError, TypeError) as exc:
        # EstimateConfig's messages start with the field's name: say the option's
        field, _, rest = str(exc).partition(" ")
        if field in {f.name for f in fields(EstimateConfig)}:
            raise UsageError(f"--{field.replace('_', '-')} {rest}") from exc
        raise UsageError(str(exc)) from exc
