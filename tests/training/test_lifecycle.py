"""Attach/detach leave FSDP exactly as they found it, and training is bitwise unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.dist import run_ranks
from tests.oracles import BATCH, BLOCKS, WIDTH, fsdp_fingerprint


@dataclass(frozen=True)
class DetachResult:
    before: dict[str, Any]  # fingerprints (tests.oracles.fsdp_fingerprint)
    during: dict[str, Any]
    after: dict[str, dict[str, Any]]  # mode -> fingerprint after that mode's tracker detached
    reattached: dict[str, Any]  # a report of a tracker attached again afterwards
    r1_modules: list[str]  # modules with snapshots in each of two trackers on two models
    r2_modules: list[str]
    r1_keys: list[str]  # and each tracker's module keys
    r2_keys: list[str]
    errors: int
    final: dict[str, Any]


def detach_restores(opts_dict: dict[str, Any]) -> DetachResult:
    """Fingerprint before attach and after detach (light and deep); re-attach works; two
    trackers on two models stay apart; training with and without trackers is bitwise equal."""
    rank = torch.distributed.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(**opts_dict))
    train_step(model, opt, make_batch(0, BATCH, WIDTH, rank))  # lazy init done
    before = fsdp_fingerprint(model, opt)
    after = {}
    for mode in ("light", "deep"):
        tracker = FSDPMemoryTracker(model, opt, mode=mode)
        with tracker:
            during = fsdp_fingerprint(model, opt)
            train_step(model, opt, make_batch(1, BATCH, WIDTH, rank))
            tracker.step()
        after[mode] = fsdp_fingerprint(model, opt)
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
    return DetachResult(
        before=before, during=during, after=after, reattached=reattached,
        r1_modules=sorted(k for k, m in r1["modules"].items() if m["snapshots"]),
        r2_modules=sorted(k for k, m in r2["modules"].items() if m["snapshots"]),
        r1_keys=sorted(t1.module_keys), r2_keys=sorted(t2.module_keys),
        errors=t1.errors_total + t2.errors_total + again.errors_total,
        final=fsdp_fingerprint(model, opt),
    )


@dataclass(frozen=True)
class VariantRun:
    losses: list[float]
    params: list[bytes]  # each final parameter (this rank's shard), as raw bytes
    errors: int  # the tracker's errors_total (0 without one)


@dataclass(frozen=True)
class BitwiseResult:
    untracked: VariantRun
    tracked: dict[str, VariantRun]  # "light", "deep", "deep_every" -> that run


def bitwise_unchanged(opts_dict: dict[str, Any], steps: int = 20) -> BitwiseResult:
    """Losses and final parameters with no tracker and under light, deep and deep_every=3."""
    rank = torch.distributed.get_rank()
    out: dict[str, VariantRun] = {}
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
        out[variant] = VariantRun(losses=losses, params=[p.clone().numpy().tobytes() for p in params],
                                  errors=tracker.errors_total if tracker else 0)
    untracked = out.pop("none")
    return BitwiseResult(untracked=untracked, tracked=out)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def detached(request: pytest.FixtureRequest) -> list[DetachResult]:
    return run_ranks(detach_restores, {"fsdp": request.param})


def test_detach_restores_every_hook_and_patch(detached: list[DetachResult], rank: int) -> None:
    res = detached[rank]
    assert res.during != res.before  # the fingerprint does see our hooks
    assert res.after["light"] == res.before
    assert res.after["deep"] == res.before
    assert res.final == res.before
    assert res.before["dispatch_mode"] == "None"
    assert res.reattached["modules"]
    assert res.r1_modules == res.r1_keys and res.r2_modules == res.r2_keys
    assert len(res.r2_keys) == len(res.r1_keys) + 1
    assert res.errors == 0


# (fsdp, checkpointed). fsdp_inside_checkpoint: FSDP modules recomputed in backward, where light
# mode's saved-tensor hooks chain to checkpointing's own
BITWISE = [(1, False), (2, False), (1, True), (2, True)]


@pytest.fixture(scope="module", params=BITWISE,
                ids=[f"fsdp{fsdp}-{'fsdp_inside_checkpoint' if ckpt else 'plain'}" for fsdp, ckpt in BITWISE])
def bitwise(request: pytest.FixtureRequest) -> list[BitwiseResult]:
    fsdp, checkpointed = request.param
    opts = {"fsdp": fsdp, "nested": True, "inner_checkpoint": True} if checkpointed else {"fsdp": fsdp}
    return run_ranks(bitwise_unchanged, opts, 5 if checkpointed else 20)


@pytest.mark.parametrize("variant", ["light", "deep", "deep_every"])
def test_training_is_bitwise_unchanged(bitwise: list[BitwiseResult], rank: int, variant: str) -> None:
    res = bitwise[rank]
    assert res.tracked[variant].losses == res.untracked.losses, variant
    assert res.tracked[variant].params == res.untracked.params, variant
    assert res.tracked[variant].errors == 0
