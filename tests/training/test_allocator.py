"""Allocator statistics: exact arithmetic on recorded memory_stats() dicts, the host path, the probe
against a scripted fake torch.cuda (no GPU needed), and real-CUDA checks where a GPU exists."""

from __future__ import annotations

import sys
from typing import Any

import psutil
import pytest
import torch

from fsdp_mem_otel.training import shadow_peaks
from fsdp_mem_otel.training.allocator import (
    CPU_KEYS,
    CUDA_KEYS,
    AllocatorProbe,
    cuda_stats_from,
    flat_stats,
    resident_bytes,
    resolve_reset_peaks,
)

GiB = 1 << 30
MiB = 1 << 20

# torch.cuda.memory_stats(0) as an FSDP2 job on one H100 might leave it at a step end, written by
# hand from the key names in torch/cuda/memory.py (all = large_pool + small_pool; every count a
# plain int). cudaMalloc retried twice, no OOM yet.
RECORDED: dict[str, int] = {
    "active.all.allocated": 1_204_331, "active.all.current": 1_874, "active.all.freed": 1_202_457,
    "active.all.peak": 2_310,
    "active.large_pool.allocated": 402_118, "active.large_pool.current": 612, "active.large_pool.freed": 401_506,
    "active.large_pool.peak": 830,
    "active.small_pool.allocated": 802_213, "active.small_pool.current": 1_262, "active.small_pool.freed": 800_951,
    "active.small_pool.peak": 1_480,
    "active_bytes.all.allocated": 9_876_543_210_000, "active_bytes.all.current": 21_474_836_480 + 6 * MiB,
    "active_bytes.all.freed": 9_876_543_210_000 - (21_474_836_480 + 6 * MiB), "active_bytes.all.peak": 42 * GiB,
    "active_bytes.large_pool.allocated": 9_870_000_000_000, "active_bytes.large_pool.current": 20 * GiB,
    "active_bytes.large_pool.freed": 9_870_000_000_000 - 20 * GiB, "active_bytes.large_pool.peak": 42 * GiB - 8 * MiB,
    "active_bytes.small_pool.allocated": 6_543_210_000, "active_bytes.small_pool.current": 6 * MiB,
    "active_bytes.small_pool.freed": 6_543_210_000 - 6 * MiB, "active_bytes.small_pool.peak": 8 * MiB,
    "allocated.all.allocated": 1_204_331, "allocated.all.current": 1_870, "allocated.all.freed": 1_202_461,
    "allocated.all.peak": 2_306,
    "allocated.large_pool.allocated": 402_118, "allocated.large_pool.current": 610,
    "allocated.large_pool.freed": 401_508, "allocated.large_pool.peak": 828,
    "allocated.small_pool.allocated": 802_213, "allocated.small_pool.current": 1_260,
    "allocated.small_pool.freed": 800_953, "allocated.small_pool.peak": 1_478,
    "allocated_bytes.all.allocated": 9_876_543_000_000, "allocated_bytes.all.current": 20 * GiB + 5 * MiB,
    "allocated_bytes.all.freed": 9_876_543_000_000 - (20 * GiB + 5 * MiB), "allocated_bytes.all.peak": 41 * GiB,
    "allocated_bytes.large_pool.allocated": 9_870_000_000_000, "allocated_bytes.large_pool.current": 20 * GiB,
    "allocated_bytes.large_pool.freed": 9_870_000_000_000 - 20 * GiB,
    "allocated_bytes.large_pool.peak": 41 * GiB - 7 * MiB,
    "allocated_bytes.small_pool.allocated": 6_543_000_000, "allocated_bytes.small_pool.current": 5 * MiB,
    "allocated_bytes.small_pool.freed": 6_543_000_000 - 5 * MiB, "allocated_bytes.small_pool.peak": 7 * MiB,
    "inactive_split.all.allocated": 90_112, "inactive_split.all.current": 37, "inactive_split.all.freed": 90_075,
    "inactive_split.all.peak": 61,
    "inactive_split.large_pool.allocated": 40_010, "inactive_split.large_pool.current": 21,
    "inactive_split.large_pool.freed": 39_989, "inactive_split.large_pool.peak": 33,
    "inactive_split.small_pool.allocated": 50_102, "inactive_split.small_pool.current": 16,
    "inactive_split.small_pool.freed": 50_086, "inactive_split.small_pool.peak": 28,
    "inactive_split_bytes.all.allocated": 3_210_987_654_321, "inactive_split_bytes.all.current": 1 * GiB + 3 * MiB,
    "inactive_split_bytes.all.freed": 3_210_987_654_321 - (1 * GiB + 3 * MiB),
    "inactive_split_bytes.all.peak": 3 * GiB,
    "inactive_split_bytes.large_pool.allocated": 3_200_000_000_000,
    "inactive_split_bytes.large_pool.current": 1 * GiB + 2 * MiB,
    "inactive_split_bytes.large_pool.freed": 3_200_000_000_000 - (1 * GiB + 2 * MiB),
    "inactive_split_bytes.large_pool.peak": 3 * GiB - 2 * MiB,
    "inactive_split_bytes.small_pool.allocated": 10_987_654_321, "inactive_split_bytes.small_pool.current": 1 * MiB,
    "inactive_split_bytes.small_pool.freed": 10_987_654_321 - 1 * MiB,
    "inactive_split_bytes.small_pool.peak": 2 * MiB,
    "max_split_size": -1,
    "num_alloc_retries": 2,
    "num_device_alloc": 412,
    "num_device_free": 377,
    "num_ooms": 0,
    "num_oom_rejections": 0,
    "num_sync_all_streams": 2,
    "oversize_allocations.allocated": 0, "oversize_allocations.current": 0, "oversize_allocations.freed": 0,
    "oversize_allocations.peak": 0,
    "oversize_segments.allocated": 0, "oversize_segments.current": 0, "oversize_segments.freed": 0,
    "oversize_segments.peak": 0,
    "requested_bytes.all.allocated": 9_876_000_000_000, "requested_bytes.all.current": 20 * GiB + 4 * MiB,
    "requested_bytes.all.freed": 9_876_000_000_000 - (20 * GiB + 4 * MiB), "requested_bytes.all.peak": 41 * GiB - MiB,
    "reserved_bytes.all.allocated": 48 * GiB + 20 * MiB, "reserved_bytes.all.current": 24 * GiB + 20 * MiB,
    "reserved_bytes.all.freed": 24 * GiB, "reserved_bytes.all.peak": 44 * GiB + 20 * MiB,
    "reserved_bytes.large_pool.allocated": 48 * GiB, "reserved_bytes.large_pool.current": 24 * GiB,
    "reserved_bytes.large_pool.freed": 24 * GiB, "reserved_bytes.large_pool.peak": 44 * GiB,
    "reserved_bytes.small_pool.allocated": 20 * MiB, "reserved_bytes.small_pool.current": 20 * MiB,
    "reserved_bytes.small_pool.freed": 0, "reserved_bytes.small_pool.peak": 20 * MiB,
    "segment.all.allocated": 412, "segment.all.current": 35, "segment.all.freed": 377, "segment.all.peak": 61,
    "segment.large_pool.allocated": 402, "segment.large_pool.current": 25, "segment.large_pool.freed": 377,
    "segment.large_pool.peak": 51,
    "segment.small_pool.allocated": 10, "segment.small_pool.current": 10, "segment.small_pool.freed": 0,
    "segment.small_pool.peak": 10,
}
H100_INFO = (53_000_000_000, 85_045_395_456)  # torch.cuda.mem_get_info(): (free, total)


