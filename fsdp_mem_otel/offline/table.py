"""Plain-text tables of a StepReport, for terminals and logs. Standard library only."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_mem_otel.schema import (
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    CATEGORIES,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    TOTAL,
    StepReport,
)


def human_bytes(n: float) -> str:
    """In the unit that fits the value: 300 -> '300 B', 1536 -> '1.5 KiB', then MiB and GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def signed_bytes(n: float) -> str:
    """A change in the unit that fits it: 2048 -> '+2.0 KiB', -300 -> '-300 B', 0 -> '0 B'."""
    return ("+" if n > 0 else "") + human_bytes(n)


def _device(report: StepReport, device: str | None) -> str:
    if device is not None:
        return device
    return max(report.peak, key=lambda d: report.peak[d].get(TOTAL, 0), default="cpu")


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned: the first left, the others right, a rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = [header[0].ljust(widths[0])] + [h.rjust(w) for h, w in zip(header[1:], widths[1:], strict=True)]
    out = ["  ".join(fmt), line]
    for r in rows:
        out.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
    return "\n".join(out)


def module_table(report: StepReport, device: str | None = None) -> str:
    """One row per FSDP module: peak forward/backward totals (max over calls), unsharded params
    after the pre-forward unshard, and the category that dominates its backward peak."""
    dev = _device(report, device)
    rows = []
    for key in report.module_order or sorted(report.modules):
        mod = report.modules.get(key)
        if mod is None:
            continue

        def peak_of(state: str, m=mod) -> dict[str, int]:  # type: ignore[no-untyped-def]
            calls = [c.get(dev, {}) for c in m.snapshots.get(state, [])]
            return max(calls, key=lambda c: c.get(TOTAL, 0), default={})

        fwd, bwd = peak_of(PEAK_FORWARD), peak_of(PEAK_BACKWARD)
        unsharded = max(
            (c.get(dev, {}).get("unsharded_param", 0) for s in (AFTER_PRE_FORWARD, AFTER_PRE_BACKWARD)
             for c in mod.snapshots.get(s, [])),
            default=0,
        )
        top = max(CATEGORIES, key=lambda c: bwd.get(c, 0)) if bwd else "-"
        calls = len(mod.snapshots.get(AFTER_PRE_FORWARD, []))
        rows.append([key, str(calls), human_bytes(fwd.get(TOTAL, 0)), human_bytes(bwd.get(TOTAL, 0)),
                     human_bytes(unsharded), top])
    header = ["module", "calls", "peak fwd", "peak bwd", "unsharded params", "largest at peak bwd"]
    return render_table(header, rows)


def peak_table(report: StepReport, device: str | None = None) -> str:
    """The step peak on ``device`` broken down by category (non-zero categories only)."""
    dev = _device(report, device)
    cats = report.peak.get(dev, {})
    total = cats.get(TOTAL, 0) or 1
    rows = [[c, human_bytes(cats[c]), f"{100 * cats[c] / total:.1f}%"] for c in CATEGORIES if cats.get(c, 0)]
    rows.append([TOTAL, human_bytes(cats.get(TOTAL, 0)), "100.0%"])
    return render_table([f"category ({dev}, step {report.step}, {report.mode})", "at step peak", "share"], rows)
