"""Code that runs on each rank of the distributed tests (spawned by tests/dist.py).

Workers return plain data; the tests assert on it. Oracles computed here are independent of the
tracker: numel x element size of what FSDP holds, and upstream FSDPMemTracker.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import torch
from torch import nn

from fsdp_mem_otel.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.schema import TOTAL
from fsdp_mem_otel.tracker import FSDPMemoryTracker

BLOCKS, WIDTH, BATCH = 3, 64, 16


def settle() -> None:
    """Free cyclic garbage now and keep the collector out of the next step.

    FSDP keeps some buffers in reference cycles; when the cyclic collector happens to run inside
    a step, memory is freed at a different point, so two identical steps would differ.
    """
    gc.collect()
    gc.disable()


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def sharded_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards, by numel x element size of what model.parameters() holds."""
    return sum(_bytes(p) for p in model.parameters())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def grad_bytes(model: nn.Module) -> int:
    return sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def _expected_module_keys(blocks: int, nested: bool = False) -> list[str]:
    """Oracle for module keys: the unwrapped model's own names of what gets sharded."""
    from fsdp_mem_otel.demo import Block, BlockModel, InnerLinear

    kinds = (Block, InnerLinear) if nested else (Block,)
    plain = BlockModel(blocks, 8)
    return ["<root>"] + [n for n, m in plain.named_modules() if isinstance(m, kinds)]


def block_param_bytes() -> int:
    """Unsharded bytes of one Block's parameters, from the unwrapped module."""
    from fsdp_mem_otel.demo import Block

    return sum(p.numel() * p.element_size() for p in Block(WIDTH).parameters())


