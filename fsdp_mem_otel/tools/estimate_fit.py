"""``fsdp-mem-otel estimate --fit CAPACITY`` and ``--compare-options``: questions asked of several estimates.

``fit()`` finds the largest batch (dim 0 of the input) or sequence length (dim 1) whose estimated
step peak, plus a stated margin, fits in a capacity, with a bounded number of estimates. It probes
1, then grows (doubling, or up to 16 times at once where the line through the last two peaks that
fit reaches the capacity further out) until a value does not fit or the upper bound fits, then
narrows the bracket between the largest value that fit and the smallest that did not: it probes
where straight lines through the probes so far cross the capacity (through the two largest that
fit, the two smallest that did not, and the bracket's ends), and halves the bracket whenever two
probes in a row did not halve it. It stops when the two are adjacent, the upper bound fits or the probe
budget is spent. Peaks that rise linearly (batch) take a handful of probes; ones that rise faster
and faster (attention over the sequence, a step peak that is the larger of two such) a few more.
The peak is assumed not to fall as the dimension grows.

``compare_options()`` estimates the job as configured and with each of three options flipped:
activation checkpointing, ``reshard_after_forward``, and bf16 mixed precision (parameters in bf16,
gradients reduced in fp32); a variant equal to the configured job is not estimated again.

Each figure is an ``estimate()`` step peak (``total`` on the device the estimate runs on), so
everything ``estimate`` cannot see (the CUDA context, NCCL and cuBLAS workspaces, the caching
allocator's fragmentation) is what the margin is for.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from fsdp_mem_otel.schema import CATEGORIES, TOTAL, StepReport
from fsdp_mem_otel.tools.estimate import CANNOT_SEE, EstimateConfig, OptionError, estimate, usage_errors, write_jsonl

#: the dimensions ``fit`` can grow, and their axis in the input's shape
FIT_DIMS = {"batch": 0, "seq": 1}
DEFAULT_MARGIN = "5%"
DEFAULT_MAX_PROBES = 20
DEFAULT_MAX_VALUE = 1 << 20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
SIZE_FORMS = ("a size such as 80GiB, 512MiB, 1.5GB or a number of bytes (units: B, KB, MB, GB, TB in powers of "
              "1000; KiB, MiB, GiB, TiB in powers of 1024)")


def parse_size(text: str) -> int:
    """``'80GiB'``, ``'512MiB'``, ``'1.5GB'``, ``'1073741824'`` -> bytes (whole bytes, rounded down,
    at least 1); a ValueError saying the accepted forms otherwise. Units are case-insensitive."""
    if not isinstance(text, str):
        raise TypeError(f"a size must be a string; got {type(text).__name__}")
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected {SIZE_FORMS}; got {text!r}")
    try:
        n = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"expected {SIZE_FORMS}; got {text!r}") from None
    if n < 1:
        raise ValueError(f"a size must be at least 1 byte; got {text!r}")
    return n


def margin_bytes(margin: int | str, capacity: int) -> int:
    """The margin in bytes: ``'5%'`` of ``capacity`` (rounded up), a size (``'2GiB'``) or an int of
    bytes; a ValueError unless 0 <= margin < capacity."""
    if isinstance(margin, bool) or not isinstance(margin, int | str):
        raise TypeError(f"margin must be a percentage of the capacity ('5%'), a size ('2GiB') or bytes; "
                        f"got {type(margin).__name__}")
    if isinstance(margin, str) and margin.strip().endswith("%"):
        try:
            pct = Decimal(margin.strip()[:-1])
        except InvalidOperation:
            raise ValueError(f"margin {margin!r}: expected a percentage such as 5% or {SIZE_FORMS}") from None
        if not 0 <= pct < 100:
            raise ValueError(f"margin must be a percentage in 0..100 (exclusive of 100); got {margin!r}")
        return math.ceil(Decimal(capacity) * pct / 100)
    n = margin if isinstance(margin, int) else (0 if margin.strip() in ("0", "0B") else parse_size(margin))
    if not 0 <= n < capacity:
        raise ValueError(f"margin ({n} bytes) must be smaller than the capacity ({capacity} bytes)")
    return n


def device_peak(report: StepReport, device: str) -> dict[str, int]:
    """The step peak's categories on the device an estimate with ``device`` ("cpu"/"cuda") ran
    on (its key ``device`` or ``device:N``; else the device with the largest peak)."""
    totals = {k: cats.get(TOTAL, 0) for k, cats in report.peak.items()}
    mine = {k: t for k, t in totals.items() if k == device or k.startswith(f"{device}:")} or totals
    return dict(report.peak[max(mine, key=mine.__getitem__)]) if mine else {}


@dataclass(frozen=True)
class Probe:
    """One estimate of the search: the value tried, its step peak, whether peak + margin <= capacity."""

    value: int
    peak: int
    fits: bool


@dataclass
class FitResult:
    """What ``fit()`` found. ``value`` is None when nothing fits (not even 1).

    Attributes:
        dim, axis: "batch" (axis 0) or "seq" (axis 1) of the input's shape; ``batch_shape``: that
            shape at ``value`` (None when nothing fits).
        capacity, margin: bytes; a value fits when its step peak + margin <= capacity.
        value, peak: the largest value found to fit and its estimated step peak.
        next_value, next_peak: the smallest value found not to fit and its peak (None: the upper
            bound fit, or nothing was tried above ``value``). ``exact`` when it is ``value + 1``.
        stop: why the search ended: "bracketed" (adjacent values found), "upper bound" (``max_value``
            fits), "max probes" (the budget ran out first), "nothing fits" (1 does not); "estimate
            failed" only in a FitError's ``partial``.
        probes: every estimate, in order. report: the StepReport of ``value`` (None if nothing fits).
    """

    dim: str
    axis: int
    capacity: int
    margin: int
    batch_shape: tuple[int, ...] | None
    max_value: int
    value: int | None
    peak: int | None
    next_value: int | None
    next_peak: int | None
    stop: str
    probes: list[Probe] = field(default_factory=list)
    report: StepReport | None = field(default=None, repr=False)

    @property
    def budget(self) -> int:
        """Bytes a step peak may reach: capacity - margin."""
        return self.capacity - self.margin

    @property
    def exact(self) -> bool:
        """Whether ``value`` is the largest that fits: ``value + 1`` was estimated not to (or
        ``value`` is the upper bound)."""
        if self.value is None:
            return True
        return self.stop == "upper bound" or self.next_value == self.value + 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, every figure in bytes (``estimate --fit --json``)."""
        return {"dim": self.dim, "axis": self.axis, "capacity": self.capacity, "margin": self.margin,
                "budget": self.budget, "fits": self.value is not None, "value": self.value, "peak": self.peak,
                "batch_shape": None if self.batch_shape is None else list(self.batch_shape),
                "next_value": self.next_value, "next_peak": self.next_peak,
                "exact": self.exact, "stop": self.stop, "max_value": self.max_value,
                "probes": [{"value": p.value, "peak": p.peak, "fits": p.fits} for p in self.probes]}


