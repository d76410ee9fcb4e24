"""``fsdp-mem-otel rules``: writes the alert and recording rules (``alerts.py``), the same rules as a
PrometheusRule, and the dashboards' ConfigMaps (the dashboards built by ``dashboards.py``,
wrapped by ``k8s_files.py``). Here, not in ``alerts.py``, because the dashboards read the
rules' recorded series: the command is the one place that needs both."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from fsdp_mem_otel.cli_errors import ArgumentParser
from fsdp_mem_otel.fleet.alerts import (
    DASHBOARDS_FILE,
    PROMETHEUS_RULE_FILE,
    RULES_FILE,
    RuleConfig,
    prometheus_rule,
    rule_groups,
)
from fsdp_mem_otel.fleet.k8s_files import configmaps, dashboards_configmaps, to_yaml


def built_dashboards_configmaps() -> list[dict[str, Any]]:
    """The dashboards' ConfigMaps from the dashboards built here (``dashboards.build_dashboards``,
    from the catalog): the same as from the files ``fsdp-mem-otel dashboards`` writes."""
    from fsdp_mem_otel.fleet.dashboards import build_dashboards

    return configmaps(sorted((d.file_name, json.loads(d.render())) for d in build_dashboards()))


def render(cfg: RuleConfig | None = None, dashboards_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Generated file name (relative: ``prometheus/...`` or ``k8s/...``) -> content. The
    dashboards' ConfigMaps hold ``dashboards_dir/*.json``, or (None) the dashboards built from
    the package, wherever it runs."""
    cms = built_dashboards_configmaps() if dashboards_dir is None else dashboards_configmaps(dashboards_dir)
    if not cms:
        raise ValueError(f"{dashboards_dir} holds no *.json")
    return {
        f"prometheus/{RULES_FILE}": to_yaml({"groups": rule_groups(cfg)}),
        f"k8s/{PROMETHEUS_RULE_FILE}": to_yaml(prometheus_rule(cfg)),
        f"k8s/{DASHBOARDS_FILE}": to_yaml(*cms),
    }


def write(out: str | os.PathLike[str], k8s_out: str | os.PathLike[str], cfg: RuleConfig | None = None,
          dashboards_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Write the rules file to ``out`` and the PrometheusRule and dashboards ConfigMaps to ``k8s_out``."""
    written = []
    for rel, text in render(cfg, dashboards_dir).items():  # rules_main writes the same, checking each path
        kind, name = rel.split("/", 1)
        directory = Path(out if kind == "prometheus" else k8s_out)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(str(path))
    return written


def rules_main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-mem-otel rules --out deploy/prometheus/ [--k8s-out deploy/k8s/] [thresholds]``."""
    p = ArgumentParser(
        prog="fsdp-mem-otel rules",
        description="Write the Prometheus alert/recording rules, the same rules as a PrometheusRule, and the "
                    "Grafana dashboards ConfigMaps.",
    )
    p.add_argument("--out", default="deploy/prometheus", help="directory for the rules file (default %(default)s)")
    p.add_argument("--k8s-out", default=None,
                   help="directory for prometheusrule.yaml and grafana-dashboards.yaml (default: OUT/../k8s)")
    p.add_argument("--dashboards", default=None, metavar="DIR",
                   help="directory of dashboard JSON files to put in the ConfigMaps (default: the dashboards built "
                        "from the package, as `fsdp-mem-otel dashboards` writes them)")
    defaults = RuleConfig()
    for f in fields(RuleConfig):
        default = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                       help=f"(default {default})")
    args = p.parse_args(argv)
    try:
        cfg = RuleConfig(**{f.name: getattr(args, f.name) for f in fields(RuleConfig)})
    except ValueError as exc:
        p.error(str(exc))
    from fsdp_mem_otel.cli_errors import UsageError, check_writable, write_failed

    k8s_out = os.path.normpath(args.k8s_out if args.k8s_out is not None else os.path.join(args.out, os.pardir, "k8s"))
    check_writable(args.out, "--out", directory=True)
    check_writable(k8s_out, "--k8s-out" if args.k8s_out is not None else "--k8s-out (default OUT/../k8s)",
                   directory=True)
    if args.dashboards is not None:
        if os.path.exists(args.dashboards) and not os.path.isdir(args.dashboards):
            raise UsageError(f"--dashboards {args.dashboards}: is a file; give the folder of dashboard JSON files "
                             "(or leave --dashboards out to build them from the package)")
        if not any(Path(args.dashboards).glob("*.json")):
            raise UsageError(f"--dashboards {args.dashboards}: holds no *.json; give the folder `fsdp-mem-otel "
                             "dashboards --out` wrote (or leave --dashboards out to build them from the package)")
    try:
        files = render(cfg, args.dashboards)
    except ValueError as exc:
        raise UsageError(f"--dashboards {args.dashboards}: {exc}") from exc
    for rel, text in files.items():
        kind, name = rel.split("/", 1)
        directory = Path(args.out if kind == "prometheus" else k8s_out)
        path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise write_failed(path, "--out" if kind == "prometheus" else "--k8s-out", exc) from exc
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from fsdp_mem_otel.cli_errors import run_command

    raise SystemExit(run_command("fsdp-mem-otel rules", rules_main, sys.argv[1:]))
