"""Prometheus rules in deploy/: promtool, regeneration, and metric names against the catalog."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from fsdp_mem_otel.fleet import alerts, rules_command
from fsdp_mem_otel.fleet import catalog as cat

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / alerts.RULES_FILE
PROM_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # CI installs it (scripts/setup.sh): a missing promtool is a failure, not a skip
        pytest.fail("promtool not found: install Debian's prometheus package (scripts/setup.sh does)")
    return path


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    assert PROM_TESTS, "no promtool unit tests in deploy/prometheus/tests"
    out = subprocess.run([_promtool(), "test", "rules", *map(str, PROM_TESTS)], capture_output=True, text=True,
                         timeout=120, cwd=DEPLOY / "prometheus" / "tests")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in PROM_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == [f"../{alerts.RULES_FILE}"], path
        for case in doc["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = {r["alert"] for r in _rules() if "alert" in r}
    assert names - fires == set(), "alerts without a test case that fires them"
    assert names - quiet == set(), "alerts without a healthy-input test case that keeps them quiet"
    assert (fires | quiet) - names == set(), "tests name alerts that do not exist"


def test_committed_files_match_the_generator() -> None:
    for rel, text in rules_command.render(dashboards_dir=ROOT / "dashboards").items():
        path = DEPLOY / rel
        assert path.exists(), f"{path} missing: run `fsdp-mem-otel rules --out deploy/prometheus/`"
        assert path.read_text() == text, f"{path} is stale: run `fsdp-mem-otel rules --out deploy/prometheus/`"


def test_prometheusrule_carries_the_same_groups() -> None:
    rules_doc = yaml.safe_load(RULES.read_text())
    pr = yaml.safe_load((DEPLOY / "k8s" / alerts.PROMETHEUS_RULE_FILE).read_text())
    assert pr["kind"] == "PrometheusRule" and pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["spec"]["groups"] == rules_doc["groups"]


def _selector_names(expr: str) -> list[str]:
    names: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_selector_walk_sees_every_kind_of_node() -> None:
    expr = "sum by (a) (rate(a_total[5m] offset 1h)) / (max_over_time(b[30m:1m]) > 0) or time() - -c unless d"
    assert sorted(_selector_names(expr)) == ["a_total", "b", "c", "d"]


def test_every_metric_in_every_expression_is_in_the_catalog_or_recorded_here() -> None:
    known = set(cat.all_names())
    recorded: set[str] = set()
    for rule in _rules():
        for name in _selector_names(rule["expr"]):
            assert name in known or name in recorded, (
                f"{rule.get('alert') or rule.get('record')}: {name} is neither in catalog.py nor recorded "
                "before this rule"
            )
        if "record" in rule:
            recorded.add(rule["record"])
    assert recorded == set(alerts.RECORDING_NAMES)


def test_capacity_rules_read_what_runs_out_on_the_device() -> None:
    """FsdpMemNearDeviceCapacity, the forecast and the headroom read the device peak: the largest of
    the tracked step peak and the allocator's peaks of the step (capacity_test.yml runs them)."""
    rules = {r.get("alert") or r.get("record"): r for r in _rules()}
    assert set(_selector_names(rules[alerts.REC_RANK_DEVICE_PEAK]["expr"])) == {
        cat.STEP_PEAK_BYTES.name, cat.ALLOCATED_PEAK_BYTES.name, cat.ACTIVE_PEAK_BYTES.name,
        cat.RESERVED_PEAK_BYTES.name}
    for name in (alerts.REC_DEVICE_RATIO, alerts.REC_RANK_HOURS, alerts.REC_JOB_HEADROOM):
        assert alerts.REC_RANK_DEVICE_PEAK in _selector_names(rules[name]["expr"]), name
    assert _selector_names(rules["FsdpMemNearDeviceCapacity"]["expr"]) == [alerts.REC_DEVICE_RATIO]
    assert _selector_names(rules["FsdpMemCapacityForecast"]["expr"]) == [alerts.REC_RANK_HOURS]
    assert _selector_names(rules[alerts.REC_JOB_DEVICE_RATIO]["expr"]) == [alerts.REC_DEVICE_RATIO]
    assert (DEPLOY / "prometheus" / "tests" / "capacity_test.yml") in PROM_TESTS


