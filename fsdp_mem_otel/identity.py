"""Who this process is: rank, job, pod. Standard library only (exporters use it without torch).

Read from the environment that torchrun and Kubernetes set up:
- torchrun: RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID (the rendezvous id), GROUP_RANK.
- Kubernetes downward API (set these in the pod spec): POD_NAME, POD_NAMESPACE, NODE_NAME, POD_UID.
- FSDP_MEM_OTEL_JOB names the job explicitly and wins over everything else.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_mem_otel import env

ENV_JOB = env.FSDP_MEM_OTEL_JOB


@dataclass(frozen=True)
class Identity:
    """Identity labels carried by every exported series and span."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pod: str = ""
    namespace: str = ""
    node: str = ""
    pod_uid: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, job: str | None = None) -> Identity:
        """Identity from torchrun / Kubernetes variables; ``job`` (from code) wins over the env.

        Job falls back to FSDP_MEM_OTEL_JOB, then TORCHELASTIC_RUN_ID, then the pod name without
        its replica suffix, then "fsdp".
        """
        environ = os.environ if environ is None else environ
        pod = environ.get(env.POD_NAME, "")
        job = job or environ.get(ENV_JOB) or environ.get(env.TORCHELASTIC_RUN_ID) or _job_from_pod(pod) or "fsdp"
        if job == "none":  # torchrun's default run id carries no information
            job = _job_from_pod(pod) or "fsdp"
        rank = _int(environ, env.RANK, 0)
        return cls(
            job=job,
            rank=rank,
            local_rank=_int(environ, env.LOCAL_RANK, rank),
            world_size=_int(environ, env.WORLD_SIZE, 1),
            host=socket.gethostname(),
            pod=pod,
            namespace=environ.get(env.POD_NAMESPACE, ""),
            node=environ.get(env.NODE_NAME, ""),
            pod_uid=environ.get(env.POD_UID, ""),
        )

    def labels(self) -> dict[str, str]:
        """Prometheus identity labels (pod/namespace only when known)."""
        out = {
            "job_name": self.job,
            "rank": str(self.rank),
            "local_rank": str(self.local_rank),
            "world_size": str(self.world_size),
        }
        if self.pod:
            out["pod"] = self.pod
        if self.namespace:
            out["namespace"] = self.namespace
        return out


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {raw!r}") from None


def _job_from_pod(pod: str) -> str:
    # "train-llm-worker-3" -> "train-llm-worker"; JobSet/PyTorchJob pods end in a replica index.
    head, _, tail = pod.rpartition("-")
    return head if head and tail.isdigit() else pod