class FitError(RuntimeError):
    """An estimate failed during the search; ``value`` is what it was tried at."""

    def __init__(self, message: str, value: int, partial: FitResult, cli_message: str | None = None) -> None:
        super().__init__(message)
        self.value = value
        self.partial = partial
        self.cli_message = message if cli_message is None else cli_message


def _shape_at(config: EstimateConfig, axis: int, value: int) -> tuple[int, ...]:
    shape = list(config.input_shape)
    shape[axis] = value
    return tuple(shape)


def fit(config: EstimateConfig, capacity: int, dim: str = "batch", margin: int | str = DEFAULT_MARGIN,
        max_probes: int = DEFAULT_MAX_PROBES, max_value: int = DEFAULT_MAX_VALUE,
        progress: Callable[[int, Probe], None] | None = None) -> FitResult:
    """The largest value of ``dim`` ("batch": dim 0 of the input shape, "seq": dim 1) whose
    estimated step peak + ``margin`` <= ``capacity`` bytes, found with at most ``max_probes``
    estimates of ``config`` (see the module docstring), trying nothing above ``max_value``.

    ``margin`` is a percentage of the capacity (``"5%"``, the default), a size (``"2GiB"``) or
    bytes. ``progress(n, probe)`` is called after each estimate (n from 1). Raises ValueError for
    bad arguments, FitError (with the search so far) when an estimate fails."""
    from fsdp_mem_otel.checks import check_int

    if not isinstance(config, EstimateConfig):
        raise TypeError(f"config must be an EstimateConfig; got {type(config).__name__}")
    check_int("capacity", capacity, 1)
    check_int("max_probes", max_probes, 1)
    check_int("max_value", max_value, 1)
    if dim not in FIT_DIMS:
        raise ValueError(f"fit dim must be one of {', '.join(FIT_DIMS)}; got {dim!r}")
    axis = FIT_DIMS[dim]
    if len(config.input_shape) <= axis:
        raise ValueError(f"fit dim {dim!r} is dim {axis} of the batch shape, which {config.input_shape} does "
                         f"not have: give a batch shape with a sequence dim (e.g. --batch-shape 8,2048)")
    margin_b = margin_bytes(margin, capacity)
    budget = capacity - margin_b
    probes: dict[int, Probe] = {}
    order: list[Probe] = []
    best: list[StepReport] = []  # the report of the largest value that fit so far

    def result(stop: str, lo: int | None, hi: int | None) -> FitResult:
        return FitResult(dim, axis, capacity, margin_b, None if lo is None else _shape_at(config, axis, lo),
                         max_value, lo, None if lo is None else probes[lo].peak, hi,
                         None if hi is None else probes[hi].peak, stop, list(order), best[-1] if best else None)

    def probe(value: int, lo: int | None, hi: int | None) -> bool:
        try:
            report = estimate(replace(config, batch_shape=_shape_at(config, axis, value)))
        except Exception as exc:
            so_far = f" (the largest {dim} found to fit so far: {lo})" if lo is not None else ""
            head = f"the estimate at {dim} {value} failed: "
            what = str(exc) if isinstance(exc, OptionError) else f"{type(exc).__name__}: {exc}"
            cli = exc.cli_message() if isinstance(exc, OptionError) else what
            raise FitError(head + what + so_far, value, result("estimate failed", lo, hi),
                           head + cli + so_far) from exc
        peak = device_peak(report, config.device).get(TOTAL, 0)
        p = probes[value] = Probe(value, peak, peak <= budget)
        order.append(p)
        if p.fits:
            best[:] = [report]
        if progress is not None:
            progress(len(order), p)
        return p.fits

    if not probe(1, None, None):
        return result("nothing fits", None, 1)
    lo, hi, last_fit = 1, None, True
    ref, streak = 0, 0  # probes since the bracket last halved (from width ref): after two, halve it
    while True:
        if hi is not None and hi == lo + 1:
            return result("bracketed", lo, hi)
        if hi is None and lo >= max_value:
            return result("upper bound", lo, None)
        if len(order) >= max_probes:
            return result("max probes", lo, hi)
        first_over = _first_over(probes, lo, hi, budget)
        if hi is None:  # growing: double, or up to GROWTH times where the peaks extrapolate to the budget
            nxt = min(max_value, max(2 * lo, min(first_over or 0, GROWTH * lo)))
        else:
            width = hi - lo
            if not ref or 2 * width <= ref:
                ref, streak = width, 0
            # after a value that fit, the first predicted over; after one that did not, the one before it
            predicted = None if first_over is None else first_over - (0 if last_fit else 1)
            if streak >= 2:
                guess = lo + width // 2
            elif predicted is not None and lo < predicted < hi:
                guess = predicted
            else:
                guess = _last_under(probes[lo], probes[hi], budget)
            streak += 1
            nxt = min(hi - 1, max(lo + 1, guess))
        last_fit = probe(nxt, lo, hi)
        if last_fit:
            lo = nxt
        else:
            hi = nxt


