"""The fleet path under faults, on loopback with real ranks and real Prometheus servers.

Two "nodes", a and b, each with a Prometheus agent (deploy/remote-write/agent.yml, 1 s scrapes)
scraping the ``fsdp-mem-otel serve`` sidecar of each training "pod" on its node (each pod its own
rank files directory) and remote-writing to one central Prometheus
(deploy/remote-write/central.yml, 1 s evaluations) that evaluates the shipped rules, generated
with the lost-rank timings shortened through ``fsdp-mem-otel rules --lost-after --lost-for
--lost-window`` (LOST_AFTER, LOST_FOR below; promtool tests cover the shipped 2m/3m).

Job ``lost`` trains on 4 real FSDP2 ranks (gloo), ranks 0 and 1 on node a, 2 and 3 on node b;
job ``done`` on 2 real ranks in a pod of its own on node a. In one setup, in turn:

1. the central is stopped for CENTRAL_DOWN seconds and restarted on its storage: no gap beyond
   one scrape in its series once the agents' backlog arrived;
2. node a's agent restarts: a gap no longer than the restart;
3. node a's sidecar restarts: the series continue, counters without a reset;
4. node b is lost (its ranks and its sidecar killed, its agent too) while job ``done`` finishes
   cleanly: FsdpMemRankLost goes pending, then fires, for exactly ranks 2 and 3 of node b within
   the time the rules promise, FsdpMemJobRanksLost for job ``lost``; for job ``done`` no alert
   is ever pending.

What it measured is printed (``pytest -s``); docs/operations.md ("What each fault costs") says what it checks.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_mem_otel.fleet import alerts, rules_command
from fsdp_mem_otel.fleet import catalog as cat
from tests.dist import free_ports
from tests.prometheus_server import PrometheusProcess

ROOT = Path(__file__).resolve().parents[2]
REMOTE_WRITE = ROOT / "deploy" / "remote-write"
NAMESPACE = "faults"
SCRAPE = 1.0  # agents' scrape and the central's evaluation interval, seconds
CENTRAL_DOWN = 30.0
#: the shortened lost-rank timing (the shipped defaults are 2m and 3m): LOST_AFTER covers a
#: scrape, the agents' batch_send_deadline (5 s) and a sidecar or agent restart
LOST_AFTER, LOST_FOR = 15, 15
#: how long a sidecar serves an ended rank's last file (--ended-seconds; default 300)
ENDED = 10.0
#: job -> node -> ranks on that node
JOBS = {"lost": {"a": (0, 1), "b": (2, 3)}, "done": {"a": (0, 1)}}
INFO = cat.TRACKER_INFO.name


def _rank(job: str, rank: int, world: int, port: int, node: str, sidecar: str, stop_file: str) -> None:
    """One rank: FSDP2 training with the sidecar exporter until ``stop_file`` appears (then a
    clean close) or a peer vanishes (then it hangs, as a rank waiting for its collective's timeout
    does, its exporter heartbeating)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.identity import Identity
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = build(2, 32, WrapOptions(fsdp=2))
    ident = Identity(job, rank, rank % 2, world, "host", pod=f"{job}-{node}", namespace=NAMESPACE, node=f"node-{node}")
    exporter = PrometheusExporter(ident, http=False, sidecar_dir=sidecar, heartbeat_seconds=0.5,
                                  sidecar_interval_seconds=0.5)
    tracker = FSDPMemoryTracker(model, opt, exporters=[exporter]).attach()
    step = 0
    try:
        while True:
            stop = torch.tensor([float(os.path.exists(stop_file))])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            if stop.item():
                break
            train_step(model, opt, make_batch(step, 8, 32, rank), on_inputs=tracker.track_inputs)
            tracker.step()
            step += 1
            time.sleep(0.3)  # leave the 2 cores to the servers
    except RuntimeError:  # gloo: a peer is gone
        time.sleep(600)
        return
    tracker.close()  # a clean end
    dist.destroy_process_group()