def run_config(opts_dict: dict[str, Any], steps: int = 3, micro_batches: int = 1, mode: str = "light",
               deep_every: int = 0, shadow_deep: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps under the tracker; return reports and oracles.

    ``shadow_deep`` attaches a second, deep-mode tracker to the same model, so both measure the
    very same steps (for comparing light mode with deep mode).
    """
    opts = WrapOptions(**opts_dict)
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, opts)
    tracker = FSDPMemoryTracker(model, opt, mode=mode, deep_every=deep_every)
    shadow = FSDPMemoryTracker(model, opt, mode="deep") if shadow_deep else None
    reports, shadow_reports = [], []
    with tracker:
        if shadow is not None:
            shadow.attach()
        for step in range(steps):
            settle()
            x = make_batch(step, BATCH, WIDTH, rank)
            if shadow is not None:
                shadow.track_inputs(x)
            train_step(model, opt, x, micro_batches=micro_batches, on_inputs=tracker.track_inputs)
            reports.append(tracker.step().to_dict())
            if shadow is not None:
                shadow_reports.append(shadow.step().to_dict())
        if shadow is not None:
            shadow.detach()
    return {
        "keys": tracker.module_keys,
        "reports": reports,
        "shadow_reports": shadow_reports,
        "errors_total": tracker.errors_total + (shadow.errors_total if shadow else 0),
        "oracle": {
            "sharded_param": sharded_param_bytes(model),
            "optimizer_state": optimizer_state_bytes(opt),
            "sharded_grad": grad_bytes(model),
            "block_params": block_param_bytes(),
            "param_names": [n for n, _ in model.named_parameters()],
        },
    }


def run_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run_config(**c) for c in configs]


def _upstream_snapshot(snap: dict[Any, dict[Any, int]]) -> dict[str, dict[str, int]]:
    """Upstream's {device: {_FSDPRefType: bytes}} in our key names."""
    names = {
        "Sharded Param": "sharded_param",
        "Unsharded Param": "unsharded_param",
        "Buffer": "buffer",
        "Sharded Grad": "sharded_grad",
        "Unsharded Grad": "unsharded_grad",
        "Activation": "activation",
        "Temp": "temp",
        "All Gather": "all_gather",
        "Reduce Scatter": "reduce_scatter",
        "OptState": "optimizer_state",
        "Inputs": "inputs",
        "Total": TOTAL,
    }
    out = {}
    for dev, cats in snap.items():
        out[str(dev)] = {names[getattr(k, "value", k)]: int(v) for k, v in cats.items()}
    return out


def parity_with_upstream(opts_dict: dict[str, Any]) -> dict[str, Any]:
    """After one warm-up step, measure one step with upstream FSDPMemTracker, our deep tracker and
    our light tracker all at once (ours attached inside upstream's context, so our hooks run
    first and our windows enclose upstream's): the three see the very same step.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    x = make_batch(0, BATCH, WIDTH, rank)
    train_step(model, opt, x)

    settle()
    upstream = FSDPMemTracker(model, opt)
    upstream.track_inputs((x,))
    with upstream:
        deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
        light = FSDPMemoryTracker(model, opt, mode="light").attach()
        deep.track_inputs(x)
        light.track_inputs(x)
        train_step(model, opt, x)
        light_report, deep_report = light.step().to_dict(), deep.step().to_dict()
        light.detach()
        deep.detach()
    up_modules = {}
    for stats in upstream.memory_tracking.values():
        if not hasattr(stats, "snapshots"):
            continue
        key = stats.mod_fqn.split(".", 1)[1] if "." in stats.mod_fqn else "<root>"
        up_modules[key] = {
            state.value: [_upstream_snapshot(s) for s in calls] for state, calls in stats.snapshots.items()
        }
    return {
        "deep": deep_report,
        "light": light_report,
        "upstream_peak": _upstream_snapshot(upstream.get_tracker_snapshot("peak")),
        "upstream_modules": up_modules,
        "errors": deep.errors_total + light.errors_total,
    }


def containment(opts_dict: dict[str, Any]) -> dict[str, Any]:
    """Break the tracker's own code mid-run; training must go on and match an untracked twin."""
    rank = torch.distributed.get_rank()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("fsdp_mem_otel").addHandler(Keep())
    losses = {}
    flaky_exporter, recorder = _FlakyExporter(fail_steps=2), _Recorder()
    for tracked in (False, True):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        tracker = FSDPMemoryTracker(model, opt, mode="light", deep_every=2,
                                    exporters=[flaky_exporter, recorder]) if tracked else None
        if tracker is not None:
            tracker.attach()
            tracker.ledger.snapshot = _flaky(tracker.ledger.snapshot)  # type: ignore[method-assign]
        run = []
        for step in range(4):
            x = make_batch(step, BATCH, WIDTH, rank)
            run.append(train_step(model, opt, x))
            if tracker is not None:
                tracker.step()
        losses[tracked] = run
        if tracker is not None:
            errors = tracker.errors_total
            tracker.detach()
    return {
        "untracked": losses[False],
        "tracked": losses[True],
        "errors_total": errors,
        "logged": sum(1 for r in records if "injected tracker failure" in str(r.msg % r.args if r.args else r.msg)),
        "exporter_logged": sum(1 for r in records if "exporter fault" in str(r.msg % r.args if r.args else r.msg)),
        "flaky_received": flaky_exporter.received,
        "recorded_steps": recorder.steps,
    }


class _FlakyExporter:
    """Raises for its first ``fail_steps`` reports, then works (the fault clears)."""

    def __init__(self, fail_steps: int) -> None:
        self.fail_steps = fail_steps
        self.received: list[int] = []

    def export(self, report: Any) -> None:
        if len(self.received) < self.fail_steps:
            self.received.append(-report.step)
            raise RuntimeError("exporter fault (injected)")
        self.received.append(report.step)

    def shutdown(self) -> None:
        pass


class _Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def export(self, report: Any) -> None:
        self.steps.append(report.step)

    def shutdown(self) -> None:
        pass


def _flaky(real: Any) -> Any:
    """``real`` that raises on every third call."""
    calls = {"n": 0}

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected tracker failure")
        return real()

    return flaky


def disable_after_errors(opts_dict: dict[str, Any]) -> dict[str, Any]:
    """With max_errors=5 and a ledger that always fails, the tracker detaches itself cleanly."""
    from fsdp_mem_otel.config import TrackerConfig

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    tracker = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=5))
    tracker.attach()

    def broken() -> dict[str, dict[str, int]]:
        raise RuntimeError("always broken")

    tracker.ledger.snapshot = broken  # type: ignore[method-assign]
    for step in range(3):
        train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
        tracker.step()
    # a broken exporter, however often it fails, does not switch measuring off
    exporter_broken = FSDPMemoryTracker(model, opt, config=TrackerConfig(max_errors=3),
                                        exporters=[_FlakyExporter(fail_steps=10**6)]).attach()
    for step in range(5):
        train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
        exporter_broken.step()
    exporter_broken.detach()
    return {"disabled": tracker.disabled, "attached": tracker.attached, "errors_total": tracker.errors_total,
            "exporter_broken": [exporter_broken.disabled, exporter_broken.errors_total]}