#: the most ``fit`` grows the value by in one probe, where the peaks so far extrapolate further
GROWTH = 16


def _crossing(a: Probe, b: Probe, budget: int) -> float | None:
    """Where the straight line through ``a`` and ``b`` reaches ``budget`` (None: it does not rise)."""
    if b.peak == a.peak or b.value == a.value:
        return None
    slope = (b.peak - a.peak) / (b.value - a.value)
    return a.value + (budget - a.peak) / slope if slope > 0 else None


def _first_over(probes: dict[int, Probe], lo: int, hi: int | None, budget: int) -> int | None:
    """The first value predicted over ``budget`` by the line through the two largest values that
    fit, or through the two smallest that do not (the lower of the two); None when neither line
    rises. Exact for peaks on a straight line; for peaks that rise faster and faster (a convex
    curve) both lines run below the curve beyond their points, so each lands on a value that is
    over, at or above the true first one."""
    under = sorted(v for v in probes if v <= lo and probes[v].fits)[-2:]
    over = sorted(v for v in probes if hi is not None and v >= hi and not probes[v].fits)[:2]
    guesses = [_crossing(probes[pair[0]], probes[pair[1]], budget) for pair in (under, over) if len(pair) == 2]
    firsts = [math.floor(x) + 1 for x in guesses if x is not None]
    return min(firsts) if firsts else None