def test_recorded_dict_is_consistent() -> None:
    """The hand-written dict obeys the allocator's own invariants (all = large + small, ...)."""
    for stat in ("active", "active_bytes", "allocated", "allocated_bytes", "inactive_split", "inactive_split_bytes",
                 "reserved_bytes", "segment"):
        for kind in ("allocated", "current", "freed"):
            all_ = RECORDED[f"{stat}.all.{kind}"]
            assert all_ == RECORDED[f"{stat}.large_pool.{kind}"] + RECORDED[f"{stat}.small_pool.{kind}"], (stat, kind)
        assert RECORDED[f"{stat}.all.current"] == RECORDED[f"{stat}.all.allocated"] - RECORDED[f"{stat}.all.freed"]
    cur = RECORDED["allocated_bytes.all.current"]
    assert cur <= RECORDED["active_bytes.all.current"] <= RECORDED["reserved_bytes.all.current"]


def test_cuda_stats_from_recorded_exact() -> None:
    sampled = {"allocated_bytes": 38 * GiB, "reserved_bytes": 44 * GiB + 20 * MiB, "active_bytes": 39 * GiB}
    tracked = 19 * GiB + 512
    out = cuda_stats_from(RECORDED, H100_INFO, tracked, sampled)
    allocated, reserved = 20 * GiB + 5 * MiB, 24 * GiB + 20 * MiB
    assert out == {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "active_bytes": 20 * GiB + 6 * MiB,
        "allocated_peak_bytes": 38 * GiB,  # sampled, not the allocator's 41 GiB since process start
        "reserved_peak_bytes": 44 * GiB + 20 * MiB,
        "active_peak_bytes": 39 * GiB,
        "inactive_split_bytes": 1 * GiB + 3 * MiB,
        "device_total_bytes": 85_045_395_456,
        # used (total - free) minus reserved: what the CUDA context, NCCL and cuBLAS hold
        "outside_pytorch_bytes": 85_045_395_456 - 53_000_000_000 - reserved,
        "num_alloc_retries": 2,
        "num_ooms": 0,
        "fragmentation_ratio": (reserved - allocated) / reserved,
        "untracked_bytes": allocated - tracked,
    }
    assert set(out) == set(CUDA_KEYS)
    assert out["untracked_bytes"] == 1 * GiB + 5 * MiB - 512