def as_dict(opts: WrapOptions) -> dict[str, Any]:
    return dataclasses.asdict(opts)


def _fsdp_fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Identity of every hook, patched attribute and global the adapters touch."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    print_ids: dict[str, Any] = {}
    for path, m in model.named_modules():
        print_ids[f"{path}:pre"] = [id(h) for h in m._forward_pre_hooks.values()]
        print_ids[f"{path}:post"] = [id(h) for h in m._forward_hooks.values()]
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None:
            for i, group in enumerate(state()._fsdp_param_groups):
                assert isinstance(group, FSDPParamGroup)
                print_ids[f"{path}:group{i}"] = sorted(k for k in vars(group) if callable(vars(group)[k]))
    for name in ("_pre_backward_hook", "_post_backward_hook", "_post_backward_reshard_only_hook",
                 "_post_backward_final_callback", "_unshard", "_reshard"):
        print_ids[f"runtime:{name}"] = id(getattr(_runtime_utils, name))
    print_ids["resize_"] = id(torch.UntypedStorage.resize_)
    print_ids["dispatch_mode"] = repr(_get_current_dispatch_mode())
    print_ids["opt_hooks"] = [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)]
    return print_ids


def detach_restores(opts_dict: dict[str, Any]) -> dict[str, Any]:
    """Fingerprint before attach and after detach (light and deep); re-attach works; two
    trackers on two models stay apart; training with and without trackers is bitwise equal."""
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))  # lazy init done
    before = _fsdp_fingerprint(model, opt)
    after = {}
    for mode in ("light", "deep"):
        tracker = FSDPMemoryTracker(model, opt, mode=mode)
        with tracker:
            during = _fsdp_fingerprint(model, opt)
            train_step(model, opt, make_batch(1, BATCH, WIDTH, rank))
            tracker.step()
        after[mode] = _fsdp_fingerprint(model, opt)
    again = FSDPMemoryTracker(model, opt)
    with again:
        train_step(model, opt, make_batch(2, BATCH, WIDTH, rank))
        reattached = again.step().to_dict()

    # two models, two trackers, interleaved steps: each sees only its own modules
    other, other_opt = build(BLOCKS + 1, WIDTH, WrapOptions(**opts_dict), seed=1)
    t1, t2 = FSDPMemoryTracker(model, opt).attach(), FSDPMemoryTracker(other, other_opt, mode="deep").attach()
    train_step(model, opt, make_batch(3, BATCH, WIDTH, rank))
    r1 = t1.step().to_dict()
    train_step(other, other_opt, make_batch(3, BATCH, WIDTH, rank))
    r2 = t2.step().to_dict()
    t2.detach()
    t1.detach()
    return {
        "before": before, "during": during, "after": after, "reattached": reattached,
        "r1_modules": sorted(k for k, m in r1["modules"].items() if m["snapshots"]),
        "r2_modules": sorted(k for k, m in r2["modules"].items() if m["snapshots"]),
        "r1_keys": sorted(t1.module_keys), "r2_keys": sorted(t2.module_keys),
        "errors": t1.errors_total + t2.errors_total + again.errors_total,
        "final": _fsdp_fingerprint(model, opt),
    }


