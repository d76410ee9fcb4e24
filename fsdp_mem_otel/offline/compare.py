"""``fsdp-mem-otel compare A B``: what grew between two memory profiles. Does not import torch.

A profile is one rank's StepReport of a run (JSONL written by the JSONL exporter or the demo's
``--out``, or an estimate): by default its last deep step (deep mode labels every byte), else its
last step. Compared on the device with the largest peak (``jsonl_format.main_device``):

- per category, the bytes at the step peak;
- per module and phase, the module's peak total during its forward (``peak_forward``) and
  backward (``peak_backward``), max over calls and devices.

Modules are matched by key; keys only one side has are listed apart. Deltas are ranked by size,
largest growth first. ``render_text`` prints the tables (each figure in the unit that fits it:
B, KiB, MiB, GiB; ``exact=True``: bytes), ``render_html_section`` gives the same as an HTML
fragment for a report page, ``to_dict`` the exact bytes as JSON-able data (``--json``).
"""

from __future__ import annotations

import html
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_mem_otel.checks import int_at_least
from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.offline.jsonl_format import check_step_report_file, main_device, read_reports
from fsdp_mem_otel.offline.table import human_bytes, render_table, signed_bytes
from fsdp_mem_otel.schema import CATEGORY_KEYS, DEEP, LIGHT, PEAK_BACKWARD, PEAK_FORWARD, StepReport

PHASES = ((PEAK_FORWARD, "forward"), (PEAK_BACKWARD, "backward"))


@dataclass(frozen=True)
class Delta:
    """One compared figure: ``name`` (a category, or ``module / phase``), bytes in A and in B;
    for a module, ``module`` and ``phase`` (``forward`` / ``backward``) too."""

    name: str
    a: int
    b: int
    module: str | None = None
    phase: str | None = None

    @property
    def delta(self) -> int:
        return self.b - self.a

    @property
    def ratio(self) -> float | None:
        """B / A (None when A is 0)."""
        return self.b / self.a if self.a else None


@dataclass(frozen=True)
class Profile:
    """The report compared from one side, and where it came from."""

    label: str
    report: StepReport
    device: str


@dataclass
class Comparison:
    """A against B: categories at the step peak and module peaks, each ranked by delta."""

    a: Profile
    b: Profile
    categories: list[Delta] = field(default_factory=list)
    modules: list[Delta] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    @property
    def step_peak(self) -> Delta:
        return next(d for d in self.categories if d.name == "total")


def load_profile(path: str | Sequence[str], *, step: int | None = None, rank: int = 0,
                 label: str | None = None) -> Profile:
    """Rank ``rank``'s report at ``step`` in ``path`` (one JSONL file, or several: a run's rank
    files) (default: its last deep step, else its last)."""
    paths = [path] if isinstance(path, str) else list(path)
    path = ", ".join(paths)
    reports = [r for r in read_reports(*paths) if r.rank == rank]
    if not reports:
        raise ValueError(f"{path}: no step report of rank {rank}")
    if step is not None:
        chosen = [r for r in reports if r.step == step]
        if not chosen:
            steps = sorted({r.step for r in reports})
            raise ValueError(f"{path}: rank {rank} has no step {step}; it has steps {steps[0]}..{steps[-1]}")
        report = chosen[-1]
    else:
        deep = [r for r in reports if r.mode == DEEP and r.aborted is None]
        report = (deep or reports)[-1]
    return Profile(label or path, report, main_device([report]))


def module_peaks(report: StepReport) -> dict[tuple[str, str], int]:
    """(module, phase) -> the module's peak total in that phase (modules that ran it)."""
    out = {}
    for key, mod in report.modules.items():
        for state, phase in PHASES:
            if mod.snapshots.get(state):
                out[(key, phase)] = mod.peak_total(state)
    return out


def _ranked(deltas: list[Delta]) -> list[Delta]:
    return sorted(deltas, key=lambda d: (-abs(d.delta), d.name))


