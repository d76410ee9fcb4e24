"""A small FSDP training used by the demo, the tests and the benchmarks.

``BlockModel`` is a stack of residual blocks (LayerNorm + two Linear); with a small width it is
dispatch-bound (per-op overhead dominates, as on a GPU), with a large width compute-bound.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from fsdp_mem_otel import env
from fsdp_mem_otel.checks import int_at_least
from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.config import DEFAULT_BASE_PORT, ExportConfig, TrackerConfig


class InnerLinear(nn.Linear):
    """A Linear that nested wrapping shards on its own (a distinct type for FSDP1 policies)."""


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))); ``inner_checkpoint`` recomputes fc1+gelu in backward."""

    def __init__(self, width: int, inner_checkpoint: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = InnerLinear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.inner_checkpoint = inner_checkpoint

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.inner_checkpoint:
            h = torch.utils.checkpoint.checkpoint(self._hidden, h, use_reentrant=False)
        else:
            h = self._hidden(h)
        return x + self.fc2(h)


class BlockModel(nn.Module):
    """``blocks`` Blocks of ``width`` features, then a Linear head.

    ``repeat_first`` calls the first block twice per forward (a module used several times).
    """

    def __init__(self, blocks: int, width: int, inner_checkpoint: bool = False, repeat_first: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, inner_checkpoint) for _ in range(blocks))
        self.head = nn.Linear(width, width)
        self.repeat_first = repeat_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.repeat_first:
            x = self.layers[0](x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@dataclass
class WrapOptions:
    """How to wrap a BlockModel with FSDP."""

    fsdp: int = 2
    reshard_after_forward: bool = True
    use_orig_params: bool = True
    checkpoint: bool = False  # checkpoint_wrapper around each block
    inner_checkpoint: bool = False  # torch.utils.checkpoint inside each block
    nested: bool = False  # also shard each block's fc1 on its own
    repeat_first: bool = False  # call the first block twice per forward


def wrap(model: BlockModel, opts: WrapOptions) -> nn.Module:
    """Shard each block and the root with FSDP ``opts.fsdp`` (1 or 2)."""
    if opts.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if opts.fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        if opts.nested:
            for m in model.modules():
                if isinstance(m, InnerLinear):
                    fully_shard(m, reshard_after_forward=opts.reshard_after_forward)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=opts.reshard_after_forward)
        fully_shard(model, reshard_after_forward=opts.reshard_after_forward)
        return model
    if opts.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if opts.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block, InnerLinear} if opts.nested else {Block}),
            use_orig_params=opts.use_orig_params,
            sharding_strategy=strategy,
            device_id=_device(),
        )
    raise ValueError(f"fsdp must be 1 or 2; got {opts.fsdp!r}")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build(blocks: int, width: int, opts: WrapOptions, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A wrapped BlockModel (same initial weights on every rank) and its Adam optimizer."""
    torch.manual_seed(seed)
    model = wrap(BlockModel(blocks, width, opts.inner_checkpoint, opts.repeat_first), opts)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def make_batch(step: int, batch: int, width: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, width, generator=g)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    micro_batches: int = 1,
    on_inputs: Callable[[torch.Tensor], None] | None = None,
    keep_losses: list[torch.Tensor] | None = None,
) -> float:
    """zero_grad, ``micro_batches`` forward/backward passes, optimizer step; returns the loss.

    ``keep_losses``: the classic leak, on purpose: each loss is kept in this list with its graph
    (``backward(retain_graph=True)``), so every step's saved activations stay alive."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for chunk in x.chunk(micro_batches):
        if on_inputs is not None:
            on_inputs(chunk)
        loss = model(chunk).pow(2).mean()
        loss.backward(retain_graph=keep_losses is not None)
        if keep_losses is not None:
            keep_losses.append(loss)
        total += float(loss.detach())
    optimizer.step()
    return total


def init_distributed() -> tuple[int, int]:
    """Join the torchrun / spawned process group on gloo; returns (rank, world_size)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return dist.get_rank(), dist.get_world_size()


def run_demo(argv: list[str] | None = None) -> int:
    """Rank-side demo: train under the tracker, print progress and, on rank 0, per-module tables.

    Configured like a job (``FSDPMemoryTracker.from_env``): ``TrackerConfig.from_env`` and the
    environment's exporters (``ExportConfig.from_env``: ``FSDP_MEM_OTEL_ESTIMATE``,
    ``FSDP_MEM_OTEL_JSONL``, the OpenTelemetry endpoint, ...), the demo's flags overriding; see
    ``demo_configs`` for the demo's own defaults."""
    import time

    from fsdp_mem_otel.exporters import build_exporters
    from fsdp_mem_otel.offline.table import human_bytes, module_table, peak_table
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    p = ArgumentParser(prog="fsdp_mem_otel.tools.demo")
    add_demo_args(p)
    args = p.parse_args(argv)
    tracker_config, export_config = demo_configs(args)
    rank, world = init_distributed()
    model, opt = build(args.blocks, args.width, WrapOptions(fsdp=args.fsdp))
    tracker = FSDPMemoryTracker(model, opt, config=tracker_config)  # validate the model before opening ports
    if tracker_config.enabled:  # FSDP_MEM_OTEL_ENABLED=0: no ports, no files, nothing measured
        tracker.exporters = list(build_exporters(export_config))
    if rank == 0:
        _print_destinations(tracker_config, export_config, tracker.exporters, world)
    last_deep = None
    kept: list[torch.Tensor] | None = [] if args.leak else None
    with tracker:
        t0 = time.perf_counter()
        for step in range(args.steps):
            x = make_batch(step, args.batch, args.width, rank)
            loss = train_step(model, opt, x, on_inputs=tracker.track_inputs, keep_losses=kept)
            report = tracker.step()
            if rank == 0 and report.leak is not None and report.leak.growing:
                grows = ", ".join(f"{c} +{human_bytes(int(v))}/step" for c, v in report.leak.growing.items())
                held = ", ".join(f"{m} {human_bytes(n)}" for m, n in report.leak.held.items())
                print(f"[rank 0] LEAK: {grows}; still held at the step end by {held or '?'}", flush=True)
            if report.mode == "deep":
                last_deep = report
            if rank == 0:
                print(
                    f"[rank 0] step {report.step}/{args.steps} {report.mode:<5} loss {loss:.4f} "
                    f"peak {human_bytes(report.peak_total())} ({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
    if rank == 0:
        # the last deep step (every byte labelled), then the last step unless that is the same one
        shown = [last_deep] if last_deep is not None else []
        if report is not last_deep:
            shown.append(report)
        for rep in shown:
            print(f"\nStep {rep.step} ({rep.mode} mode), FSDP{rep.fsdp_version}, rank 0 of {world}:")
            print(peak_table(rep))
            print()
            print(module_table(rep))
        print(f"\ntracker errors: {tracker.errors_total}")
        if export_config.jsonl and tracker.exporters:
            files = " ".join(export_config.jsonl_path(r, world) for r in range(world))
            print(f"\nTo see this run as pictures: fsdp-mem-otel report {files} -o report.html", flush=True)
    tracker.close()
    dist.destroy_process_group()
    return 0


def jsonl_path(out: str, rank: int) -> str:
    """RUN.jsonl -> RUN.rank<rank>.jsonl (a "{rank}" in ``out`` is filled in instead)."""
    return jsonl_template(out).replace("{rank}", str(rank))


def jsonl_template(out: str) -> str:
    """``--out RUN.jsonl`` as ``FSDP_MEM_OTEL_JSONL`` would say it: ``RUN.rank{rank}.jsonl``."""
    if "{rank}" in out:
        return out
    root, ext = os.path.splitext(out)
    return f"{root}.rank{{rank}}{ext or '.jsonl'}"


#: What the demo does where neither the environment nor a flag says: deep every 5th step (the
#: library: never), no per-rank Prometheus endpoint unless ``--port`` (the library: on, port 9400)
#: and, when one is asked for, bound to loopback (the library: every address).
DEMO_ENV_DEFAULTS = {
    env.FSDP_MEM_OTEL_DEEP_EVERY: "5",
    env.FSDP_MEM_OTEL_PROMETHEUS: "0",
    env.FSDP_MEM_OTEL_PROMETHEUS_ADDR: "127.0.0.1",
}


def demo_configs(args: Any, environ: Mapping[str, str] | None = None) -> tuple[TrackerConfig, ExportConfig]:
    """The demo's tracker and exporter configuration: the job's (``TrackerConfig.from_env``,
    ``ExportConfig.from_env``: every ``FSDP_MEM_OTEL_*`` variable), over ``DEMO_ENV_DEFAULTS``,
    under the flags given: ``--mode``, ``--deep-every``, ``--port`` (Prometheus on, that base
    port), ``--sidecar-dir``, ``--out`` (the JSONL path). Invalid values raise ``ValueError`` /
    ``TypeError`` naming the variable or field."""
    source = os.environ if environ is None else environ
    merged = dict(DEMO_ENV_DEFAULTS)
    merged.update({k: v for k, v in source.items() if v.strip()})  # an empty variable counts as unset
    measure = {k: v for k, v in (("mode", args.mode), ("deep_every", args.deep_every)) if v is not None}
    export: dict[str, Any] = {}
    if args.port is not None:
        export.update(prometheus=True, prometheus_port=args.port)
    if args.sidecar_dir:
        export["sidecar_dir"] = args.sidecar_dir
    if args.out:
        export["jsonl"] = jsonl_template(args.out)
    return TrackerConfig.from_env(merged, **measure), ExportConfig.from_env(merged, **export)


def _print_destinations(tracker_config: TrackerConfig, config: ExportConfig, exporters: list[Any],
                        world: int) -> None:
    """Rank 0 says how the run is measured and where its reports go."""
    deep = "every step" if tracker_config.mode == "deep" else (
        f"every {tracker_config.deep_every} steps" if tracker_config.deep_every else "never")
    print(f"[rank 0] tracker: {tracker_config.mode} mode, deep {deep}"
          f"{'' if tracker_config.enabled else ' (off: FSDP_MEM_OTEL_ENABLED)'}", flush=True)
    kinds = {type(e).__name__ for e in exporters}
    if "OTelSpanExporter" in kinds:
        print(f"[rank 0] OpenTelemetry spans to the OTLP endpoint (spans every {config.spans_every} step(s), "
              f"module spans every {config.module_spans_every})", flush=True)
    if "JSONLExporter" in kinds and config.jsonl:
        paths = ", ".join(config.jsonl_path(r, world) for r in range(world))
        print(f"[rank 0] step reports as JSON lines: {paths}", flush=True)
    if "PrometheusExporter" in kinds:
        if config.prometheus:
            scheme = "https" if config.tls_certfile else "http"
            host = "127.0.0.1" if config.prometheus_addr in ("0.0.0.0", "::", "") else config.prometheus_addr
            urls = ", ".join(f"{scheme}://{host}:{config.prometheus_port + r}/metrics" for r in range(world))
            print(f"[rank 0] Prometheus per rank: {urls}", flush=True)
        if config.sidecar_dir:
            print(f"[rank 0] sidecar files in {config.sidecar_dir}; serve them with: "
                  f"fsdp-mem-otel serve --dir {config.sidecar_dir} --port {DEFAULT_BASE_PORT}", flush=True)
    if config.estimate:
        if "PrometheusExporter" in kinds:
            print(f"[rank 0] the estimate in {config.estimate} is exported beside the measurement "
                  "(fsdp_mem_estimate_step_peak_bytes, fsdp_mem_estimate_module_peak_bytes)", flush=True)
        else:
            print("[rank 0] FSDP_MEM_OTEL_ESTIMATE is set, but nothing exports it: add --port or --sidecar-dir "
                  "(or FSDP_MEM_OTEL_PROMETHEUS=1)", flush=True)


def add_demo_args(p: Any) -> None:
    """The rank-side demo options (shared with the ``fsdp-mem-otel demo`` launcher)."""
    p.add_argument("--steps", type=int_at_least(1), default=20, help="training steps (default 20)")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="FSDP generation (default 2)")
    p.add_argument("--blocks", type=int_at_least(1), default=4, help="residual blocks (default 4)")
    p.add_argument("--width", type=int_at_least(1), default=64, help="block width (default 64)")
    p.add_argument("--batch", type=int_at_least(1), default=32, help="batch size per rank (default 32)")
    p.add_argument("--leak", action="store_true",
                   help="leak on purpose, as the classic bug does: keep each step's loss with its graph")
    p.add_argument("--mode", choices=("light", "deep"), default=None,
                   help="tracker mode (default: FSDP_MEM_OTEL_MODE, else light)")
    p.add_argument("--deep-every", type=int_at_least(0), default=None,
                   help="run every Nth step deep (default: FSDP_MEM_OTEL_DEEP_EVERY, else 5; 0 = never)")
    p.add_argument("--port", type=int_at_least(1, 65535, "a TCP port (1-65535)"), default=None,
                   help="serve Prometheus /metrics per rank on PORT + local rank (default: off, unless "
                        "FSDP_MEM_OTEL_PROMETHEUS=1)")
    p.add_argument("--sidecar-dir", default=None,
                   help="also write each rank's exposition to DIR/rank-<rank>.prom for `fsdp-mem-otel serve` "
                        "(default: FSDP_MEM_OTEL_SIDECAR_DIR)")
    p.add_argument("--out", default=None,
                   help="write every StepReport as JSON lines; RUN.jsonl becomes RUN.rank<N>.jsonl per rank "
                        "(default: FSDP_MEM_OTEL_JSONL)")


def _exit_without_finalizing(code: int) -> None:
    """Leave the rank process once its output is flushed, skipping interpreter finalization.

    FSDP keeps references to the gloo process group past ``destroy_process_group`` (its
    refcount stays above 15 with no tracker attached), so the group is destructed while the
    interpreter is being torn down, where gloo's worker threads can abort the process
    ("terminate called without an active exception", SIGABRT after a successful run). The
    tracker and its exporters are closed by then; nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from fsdp_mem_otel.cli_errors import run_command

    # a rank's failure in one line, prefixed with its rank (--debug: the traceback too)
    _exit_without_finalizing(run_command(f"fsdp-mem-otel demo [rank {os.environ.get('RANK', '?')}]", run_demo,
                                         sys.argv[1:]))