def _last_under(lo: Probe, hi: Probe, budget: int) -> int:
    """The last value the straight line between ``lo`` (fits) and ``hi`` (does not) keeps within
    ``budget``: for a convex curve, at or below the true last value that fits."""
    return lo.value + (budget - lo.peak) * (hi.value - lo.value) // (hi.peak - lo.peak)


@dataclass(frozen=True)
class OptionRow:
    """One row of ``compare_options()``: a setting of one option (or the configured job).

    ``peaks`` are the step peak's categories (with ``total``) on the estimate's device; ``delta``
    is ``peak`` minus the configured job's; ``moved`` the category whose bytes at the step peak
    changed most (None when none changed) and ``moved_delta`` by how much."""

    option: str
    setting: str
    configured: bool
    config: EstimateConfig
    peak: int
    delta: int
    moved: str | None
    moved_delta: int
    peaks: dict[str, int]

    @property
    def label(self) -> str:
        if self.option == "as configured":
            return self.option
        return f"{self.option}: {self.setting}" + (" (configured)" if self.configured else "")

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "setting": self.setting, "configured": self.configured, "peak": self.peak,
                "delta": self.delta, "moved": self.moved, "moved_delta": self.moved_delta, "peaks": self.peaks}


def option_variants(config: EstimateConfig) -> list[tuple[str, str, EstimateConfig]]:
    """(option, setting, config) for each setting ``compare_options`` shows: activation
    checkpointing on/off, reshard_after_forward on/off, bf16 mixed precision on (param_dtype bf16,
    reduce_dtype fp32) / off (neither set)."""
    return [
        ("activation checkpointing", "on", replace(config, activation_checkpointing=True)),
        ("activation checkpointing", "off", replace(config, activation_checkpointing=False)),
        ("reshard_after_forward", "on", replace(config, reshard_after_forward=True)),
        ("reshard_after_forward", "off", replace(config, reshard_after_forward=False)),
        ("bf16 mixed precision", "on", replace(config, param_dtype="bf16", reduce_dtype="fp32")),
        ("bf16 mixed precision", "off", replace(config, param_dtype=None, reduce_dtype=None)),
    ]


