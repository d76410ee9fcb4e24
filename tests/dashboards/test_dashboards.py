"""Generated Grafana dashboards: committed JSON is current, every query is valid PromQL over catalog
metrics only, and the JSON type-checks against Grafana's published TypeScript types.

The live check (every query answered by a real Prometheus scraping a real 2-rank training) is in
test_live_prometheus.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.fleet import dashboards as dash
from fsdp_mem_otel.fleet.alerts import RECORDED_LABELS

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "dashboards"
SCHEMA_TOOL = REPO / "tools" / "grafana-schema"

#: every target allowed to be empty on a CPU-only run: (dashboard uid, panel title, refId).
#: Adding a CUDA-only query is a deliberate change to this list.
EXPECTED_CUDA_ONLY = {
    ("fsdp-mem-fleet", "OOMs in range", "A"),
    ("fsdp-mem-fleet", "Allocator retries in range", "A"),
    ("fsdp-mem-fleet", "Memory peak as share of device capacity", "A"),
    ("fsdp-mem-fleet", "Tracked vs allocator peak per job (largest rank)", "B"),
    ("fsdp-mem-fleet", "Tracked vs allocator peak per job (largest rank)", "C"),
    ("fsdp-mem-job", "Tracked vs allocator peak (largest rank)", "B"),
    ("fsdp-mem-job", "Tracked vs allocator peak (largest rank)", "C"),
    ("fsdp-mem-fleet", "OOMs and allocator retries per job", "A"),
    ("fsdp-mem-fleet", "OOMs and allocator retries per job", "B"),
    ("fsdp-mem-fleet", "Hours to device capacity per job (soonest first)", "A"),
    ("fsdp-mem-job", "Hours to device capacity per rank (soonest first)", "A"),
    ("fsdp-mem-allocator", "Tracked vs allocator", "C"),
    ("fsdp-mem-allocator", "Tracked vs allocator", "D"),
    ("fsdp-mem-allocator", "Tracked vs allocator", "E"),
    ("fsdp-mem-allocator", "Tracked vs allocator", "F"),
    ("fsdp-mem-allocator", "Untracked bytes (allocated - tracked)", "A"),
    ("fsdp-mem-allocator", "Device memory outside PyTorch (used - reserved)", "A"),
    ("fsdp-mem-allocator", "Fragmentation (1 - allocated / reserved)", "A"),
    ("fsdp-mem-allocator", "Cached and split bytes", "A"),
    ("fsdp-mem-allocator", "Cached and split bytes", "B"),
    ("fsdp-mem-allocator", "Allocator retries and OOMs", "A"),
    ("fsdp-mem-allocator", "Allocator retries and OOMs", "B"),
    ("fsdp-mem-allocator", "Allocator peak - tracked step peak", "A"),
    ("fsdp-mem-allocator", "Allocator peak - tracked step peak", "B"),
    ("fsdp-mem-allocator", "Memory peak as share of device capacity", "A"),
}

#: every target allowed to be empty on a job that does not leak (the tracker exports the leak series
#: only while a category grows or tensors outlive the step): (dashboard uid, panel title, refId)
EXPECTED_LEAK_ONLY = {
    ("fsdp-mem-fleet", "Leak growth per job and category (bytes per step)", "A"),
    ("fsdp-mem-job", "Leak growth per category (fastest rank)", "A"),
    ("fsdp-mem-job", "Bytes held at step end per module (largest rank)", "A"),
}
#: targets that answer only where memory grows steadily over the rules' forecast window
#: (alerts.forecast_expression): the hours to device capacity
EXPECTED_GROWTH_ONLY = {
    ("fsdp-mem-fleet", "Hours to device capacity per job (soonest first)", "A"),
    ("fsdp-mem-job", "Hours to device capacity per rank (soonest first)", "A"),
}

#: Grafana's built-in variables, with values a 1 s scrape interval makes sensible
BUILTINS = {"__rate_interval": "4s", "__interval": "1s", "__range": "60s", "__range_s": "60"}
_VAR_RE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)")
_REGEX_META = re.compile(r"[$^*{}\[\]'+?.()|]")
_LABEL_VALUES_RE = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.S)


# -- helpers shared with test_live_prometheus.py ---------------------------------------------------
def targets(d: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query target of a dashboard JSON (rows' collapsed panels included)."""
    for panel in d["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                yield inner, t


def variables(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in d["templating"]["list"]}


def grafana_escape(value: str) -> str:
    """Grafana's prometheusSpecialRegexEscape: a value inside a PromQL regex string."""
    return _REGEX_META.sub(lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))