def test_peaks_never_below_step_end() -> None:
    """A step whose hooks all saw less than the end value: the peak is the end value."""
    out = cuda_stats_from(RECORDED, H100_INFO, 0, {"allocated_bytes": 1, "reserved_bytes": 2, "active_bytes": 3})
    assert out["allocated_peak_bytes"] == out["allocated_bytes"]
    assert out["reserved_peak_bytes"] == out["reserved_bytes"]
    assert out["active_peak_bytes"] == out["active_bytes"]
    assert cuda_stats_from(RECORDED, H100_INFO, 0, None)["allocated_peak_bytes"] == out["allocated_bytes"]


def test_allocator_peaks_when_resetting() -> None:
    out = cuda_stats_from(RECORDED, H100_INFO, 0, {"allocated_bytes": 1}, allocator_peaks=True)
    assert out["allocated_peak_bytes"] == 41 * GiB
    assert out["reserved_peak_bytes"] == 44 * GiB + 20 * MiB
    assert out["active_peak_bytes"] == 42 * GiB


def test_empty_stats_and_optional_inputs() -> None:
    """cudaMallocAsync / an idle device: nothing reserved -> ratio 0, no division error."""
    out = cuda_stats_from({}, None, None)
    assert out["fragmentation_ratio"] == 0.0
    assert out["allocated_bytes"] == out["reserved_bytes"] == out["num_ooms"] == 0
    assert "device_total_bytes" not in out and "untracked_bytes" not in out


def test_untracked_is_signed() -> None:
    stats = {"allocated_bytes.all.current": 1000, "reserved_bytes.all.current": 4000}
    out = cuda_stats_from(stats, (0, 8000), 1500, {})
    assert out["untracked_bytes"] == -500
    assert out["fragmentation_ratio"] == 0.75


# -- host ------------------------------------------------------------------------------------------
def test_cpu_probe_reports_resident_bytes() -> None:
    probe = AllocatorProbe()
    if torch.cuda.is_available():
        pytest.skip("host-only path: this machine has CUDA")
    probe.start()
    probe.sample()  # no-op on CPU
    out = probe.step_stats({"cpu": 12345})
    assert set(out) == {"cpu"}
    assert set(out["cpu"]) == set(CPU_KEYS)  # no untracked_bytes for the host
    rss = out["cpu"]["resident_bytes"]
    assert rss > 0
    assert abs(rss - psutil.Process().memory_info().rss) < 64 * MiB
    assert probe.devices == []


def test_resident_bytes_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/statm fallback is Linux only")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "psutil", None)  # makes `import psutil` raise ImportError
        value = resident_bytes()
    assert value is not None and abs(value - psutil.Process().memory_info().rss) < 64 * MiB