def compare(a: Profile, b: Profile) -> Comparison:
    """Compare two profiles (see the module docstring)."""
    cats_a, cats_b = a.report.peak.get(a.device, {}), b.report.peak.get(b.device, {})
    categories = [Delta(c, int(cats_a.get(c, 0)), int(cats_b.get(c, 0))) for c in CATEGORY_KEYS]
    mods_a, mods_b = module_peaks(a.report), module_peaks(b.report)
    shared = [Delta(f"{k[0]} / {k[1]}", mods_a[k], mods_b[k], k[0], k[1]) for k in mods_a if k in mods_b]
    keys_a, keys_b = set(a.report.modules), set(b.report.modules)
    return Comparison(a, b, _ranked(categories), _ranked(shared), sorted(keys_a - keys_b), sorted(keys_b - keys_a))


def compare_runs(a_path: str, b_path: str, *, step: int | None = None, rank: int = 0) -> Comparison:
    """Compare rank ``rank`` of two JSONL runs (or an estimate and a run) at ``step`` (default:
    each run's last deep step, else its last step)."""
    return compare(load_profile(a_path, step=step, rank=rank), load_profile(b_path, step=step, rank=rank))


def kind(report: StepReport) -> str:
    """What a profile is, in words: ``light mode``, ``deep mode``, or ``an estimate`` (deep mode
    on fake tensors: a deep report without any allocator statistics, as ``estimate`` writes it)."""
    if report.mode == DEEP and not any(report.allocator.values()):
        return "an estimate (deep mode)"
    return f"{report.mode} mode"


def modes_note(c: Comparison) -> str | None:
    """One line when the two sides were measured in different modes (light against deep or an
    estimate), which put the same bytes in different categories (README: what light mode
    measures); None when both are in the same mode."""
    a, b = c.a.report.mode, c.b.report.mode
    if a == b or {a, b} - {LIGHT, DEEP}:
        return None
    return (f"note: A is {kind(c.a.report)}, B is {kind(c.b.report)}: they put the same bytes in different "
            "categories (deep: every op's output under its category, temporaries in temp; light: FSDP's hooks, "
            "buffers and saved tensors, op temporaries not seen on CPU and the allocator's excess as temp on CUDA, "
            "its peaks low by the temporaries): compare the totals and peaks, not the categories")


def _pct(d: Delta) -> str:
    r = d.ratio
    return "new" if r is None and d.b else ("" if r is None else f"{(r - 1) * 100:+.1f}%")


def _formats(exact: bool) -> tuple[Callable[[int], str], Callable[[int], str]]:
    """How a figure and a change read: in the unit that fits each, or exact bytes."""
    if exact:
        return (lambda n: f"{n:,}"), (lambda n: f"{n:+,}" if n else "0")
    return human_bytes, signed_bytes


def _head(first: str, exact: bool) -> tuple[str, str, str, str, str]:
    unit = " (bytes)" if exact else ""
    return (first, f"A{unit}", f"B{unit}", f"B - A{unit}", "change")


def _rows(deltas: list[Delta], top: int | None, exact: bool = False) -> list[tuple[str, str, str, str, str]]:
    size, change = _formats(exact)
    shown = deltas if top is None else deltas[:top]
    return [(d.name, size(d.a), size(d.b), change(d.delta), _pct(d)) for d in shown]


def _describe(p: Profile, exact: bool = False) -> str:
    r = p.report
    peak = _formats(exact)[0](r.peak_total(p.device))
    unit = " bytes" if exact else ""
    return f"{p.label}: rank {r.rank}, step {r.step} ({r.mode}), {p.device}, step peak {peak}{unit}"


def render_text(c: Comparison, top: int | None = 20, exact: bool = False) -> str:
    """Plain-text tables: categories at the step peak, then module peaks, largest delta first.
    Each figure in the unit that fits it (B, KiB, MiB, GiB), or with ``exact`` in bytes."""
    note = modes_note(c)
    parts = [f"A = {_describe(c.a, exact)}", f"B = {_describe(c.b, exact)}", *([note] if note else []), "",
             "At the step peak, by category:", render_table(_head("category", exact), _rows(c.categories, None, exact)),
             ""]
    parts += [f"Module peaks (largest change first{'' if top is None else f', top {top}'}):",
              render_table(_head("module / phase", exact), _rows(c.modules, top, exact))]
    if c.only_a or c.only_b:
        parts += ["", f"Modules only in A: {', '.join(c.only_a) or '-'}",
                  f"Modules only in B: {', '.join(c.only_b) or '-'}"]
    return "\n".join(parts) + "\n"


