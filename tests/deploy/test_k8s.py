"""Kubernetes files in deploy/k8s: schemas (built-in kinds and CRDs, strict), wiring, yamllint.

Built-in kinds are validated with kubernetes-validate (strict: unknown fields rejected) for
K8S_VERSION. Custom resources are validated with jsonschema against the CRD schemas stored in
deploy/k8s/crds/ (see the "$comment" of each for where it comes from); their embedded Kubernetes
types (ObjectMeta, PodTemplateSpec) resolve to kubernetes-validate's strict definitions.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from fsdp_mem_otel.fleet import alerts
from fsdp_mem_otel.fleet import catalog as cat
from fsdp_mem_otel.schema import CATEGORY_KEYS
from tests.exporters.test_prometheus import big_report, exposition, samples

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRDS = K8S / "crds"
K8S_VERSION = "1.33"
#: apiVersion group -> CRD schema file
CRD_FILES = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.json",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.json",
}
#: modules per rank budgeted in podmonitor.yaml's sampleLimit, and ranks (GPUs) per pod
BUDGET_MODULES = 256
BUDGET_DEVICES = 2
RANKS_PER_POD = 8
HEADROOM = 1.5


def _docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def _one(kind: str) -> dict[str, Any]:
    found = [d for _, d in _docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@cache
def _registry() -> Registry:
    defs_path = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
                 / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json")
    defs = Resource.from_contents(json.loads(defs_path.read_text()))
    # the CRD files refer to "/api/_definitions.json#/$defs/..." (no base URI): register both names
    return Registry().with_resources([("/api/_definitions.json", defs), (defs.id() or "", defs)])


def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((CRDS / CRD_FILES[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def _validate(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_FILES:
        _crd_validator(*key).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_validates_strictly() -> None:
    kinds = set()
    for path, doc in _docs():
        try:
            _validate(doc)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
        kinds.add(doc["kind"])
    assert {"PyTorchJob", "PodMonitor", "PrometheusRule", "ConfigMap", "Deployment", "Service", "DaemonSet"} <= kinds


def test_crd_schemas_are_strict_and_are_json_schemas() -> None:
    for name in CRD_FILES.values():
        schema = json.loads((CRDS / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$comment"], f"{name}: say where the schema comes from"
        assert schema["additionalProperties"] is False
        assert schema["properties"]["spec"]["additionalProperties"] is False


@pytest.mark.parametrize("kind,path,typo", [
    ("PodMonitor", ["spec"], "sampleLimt"),
    ("PodMonitor", ["spec", "podMetricsEndpoints", 0], "honourLabels"),
    ("PrometheusRule", ["spec", "groups", 0, "rules", 0], "expression"),
    ("PyTorchJob", ["spec"], "pytorchReplicaSpec"),
    ("PyTorchJob", ["spec", "runPolicy"], "cleanPodPolicyy"),
    # inside the embedded pod template: Kubernetes' own strict schema applies
    ("PyTorchJob", ["spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0], "imagePullPolicyy"),
    ("Deployment", ["spec", "template", "spec"], "containerz"),
    ("Service", ["spec"], "selectr"),
])
def test_typo_in_a_field_name_is_rejected(kind: str, path: list[Any], typo: str) -> None:
    doc = copy.deepcopy(_one(kind))
    _validate(doc)
    node: Any = doc
    for key in path:
        node = node[key]
    node[typo] = node.get(typo, "x")
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        _validate(doc)


def test_wrong_enum_value_is_rejected() -> None:
    doc = copy.deepcopy(_one("PyTorchJob"))
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


def _pod() -> dict[str, Any]:
    specs = _one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    return specs["Worker"]["template"]


def test_training_container_gets_identity_from_the_downward_api() -> None:
    pod = _pod()
    train = next(c for c in pod["spec"]["containers"] if c["name"] == "pytorch")
    env = {e["name"]: e for e in train["env"]}
    field = {k: v["valueFrom"]["fieldRef"]["fieldPath"] for k, v in env.items() if "valueFrom" in v}
    assert field["POD_NAME"] == "metadata.name"
    assert field["POD_NAMESPACE"] == "metadata.namespace"
    assert field["NODE_NAME"] == "spec.nodeName"
    assert field["POD_UID"] == "metadata.uid"
    assert "FSDP_MEM_OTEL_JOB" in env
    assert train["command"][0] == "torchrun"


def test_the_pod_template_turns_tracking_on_through_the_launcher() -> None:
    """The fleet way: the job's script runs unchanged under ``-m fsdp_mem_otel.run`` (a module
    this package has, with the ``run`` entry tests/integrations/test_launcher.py trains through)."""
    import importlib.util

    train = next(c for c in _pod()["spec"]["containers"] if c["name"] == "pytorch")
    assert train["command"] == ["torchrun", "-m", "fsdp_mem_otel.run", "/app/train.py"]
    assert importlib.util.find_spec("fsdp_mem_otel.run") is not None


RANK_DIR = "/fsdp-mem-otel/ranks"


def test_sidecar_serves_the_shared_directory_on_the_scraped_port() -> None:
    pod = _pod()["spec"]
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "fsdp-mem-otel")
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: the pod completes with training
    assert sidecar["command"][:6] == ["fsdp-mem-otel", "serve", "--dir", RANK_DIR, "--port", "9400"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in sidecar["ports"]
    train = next(c for c in pod["containers"] if c["name"] == "pytorch")
    vol = {v["name"]: v for v in pod["volumes"]}
    shared = {(m["name"], m["mountPath"]) for m in sidecar["volumeMounts"]}
    shared &= {(m["name"], m["mountPath"]) for m in train["volumeMounts"]}
    assert shared == {("fsdp-mem-otel", "/fsdp-mem-otel")}
    assert "emptyDir" in vol["fsdp-mem-otel"]
    # training writes where serve reads: a subdirectory of the open emptyDir, created owner-only
    train_env = {e["name"]: e.get("value") for e in train["env"]}
    assert train_env["FSDP_MEM_OTEL_SIDECAR_DIR"] == RANK_DIR
    assert train_env["FSDP_MEM_OTEL_PROMETHEUS"] == "0"
    assert os.path.dirname(RANK_DIR) == "/fsdp-mem-otel"
    # ... and serve runs as the training user, the only one that can read it
    assert pod["securityContext"]["runAsUser"] == 1000
    assert "runAsUser" not in sidecar.get("securityContext", {})

    pm = _one("PodMonitor")["spec"]
    labels = _pod()["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in pm["podMetricsEndpoints"]] == ["metrics"]


def test_sample_limit_follows_the_cardinality_budget() -> None:
    sidecar_per_rank = len(cat.by_scope(cat.SCOPE_SIDECAR))
    # FSDP_MEM_OTEL_DETAIL=1 with the default top-K, on an accelerator and the CPU (optimizer
    # step scalars), plus the omitted-modules gauge
    detail = cat.DEFAULT_DETAIL_TOP_K * cat.DETAIL_SERIES_PER_MODULE_DEVICE * BUDGET_DEVICES + 1
    # FSDP_MEM_OTEL_ESTIMATE: a module's forward and backward peak, and the step peak's categories
    estimate = 2 * BUDGET_MODULES + len(CATEGORY_KEYS)
    per_rank = cat.MAX_SERIES_PER_MODULE * BUDGET_MODULES + cat.MAX_OTHER_SERIES + detail + estimate
    per_pod = RANKS_PER_POD * (per_rank + sidecar_per_rank)
    expected = math.ceil(per_pod * HEADROOM / 500) * 500
    assert sidecar_per_rank > 0
    # the budget holds for a real exposition: 256 modules, two devices, every state, detail and
    # an estimate of the same model on
    big = big_report(BUDGET_MODULES)
    text = exposition(big, detail=True, estimate=big)
    assert len(samples(text)) <= per_rank
    assert any(s.name == "fsdp_mem_estimate_module_peak_bytes" for s in samples(text))
    assert _one("PodMonitor")["spec"]["sampleLimit"] == expected
    nproc = _one("PyTorchJob")["spec"]["nprocPerNode"]
    assert int(nproc) == RANKS_PER_POD


def test_collector_receives_otlp_http_and_batches_to_debug() -> None:
    cm = next(d for _, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fsdp-mem-otel-collector")
    conf = yaml.safe_load(cm["data"]["config.yaml"])
    assert conf["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    pipe = conf["service"]["pipelines"]["traces"]
    assert pipe["receivers"] == ["otlp"] and pipe["processors"][-1] == "batch" and pipe["exporters"] == ["debug"]
    for section in ("receivers", "processors", "exporters"):
        assert set(pipe[section]) <= set(conf[section])
    svc = _one("Service")
    assert [p["port"] for p in svc["spec"]["ports"]] == [4318]
    env = {e["name"]: e.get("value") for e in next(c for c in _pod()["spec"]["containers"])["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{svc['metadata']['name']}:4318"


def test_dashboards_configmaps_from_json_files(tmp_path: Path) -> None:
    (tmp_path / "Memory Overview.json").write_text(json.dumps({"title": "Memory", "panels": []}))
    (tmp_path / "modules.json").write_text(json.dumps({"title": "Modules", "panels": [{"id": 1}]}))
    cms = alerts.dashboards_configmaps(tmp_path)
    assert [c["metadata"]["name"] for c in cms] == ["fsdp-mem-otel-dashboard-memory-overview",
                                                    "fsdp-mem-otel-dashboard-modules"]
    for cm in cms:
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (key, text), = cm["data"].items()
        assert json.loads(text) == json.loads((tmp_path / key).read_text())
    round_trip = list(yaml.safe_load_all(alerts.to_yaml(*cms)))
    assert round_trip == cms
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json"):
        alerts.dashboards_configmaps(tmp_path)


def test_committed_dashboards_configmaps_cover_every_dashboard() -> None:
    dashboards = sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    docs = [d for d in yaml.safe_load_all((K8S / alerts.DASHBOARDS_FILE).read_text()) if d]
    assert sorted(k for d in docs for k in d["data"]) == dashboards


def test_yamllint_passes_on_deploy() -> None:
    out = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(ROOT / "deploy" / ".yamllint"),
                          str(ROOT / "deploy")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sidecar_image_installs_the_released_package_without_torch() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    install = next(line for line in dockerfile.splitlines() if line.startswith("RUN pip install"))
    version = project["version"]
    assert f'"fsdp-mem-otel=={version}"' in install and "[" not in install  # no torch extra
    assert not any(dep.startswith("torch") for dep in project["dependencies"])
    assert "USER 1000:1000" in dockerfile.splitlines()
    sidecar = next(c for c in _pod()["spec"]["initContainers"] if c["name"] == "fsdp-mem-otel")
    assert sidecar["image"].endswith(":" + version)
    cmd = json.loads(next(line for line in dockerfile.splitlines() if line.startswith("CMD "))[4:])
    assert cmd[:3] == ["serve", "--dir", RANK_DIR]


REMOTE_WRITE = ROOT / "deploy" / "remote-write"


def _agent_config(node: str = "node-1") -> dict[str, Any]:
    """The DaemonSet's agent configuration as its init container renders it on ``node``."""
    cm = next(d for _, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fsdp-mem-otel-agent")
    init = _one("DaemonSet")["spec"]["template"]["spec"]["initContainers"][0]
    script = init["command"][-1]
    assert "s/@NODE_NAME@/$(NODE_NAME)/" in script  # Kubernetes expands $(NODE_NAME) from the env
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]} == {"NODE_NAME": "spec.nodeName"}
    return dict(yaml.safe_load(cm["data"]["agent.yml"].replace("@NODE_NAME@", node)))


