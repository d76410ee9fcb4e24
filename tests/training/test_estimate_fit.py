"""``fsdp-mem-otel estimate --fit CAPACITY`` and ``--compare-options`` (tools/estimate_fit.py).

The oracle of ``--fit`` is the tracker's deep-mode measurement of real 2-rank FSDP2 runs (gloo,
CPU) of two adjacent batch sizes, B and B + 1, built and trained by test_estimate.py's rank body:
the capacity is chosen between them (with the 5% margin), and the command must answer B. The
search itself is checked against peak functions whose answer is known by brute force; the options
table against separate ``estimate()`` runs of each variant, figure for figure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fsdp_mem_otel.schema import CATEGORIES, TOTAL, StepReport
from fsdp_mem_otel.tools import estimate_fit
from fsdp_mem_otel.tools.estimate import EstimateConfig, estimate
from fsdp_mem_otel.tools.estimate_cli import estimate_main
from fsdp_mem_otel.tools.estimate_fit import (
    FitError,
    OptionRow,
    compare_options,
    device_peak,
    fit,
    margin_bytes,
    options_table,
    parse_size,
)
from tests.dist import run_ranks
from tests.training.test_estimate import real_runs

ROOT = Path(__file__).resolve().parents[2]
#: the job fitted: the demo model, 2 blocks of width 64, on 2 ranks; B rows fit, B + 1 do not
SMALL = {"world_size": 2, "blocks": 2, "width": 64}
B = 33


def _config(batch: int) -> EstimateConfig:
    return EstimateConfig(batch_shape=(batch, SMALL["width"]), **SMALL)


@pytest.fixture(scope="module")
def real_peaks() -> dict[int, int]:
    """Rank 0's measured step peak of batches B and B + 1 on two real ranks: the least disturbed
    of test_estimate.MEASURED_STEPS steps (gloo's late frees only ever add memory)."""
    per_rank = run_ranks(real_runs, [asdict(_config(b)) for b in (B, B + 1)], timeout=600)
    return {b: min(StepReport.from_dict(r).peak_total("cpu") for r in reports)
            for b, reports in zip((B, B + 1), per_rank[0], strict=True)}


def test_fit_answers_the_batch_that_fits_by_the_real_runs_measurement(real_peaks: dict[int, int]) -> None:
    fits, too_big = real_peaks[B], real_peaks[B + 1]
    assert fits < too_big, real_peaks
    # a capacity whose 95% lies between the two measured peaks
    capacity = math.ceil((fits + too_big) / 2 / 0.95)
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_mem_otel", "estimate", "--world-size", "2", "--blocks", "2", "--width", "64",
         "--fit", str(capacity), "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    margin = result["margin"]
    assert margin == math.ceil(capacity * 5 / 100) and result["capacity"] == capacity  # the default 5%
    # the tracker's own measurement of real runs: B fits with the margin, B + 1 does not
    assert fits + margin <= capacity < too_big + margin, (real_peaks, capacity, margin)
    assert (result["value"], result["next_value"], result["exact"], result["stop"]) == (B, B + 1, True, "bracketed")
    assert result["batch_shape"] == [B, 64]
    assert result["peak"] + margin <= capacity < result["next_peak"] + margin
    assert len(result["probes"]) <= 20 and [p["value"] for p in result["probes"]][:2] == [1, 2]
    # progress: one line per probe, the value, the peak and the verdict
    lines = [x for x in done.stderr.splitlines() if x.startswith("probe ")]
    assert len(lines) == len(result["probes"]), done.stderr
    assert lines[-1].startswith(f"probe {len(lines)}/20: batch ") and "margin" in done.stderr
    assert sum(x.endswith(": fits") for x in lines) == sum(p["fits"] for p in result["probes"])


def _fake_estimates(peak_of: Any, monkeypatch: pytest.MonkeyPatch, axis: int = 0, fail_at: int | None = None
                    ) -> list[int]:
    """Have fit() call ``peak_of(value)`` instead of estimating; returns the values it asked for."""
    asked: list[int] = []

    def fake(config: EstimateConfig) -> Any:
        assert config.batch_shape is not None
        value = config.batch_shape[axis]
        asked.append(value)
        if value == fail_at:
            raise RuntimeError("out of positions")
        return SimpleNamespace(peak={"cpu": {TOTAL: peak_of(value)}})

    monkeypatch.setattr(estimate_fit, "estimate", fake)
    return asked


PEAKS = {
    "linear": lambda b: 300_000 + 2_320 * b,
    "convex": lambda b: 2_000_000 + 900 * b + 3 * b * b,  # attention's seq^2
    "in 512-byte blocks": lambda b: 512 * math.ceil((1_000_000 + 700 * b) / 512),
    "flat, then linear": lambda b: 5_000_000 + max(0, b - 300) * 4_096,
}


@pytest.mark.parametrize("name", list(PEAKS))
def test_search_finds_the_largest_value_that_fits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    peak_of = PEAKS[name]
    for capacity in (peak_of(1) + 10_000, peak_of(37) + 60_000, peak_of(1_000) + 123_457, peak_of(70_000) + 1):
        asked = _fake_estimates(peak_of, monkeypatch)
        r = fit(_config(8), capacity, margin=0)
        best = max(v for v in range(1, 80_000) if peak_of(v) <= capacity)  # brute force
        assert (r.value, r.next_value, r.stop, r.exact) == (best, best + 1, "bracketed", True), (name, capacity)
        assert (r.peak, r.next_peak) == (peak_of(best), peak_of(best + 1))
        assert len(asked) == len(set(asked)) == len(r.probes) <= 2 * math.log2(best + 1) + 6, (name, asked)


def test_search_stops_at_the_upper_bound_the_probe_budget_and_when_nothing_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    peak_of = PEAKS["linear"]
    _fake_estimates(peak_of, monkeypatch)
    r = fit(_config(8), 10**12, max_value=500)
    assert (r.value, r.next_value, r.stop, r.exact) == (500, None, "upper bound", True)

    capacity = math.ceil(peak_of(5_000) / 0.95)
    r = fit(_config(8), capacity, max_probes=5)
    assert (r.stop, len(r.probes), r.exact, r.value, r.next_value) == ("max probes", 5, False, 512, 5_001)
    assert (r.peak, r.next_peak) == (peak_of(512), peak_of(5_001))
    assert "the probe budget ran out: the largest that fits is between 512 and 5000" in estimate_fit.fit_text(
        r, _config(8))
    r = fit(_config(8), capacity, max_probes=3)  # still growing
    assert (r.stop, r.exact, r.value, r.next_value) == ("max probes", False, 32, None)
    assert "the probe budget ran out before a value that does not fit" in estimate_fit.fit_text(r, _config(8))

    r = fit(_config(8), peak_of(1), margin="1KiB")
    assert (r.value, r.batch_shape, r.next_value, r.stop, r.report) == (None, None, 1, "nothing fits", None)
    assert r.to_dict()["fits"] is False


def test_a_failed_estimate_names_the_value_and_keeps_the_search_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_estimates(PEAKS["linear"], monkeypatch, axis=1, fail_at=2)
    with pytest.raises(FitError, match=r"the estimate at seq 2 failed: RuntimeError: out of positions \(the "
                                       r"largest seq found to fit so far: 1\)") as info:
        fit(_config(8), 10**9, dim="seq")
    assert asked == [1, 2] and info.value.value == 2 and info.value.partial.value == 1


def test_seq_fits_dim_1_of_the_batch_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_estimates(PEAKS["convex"], monkeypatch, axis=1)
    r = fit(_config(8), 10**8, dim="seq", margin=0)
    assert r.batch_shape == (8, r.value) and r.margin == 0 and asked[0] == 1
    with pytest.raises(ValueError, match=r"fit dim 'seq' is dim 1 of the batch shape, which \(8,\) does not have"):
        fit(EstimateConfig(batch_shape=(8,), **SMALL), 10**9, dim="seq")


@pytest.fixture(scope="module")
def option_rows() -> list[OptionRow]:
    """compare_options() of the small job with activation checkpointing on."""
    return compare_options(EstimateConfig(activation_checkpointing=True, **SMALL))


def test_options_table_equals_separate_estimates_of_each_variant(option_rows: list[OptionRow]) -> None:
    rows = option_rows
    assert [r.label for r in rows] == [
        "as configured", "activation checkpointing: on (configured)", "activation checkpointing: off",
        "reshard_after_forward: on (configured)", "reshard_after_forward: off", "bf16 mixed precision: on",
        "bf16 mixed precision: off (configured)"]
    separate: dict[EstimateConfig, dict[str, int]] = {}
    for r in rows:
        if r.config not in separate:
            separate[r.config] = device_peak(estimate(r.config), "cpu")
        assert r.peaks == separate[r.config] and r.peak == r.peaks[TOTAL], r.label
        assert r.delta == r.peak - rows[0].peak
        moves = {c: r.peaks[c] - rows[0].peaks[c] for c in CATEGORIES}
        assert r.moved_delta == max(moves.values(), key=abs) and (r.moved is None) == (r.moved_delta == 0)
        assert r.moved is None or moves[r.moved] == r.moved_delta
    assert len(separate) == 4  # the configured job and one variant of each option
    assert rows[2].config.activation_checkpointing is False and rows[4].config.reshard_after_forward is False
    assert (rows[5].config.param_dtype, rows[5].config.reduce_dtype) == ("bf16", "fp32")
    assert rows[2].delta > 0 and rows[2].moved == "activation"  # checkpointing saves activations
    table = options_table(rows)
    assert len(table.splitlines()) == len(rows) + 2 and "vs configured" in table and "moved most" in table


def test_cli_compare_options_prints_compare_options(option_rows: list[OptionRow],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(capsys, "--activation-checkpointing", "--compare-options", "--json")
    assert rc == 0 and json.loads(out)["rows"] == [r.to_dict() for r in option_rows], err
    assert err.count("estimating ") == 4  # progress: the configured job and one variant of each option
    rc, out, _ = _main(capsys, "--activation-checkpointing", "--compare-options")
    assert rc == 0 and options_table(option_rows) in out and "activation checkpointing on" in out


def test_parse_size_and_margin() -> None:
    assert parse_size("80GiB") == 80 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096 and parse_size(" 2 kib ") == 2048
    for bad in ("", "lots", "1.5XB", "-1GiB", "1e9", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert margin_bytes("5%", 1000) == 50 and margin_bytes("2.5%", 1001) == 26 and margin_bytes("1KiB", 4096) == 1024
    assert margin_bytes(0, 10) == 0 and margin_bytes("0", 10) == 0 and margin_bytes("0%", 10) == 0
    for bad_margin in ("100%", "-1%", "4KiB", "x%"):
        with pytest.raises(ValueError, match="margin"):
            margin_bytes(bad_margin, 4096)


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        rc = estimate_main(["--world-size", "2", "--blocks", "2", "--width", "64", *args])
    except SystemExit as exc:  # argparse's errors
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("args", "message"), [
    (("--fit", "lots"), "argument --fit: expected a size such as 80GiB, 512MiB, 1.5GB or a number of bytes"),
    (("--fit", "0"), "argument --fit: a size must be at least 1 byte"),
    (("--fit", "1GiB", "--fit-dim", "width"), "argument --fit-dim: invalid choice: 'width'"),
    (("--fit", "1GiB", "--fit-dim", "seq", "--batch-shape", "32"),
     "fit dim 'seq' is dim 1 of the batch shape, which (32,) does not have"),
    (("--fit-dim", "seq",), "--fit-dim only goes with --fit CAPACITY"),
    (("--fit", "1KiB", "--fit-margin", "2KiB"), "margin (2048 bytes) must be smaller than the capacity (1024 bytes)"),
    (("--fit", "1GiB", "--fit-margin", "150%"), "argument --fit-margin: margin must be a percentage in 0..100"),
    (("--fit", "1GiB", "--compare-options"), "argument --compare-options: not allowed with argument --fit"),
    (("--json",), "--json goes with --fit or --compare-options"),
    (("--fit", "1GiB", "--fit-dim", "seq"), "the estimate at seq 1 failed"),  # the demo model needs width 64
])
def test_cli_errors_name_the_argument(args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(capsys, *args)
    assert rc == 2 and message in err and out == "", err


def test_cli_says_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(capsys, "--fit", "64KiB", "--fit-margin", "1KiB")
    assert rc == 1 and "nothing fits: batch 1 peaks at" in out, out
    assert "fsdp-mem-otel estimate: nothing fits in 64.0 KiB: at batch 1 the estimated step peak is" in err
    assert "probe 1/20: batch 1: peak" in err and "does not fit" in err
