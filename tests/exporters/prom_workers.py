"""Helpers for the Prometheus exporter tests: TLS material, HTTP scrapes, and the code that runs
on each of the 2 real ranks (spawned by tests/dist.py; torch is imported inside the worker)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

BLOCKS, WIDTH, BATCH, STEPS = 3, 32, 8, 3
#: the sidecar's --stale-seconds in the real run (generous: the first scrape must see both ranks
#: fresh on a loaded CI machine); rank 0 keeps writing for 1 s longer than this after rank 1 stops
STALE_SECONDS = 3.0


def make_tls(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files.

    Made with the ``openssl`` command (the ``cryptography`` package is not a dependency).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the TLS tests need the openssl command")
    d = Path(directory)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "2",
        "-subj", "/CN=fsdp-mem-otel test CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    leaves = {
        "server": ("127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        "client": ("prometheus", "extendedKeyUsage=clientAuth\n"),
    }
    for leaf, (cn, ext) in leaves.items():
        (d / f"{leaf}.ext").write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n" + ext
        )
        run("req", *ec, "-keyout", str(d / f"{leaf}.key"), "-out", str(d / f"{leaf}.csr"), "-subj", f"/CN={cn}")
        run("x509", "-req", "-in", str(d / f"{leaf}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-out", str(d / f"{leaf}.pem"), "-days", "2", "-extfile", str(d / f"{leaf}.ext"))
    return {
        "ca": str(d / "ca.pem"),
        "cert": str(d / "server.pem"),
        "key": str(d / "server.key"),
        "client_cert": str(d / "client.pem"),
        "client_key": str(d / "client.key"),
    }


def client_context(tls: dict[str, str], with_cert: bool = True) -> ssl.SSLContext:
    """What Prometheus does with tls_config: trust the test CA, present the client certificate."""
    ctx = ssl.create_default_context(cafile=tls["ca"])
    if with_cert:
        ctx.load_cert_chain(tls["client_cert"], tls["client_key"])
    return ctx


def get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
        assert resp.status == 200, resp.status
        return resp.read().decode("utf-8")


def try_get(url: str, context: ssl.SSLContext | None = None) -> str:
    """'ok' when the scrape succeeds, else the exception's type name."""
    try:
        get(url, context, timeout=5.0)
        return "ok"
    except OSError as exc:
        return type(exc).__name__


def train_scrape_and_serve(base_port: int, tls_base_port: int, sidecar_dir: str, sidecar_port: int,
                           tls: dict[str, str]) -> dict[str, Any]:
    """Rank side of the real test.

    FSDP2 training under a tracker with two Prometheus exporters: plain HTTP plus a sidecar file,
    and mutual TLS. After a barrier each rank scrapes both ranks' endpoints. Then rank 0 runs the
    sidecar server over the shared directory and scrapes it with both ranks alive; rank 1 then
    stops (its tracker closes), rank 0 keeps writing, and rank 0 scrapes again after the stale
    window.
    """
    import torch.distributed as dist

    from fsdp_mem_otel.exporters.prometheus import PrometheusExporter
    from fsdp_mem_otel.fleet import serve
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch, train_step
    from fsdp_mem_otel.training.tracker import FSDPMemoryTracker

    rank = dist.get_rank()
    model, opt = build(BLOCKS, WIDTH, WrapOptions(fsdp=2))
    plain = PrometheusExporter(base_port=base_port, addr="127.0.0.1", sidecar_dir=sidecar_dir)
    secure = PrometheusExporter(base_port=tls_base_port, addr="127.0.0.1", certfile=tls["cert"], keyfile=tls["key"],
                                client_cafile=tls["ca"])
    tracker = FSDPMemoryTracker(model, opt, exporters=[plain, secure])
    reports = []
    with tracker:
        for step in range(STEPS):
            train_step(model, opt, make_batch(step, BATCH, WIDTH, rank), on_inputs=tracker.track_inputs)
            reports.append(tracker.step())
    out: dict[str, Any] = {
        "reports": [r.to_dict() for r in reports],
        "ports": (plain.port, secure.port),
        "job": plain.identity.job,
        "flushed": plain.flush(),
    }
    dist.barrier()  # both ranks have exported every step
    ports = range(base_port, base_port + 2)
    tls_ports = range(tls_base_port, tls_base_port + 2)
    out["scrapes"] = [get(f"http://127.0.0.1:{p}/metrics") for p in ports]
    out["tls_scrapes"] = [get(f"https://127.0.0.1:{p}/metrics", client_context(tls)) for p in tls_ports]
    out["tls_without_client_cert"] = try_get(f"https://127.0.0.1:{tls_ports[0]}/metrics",
                                             client_context(tls, with_cert=False))
    out["plain_http_to_tls_port"] = try_get(f"http://127.0.0.1:{tls_ports[0]}/metrics")
    dist.barrier()  # scrapes done

    # Sidecar: rewrite both files now, so both start fresh.
    plain.export(reports[-1])
    out["flushed_again"] = plain.flush()
    dist.barrier()
    server = None
    if rank == 0:
        server = serve.make_server(sidecar_dir, sidecar_port, "127.0.0.1", stale_seconds=STALE_SECONDS)
        server.start()
        out["sidecar_alive"] = get(f"http://127.0.0.1:{sidecar_port}/metrics")
    dist.barrier()
    if rank == 1:
        tracker.close()  # rank 1 ends: its last write records the end, endpoint down
        out["errors_total"] = (plain.errors_total, secure.errors_total)
    else:
        deadline = time.monotonic() + STALE_SECONDS + 1.0
        while time.monotonic() < deadline:  # rank 0 keeps reporting
            plain.export(reports[-1])
            plain.flush()
            time.sleep(0.2)
        out["sidecar_one_silent"] = get(f"http://127.0.0.1:{sidecar_port}/metrics")
        out["rank1_endpoint_after_close"] = try_get(f"http://127.0.0.1:{base_port + 1}/metrics")
        assert server is not None
        server.stop()
    dist.barrier()
    tracker.close()
    if rank == 0:
        out["errors_total"] = (plain.errors_total, secure.errors_total)
    return out