# -- the central's HTTP API ----------------------------------------------------------------------------
def _api(base: str, query: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": query, **({"time": f"{at:.3f}"} if at is not None else {})}
    with urllib.request.urlopen(f"{base}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10) as resp:
        body = json.loads(resp.read().decode())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _sel(job: str, rank: int | None = None, name: str = INFO, **extra: str) -> str:
    labels = {"job_name": job, **({"rank": str(rank)} if rank is not None else {}), **extra}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _times(base: str, selector: str, start: float, end: float) -> list[float]:
    """Timestamps of the central's raw samples of one series between ``start`` and ``end``."""
    got = _api(base, f"{selector}[{int(end - start) + 1}s]", at=end)
    assert len(got) == 1, (selector, got)
    return [float(t) for t, _ in got[0]["values"] if t >= start]


def _max_gap(times: list[float]) -> float:
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def _wait(what: str, predicate: Any, timeout: float, every: float = 0.5, detail: Any = None) -> float:
    """Poll ``predicate`` until it holds; the time it first held (``detail()`` says why not)."""
    deadline = time.time() + timeout
    while True:
        if predicate():
            return time.time()
        assert time.time() < deadline, f"timed out waiting for {what}" + (f": {detail()}" if detail else "")
        time.sleep(every)


def _caught_up(base: str, selector: str, since: float) -> bool:
    """The central holds a sample of ``selector`` scraped after ``since``."""
    got = _api(base, f"timestamp({selector})")
    return bool(got) and float(got[0]["value"][1]) > since


def _scraping_since(base: str, since: float) -> bool:
    """Every target of the Prometheus at ``base`` was scraped successfully after ``since`` (a
    restarted Prometheus discovers its targets and scrapes them about 5 s after it is ready)."""
    with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as resp:
        targets = json.loads(resp.read().decode())["data"]["activeTargets"]

    def when(stamp: str) -> float:  # RFC 3339 with nanoseconds
        head, _, frac = stamp.rstrip("Z").partition(".")
        return datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp() + \
            float("0." + (frac or "0"))

    return bool(targets) and all(t["health"] == "up" and when(t["lastScrape"]) > since for t in targets)


def _wal_bytes_per_sample(base: str, storage: Path) -> float:
    """The agent's WAL bytes per sample appended so far (what a central outage's backlog costs on disk)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        line = next(x for x in resp.read().decode().splitlines()
                    if x.startswith("prometheus_agent_samples_appended_total"))
    size = sum(f.stat().st_size for f in (storage / "wal").rglob("*") if f.is_file())
    return size / float(line.split()[-1])


def _active(base: str) -> list[dict[str, Any]]:
    """The central's pending and firing alerts (labels, state, value)."""
    with urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=10) as resp:
        return list(json.loads(resp.read().decode())["data"]["alerts"])


def _alerts(base: str, alertname: str) -> set[tuple[str, ...]]:
    """(state, job_name, rank, node) of the alert's pending and firing instances."""
    return {(a["state"], a["labels"].get("job_name", ""), a["labels"].get("rank", ""), a["labels"].get("node", ""))
            for a in _active(base) if a["labels"]["alertname"] == alertname}


# -- the fleet ---------------------------------------------------------------------------------------
class Sidecar:
    """``fsdp-mem-otel serve`` over one node's rank files, restartable."""

    def __init__(self, directory: Path, port: int, log: Path) -> None:
        self.argv = [sys.executable, "-m", "fsdp_mem_otel.fleet.serve", "--dir", str(directory), "--port", str(port),
                     "--addr", "127.0.0.1", "--stale-seconds", "3", "--ended-seconds", str(ENDED)]
        self.url, self.log = f"http://127.0.0.1:{port}/", log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url, timeout=2):
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.send_signal(signum)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("faults")
    pods = [(job, node) for job, nodes in JOBS.items() for node in nodes]
    ports = {name: free_ports(1) for name in ("central", "agent-a", "agent-b", *(f"{j}-{n}" for j, n in pods))}
    # the shipped rules, with the lost-rank timing shortened by the rules command's own options
    assert rules_command.rules_main(["--out", str(tmp / "rules"), "--k8s-out", str(tmp / "k8s"),
                                     "--lost-after", f"{LOST_AFTER}s", "--lost-for", f"{LOST_FOR}s",
                                     "--lost-window", "10m"]) == 0
    central_conf = yaml.safe_load((REMOTE_WRITE / "central.yml").read_text())
    central_conf["global"]["evaluation_interval"] = f"{SCRAPE:g}s"
    central_conf["rule_files"] = [str(tmp / "rules" / alerts.RULES_FILE)]
    (tmp / "central.yml").write_text(yaml.safe_dump(central_conf))
    central = PrometheusProcess(tmp / "central.log", ports["central"], "--web.enable-remote-write-receiver",
                                f"--config.file={tmp / 'central.yml'}", f"--storage.tsdb.path={tmp / 'central-data'}")
    sidecars, agents = {}, {}
    for job, node in pods:
        (tmp / f"ranks-{job}-{node}").mkdir()
        sidecars[job, node] = Sidecar(tmp / f"ranks-{job}-{node}", ports[f"{job}-{node}"],
                                      tmp / f"sidecar-{job}-{node}.log")
    for node in ("a", "b"):
        conf = yaml.safe_load((REMOTE_WRITE / "agent.yml").read_text())
        conf["global"]["scrape_interval"] = f"{SCRAPE:g}s"
        conf["scrape_configs"][0]["static_configs"] = [
            {"targets": [f"127.0.0.1:{ports[f'{j}-{n}']}" for j, n in pods if n == node]}]
        conf["remote_write"][0]["url"] = f"http://127.0.0.1:{ports['central']}/api/v1/write"
        (tmp / f"agent-{node}.yml").write_text(yaml.safe_dump(conf))
        agents[node] = PrometheusProcess(tmp / f"agent-{node}.log", ports[f"agent-{node}"], "--enable-feature=agent",
                                         f"--config.file={tmp / f'agent-{node}.yml'}",
                                         f"--storage.agent.path={tmp / f'agent-{node}-data'}")
    ctx = mp.get_context("spawn")
    ranks: dict[tuple[str, int], Any] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(central.stop)
        base = central.start()
        for sidecar in sidecars.values():
            stack.callback(sidecar.stop)
            sidecar.start()
        for agent in agents.values():
            stack.callback(agent.stop)
            agent.start()

        def _kill_ranks() -> None:
            for p in ranks.values():
                if p.is_alive():
                    p.kill()
                p.join(10)

        stack.callback(_kill_ranks)
        for job, nodes in JOBS.items():
            world, port = sum(len(r) for r in nodes.values()), free_ports(1)
            for node, node_ranks in nodes.items():
                for r in node_ranks:
                    args = (job, r, world, port, node, str(tmp / f"ranks-{job}-{node}"), str(tmp / f"stop-{job}"))
                    ranks[job, r] = ctx.Process(target=_rank, args=args)
                    ranks[job, r].start()
        every = [(job, r) for job, nodes in JOBS.items() for rs in nodes.values() for r in rs]

        def missing() -> str:
            logs = "\n".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.log")))
            return (f"not in the central store: {[k for k in every if not _api(base, _sel(*k))]}, dead ranks: "
                    f"{[k for k, p in ranks.items() if not p.is_alive()]}, rank files: "
                    f"{sorted(str(f.relative_to(tmp)) for f in tmp.glob('ranks-*/*'))}\n{logs}")

        _wait("every rank in the central store",
              lambda: all(_api(base, _sel(job, r)) for job, r in every) and all(p.is_alive() for p in ranks.values()),
              timeout=240, every=1.0, detail=missing)
        time.sleep(5)  # some history before the first fault
        yield {"base": base, "tmp": tmp, "central": central, "agents": agents, "sidecars": sidecars, "ranks": ranks}