def compare_options(config: EstimateConfig,
                    progress: Callable[[str], None] | None = None) -> list[OptionRow]:
    """The configured job's step peak, then each setting of ``option_variants(config)`` with its
    difference to it and the category that moved most: one ``estimate()`` per distinct config.
    ``progress(label)`` is called before each estimate."""
    if not isinstance(config, EstimateConfig):
        raise TypeError(f"config must be an EstimateConfig; got {type(config).__name__}")
    if progress is not None:
        progress("as configured")
    base = device_peak(estimate(config), config.device)
    rows = [OptionRow("as configured", "", True, config, base.get(TOTAL, 0), 0, None, 0, base)]
    for option, setting, variant in option_variants(config):
        same = _canonical(variant) == _canonical(config)
        if not same and progress is not None:
            progress(f"{option}: {setting}")
        peaks = base if same else device_peak(estimate(variant), config.device)
        moves = {c: peaks.get(c, 0) - base.get(c, 0) for c in CATEGORIES}
        moved = max(moves, key=lambda c: abs(moves[c]))
        rows.append(OptionRow(option, setting, same, variant, peaks.get(TOTAL, 0),
                              peaks.get(TOTAL, 0) - base.get(TOTAL, 0), moved if moves[moved] else None,
                              moves[moved], peaks))
    return rows


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _canonical(config: EstimateConfig) -> EstimateConfig:
    """``config`` with its mixed-precision dtypes under one name each (bfloat16 -> bf16, ...)."""
    return replace(config, param_dtype=_DTYPE_NAMES.get(config.param_dtype or "", config.param_dtype),
                   reduce_dtype=_DTYPE_NAMES.get(config.reduce_dtype or "", config.reduce_dtype))


def options_table(rows: Sequence[OptionRow]) -> str:
    """``compare_options()``'s rows as a plain-text table."""
    from fsdp_mem_otel.offline.table import human_bytes, render_table, signed_bytes

    head = ("option", "step peak", "vs configured", "moved most")
    return render_table(head, [(r.label, human_bytes(r.peak), signed_bytes(r.delta),
                                f"{r.moved} {signed_bytes(r.moved_delta)}" if r.moved else "-") for r in rows])


def describe(config: EstimateConfig) -> str:
    """The three compared options as ``config`` sets them, in words."""
    mp = "off" if config.param_dtype is None and config.reduce_dtype is None else \
        f"param {config.param_dtype or '-'}, reduce {config.reduce_dtype or '-'}"
    return (f"activation checkpointing {'on' if config.activation_checkpointing else 'off'}, "
            f"reshard_after_forward {'on' if config.reshard_after_forward else 'off'}, mixed precision {mp}")