def render_html_section(c: Comparison, top: int | None = 50) -> str:
    """The same as an HTML fragment (a ``<section>``) for a report page; everything escaped."""

    def table(title: str, first: str, rows: list[tuple[str, str, str, str, str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in _head(first, False))
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
        return f"<h3>{html.escape(title)}</h3><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    parts = ["<section class=\"comparison\"><h2>Compared with a baseline</h2>",
             f"<p>A = {html.escape(_describe(c.a))}<br>B = {html.escape(_describe(c.b))}</p>",
             *([f"<p class=\"note\">{html.escape(note)}</p>"] if (note := modes_note(c)) else []),
             table("At the step peak, by category", "category", _rows(c.categories, None)),
             table("Module peaks, largest change first", "module / phase", _rows(c.modules, top))]
    if c.only_a or c.only_b:
        parts.append(f"<p>Modules only in A: {html.escape(', '.join(c.only_a) or '-')}<br>"
                     f"Modules only in B: {html.escape(', '.join(c.only_b) or '-')}</p>")
    parts.append("</section>")
    return "".join(parts)


def to_dict(c: Comparison, top: int | None = None) -> dict[str, Any]:
    """The comparison as JSON-able data, every figure in exact bytes (``fsdp-mem-otel compare --json``):
    ``a`` / ``b`` (where each side comes from), ``categories`` (every category, ranked like the
    table), ``modules`` (the ``top`` largest changes; None: all) with ``modules_total``, and the
    modules only one side has."""

    def side(p: Profile) -> dict[str, Any]:
        r = p.report
        return {"label": p.label, "rank": r.rank, "step": r.step, "mode": r.mode, "device": p.device,
                "step_peak_bytes": int(r.peak_total(p.device))}

    def delta(d: Delta) -> dict[str, Any]:
        out: dict[str, Any] = {"name": d.name}
        if d.module is not None:
            out.update(module=d.module, phase=d.phase)
        out.update(a_bytes=d.a, b_bytes=d.b, delta_bytes=d.delta, ratio=d.ratio)
        return out

    modules = c.modules if top is None else c.modules[:top]
    return {"a": side(c.a), "b": side(c.b), "categories": [delta(d) for d in c.categories],
            "modules": [delta(d) for d in modules], "modules_total": len(c.modules),
            "modules_only_in_a": list(c.only_a), "modules_only_in_b": list(c.only_b), "note": modes_note(c)}


def compare_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel compare A B [--step N] [--rank R] [--top K] [--bytes | --json]``."""
    p = ArgumentParser(
        prog="fsdp-mem-otel compare",
        description="What grew between two memory profiles (JSONL runs, or an estimate and a run): per category "
                    "at the step peak and per module at its forward/backward peaks, largest change first.")
    p.add_argument("a", metavar="A.jsonl",
                   help="the baseline: a run's JSONL (rotated files are read too) or an estimate")
    p.add_argument("b", metavar="B.jsonl", help="the run compared with it")
    p.add_argument("--step", type=int_at_least(0), default=None,
                   help="compare this step of both (default: each run's last deep step, else its last)")
    p.add_argument("--rank", type=int_at_least(0), default=0, help="the rank compared (default 0)")
    p.add_argument("--top", type=int_at_least(0), default=20, help="module rows shown (default 20; 0 = all)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--bytes", action="store_true",
                     help="every figure in exact bytes (default: each in the unit that fits it, B to GiB)")
    out.add_argument("--json", action="store_true",
                     help="print the comparison as JSON, every figure in exact bytes (--top applies to modules)")
    args = p.parse_args(argv)
    check_step_report_file(args.a, "A, the baseline")
    check_step_report_file(args.b, "B")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            c = compare_runs(args.a, args.b, step=args.step, rank=args.rank)
    except (OSError, ValueError) as exc:
        print(f"fsdp-mem-otel compare: {exc}", file=sys.stderr)
        return 1
    for w in caught[:5]:
        print(f"fsdp-mem-otel compare: warning: {w.message}", file=sys.stderr)
    if len(caught) > 5:
        print(f"fsdp-mem-otel compare: ... {len(caught) - 5} more lines skipped", file=sys.stderr)
    if args.json:
        json.dump(to_dict(c, top=args.top or None), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(c, top=args.top or None, exact=args.bytes))
    return 0
