"""Light mode on models whose memory depends on the batch's content while every input shape stays
the same, FSDP2 and FSDP1 (``use_orig_params=True``) on 2 real gloo ranks, STEPS steps of Adam
(tests/content_models.py): adaptive depth with shared weights, a conditional sub-layer with
parameters of its own, top-1 MoE whose per-expert token counts the batch decides (with and without
capacity dropping), top-1 MoE routed by its learnt gate with capacity dropping (other counts on
every step and rank), LayerDrop decided at the root, a block that returns its input, and a steady
control. Every scenario runs under both generations (FSDP1 copes with the skipped module and the
unused parameters), all of a generation in one run_ranks call.

Three trackers are attached to the same model over the same steps:

(a) a light tracker attached for the whole run, default config: what is tested;
(b) a deep tracker: at every boundary state of every module (``STATES[:10]``) and at the step's
    end, each category light mode counts exactly (EXACT_IN_LIGHT, as in test_light_groups.py)
    must equal deep mode's, except on a step on which light mode says it fell back
    (``fallback_groups`` grew). Not at the peaks: light mode's peaks are taken at hook boundaries
    and saved tensors, deep mode's at every op, so they are other moments (on the steady control
    the root's ``peak_forward`` holds 21248 bytes of ``unsharded_param`` in light mode, 4224 in
    deep mode);
(c) a light tracker made and attached at the start of each step and detached after its
    ``step()``: it knows nothing of earlier steps. (a) must report what (c) reports at every
    state of every module, the peaks included, in every category (``temp``, ``activation`` and
    ``total`` too), and the step's peak and end: on the steady control the two agree in all of
    them, so none is left out. (c) itself is held to (b) like (a), so that a failure says which
    of the two light trackers is off.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_mem_otel.schema import CATEGORY_KEYS, STATES
from fsdp_mem_otel.training.tracker import FSDPMemoryTracker
from tests.content_models import BLOCK_TYPES, SCENARIOS, STEPS, build_model, make_batch
from tests.dist import RANKS, run_ranks

EXACT_IN_LIGHT = ("sharded_param", "unsharded_param", "buffer", "sharded_grad", "unsharded_grad",
                  "all_gather", "reduce_scatter", "optimizer_state", "inputs")
BOUNDARY_STATES = STATES[:10]  # the 8 boundary states and the checkpoint-recompute ones


@dataclass
class Run:
    """One scenario on one rank: each tracker's reports (``to_dict()``), step by step."""

    light: list[dict[str, Any]] = field(default_factory=list)  # (a)
    deep: list[dict[str, Any]] = field(default_factory=list)  # (b)
    fresh: list[dict[str, Any]] = field(default_factory=list)  # (c)
    errors: int = 0

    def __repr__(self) -> str:  # a failing test shows its fixture: not every report
        return f"Run({len(self.light)} steps, {self.errors} errors)"


def _wrap(model: nn.Module, fsdp: int) -> nn.Module:
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(set(BLOCK_TYPES)), use_orig_params=True,
                                    device_id=torch.device("cpu"))