def substitute(expr: str, d: dict[str, Any], values: dict[str, list[str]]) -> str:
    """Interpolate Grafana variables as Grafana's Prometheus data source does.

    ``values``: variable -> selected values (``[".*"]`` with the variable's allValue means "All").
    Multi-value / include-All variables become ``(a|b)`` of regex-escaped values; single-value ones are
    inserted as they are.
    """
    defs = variables(d)

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        fmt = m.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name not in defs:
            raise KeyError(f"{d['uid']}: ${name} is not a variable of the dashboard")
        vals = values[name]
        v = defs[name]
        if v.get("includeAll") and vals == [v.get("allValue", ".*")]:
            return vals[0]
        if fmt == "regex" or v.get("multi") or v.get("includeAll"):
            escaped = [grafana_escape(x) for x in vals]
            return escaped[0] if len(escaped) == 1 and not v.get("multi") else "(" + "|".join(escaped) + ")"
        if len(vals) != 1:
            raise ValueError(f"${name} is single-valued; got {vals}")
        return vals[0]

    return _VAR_RE.sub(one, expr)


def label_values_selector(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    m = _LABEL_VALUES_RE.match(query.strip())
    assert m, f"not a label_values() query: {query!r}"
    return m.group(1), m.group(2)


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every vector selector of a PromQL expression (inside range selectors, subqueries, ... too)."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


def metric_names(expr: str) -> set[str]:
    """Metric names the expression selects, from the parsed AST (``{__name__="x"}`` included)."""
    names: set[str] = set()
    for vs in selectors(expr):
        if vs.name:
            names.add(vs.name)
        for m in vs.matchers.matchers:
            if m.name == "__name__":
                names.add(m.value)
        assert not vs.matchers.or_matchers, f"'or' matchers are not used here: {expr}"
    return names


# -- sample values for the offline checks ---------------------------------------------------------------
SAMPLE_VALUES: dict[str, list[str]] = {
    "datasource": ["prometheus"],
    "namespace": ["ml"],
    "job": ["train.llm-7b"],
    "pod": ["train-llm-0", "train-llm-1"],
    "rank": ["0", "1"],
    "inspect": ["0"],
    "module": ["<root>", "layers.0", "layers.0.attn"],
    "baseline": ["1d"],
}


def all_values(d: dict[str, Any]) -> dict[str, list[str]]:
    """Every include-All variable set to All, the rest to a sample value."""
    out = {}
    for name, v in variables(d).items():
        out[name] = [v.get("allValue", ".*")] if v.get("includeAll") else SAMPLE_VALUES[name][:1]
    return out


@pytest.fixture(scope="module")
def built() -> list[dash.Dashboard]:
    return dash.build_dashboards()


# -- tests --------------------------------------------------------------------------------------------------
def test_committed_dashboards_are_current(built: list[dash.Dashboard], tmp_path: Path) -> None:
    names = sorted(d.file_name for d in built)
    assert sorted(p.name for p in COMMITTED.glob("*.json")) == names, "stale or missing files in dashboards/"
    for d in built:
        assert (COMMITTED / d.file_name).read_text(encoding="utf-8") == d.render(), (
            f"dashboards/{d.file_name} is out of date: run `fsdp-mem-otel dashboards --out dashboards/`")
    # the entry points write the same bytes, twice in a row (stable output)
    assert [p.name for p in dash.write_dashboards(tmp_path / "a")] == [d.file_name for d in built]
    assert dash.dashboards_main(["--out", str(tmp_path / "b")]) == 0
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() == \
            (COMMITTED / name).read_bytes()
    assert dash.dashboards_main(["--out", str(COMMITTED), "--check"]) == 0
    (tmp_path / "b" / names[0]).write_text("{}\n")
    assert dash.dashboards_main(["--out", str(tmp_path / "b"), "--check"]) == 1


def test_structure(built: list[dash.Dashboard]) -> None:
    assert len({d.uid for d in built}) == len(built) == 3
    for d in built:
        j = d.json
        assert j["uid"] == d.uid and j["title"] == d.title and dash.TAG in j["tags"]
        text = d.render()
        for key in ('"created"', '"updated"', '"iteration"', '"version"'):
            assert key not in text  # nothing that changes from one build to the next
        ids = [p["id"] for p in j["panels"]]
        assert ids == list(range(1, len(ids) + 1))
        titles = [p["title"] for p in j["panels"] if p["type"] != "row"]
        assert len(titles) == len(set(titles))
        defs = variables(j)
        assert {"datasource", "namespace", "job"} <= set(defs)
        # the fleet overview reads per-job recorded series only: no per-rank variables
        assert ({"pod", "rank"} <= set(defs)) == (d.uid != "fsdp-mem-fleet"), d.uid
        assert defs["datasource"]["type"] == "datasource" and defs["datasource"]["query"] == "prometheus"
        for panel, t in targets(j):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert t["datasource"] == panel["datasource"] and t["refId"]
            assert panel["fieldConfig"]["defaults"]["unit"] in ("bytes", "percentunit", "s", "h", "short"), \
                panel["title"]
            assert "$namespace" in t["expr"] and "$job" in t["expr"], panel["title"]
            # raw per-rank series are scoped by $rank or $inspect; recorded series by what they keep
            raw = metric_names(substitute(t["expr"], j, SAMPLE_VALUES)) - set(RECORDED_LABELS)
            assert "$rank" in t["expr"] or "$inspect" in t["expr"] or not raw, panel["title"]
            assert not raw or d.uid != "fsdp-mem-fleet", (panel["title"], raw)
    by_uid = {d.uid: d.json for d in built}
    assert "module" in variables(by_uid["fsdp-mem-job"])
    assert variables(by_uid["fsdp-mem-fleet"])["job"]["multi"] is True
    assert variables(by_uid["fsdp-mem-job"])["job"]["multi"] is False
    # what a panel repeats over (a row per rank, a panel per rank) has no All
    for d in built:
        for panel in d.json["panels"]:
            if panel.get("repeat"):
                assert not variables(d.json)[panel["repeat"]].get("includeAll"), (d.uid, panel["title"])
    panel_types = {p["type"] for d in built for p in d.json["panels"]}
    assert {"timeseries", "table", "heatmap", "stat", "row"} <= panel_types


def test_every_query_parses_after_substitution(built: list[dash.Dashboard]) -> None:
    n = 0
    for d in built:
        for values in (SAMPLE_VALUES, all_values(d.json)):
            for panel, t in targets(d.json):
                expr = substitute(t["expr"], d.json, values)
                assert "$" not in expr, expr
                try:
                    promql_parser.parse(expr)
                except Exception as exc:  # noqa: BLE001 - report which panel
                    pytest.fail(f"{d.uid} / {panel['title']} / {t['refId']}: {exc}\n{expr}")
                n += 1
            for v in variables(d.json).values():
                if v["type"] == "query":
                    selector, _ = label_values_selector(substitute(v["query"], d.json, values))
                    promql_parser.parse(selector)
    assert n > 50


def test_escaping_is_grafanas() -> None:
    d = {"uid": "x", "templating": {"list": [
        {"name": "m", "multi": True, "includeAll": True, "allValue": ".*"},
        {"name": "j", "multi": False},
    ]}}
    got = substitute('x{module=~"$m", job_name="$j"}[$__rate_interval]', d, {"m": ["layers.0", "<root>"], "j": ["a"]})
    assert got == 'x{module=~"(layers\\\\.0|<root>)", job_name="a"}[4s]'
    vs = selectors(got)[0]
    assert {m.name: m.value for m in vs.matchers.matchers}["module"] == "(layers\\.0|<root>)"  # the regex
    assert re.fullmatch("(layers\\.0|<root>)", "layers.0") and not re.fullmatch("(layers\\.0|<root>)", "layersX0")
    assert substitute('x{module=~"$m"}', d, {"m": [".*"], "j": ["a"]}) == 'x{module=~".*"}'


def _labels_of(name: str) -> set[str]:
    if name in RECORDED_LABELS:
        return set(RECORDED_LABELS[name])
    m = cat.metric(name)
    return set(m.all_labels) | set(cat.IDENTITY_LABELS) | set(cat.OPTIONAL_IDENTITY_LABELS)


def test_every_metric_is_in_the_catalog(built: list[dash.Dashboard]) -> None:
    # catalog metrics, and the recording rules' series (fleet-wide panels read those)
    catalog = set(cat.all_names()) | set(RECORDED_LABELS)
    used: set[str] = set()
    for d in built:
        for panel, t in targets(d.json):
            expr = substitute(t["expr"], d.json, SAMPLE_VALUES)
            names = metric_names(expr)
            assert names, f"{d.uid} / {panel['title']}: no metric"
            assert names <= catalog, f"{d.uid} / {panel['title']}: not in the catalog: {names - catalog}"
            for vs in selectors(expr):  # and each label matched is one the metric carries
                assert vs.name, f"{d.uid} / {panel['title']}: select metrics by name"
                allowed = _labels_of(vs.name)
                labels = {x.name for x in vs.matchers.matchers}
                assert labels <= allowed, f"{d.uid} / {panel['title']}: {vs.name} has no label {labels - allowed}"
            used |= names
        for v in variables(d.json).values():
            if v["type"] == "query":
                selector, label = label_values_selector(substitute(v["query"], d.json, SAMPLE_VALUES))
                names = metric_names(selector)
                assert names and names <= catalog
                assert all(label in _labels_of(x) for x in names)
    # the dashboards cover the memory metrics operators need, directly or through recorded series
    from fsdp_mem_otel.fleet.alerts import recording_rules

    reads = {r["record"]: metric_names(r["expr"]) for r in recording_rules()}
    for _ in range(3):  # recorded series read other recorded series
        used |= {name for rec in used & set(reads) for name in reads[rec]}
    for m in (cat.STEP_PEAK_BYTES, cat.CURRENT_BYTES, cat.MODULE_PEAK_BYTES, cat.DEVICE_TOTAL_BYTES,
              cat.ALLOCATED_BYTES, cat.RESERVED_BYTES, cat.UNTRACKED_BYTES, cat.FRAGMENTATION_RATIO,
              cat.ALLOC_RETRIES_TOTAL, cat.OOMS_TOTAL, cat.RESIDENT_BYTES, cat.SIDECAR_RANK_STALE,
              cat.LEAK_GROWTH, cat.STEP_END_HELD_BYTES):
        assert m.name in used, m.name


def test_selector_helper_rejects_unknown_labels() -> None:
    scope = dash.Scope(multi_job=True)
    assert dash.sel(cat.STEP_PEAK_BYTES, scope, category="total").startswith(cat.STEP_PEAK_BYTES.name + "{")
    with pytest.raises(ValueError, match="no label 'phase'"):
        dash.sel(cat.STEP_PEAK_BYTES, scope, phase="forward")
    with pytest.raises(ValueError, match="operator"):
        dash.sel(cat.STEP_PEAK_BYTES, None, ("category", "==", "x"))


def test_cuda_only_targets_are_exactly_the_listed_ones(built: list[dash.Dashboard]) -> None:
    got = {(d.uid, title, ref) for d in built for title, ref in d.cuda_only}
    assert got == EXPECTED_CUDA_ONLY
    for d in built:
        for panel, t in targets(d.json):
            if (panel["title"], t["refId"]) in d.cuda_only:
                assert "CUDA only" in panel["description"]


def test_leak_only_targets_are_exactly_the_listed_ones(built: list[dash.Dashboard]) -> None:
    got = {(d.uid, title, ref) for d in built for title, ref in d.leak_only}
    assert got == EXPECTED_LEAK_ONLY
    assert not EXPECTED_LEAK_ONLY & EXPECTED_CUDA_ONLY  # a leaking CPU job answers them
    assert EXPECTED_GROWTH_ONLY <= EXPECTED_CUDA_ONLY  # hours to capacity: a CUDA device's capacity
    for d in built:
        for panel, t in targets(d.json):
            if (panel["title"], t["refId"]) in d.leak_only:
                assert "Empty while nothing leaks" in panel["description"]


# -- Grafana's TypeScript dashboard types -------------------------------------------------------------
def _installed_version(package: str) -> str | None:
    try:
        return json.loads((SCHEMA_TOOL / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def _ensure_node_modules() -> None:
    lock = json.loads((SCHEMA_TOOL / "package-lock.json").read_text())
    wanted = {name: lock["packages"][f"node_modules/{name}"]["version"] for name in ("@grafana/schema", "typescript")}
    if all(_installed_version(name) == version for name, version in wanted.items()):
        return
    npm = shutil.which("npm")
    assert npm is not None, "npm is required for the Grafana schema check (CI must install Node.js and npm)"
    proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=SCHEMA_TOOL, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"npm ci failed:\n{proc.stdout}\n{proc.stderr}"


def _ts_module(d: dict[str, Any]) -> str:
    return ("import type { Dashboard } from '@grafana/schema';\nimport type { Loose } from './loose';\n\n"
            f"export const dashboard: Loose<Dashboard> = {json.dumps(d, indent=2, sort_keys=True)};\n")


def test_json_typechecks_against_grafana_schema(built: list[dash.Dashboard], tmp_path: Path) -> None:
    """``tsc --noEmit`` over one tiny module per dashboard: ``const dashboard: Loose<Dashboard> = <json>``.

    ``Dashboard`` is @grafana/schema's (pinned in tools/grafana-schema/package-lock.json to the Grafana
    11.6 line, like the SDK). ``Loose`` (tools/grafana-schema/loose.ts) only turns string enums into
    the union of their values, since TypeScript never lets a JSON string literal be a string enum
    member. A deliberately broken copy must fail, so the check is not vacuous.
    """
    assert shutil.which("node") is not None, "node is required for the Grafana schema check"
    _ensure_node_modules()
    (tmp_path / "node_modules").symlink_to(SCHEMA_TOOL / "node_modules", target_is_directory=True)
    shutil.copy(SCHEMA_TOOL / "loose.ts", tmp_path / "loose.ts")
    (tmp_path / "tsconfig.json").write_text(json.dumps(
        {"extends": str(SCHEMA_TOOL / "tsconfig.json"), "include": ["*.ts"]}))
    for d in built:
        (tmp_path / f"{d.uid}.ts").write_text(_ts_module(d.json))
    broken = json.loads(built[0].render())
    broken["panels"][1]["gridPos"]["depth"] = 3  # not a field of GridPos
    broken["panels"][1]["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolut", "steps": []}  # no such value
    broken["templating"]["list"][1]["refresh"] = "2"  # a number enum, not a string
    (tmp_path / "broken.ts").write_text(_ts_module(broken))
    tsc = SCHEMA_TOOL / "node_modules" / ".bin" / "tsc"
    proc = subprocess.run([str(tsc), "--noEmit", "-p", str(tmp_path / "tsconfig.json")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})
    errors = [line for line in proc.stdout.splitlines() if ": error TS" in line]
    assert proc.returncode != 0 and errors, proc.stdout + proc.stderr
    assert all(line.startswith("broken.ts(") for line in errors), "\n".join(errors)
    text = "\n".join(errors)
    assert len(errors) == 3, text  # one per planted fault, none from the real dashboards
    assert "'\"depth\"' does not exist" in text and "'\"absolut\"'" in text and "VariableRefresh" in text, text
