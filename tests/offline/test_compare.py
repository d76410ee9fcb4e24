"""``fsdp-mem-otel compare``: two real demo runs (2 ranks, FSDP2) that differ by a known batch size.

The oracle is arithmetic on the JSONL files, read here with ``json`` alone, and on the batch:
the demo's input is ``batch x width`` float32 per rank; how a figure reads is written here
again (``scaled``), from the rule docs/compare.md states.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.offline.compare import compare_runs, render_html_section, render_text
from tests.offline.test_report import synthetic, write_jsonl

WIDTH = 64
BATCHES = (8, 16)


def demo_run(out: Path, batch: int, blocks: int = 3) -> Path:
    cmd = [sys.executable, "-m", "fsdp_mem_otel.cli", "demo", "--steps", "4", "--deep-every", "2", "--blocks",
           str(blocks), "--width", str(WIDTH), "--batch", str(batch), "--out", str(out / "run.jsonl")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                                 "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "run.rank0.jsonl"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, batch, blocks in (("small", BATCHES[0], 3), ("large", BATCHES[1], 3), ("deeper", BATCHES[0], 4)):
        d = tmp_path_factory.mktemp(name)
        out[name] = demo_run(d, batch, blocks)
    return out


def last_deep(path: Path) -> dict[str, Any]:
    """Rank 0's last deep step, straight from the file."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    deep = [x for x in lines if x["rank"] == 0 and x["mode"] == "deep" and not x.get("aborted")]
    return deep[-1]


def module_peak(line: dict[str, Any], key: str, state: str) -> int:
    calls = line["modules"][key]["snapshots"].get(state) or []
    return max(c["total"] for call in calls for c in call.values())


def scaled(n: int, signed: bool = False) -> str:
    """The oracle of a figure's text: under 1 KiB in bytes, else one decimal of the largest
    binary unit (KiB, MiB, GiB) it reaches; a change carries its sign."""
    sign = "+" if signed and n > 0 else ("-" if n < 0 else "")
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} B"
    unit, size = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s)
    return f"{sign}{n / size:.1f} {unit}"


def compare_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "compare", *args], capture_output=True,
                          text=True, timeout=120)


def table_rows(text: str, title: str) -> dict[str, list[str]]:
    """The rows of the table under ``title`` in compare's text output: first column -> the others."""
    lines = text[text.index(title):].splitlines()[3:]  # title, header, rule
    rows = {}
    for line in lines:
        if not line.strip():
            break
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip()] = [c.strip() for c in cells[1:]]
    return rows


def test_grown_categories_and_modules_match_the_jsonl(runs: dict[str, Path]) -> None:
    c = compare_runs(str(runs["small"]), str(runs["large"]))
    a, b = last_deep(runs["small"]), last_deep(runs["large"])
    assert (c.a.report.step, c.b.report.step) == (a["step"], b["step"])
    dev = c.a.device
    assert dev == "cpu"  # gloo on CPU
    for d in c.categories:
        assert (d.a, d.b) == (a["peak"][dev][d.name], b["peak"][dev][d.name]), d.name
    by_name = {d.name: d for d in c.categories}
    # the batch doubled: its input tensor grew by (16 - 8) x width x 4 bytes, activations grew
    assert by_name["inputs"].delta == (BATCHES[1] - BATCHES[0]) * WIDTH * 4
    assert by_name["activation"].delta > 0
    # the model did not change: parameters and optimizer state did not move
    for same in ("sharded_param", "optimizer_state"):
        assert by_name[same].delta == 0, same
    # ranked: largest change first
    assert [abs(d.delta) for d in c.categories] == sorted((abs(d.delta) for d in c.categories), reverse=True)
    names = set()
    for d in c.modules:
        key, phase = d.name.rsplit(" / ", 1)
        state = f"peak_{phase}"
        assert (d.a, d.b) == (module_peak(a, key, state), module_peak(b, key, state)), d.name
        names.add(key)
    assert names == set(a["modules"]) and not c.only_a and not c.only_b
    text = render_text(c)
    assert "activation" in text and "inputs" in text and "layers.0 / forward" in text
    section = render_html_section(c)
    assert section.startswith("<section") and "<td>activation</td>" in section


def test_different_structures_list_the_modules_one_side_has(runs: dict[str, Path]) -> None:
    c = compare_runs(str(runs["small"]), str(runs["deeper"]))
    assert c.only_a == [] and c.only_b == ["layers.3"]
    assert not any(d.name.startswith("layers.3 ") for d in c.modules)
    assert "Modules only in B: layers.3" in render_text(c)


