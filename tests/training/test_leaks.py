"""The leak detector driven directly with step-end breakdowns (no FSDP, no ranks)."""

from __future__ import annotations

import pytest

from fsdp_mem_otel.schema import CATEGORY_KEYS
from fsdp_mem_otel.training.leaks import LeakWatch


def _end(**bytes_: int) -> dict[str, dict[str, int]]:
    cats = dict.fromkeys(CATEGORY_KEYS, 0)
    cats.update(bytes_)
    cats["total"] = sum(v for k, v in cats.items() if k != "total")
    return {"cpu": cats}


def _run(ends: list[dict[str, dict[str, int]]], held: dict[str, int] | None = None) -> list[object]:
    watch = LeakWatch(window=30)
    return [watch.observe(e, held or {}) for e in ends]


def test_a_steady_growth_is_reported_with_its_slope_after_five_rises() -> None:
    reports = _run([_end(sharded_param=1000, activation=100 * i) for i in range(12)])
    assert reports[:9] == [None] * 9  # judged from the 10th step end on
    last = reports[-1]
    assert last is not None and last.growing == {"activation": pytest.approx(100.0), "total": pytest.approx(100.0)}
    assert last.steps == 12


def test_growth_every_other_step_counts_too() -> None:
    reports = _run([_end(inputs=64 * (i // 2)) for i in range(14)])
    assert reports[-1] is not None and reports[-1].growing["inputs"] == pytest.approx(32.0, rel=0.1)


@pytest.mark.parametrize("shape", ["plateau_after_warm_up", "optimizer_state_at_step_1", "lr_warm_up", "noisy"])
def test_healthy_runs_stay_quiet(shape: str) -> None:
    if shape == "plateau_after_warm_up":  # allocator and caches fill for three steps, then flat
        ends = [_end(activation=min(i, 3) * 500) for i in range(60)]
    elif shape == "optimizer_state_at_step_1":
        ends = [_end(sharded_param=4000, optimizer_state=0 if i == 0 else 8000) for i in range(60)]
    elif shape == "lr_warm_up":  # the learning rate changes, memory does not
        ends = [_end(sharded_param=4000, optimizer_state=8000) for _ in range(60)]
    else:  # dynamic shapes: up and down
        ends = [_end(activation=1000 + (i * 37) % 200) for i in range(60)]
    assert all(r is None for r in _run(ends))


def test_held_tensors_are_named_largest_first() -> None:
    held = {f"layers.{i}": 10 * i for i in range(12)} | {"idle": 0}
    report = _run([_end()], held)[0]
    assert report is not None and not report.growing
    assert list(report.held) == [f"layers.{i}" for i in range(11, 3, -1)]  # the top 8
    assert report.held_elsewhere == 10 * (1 + 2 + 3)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        LeakWatch(window=3)
    with pytest.raises(ValueError, match="min_steps"):
        LeakWatch(window=10, min_steps=6)