# --- the command line ------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _margin_arg(text: str) -> str:
    t = text.strip()
    try:
        if t.endswith("%"):
            margin_bytes(t, 1 << 62)
        elif t not in ("0", "0B"):
            parse_size(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return t


def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    """``estimate``'s --fit, --fit-dim, --fit-margin, --fit-max-probes, --fit-max, --compare-options, --json."""
    from fsdp_mem_otel.checks import int_at_least

    g = p.add_argument_group("capacity planning (instead of the tables)")
    modes = g.add_mutually_exclusive_group()
    modes.add_argument("--fit", type=_size_arg, default=None, metavar="CAPACITY",
                       help="find the largest --fit-dim whose estimated step peak + margin fits in CAPACITY "
                            "(80GiB, 512MiB, 1.5GB or bytes)")
    modes.add_argument("--compare-options", action="store_true",
                       help="one table: the job as configured, with and without activation checkpointing, "
                            "reshard_after_forward, bf16 mixed precision (param bf16, reduce fp32)")
    g.add_argument("--fit-dim", choices=tuple(FIT_DIMS), default=None,
                   help="what --fit grows: batch (dim 0 of --batch-shape, the default) or seq (dim 1)")
    g.add_argument("--fit-margin", type=_margin_arg, default=None, metavar="PCT%|SIZE",
                   help=f"kept free below CAPACITY, e.g. 10%% or 4GiB (default {DEFAULT_MARGIN.replace('%', '%%')} "
                        "of CAPACITY): for what the estimate cannot see")
    g.add_argument("--fit-max-probes", type=int_at_least(1), default=None, metavar="N",
                   help=f"estimates --fit may run (default {DEFAULT_MAX_PROBES})")
    g.add_argument("--fit-max", type=int_at_least(1), default=None, metavar="N",
                   help=f"largest value --fit tries (default {DEFAULT_MAX_VALUE})")
    g.add_argument("--json", action="store_true",
                   help="with --fit or --compare-options: the result as JSON, every figure in bytes")


def fit_mode_errors(args: argparse.Namespace) -> str | None:
    """An error message when the capacity-planning options are combined wrongly, else None."""
    fit_only = [name for name, value in (("--fit-dim", args.fit_dim), ("--fit-margin", args.fit_margin),
                                        ("--fit-max-probes", args.fit_max_probes), ("--fit-max", args.fit_max))
                if value is not None]
    if fit_only and args.fit is None:
        return f"{', '.join(fit_only)} only go{'es' if len(fit_only) == 1 else ''} with --fit CAPACITY"
    if args.json and args.fit is None and not args.compare_options:
        return "--json goes with --fit or --compare-options"
    if (args.fit is not None or args.compare_options) and args.world_sizes:
        return "--world-sizes does not go with --fit or --compare-options"
    return None


def run_fit_mode(args: argparse.Namespace, config: EstimateConfig) -> int:
    """``estimate --fit`` or ``--compare-options`` for ``config``: the result on stdout, progress
    on stderr; returns 0, 1 when nothing fits; raises ``UsageError`` on a bad argument, a failed
    estimate or an --out it cannot write (checked before the first estimate)."""
    from fsdp_mem_otel.cli_errors import UsageError, check_writable

    if args.out:
        check_writable(args.out, "--out")
    try:
        with usage_errors():
            return _compare_main(args, config) if args.compare_options else _fit_main(args, config)
    except FitError as exc:
        raise UsageError(exc.cli_message) from exc


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _compare_main(args: argparse.Namespace, config: EstimateConfig) -> int:
    rows = compare_options(config, progress=lambda label: _err(f"estimating {label} ..."))
    if args.out:
        _write_out(estimate(config), args.out)
    if args.json:
        print(json.dumps({"world_size": config.world_size, "batch_shape": list(config.input_shape),
                          "rows": [r.to_dict() for r in rows]}, indent=2))
        return 0
    print(f"Step peak per rank of {config.world_size}, batch shape {config.input_shape}; configured: "
          f"{describe(config)}:")
    print(options_table(rows))
    print(f"\n{CANNOT_SEE}")
    if args.out:
        print(f"The configured job's estimate written to {args.out}")
    return 0


def _fit_main(args: argparse.Namespace, config: EstimateConfig) -> int:
    from fsdp_mem_otel.offline.table import human_bytes

    dim, capacity = args.fit_dim or "batch", args.fit
    margin = margin_bytes(args.fit_margin or DEFAULT_MARGIN, capacity)
    max_probes = args.fit_max_probes or DEFAULT_MAX_PROBES

    def show(n: int, p: Probe) -> None:
        _err(f"probe {n}/{max_probes}: {dim} {p.value}: peak {human_bytes(p.peak)} + margin {human_bytes(margin)} = "
             f"{_compared(p.peak + margin, capacity)}: {'fits' if p.fits else 'does not fit'}")

    _err(f"fitting {dim} (dim {FIT_DIMS[dim]} of the batch shape) into {human_bytes(capacity)}, margin "
         f"{human_bytes(margin)} ...")
    result = fit(config, capacity, dim, margin, max_probes, args.fit_max or DEFAULT_MAX_VALUE, progress=show)
    print(json.dumps(result.to_dict(), indent=2) if args.json else fit_text(result, config), flush=True)
    if args.out and result.report is not None:
        _write_out(result.report, args.out)
    if result.value is None:
        _err(f"fsdp-mem-otel estimate: nothing fits in {human_bytes(capacity)}: at {dim} 1 the estimated step peak "
             f"is {human_bytes(result.next_peak or 0)}, over the {human_bytes(result.budget)} left by the margin "
             f"of {human_bytes(margin)}")
        return 1
    if args.out and not args.json:
        print(f"The estimate at {dim} {result.value} written to {args.out}")
    return 0


def _compared(total: int, capacity: int) -> str:
    """``total <= capacity`` or ``total > capacity`` in the unit of the capacity, with as many
    decimals as it takes for the two figures to differ where the bytes do (bytes, at worst)."""
    from fsdp_mem_otel.offline.table import human_bytes

    sign = "<=" if total <= capacity else ">"
    a, b = human_bytes(total), human_bytes(capacity)
    if total == capacity or (a != b and (total < capacity) == (_number(a) < _number(b))):
        return f"{a} {sign} {b}"
    unit, scale = next(((u, f) for u, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if capacity >= f), ("B", 1))
    for decimals in range(2, 7):
        x, y = f"{total / scale:.{decimals}f}", f"{capacity / scale:.{decimals}f}"
        if x != y:
            return f"{x} {unit} {sign} {y} {unit}"
    return f"{total:,} B {sign} {capacity:,} B"


def _number(text: str) -> float:
    """The figure of ``human_bytes``' text, in bytes."""
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}.get(unit, 1)