def _train(fsdp: int, name: str) -> Run:
    rank = torch.distributed.get_rank()
    model = _wrap(build_model(name), fsdp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    light = FSDPMemoryTracker(model, opt).attach()
    deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
    run = Run()
    for step in range(STEPS):
        gc.collect()  # FSDP's cyclic garbage freed here, not inside a step (the collector is off)
        gc.freeze()  # and what survives is not walked again at the next step
        fresh = FSDPMemoryTracker(model, opt).attach()
        opt.zero_grad(set_to_none=True)
        x, target = make_batch(name, step, rank)
        for tracker in (light, deep, fresh):
            tracker.track_inputs((x, target))
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
        run.light.append(light.step().to_dict())
        run.deep.append(deep.step().to_dict())
        run.fresh.append(fresh.step().to_dict())
        fresh.detach()
        run.errors += fresh.errors_total
    light.detach()
    deep.detach()
    run.errors += light.errors_total + deep.errors_total
    return run


def train_all(fsdp: int, names: list[str]) -> dict[str, Run]:
    """Rank body: every scenario, one after the other."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2 on the pass-through block
    gc.disable()
    try:
        return {name: _train(fsdp, name) for name in names}
    finally:
        gc.unfreeze()
        gc.enable()


def _differences(ours: dict[str, Any], theirs: dict[str, Any], categories: tuple[str, ...],
                 states: tuple[str, ...], parts: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """(where, category, ours, theirs) wherever the two reports disagree."""
    out: list[tuple[Any, ...]] = []

    def compare(where: tuple[Any, ...], a: dict[str, Any], b: dict[str, Any]) -> None:
        for dev in sorted(a.keys() | b.keys()):
            for cat in categories:
                va, vb = a.get(dev, {}).get(cat, 0), b.get(dev, {}).get(cat, 0)
                if va != vb:
                    out.append((*where, str(cat), va, vb))

    for key in sorted(ours["modules"].keys() | theirs["modules"].keys()):
        for state in states:
            a = ours["modules"].get(key, {}).get("snapshots", {}).get(state, [])
            b = theirs["modules"].get(key, {}).get("snapshots", {}).get(state, [])
            if len(a) != len(b):
                out.append((key, str(state), "calls", len(a), len(b)))
            for i, (sa, sb) in enumerate(zip(a, b, strict=False)):  # a count that differs is one difference
                compare((key, str(state), i), sa, sb)
    for part in parts:
        compare((part,), ours[part], theirs[part])
    return out


Differences = dict[int, tuple[int, list[tuple[Any, ...]]]]  # step (1-based) -> how many, the first ones


def _flagged(light: list[dict[str, Any]]) -> set[int]:
    """The steps (1-based) that say on themselves that light mode fell back (``fallback_groups`` grew)."""
    counts = [0] + [r["fallback_groups"] for r in light]
    return {step for step in range(1, len(counts)) if counts[step] > counts[step - 1]}


def _against_deep(light: list[dict[str, Any]], deep: list[dict[str, Any]]) -> Differences:
    """Where light's exact categories differ from deep's, on the steps where light did not say it
    fell back."""
    bad: Differences = {}
    flagged = _flagged(light)
    for step, (ours, theirs) in enumerate(zip(light, deep, strict=True), 1):
        diffs = _differences(ours, theirs, EXACT_IN_LIGHT, BOUNDARY_STATES, ("current",))
        if diffs and step not in flagged:
            bad[step] = (len(diffs), diffs[:4])
    return bad


def _say(bad: Differences) -> str:
    """Which steps differ, in how many figures, and the first of them: (where, category, ours, theirs)."""
    first = min(bad)
    return (f"steps {sorted(bad)} differ in {[n for n, _ in bad.values()]} figures; step {first}: "
            + "; ".join(map(str, bad[first][1])))


@pytest.fixture(scope="module", params=[2, 1], ids=["fsdp2", "fsdp1"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Run]]:
    """Per rank: scenario -> Run, for one FSDP generation."""
    return run_ranks(train_all, request.param, list(SCENARIOS), timeout=600)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_light_equals_deep_in_its_exact_categories(runs: list[dict[str, Run]], name: str, rank: int) -> None:
    run = runs[rank][name]
    assert run.errors == 0
    assert [r["mode"] for r in run.deep] == ["deep"] * STEPS
    bad = _against_deep(run.light, run.deep)
    assert not bad, _say(bad)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_tracker_fresh_each_step_equals_deep_in_its_exact_categories(runs: list[dict[str, Run]], name: str,
                                                                       rank: int) -> None:
    run = runs[rank][name]
    bad = _against_deep(run.fresh, run.deep)
    assert not bad, _say(bad)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_light_reports_what_a_tracker_fresh_each_step_reports(runs: list[dict[str, Run]], name: str, rank: int,
                                                               request: pytest.FixtureRequest) -> None:
    run = runs[rank][name]
    assert [r["mode"] for r in run.light + run.fresh] == ["light"] * 2 * STEPS
    flagged = _flagged(run.light)  # a step that says on itself it fell back may differ
    # FSDP2 only (FSDP1's groups are tracked storages): a parameter whose gradient comes and goes
    # makes its group fall back, once; nothing else does
    fsdp2 = request.node.callspec.params["runs"] == 2
    assert len(flagged) == (name == "conditional_sublayer" and fsdp2), flagged
    bad: Differences = {}
    for step, (ours, fresh) in enumerate(zip(run.light, run.fresh, strict=True), 1):
        diffs = _differences(ours, fresh, CATEGORY_KEYS, STATES, ("peak", "current"))
        if diffs and step not in flagged:
            bad[step] = (len(diffs), diffs[:4])
    assert not bad, _say(bad)