def _log(what: str, **values: Any) -> None:
    print(f"[faults] {what}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in values.items()), flush=True)


def test_faults_on_the_fleet_path(fleet: dict[str, Any]) -> None:
    base, central, agents, sidecars = fleet["base"], fleet["central"], fleet["agents"], fleet["sidecars"]
    node_a, node_b = _sel("lost", 0), _sel("lost", 2)

    # 1. central outage: no gap beyond one scrape once the agents' backlog arrived
    t0 = time.time()
    central.stop()
    time.sleep(CENTRAL_DOWN)
    central.start()
    t_up = time.time()
    every_node = (node_a, node_b, _sel("done", 1))
    t_caught = _wait("the agents' backlog", lambda: all(_caught_up(base, s, t_up + SCRAPE) for s in every_node),
                     timeout=60)
    for selector in every_node:
        times = _times(base, selector, t0 - 10, t_caught)
        assert times[0] <= t0 - 5 and times[-1] >= t_up  # the series spans the outage ...
        gap = _max_gap(times)
        assert gap <= 2 * SCRAPE + 0.5, (selector, gap)  # ... with at most one scrape missing
    _log("central outage", down=t_up - t0, backlog_arrived_after_restart=t_caught - t_up,
         max_gap=max(_max_gap(_times(base, s, t0 - 10, t_caught)) for s in every_node))

    _log("agent WAL", bytes_per_sample=_wal_bytes_per_sample(agents["a"].base, fleet["tmp"] / "agent-a-data"))

    # 2. node a's agent restarts: a gap no longer than the restart, until it scrapes again
    since = t_caught
    time.sleep(3)
    t0 = time.time()
    agents["a"].stop()
    agent_base = agents["a"].start()
    ready = time.time() - t0
    restart = _wait("node a's agent scraping", lambda: _scraping_since(agent_base, t0), timeout=30, every=0.1) - t0
    t_caught = _wait("node a's agent back", lambda: _caught_up(base, node_a, t0 + restart + SCRAPE), timeout=30)
    times = _times(base, node_a, since, t_caught)
    gap = _max_gap(times)
    assert gap <= restart + SCRAPE + 0.5, f"{gap} {restart} {[round(t - t0, 2) for t in times]}"
    assert _max_gap(_times(base, node_b, since, t_caught)) <= 2 * SCRAPE + 0.5  # node b's agent unaffected
    _log("agent restart", ready_after=ready, scraping_after=restart, gap=gap)

    # 3. the sidecar of job lost's pod on node a restarts: the same series continue, counters without a reset
    since = t_caught
    time.sleep(3)
    series_before = {json.dumps(s["metric"], sort_keys=True) for s in _api(base, '{job_name="lost",rank="0"}')}
    t0 = time.time()
    sidecars["lost", "a"].stop()
    sidecars["lost", "a"].start()
    restart = time.time() - t0
    t_caught = _wait("node a's sidecar back", lambda: _caught_up(base, node_a, t0 + restart + SCRAPE), timeout=30)
    time.sleep(3)
    times = _times(base, node_a, since, t_caught)
    gap = _max_gap(times)
    assert gap <= restart + 2 * SCRAPE + 0.5, f"{gap} {restart} {[round(t - t0, 2) for t in times]}"
    series_after = {json.dumps(s["metric"], sort_keys=True) for s in _api(base, '{job_name="lost",rank="0"}')}
    assert series_after == series_before
    window = f"{int(time.time() - t0) + 15}s"
    for job, r in (("lost", 0), ("lost", 1)):
        steps = _sel(job, r, "fsdp_mem_steps_total")
        assert [float(s["value"][1]) for s in _api(base, f"resets({steps}[{window}])")] == [0.0]
        assert float(_api(base, f"increase({steps}[{window}])")[0]["value"][1]) > 0  # it kept counting
    _log("sidecar restart", restart=restart, gap=gap, series=len(series_after))

    # 4. node b lost (ranks, sidecar and agent gone at once) while job done finishes cleanly
    time.sleep(3)
    t_loss = time.time()
    for r in JOBS["lost"]["b"]:
        os.kill(fleet["ranks"]["lost", r].pid, signal.SIGKILL)
    sidecars["lost", "b"].stop(signal.SIGKILL)
    agents["b"].kill()
    (fleet["tmp"] / "stop-done").write_text("")
    for r in JOBS["done"]["a"]:
        fleet["ranks"]["done", r].join(60)
        assert fleet["ranks"]["done", r].exitcode == 0
    t_done = time.time()
    lost_b = {("lost", str(r), "node-b") for r in JOBS["lost"]["b"]}

    def state(alertstate: str) -> bool:
        return {a[1:] for a in _alerts(base, "FsdpMemRankLost") if a[0] == alertstate} == lost_b

    t_pending = _wait("FsdpMemRankLost pending", lambda: state("pending") or state("firing"), timeout=LOST_AFTER + 30)
    t_firing = _wait("FsdpMemRankLost firing", lambda: state("firing"), timeout=LOST_FOR + 30)
    # the rules' promise at these settings: pending within lost_after of the last sample (plus the
    # agent's unsent batch, up to batch_send_deadline 5 s earlier, and an evaluation), firing
    # lost_for later
    assert LOST_AFTER - 8 <= t_pending - t_loss <= LOST_AFTER + 3 * SCRAPE
    assert LOST_FOR - 2 * SCRAPE <= t_firing - t_pending <= LOST_FOR + 3 * SCRAPE
    job_alerts = [a for a in _active(base) if a["labels"]["alertname"] == "FsdpMemJobRanksLost"]
    assert [(a["labels"]["job_name"], float(a["value"])) for a in job_alerts] == [("lost", 2.0)]  # 2 of its 4 ranks
    # observe job done well past its ranks' linger, lost_after and lost_for
    quiet_until = t_done + ENDED + LOST_AFTER + LOST_FOR + 5
    while time.time() < quiet_until:
        time.sleep(1)
    span = f"{int(time.time() - t_loss) + 2}s"
    # never, at any evaluation since node b was lost: an alert for ranks 0, 1 or for job done
    ever = _api(base, f"count_over_time(ALERTS[{span}])")
    assert {(s["metric"]["alertname"], s["metric"].get("job_name"), s["metric"].get("rank")) for s in ever} <= {
        ("FsdpMemRankLost", "lost", "2"), ("FsdpMemRankLost", "lost", "3"), ("FsdpMemJobRanksLost", "lost", None)}
    assert not [s for s in ever if s["metric"].get("job_name") == "done"]
    # job done's clean end reached the central store, and its series ended
    ends = _api(base, f'max_over_time({_sel("done", name=cat.RANK_END_TIMESTAMP_SECONDS.name)}[{span}])')
    assert {(s["metric"]["rank"], s["metric"]["reason"]) for s in ends} == {("0", "clean"), ("1", "clean")}
    assert not _api(base, f'present_over_time({_sel("done")}[5s])')
    _log("node lost", pending_after=t_pending - t_loss, firing_after=t_firing - t_loss,
         clean_job_quiet_for=time.time() - t_done)