def _write_out(report: StepReport, path: str) -> None:
    """--out, after the result was printed: a failure says so in one line, the result stays on stdout."""
    from fsdp_mem_otel.cli_errors import UsageError

    try:
        write_jsonl(report, path)
    except OSError as exc:
        raise UsageError(f"--out {path}: writing the estimate failed ({exc.strerror or exc}); the result is printed "
                         "above: give an --out in a folder you can write to", code=1) from exc


def fit_text(result: FitResult, config: EstimateConfig) -> str:
    """``fit()``'s result in words (``estimate --fit``)."""
    from fsdp_mem_otel.offline.table import human_bytes

    def b(n: int | None) -> str:
        return f"{human_bytes(n or 0)} ({n or 0:,} bytes)"

    lines = [f"Fit of {result.dim} (dim {result.axis} of the batch shape {config.input_shape}) per rank of "
             f"{config.world_size} into {b(result.capacity)}",
             f"  margin kept free:   {b(result.margin)}; a step peak may reach {b(result.budget)}"]
    if result.value is None:
        lines.append(f"  nothing fits: {result.dim} 1 peaks at {b(result.next_peak)}")
        return "\n".join(lines)
    lines.append(f"  largest that fits: {result.dim} {result.value} (batch shape {result.batch_shape}), "
                 f"step peak {b(result.peak)}")
    if result.stop == "upper bound":
        lines.append(f"  (the upper bound --fit-max {result.max_value}: larger values were not tried)")
    elif result.next_value is not None:
        lines.append(f"  {'next' if result.exact else 'smallest tried that'} does not fit: {result.dim} "
                     f"{result.next_value}, step peak {b(result.next_peak)}")
        if not result.exact:
            lines.append(f"  (the probe budget ran out: the largest that fits is between {result.value} and "
                         f"{result.next_value - 1}; raise --fit-max-probes)")
    else:
        lines.append("  (the probe budget ran out before a value that does not fit: raise --fit-max-probes)")
    lines.append(f"  {len(result.probes)} estimates; what the margin covers: {CANNOT_SEE_SHORT}")
    return "\n".join(lines)


CANNOT_SEE_SHORT = ("the CUDA context, NCCL and cuBLAS workspaces and the caching allocator's fragmentation "
                    "(not in the estimate)")
