"""``fsdp-mem-otel compare``: two real demo runs (2 ranks, FSDP2) that differ by a known batch size.

The oracle is arithmetic on the JSONL files, read here with ``json`` alone, and on the batch:
the demo's input is ``batch x width`` float32 per rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_mem_otel.compare import compare_runs, render_html_section, render_text

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


def test_cli_and_its_errors(runs: dict[str, Path], tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fsdp_mem_otel.cli", "compare", *args], capture_output=True,
                              text=True, timeout=120)

    ok = run(str(runs["small"]), str(runs["large"]), "--top", "3")
    assert ok.returncode == 0, ok.stderr
    assert "At the step peak, by category:" in ok.stdout and "top 3" in ok.stdout
    step = run(str(runs["small"]), str(runs["large"]), "--step", "99")
    assert step.returncode == 1 and "has no step 99" in step.stderr
    missing = run(str(tmp_path / "nothing.jsonl"), str(runs["large"]))
    assert missing.returncode == 1 and "nothing.jsonl" in missing.stderr
    rank = run(str(runs["small"]), str(runs["large"]), "--rank", "5")
    assert rank.returncode == 1 and "no step report of rank 5" in rank.stderr
    bad = run(str(runs["small"]), str(runs["large"]), "--top", "-1")
    assert bad.returncode == 2 and "--top" in bad.stderr


def test_compare_does_not_import_torch() -> None:
    code = "import sys, fsdp_mem_otel.compare; assert 'torch' not in sys.modules, 'torch imported'"
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
    assert "+0.002" in inputs_row[:200]  # (16 - 8) x 64 x 4 bytes = 2 KiB, in MiB