def test_probe_validation() -> None:
    with pytest.raises(TypeError, match="reset_peaks"):
        AllocatorProbe(reset_peaks=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="devices"):
        AllocatorProbe("cuda:0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="devices"):
        AllocatorProbe(["cpu"])
    with pytest.raises(ValueError, match="devices"):
        AllocatorProbe([-1])
    assert AllocatorProbe([0, "cuda:1", torch.device("cuda", 2)]).reset_peaks is False


# -- the probe against a scripted torch.cuda -------------------------------------------------------
class FakeCuda:
    """Just the torch.cuda functions the probe calls, over a scripted allocator on device 0."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.active = 0
        self.free = 1000
        self.peak = {"allocated": 0, "reserved": 0, "active": 0}
        self.resets: list[int] = []
        self.calls: list[str] = []

    def set(self, allocated: int, reserved: int, active: int | None = None) -> None:
        self.allocated, self.reserved, self.active = allocated, reserved, allocated if active is None else active
        for k in self.peak:
            self.peak[k] = max(self.peak[k], getattr(self, k))

    def nested(self, device: int) -> dict[str, Any]:
        self.calls.append("nested")
        return {
            f"{k}_bytes": {"all": {"current": getattr(self, k), "peak": self.peak[k]}} for k in self.peak
        } | {"num_alloc_retries": 1, "num_ooms": 0}

    def flat(self, device: int) -> dict[str, int]:
        self.calls.append("flat")
        out = {f"{k}_bytes.all.current": getattr(self, k) for k in self.peak}
        out.update({f"{k}_bytes.all.peak": v for k, v in self.peak.items()})
        out.update(num_alloc_retries=1, num_ooms=0)
        return out

    def reset_peak(self, device: int) -> None:
        self.resets.append(device)
        self.peak = {k: getattr(self, k) for k in self.peak}

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "memory_stats_as_nested_dict", self.nested)
        mp.setattr(torch.cuda, "memory_stats", self.flat)
        mp.setattr(torch.cuda, "mem_get_info", lambda d: (self.free, 1 << 40))
        mp.setattr(torch.cuda, "memory_reserved", lambda d: self.reserved)
        mp.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)
        for name in ("reset_max_memory_allocated", "reset_max_memory_cached", "empty_cache"):
            mp.setattr(torch.cuda, name, lambda *a, _n=name, **k: self.calls.append(_n))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_probe_sampled_maxima(fake_cuda: FakeCuda) -> None:
    fake_cuda.set(100, 1000)
    probe = AllocatorProbe()
    probe.start()
    assert probe.devices == ["cuda:0"]
    for allocated, reserved in ((400, 1000), (900, 2000), (300, 2000)):  # hook boundaries
        fake_cuda.set(allocated, reserved)
        probe.sample()
    fake_cuda.set(200, 1500)  # step end
    out = probe.step_stats({"cuda:0": 150, "cpu": 0})
    cuda = out["cuda:0"]
    assert (cuda["allocated_bytes"], cuda["allocated_peak_bytes"]) == (200, 900)
    assert (cuda["reserved_bytes"], cuda["reserved_peak_bytes"]) == (1500, 2000)
    assert cuda["active_peak_bytes"] == 900
    assert cuda["untracked_bytes"] == 50
    assert cuda["device_total_bytes"] == 1 << 40
    assert cuda["fragmentation_ratio"] == (1500 - 200) / 1500
    assert "resident_bytes" in out["cpu"] and "untracked_bytes" not in out["cpu"]
    # the user's peaks and cache are untouched
    assert fake_cuda.resets == [] and "empty_cache" not in fake_cuda.calls
    assert fake_cuda.peak["allocated"] == 900
    # the next step's maxima restart from the step end, not from the previous step's peak
    fake_cuda.set(250, 1500)
    probe.sample()
    fake_cuda.set(220, 1500)
    assert probe.step_stats({"cuda:0": 0})["cuda:0"]["allocated_peak_bytes"] == 250


def test_probe_sample_uses_one_cheap_call(fake_cuda: FakeCuda) -> None:
    probe = AllocatorProbe()
    probe.start()
    fake_cuda.calls.clear()
    probe.sample()
    assert fake_cuda.calls == ["nested"]  # one C call per device, no flat dict per sample


def test_probe_sampler_only_where_sampling_reads_something(fake_cuda: FakeCuda,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the sink calls the sampler at every window end: None where sample() would return at once
    probe = AllocatorProbe()
    assert probe.sampler == probe.sample
    fake_cuda.calls.clear()
    probe.sampler()  # type: ignore[misc]
    assert fake_cuda.calls == ["nested"]
    assert AllocatorProbe([0], reset_peaks=True).sampler is None  # the allocator keeps the peaks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert AllocatorProbe().sampler is None


def test_probe_reset_peaks(fake_cuda: FakeCuda) -> None:
    fake_cuda.set(5000, 8000)  # a peak from before the tracker started
    fake_cuda.set(100, 8000)
    probe = AllocatorProbe([0], reset_peaks=True)
    probe.start()
    assert fake_cuda.resets == [0]
    fake_cuda.calls.clear()
    probe.sample()
    assert fake_cuda.calls == []  # the allocator keeps the peak: nothing to sample
    fake_cuda.set(700, 8000)  # between hooks: a sampled maximum would miss it
    fake_cuda.set(300, 8000)
    out = probe.step_stats({"cuda:0": 0})["cuda:0"]
    assert out["allocated_peak_bytes"] == 700
    assert fake_cuda.resets == [0, 0]
    fake_cuda.set(350, 8000)
    assert probe.step_stats({})["cuda:0"]["allocated_peak_bytes"] == 350
    assert torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["peak"] == 5000  # the script's
    probe.stop()
    assert fake_cuda.peak["allocated"] == 350  # the live counter: the peak since the probe's last reset


def test_reset_peaks_default_follows_cuda(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_reset_peaks(None) is True  # CUDA available (the fake): the allocator's own peaks
    assert resolve_reset_peaks(False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_reset_peaks(None) is False
    assert resolve_reset_peaks(True) is True  # explicit wins (without CUDA the probe resets nothing anyway)


def test_probe_takes_and_gives_back_the_counters(fake_cuda: FakeCuda) -> None:
    readers = torch.cuda.memory_stats_as_nested_dict
    probe = AllocatorProbe([0], reset_peaks=True)
    assert probe.window_edge() == {} and fake_cuda.resets == []  # not started: nothing reset
    probe.start()
    assert shadow_peaks.installed() and torch.cuda.memory_stats_as_nested_dict is not readers
    fake_cuda.calls.clear()
    probe.window_edge()
    assert fake_cuda.calls == ["nested"] and fake_cuda.resets == [0, 0]  # one read, one reset per edge
    probe.stop()
    assert not shadow_peaks.installed() and torch.cuda.memory_stats_as_nested_dict is readers
    assert probe.window_edge() == {} and fake_cuda.resets == [0, 0]  # stopped: nothing reset
    AllocatorProbe([0]).start()  # sampling: never takes the counters
    assert not shadow_peaks.installed()


def test_a_device_found_after_start_starts_its_window_then(fake_cuda: FakeCuda,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda.set(9000, 10000)  # the script's peak, from before the tracker
    fake_cuda.set(100, 10000)
    probe = AllocatorProbe(reset_peaks=True)  # auto: the current device, once CUDA is in use
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    probe.start()  # at attach, before the model reached CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    try:
        assert fake_cuda.resets == []
        assert probe.window_edge()["cuda:0"] == (100, 100)  # not the 9000 from before the tracker
        assert fake_cuda.resets == [0]
        fake_cuda.set(300, 10000)
        fake_cuda.set(100, 10000)
        assert probe.step_stats({"cuda:0": 0})["cuda:0"]["allocated_peak_bytes"] == 300
        assert torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["peak"] == 9000
    finally:
        probe.stop()


def test_flat_stats_reads_the_keys_cuda_stats_from_needs() -> None:
    nested = {"allocated_bytes": {"all": {"current": 5, "peak": 9}, "large_pool": {"current": 4, "peak": 8}},
              "num_ooms": 2, "reserved_bytes_by_private_pools": {(0, 1): {"all": {"current": 1}}}}
    assert flat_stats(nested) == {"allocated_bytes.all.current": 5, "allocated_bytes.all.peak": 9, "num_ooms": 2}


def test_probe_discovers_devices_from_ledger(fake_cuda: FakeCuda) -> None:
    probe = AllocatorProbe()
    out = probe.step_stats({"cuda:0": 0, "cuda:3": 0, "cpu": 0})
    assert sorted(k for k in out if k != "cpu") == ["cuda:0", "cuda:3"]


def test_probe_survives_mem_get_info_failure(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: int) -> tuple[int, int]:
        raise RuntimeError("CUDA error: operation not supported")

    monkeypatch.setattr(torch.cuda, "mem_get_info", refuse)
    fake_cuda.set(10, 20)
    out = AllocatorProbe().step_stats({"cuda:0": 0})["cuda:0"]
    assert "device_total_bytes" not in out and out["allocated_bytes"] == 10


def test_probe_no_cuda_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA present but never initialized by the job: the probe must not initialize it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("touched CUDA")

    for name in ("current_device", "memory_stats", "memory_stats_as_nested_dict", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, boom)
    probe = AllocatorProbe()
    probe.start()
    probe.sample()
    assert set(probe.step_stats({"cpu": 0})) == {"cpu"}


# -- real CUDA -------------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
def test_cuda_allocated_matches_torch() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    probe = AllocatorProbe()
    probe.start()
    y = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
    probe.sample()
    del y
    key = f"cuda:{dev.index}"
    out = probe.step_stats({key: x.untyped_storage().nbytes()})[key]
    torch.cuda.synchronize()
    assert out["allocated_bytes"] == torch.cuda.memory_allocated(dev)
    assert out["reserved_bytes"] == torch.cuda.memory_reserved(dev)
    assert out["allocated_peak_bytes"] >= out["allocated_bytes"] + 32 * MiB
    assert out["untracked_bytes"] == out["allocated_bytes"] - 64 * MiB
    assert out["device_total_bytes"] == torch.cuda.mem_get_info(dev)[1]
    assert 0.0 <= out["fragmentation_ratio"] < 1.0
    del x


@cuda_only
def test_cuda_user_peak_not_reset() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    del big
    user_peak = torch.cuda.max_memory_allocated(dev)
    user_reserved_peak = torch.cuda.max_memory_reserved(dev)
    probe = AllocatorProbe()
    probe.start()
    for _ in range(3):
        probe.sample()
        probe.step_stats({})
    assert torch.cuda.max_memory_allocated(dev) >= user_peak
    assert torch.cuda.max_memory_reserved(dev) >= user_reserved_peak
    assert torch.cuda.max_memory_allocated(dev) >= 256 * MiB


@cuda_only
def test_cuda_reset_peaks_shadows_the_scripts_peaks() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    del big
    readers = (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats)
    probe = AllocatorProbe(reset_peaks=True)
    probe.start()
    try:
        small = torch.empty(MiB, dtype=torch.uint8, device=dev)
        out = probe.step_stats({})[f"cuda:{dev.index}"]
        assert out["allocated_peak_bytes"] < 256 * MiB  # the probe's: since its reset
        assert torch.cuda.max_memory_allocated(dev) >= 256 * MiB  # the script's: as without the probe
        del small
    finally:
        probe.stop()
    assert (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats) == readers
    assert torch.cuda.max_memory_allocated(dev) < 256 * MiB  # the live counter: the probe reset it


def test_outside_pytorch_from_recorded_stats() -> None:
    reserved = RECORDED["reserved_bytes.all.current"]
    free, total = H100_INFO
    assert cuda_stats_from(RECORDED, H100_INFO, 0)["outside_pytorch_bytes"] == total - free - reserved
    # a driver that reports less used memory than the allocator reserved: floored, never negative
    assert cuda_stats_from(RECORDED, (total - reserved + 1, total), 0)["outside_pytorch_bytes"] == 0
    assert "outside_pytorch_bytes" not in cuda_stats_from(RECORDED, None, 0)  # no mem_get_info


def test_probe_outside_pytorch_now(fake_cuda: FakeCuda) -> None:
    fake_cuda.set(100, 4096)
    fake_cuda.free = (1 << 40) - 4096 - 700  # 700 bytes used beyond the allocator's reservation
    probe = AllocatorProbe()
    assert probe.outside_pytorch() == {"cuda:0": 700}
    stats = probe.step_stats({"cuda:0": 100})
    assert stats["cuda:0"]["outside_pytorch_bytes"] == 700


def test_oom_abort_carries_outside_pytorch_bytes() -> None:
    from fsdp_mem_otel.schema import StepAbort, StepReport

    abort = StepAbort("OutOfMemoryError", "CUDA out of memory", True, "layers.1", "after_pre_forward",
                      {"cuda:0": {"total": 1}}, outside_pytorch_bytes={"cuda:0": 3 * GiB})
    report = StepReport(step=1, rank=0, world_size=1, mode="light", fsdp_version=2, peak={}, modules={},
                        aborted=abort)
    again = StepReport.from_dict(report.to_dict())
    assert again.aborted is not None and again.aborted.outside_pytorch_bytes == {"cuda:0": 3 * GiB}