def test_agent_daemonset_runs_the_shipped_agent_settings(tmp_path: Path) -> None:
    conf = _agent_config()
    shipped = yaml.safe_load((REMOTE_WRITE / "agent.yml").read_text())
    # the same WAL, queue and scrape settings as deploy/remote-write/agent.yml, whose comments
    # state the outage they ride out
    assert conf["remote_write"][0]["queue_config"] == shipped["remote_write"][0]["queue_config"]
    assert conf["global"] == shipped["global"]
    job, shipped_job = conf["scrape_configs"][0], shipped["scrape_configs"][0]
    assert job["honor_labels"] is shipped_job["honor_labels"] is True
    assert job["sample_limit"] == shipped_job["sample_limit"] == _one("PodMonitor")["spec"]["sampleLimit"]
    assert conf["global"]["scrape_interval"] == _one("PodMonitor")["spec"]["podMetricsEndpoints"][0]["interval"]
    sd = job["kubernetes_sd_configs"][0]
    assert sd["selectors"][0]["field"] == "spec.nodeName=node-1"  # its own node's pods only
    assert sd["selectors"][0]["label"] == "fsdp-mem-otel/scrape=true"
    assert "fsdp-mem-otel/scrape" in _pod()["metadata"]["labels"]
    agent = _one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    header = (REMOTE_WRITE / "agent.yml").read_text().split("---")[0]
    for flag in ("--enable-feature=agent", "--storage.agent.retention.max-time=4h"):
        assert flag in agent["args"] and flag.split("=")[0] in header + " --enable-feature"
    assert {m["mountPath"] for m in agent["volumeMounts"]} >= {"/agent"}
    assert "--storage.agent.path=/agent" in agent["args"]
    # a valid agent configuration, as Prometheus itself reads it; Debian's Prometheus is built
    # without Kubernetes discovery, so promtool reads it with the discovery swapped for a target
    assert set(sd) == {"role", "namespaces", "selectors"} and sd["role"] == "pod"
    job["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    del job["kubernetes_sd_configs"]
    path = tmp_path / "agent.yml"
    path.write_text(yaml.safe_dump(conf))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (scripts/setup.sh does)")
    out = subprocess.run([promtool, "check", "config", "--agent", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_central_accepts_the_backlog_of_the_outage_the_agent_rides_out() -> None:
    central = yaml.safe_load((REMOTE_WRITE / "central.yml").read_text())
    window = central["storage"]["tsdb"]["out_of_order_time_window"]
    agent = _one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    retention = next(a for a in agent["args"] if a.startswith("--storage.agent.retention.max-time="))
    assert retention.split("=")[1] == window == "4h"
    assert "rides out 4 h" in (REMOTE_WRITE / "agent.yml").read_text()


def test_training_pod_gives_the_sidecar_time_to_deliver_the_ranks_end() -> None:
    from fsdp_mem_otel.exporters.worker import EXIT_DEADLINE_SECONDS
    from fsdp_mem_otel.fleet.serve import DEFAULT_DRAIN_SECONDS

    spec = _pod()["spec"]
    interval = _one("PodMonitor")["spec"]["podMetricsEndpoints"][0]["interval"]
    assert DEFAULT_DRAIN_SECONDS > int(interval.rstrip("s"))  # a scrape comes within the drain
    assert spec["terminationGracePeriodSeconds"] > DEFAULT_DRAIN_SECONDS + EXIT_DEADLINE_SECONDS
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "fsdp-mem-otel")
    assert "--drain-seconds" not in sidecar["command"]  # the default