def test_cli_scaled_units_exact_bytes_and_json_match_the_jsonl(runs: dict[str, Path]) -> None:
    a, b = last_deep(runs["small"]), last_deep(runs["large"])
    peak_a, peak_b = a["peak"]["cpu"], b["peak"]["cpu"]
    # (16 - 8) x 64 x 4 bytes: a 2 KiB change of the inputs
    assert peak_b["inputs"] - peak_a["inputs"] == (BATCHES[1] - BATCHES[0]) * WIDTH * 4 == 2048
    text = compare_cli(str(runs["small"]), str(runs["large"]))
    assert text.returncode == 0, text.stderr
    rows = table_rows(text.stdout, "At the step peak, by category:")
    assert rows["inputs"][:3] == [scaled(peak_a["inputs"]), scaled(peak_b["inputs"]), "+2.0 KiB"]
    assert set(rows) == set(peak_a)
    for cat, cells in rows.items():
        assert cells[:3] == [scaled(peak_a[cat]), scaled(peak_b[cat]), scaled(peak_b[cat] - peak_a[cat], True)], cat
    assert f"step peak {scaled(peak_a['total'])}" in text.stdout
    exact = compare_cli(str(runs["small"]), str(runs["large"]), "--bytes")
    assert exact.returncode == 0, exact.stderr
    rows = table_rows(exact.stdout, "At the step peak, by category:")
    assert rows["inputs"][:3] == [f"{peak_a['inputs']:,}", f"{peak_b['inputs']:,}", "+2,048"]
    js = compare_cli(str(runs["small"]), str(runs["large"]), "--json", "--top", "0")
    assert js.returncode == 0, js.stderr
    got = json.loads(js.stdout)
    assert (got["a"]["step"], got["b"]["step"]) == (a["step"], b["step"])
    assert (got["a"]["step_peak_bytes"], got["b"]["step_peak_bytes"]) == (peak_a["total"], peak_b["total"])
    assert {d["name"]: (d["a_bytes"], d["b_bytes"], d["delta_bytes"]) for d in got["categories"]} == {
        cat: (peak_a[cat], peak_b[cat], peak_b[cat] - peak_a[cat]) for cat in peak_a}
    expected = {(key, phase): (module_peak(a, key, f"peak_{phase}"), module_peak(b, key, f"peak_{phase}"))
                for key in a["modules"] for phase in ("forward", "backward")}
    assert {(d["module"], d["phase"]): (d["a_bytes"], d["b_bytes"]) for d in got["modules"]} == expected
    assert all(d["delta_bytes"] == d["b_bytes"] - d["a_bytes"] for d in got["modules"])
    assert got["modules_total"] == len(expected) and got["modules_only_in_a"] == got["modules_only_in_b"] == []
    top = json.loads(compare_cli(str(runs["small"]), str(runs["large"]), "--json", "--top", "2").stdout)
    assert top["modules"] == got["modules"][:2] and top["modules_total"] == len(expected)


def test_a_change_under_one_kib_reads_in_bytes(tmp_path: Path) -> None:
    a, b = synthetic(step=3, rank=0), synthetic(step=3, rank=0)
    dev = next(iter(b.peak))
    b.peak[dev]["inputs"] += 300
    b.peak[dev]["total"] += 300
    write_jsonl(tmp_path / "a.jsonl", [a])
    write_jsonl(tmp_path / "b.jsonl", [b])
    out = compare_cli(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout, "At the step peak, by category:")
    assert rows["inputs"][2] == "+300 B" and rows["total"][2] == "+300 B"
    assert rows["activation"][2] == "0 B"  # unchanged
    got = json.loads(compare_cli(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--json").stdout)
    by_name = {d["name"]: d for d in got["categories"]}
    assert by_name["inputs"]["delta_bytes"] == 300 and by_name["activation"]["delta_bytes"] == 0


def test_cli_and_its_errors(runs: dict[str, Path], tmp_path: Path) -> None:
    run = compare_cli
    ok = run(str(runs["small"]), str(runs["large"]), "--top", "3")
    assert ok.returncode == 0, ok.stderr
    assert "At the step peak, by category:" in ok.stdout and "top 3" in ok.stdout
    step = run(str(runs["small"]), str(runs["large"]), "--step", "99")
    assert step.returncode == 1 and "has no step 99" in step.stderr
    missing = run(str(tmp_path / "nothing.jsonl"), str(runs["large"]))
    assert missing.returncode == 2 and "nothing.jsonl (A, the baseline): no such file" in missing.stderr
    rank = run(str(runs["small"]), str(runs["large"]), "--rank", "5")
    assert rank.returncode == 1 and "no step report of rank 5" in rank.stderr
    bad = run(str(runs["small"]), str(runs["large"]), "--top", "-1")
    assert bad.returncode == 2 and "--top" in bad.stderr
    both = run(str(runs["small"]), str(runs["large"]), "--json", "--bytes")
    assert both.returncode == 2 and "--bytes" in both.stderr and "--json" in both.stderr


def test_compare_does_not_import_torch() -> None:
    code = "import sys, fsdp_mem_otel.offline.compare; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_report_with_a_baseline_has_the_comparison(runs: dict[str, Path], tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "report", str(runs["large"]), "-o", str(page),
                           "-q", "--baseline", str(runs["small"])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    section = text[text.index('<section class="comparison">'):]
    section = section[:section.index("</section>")]
    expected = render_html_section(compare_runs(str(runs["small"]), str(runs["large"])))
    assert section + "</section>" == expected
    inputs_row = section[section.index("<td>inputs</td>"):]
    assert "<td>+2.0 KiB</td>" in inputs_row[:200]  # (16 - 8) x 64 x 4 bytes = 2 KiB