def test_alerts_have_severity_summary_description_runbook() -> None:
    for rule in _rules():
        if "alert" not in rule:
            continue
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, rule["alert"]
        assert all(v.strip() for v in rule["annotations"].values()), rule["alert"]


def test_thresholds_are_configurable(tmp_path: Path) -> None:
    rc = rules_command.rules_main(["--out", str(tmp_path / "prom"), "--k8s-out", str(tmp_path / "k8s"),
                            "--regression-percent", "25",
                            "--regression-offset", "1d", "--capacity-ratio", "0.8", "--stalled-after", "30m"])
    assert rc == 0
    rules = {r.get("alert"): r for g in yaml.safe_load((tmp_path / "prom" / alerts.RULES_FILE).read_text())["groups"]
             for r in g["rules"]}
    assert "offset 1d" in rules["FsdpMemStepPeakRegression"]["expr"]
    assert "> 1.25" in rules["FsdpMemStepPeakRegression"]["expr"]
    assert "> 0.8" in rules["FsdpMemNearDeviceCapacity"]["expr"]
    assert "> 1800" in rules["FsdpMemTrainingStalled"]["expr"]
    assert (tmp_path / "k8s" / alerts.PROMETHEUS_RULE_FILE).exists()
    out = subprocess.run([_promtool(), "check", "rules", str(tmp_path / "prom" / alerts.RULES_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_leak_and_forecast_knobs_reach_both_rule_groups(tmp_path: Path) -> None:
    rc = rules_command.rules_main(["--out", str(tmp_path / "prom"), "--k8s-out", str(tmp_path / "k8s"),
                            "--leak-min-bytes-per-step", "1048576",
                            "--leak-lookback", "5m", "--leak-for", "30m", "--forecast-window", "2h",
                            "--forecast-hours", "24", "--forecast-for", "1h"])
    assert rc == 0
    rules = {r.get("alert") or r.get("record"): r
             for g in yaml.safe_load((tmp_path / "prom" / alerts.RULES_FILE).read_text())["groups"] for r in g["rules"]}
    leak = rules["FsdpMemLeak"]
    assert leak["for"] == "30m" and leak["expr"].count("[5m]") == 2 and leak["expr"].count("> 1048576\n") == 2
    forecast = rules["FsdpMemCapacityForecast"]
    assert "threshold 1048576 bytes per step" in leak["annotations"]["description"]
    assert forecast["for"] == "1h" and forecast["expr"] == f"{alerts.REC_RANK_HOURS} < 24\n"
    # the recording rule the alert reads fits over the window given (and its halves), not the default
    hours = rules[alerts.REC_RANK_HOURS]["expr"]
    assert hours.count("[2h]") == 4 and hours.count("[1h] offset 1h") == 2 and hours.count("offset 2h") == 2
    assert "[30m]" not in hours
    out = subprocess.run([_promtool(), "check", "rules", str(tmp_path / "prom" / alerts.RULES_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_forecast_halves() -> None:
    assert [alerts._half(d) for d in ("1h", "10s", "15s", "90m", "1d")] == ["30m", "5s", "7500ms", "45m", "12h"]


@pytest.mark.parametrize("field,value", [("regression_window", "30 minutes"), ("capacity_ratio", 0.0),
                                         ("imbalance_percent", 150.0), ("stalled_after", 15),
                                         ("forecast_window", "1s"), ("leak_min_bytes_per_step", 0.0),
                                         ("leak_lookback", "2 minutes")])
def test_rule_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        alerts.RuleConfig(**{field: value})  # type: ignore[arg-type]
