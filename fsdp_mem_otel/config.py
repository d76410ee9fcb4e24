"""Tracker configuration: one dataclass, validated on construction, readable from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from fsdp_mem_otel.model import MODES

#: Environment variables read by TrackerConfig.from_env(); each maps to the field of that name.
ENV_MODE = "FSDP_MEM_OTEL_MODE"  # "light" (default) or "deep"
ENV_DEEP_EVERY = "FSDP_MEM_OTEL_DEEP_EVERY"  # run every Nth step deep; 0 = never
ENV_MAX_ERRORS = "FSDP_MEM_OTEL_MAX_ERRORS"  # disable the tracker after this many internal errors
ENV_ENABLED = "FSDP_MEM_OTEL_ENABLED"  # "0"/"false" turns the tracker into a no-op
ENV_RESET_PEAKS = "FSDP_MEM_OTEL_RESET_PEAKS"  # "1": reset the CUDA allocator's peak counters each step

_ENV_FIELDS = {
    ENV_MODE: "mode",
    ENV_DEEP_EVERY: "deep_every",
    ENV_MAX_ERRORS: "max_errors",
    ENV_ENABLED: "enabled",
    ENV_RESET_PEAKS: "reset_peaks",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class TrackerConfig:
    """How the tracker measures.

    Attributes:
        mode: "light" (snapshots at FSDP hook boundaries only; the always-on default) or "deep"
            (every op accounted through a dispatch mode).
        deep_every: with mode="light", run every Nth step (steps N, 2N, ...) deep; 0 = never.
        max_errors: after this many internal errors the tracker detaches itself; 0 = never.
        enabled: False makes attach() a no-op (for switching off by environment).
        reset_peaks: on CUDA, reset the allocator's peak counters at every step end to report its
            exact per-step peaks. Off by default: the tracker never touches the user's peaks and
            reports the maxima it sampled at FSDP hooks instead.
    """

    mode: str = "light"
    deep_every: int = 0
    max_errors: int = 100
    enabled: bool = True
    reset_peaks: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("deep_every", "max_errors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= 0; got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be an int >= 0; got {value}")
        for name in ("enabled", "reset_peaks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {type(getattr(self, name)).__name__}")

    def is_deep(self, step: int) -> bool:
        """Whether 1-based step ``step`` runs in deep mode."""
        if self.mode == "deep":
            return True
        return self.deep_every > 0 and step % self.deep_every == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> TrackerConfig:
        """Build from FSDP_MEM_OTEL_* variables; ``overrides`` (from code) win over the env."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for var, name in _ENV_FIELDS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            values[name] = _parse(var, name, raw)
        known = {f.name for f in fields(cls)}
        for name, value in overrides.items():
            if name not in known:
                raise TypeError(f"unknown config field {name!r}; accepted: {', '.join(sorted(known))}")
            values[name] = value
        return cls(**values)  # type: ignore[arg-type]


def _parse(var: str, name: str, raw: str) -> object:
    default = getattr(TrackerConfig, name)
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{var} must be one of 1/0/true/false/yes/no/on/off; got {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer >= 0; got {raw!r}") from None
    return raw.strip()