def bitwise_unchanged(opts_dict: dict[str, Any], steps: int = 20) -> dict[str, Any]:
    """Losses and final parameters with no tracker and under light, deep and deep_every=3."""
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    for variant in ("none", "light", "deep", "deep_every"):
        model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
        tracker = None
        if variant != "none":
            tracker = FSDPMemoryTracker(model, opt, mode="deep" if variant == "deep" else "light",
                                        deep_every=3 if variant == "deep_every" else 0).attach()
        losses = []
        for step in range(steps):
            x = make_batch(step, BATCH, WIDTH, rank)
            losses.append(train_step(model, opt, x, micro_batches=2))
            if tracker is not None:
                tracker.step()
        if tracker is not None:
            tracker.detach()
        params = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
        out[variant] = {"losses": losses, "params": [p.clone().numpy().tobytes() for p in params],
                        "errors": tracker.errors_total if tracker else 0}
    return out


def oom_mid_step(opts_dict: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """Raise torch.OutOfMemoryError inside layers.1's forward or backward on step 2 (both ranks),
    recover as FSDP2 documents (reset_iter_state), and keep training under the tracker."""
    from fsdp_mem_otel.demo import Block

    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    block = [m for m in model.modules() if isinstance(m, Block)][1]
    armed = {"on": False}

    def boom(*_: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    tracker = FSDPMemoryTracker(model, opt, deep_every=2).attach()
    if where == "forward":  # runs after FSDP's unshard and the tracker's after_pre_forward
        block.register_forward_pre_hook(boom)
    else:  # fires after FSDP's pre-backward for this block
        block.register_forward_hook(lambda m, i, out: out.register_hook(lambda g: boom()) and None)
    reports = []
    for step in range(4):
        settle()
        armed["on"] = step == 1
        x = make_batch(step, BATCH, WIDTH, rank)
        try:
            with tracker.step_scope():
                train_step(model, opt, x, on_inputs=tracker.track_inputs)
        except torch.OutOfMemoryError:
            model.reset_iter_state()  # type: ignore[operator]
            opt.zero_grad(set_to_none=True)
        reports.append(tracker.step().to_dict())
    tracker.detach()
    return reports


ODD_NAMES = ('blk "quoted"', "blk{brace}=1", "blk\\back", "blk-é-ü", "blk\nnewline")


class OddNames(nn.Module):
    """Blocks under names with characters special to Prometheus labels and JSON."""

    def __init__(self) -> None:
        super().__init__()
        from fsdp_mem_otel.demo import Block

        self.blocks = nn.ModuleDict({name: Block(WIDTH) for name in ODD_NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks.values():
            x = b(x)
        return x


def edge_cases(fsdp: int) -> dict[str, Any]:
    """step() with no forward, twice in a row, from another thread; odd module names."""
    import json
    import threading

    from fsdp_mem_otel.demo import Block

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model: nn.Module = OddNames()
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks.values():  # type: ignore[operator]
            fully_shard(b)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters())
    foreign_error = ""
    try:
        FSDPMemoryTracker(model, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    except ValueError as exc:
        foreign_error = str(exc)
    tracker = FSDPMemoryTracker(model, opt).attach()
    empty1 = tracker.step().to_dict()
    empty2 = tracker.step().to_dict()
    thread_error: list[str] = []

    def from_thread() -> None:
        try:
            tracker.step()
        except RuntimeError as exc:
            thread_error.append(str(exc))

    t = threading.Thread(target=from_thread)
    t.start()
    t.join()
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))
    report = tracker.step()
    text = report.to_json()
    tracker.detach()
    return {
        "empty": [empty1, empty2],
        "thread_error": thread_error,
        "keys": tracker.module_keys,
        "json_keys": sorted(json.loads(text)["modules"]),
        "report": report.to_dict(),
        "errors": tracker.errors_total,
        "foreign_error": foreign_error,
    }


def soak(light_steps: int, deep_steps: int) -> dict[str, Any]:
    """Many steps on a tiny model: the tracker's own tables and the process RSS must stay flat."""
    import psutil

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

    rank = torch.distributed.get_rank()
    model, opt = build(2, 16, WrapOptions(fsdp=2))
    proc = psutil.Process()
    samples = []
    for mode, steps in (("light", light_steps), ("deep", deep_steps)):
        exporter = PrometheusExporter(http=False)
        tracker = FSDPMemoryTracker(model, opt, mode=mode, exporters=[exporter]).attach()
        x = make_batch(0, 4, 16, rank)
        for step in range(steps):
            train_step(model, opt, x, on_inputs=tracker.track_inputs)
            tracker.step()
            if step in (steps // 10, steps - 1):
                gc.collect()
                samples.append({
                    "mode": mode, "step": step, "rss": proc.memory_info().rss,
                    "ledger": len(tracker.ledger), "opt_tensors": len(tracker._opt_tensors),
                    "windows": tracker.ledger.open_windows, "logged": tracker.failures.kinds_logged,
                    "errors": tracker.errors_total,
                    "series": sum(len(f.samples) for f in exporter.registry.collect()),
                })
        tracker.close()
    return {"samples": samples}


def from_env_run(base_port: int, directory: str) -> dict[str, Any]:
    """FSDPMemoryTracker.from_env() in a job configured only through environment variables."""
    import os
    import urllib.request

    rank = torch.distributed.get_rank()
    os.environ.update({
        "FSDP_MEM_OTEL_MODE": "light", "FSDP_MEM_OTEL_DEEP_EVERY": "2", "FSDP_MEM_OTEL_JOB": "envjob",
        "FSDP_MEM_OTEL_PROMETHEUS_PORT": str(base_port), "FSDP_MEM_OTEL_PROMETHEUS_ADDR": "127.0.0.1",
        "FSDP_MEM_OTEL_JSONL": os.path.join(directory, "run-{rank}.jsonl"),
    })
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    tracker = FSDPMemoryTracker.from_env(model, opt)
    reports = []
    with tracker:
        for step in range(2):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank))
            reports.append(tracker.step().to_dict())
        torch.distributed.barrier()
        with urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10) as r:
            text = r.read().decode()
    tracker.close()
    return {"modes": [r["mode"] for r in reports], "peak": reports[-1]["peak"]["cpu"]["total"], "text": text,
            "kinds": sorted(type(e).__name__ for e in tracker.exporters)}


SENTINEL = 0.123456789


def no_tensor_data(directory: str) -> dict[str, Any]:
    """Parameters and inputs all hold SENTINEL; return what every exporter emitted, as text."""
    import os

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fsdp_mem_otel.exporters.jsonl import JSONLExporter
    from fsdp_mem_otel.exporters.otel import OTelSpanExporter
    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter

    rank = torch.distributed.get_rank()
    model, _ = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    spans = InMemorySpanExporter()
    prom = PrometheusExporter(http=False, detail=True)
    path = os.path.join(directory, f"rank{rank}.jsonl")
    jsonl = JSONLExporter(path)
    otel = OTelSpanExporter(span_exporter=spans)
    tracker = FSDPMemoryTracker(model, opt, mode="deep", exporters=[prom, jsonl, otel])
    with tracker:
        x = torch.full((BATCH, WIDTH), SENTINEL)
        train_step(model, opt, x, on_inputs=tracker.track_inputs)
        tracker.step()
    tracker.close()
    from prometheus_client import generate_latest

    span_text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    with open(path) as f:
        jsonl_text = f.read()
    return {"prometheus": generate_latest(prom.registry).decode(), "spans": span_text, "jsonl": jsonl_text}
