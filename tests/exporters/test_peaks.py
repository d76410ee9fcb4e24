"""Module peaks read from the recorder's counters (``exporters.peaks``): the same answers as the
snapshot dicts, without building them; and the JSONL and Prometheus exporters' per-step paths
leave the dicts unbuilt."""

from __future__ import annotations

from pathlib import Path

from fsdp_mem_otel.exporters.jsonl import JSONLExporter, read_reports, report_bytes
from fsdp_mem_otel.exporters.peaks import all_calls, module_peaks, peaks
from fsdp_mem_otel.exporters.prometheus import StepReportCollector
from fsdp_mem_otel.identity import Identity
from fsdp_mem_otel.schema import (
    CATEGORY_KEYS,
    PEAK_BACKWARD,
    PEAK_FORWARD,
    STATES,
    CountedModuleReport,
    ModuleReport,
    StepReport,
    breakdown_of,
)

N = len(CATEGORY_KEYS)


def counters(total: int) -> list[int]:
    return [total // N] * (N - 1) + [total]


#: every shape a module's counters take: several calls and devices, states never reached, a call
#: with no device, a backward only
SHAPES: list[dict[str, list[dict[str, list[int]]]]] = [
    {PEAK_FORWARD: [{"cuda:0": counters(7000)}], PEAK_BACKWARD: [{"cuda:0": counters(8960)}]},
    {PEAK_FORWARD: [{"cuda:0": counters(6000), "cpu": counters(9000)}, {"cuda:0": counters(6500)}],
     "after_post_forward": [{"cuda:0": counters(1)}]},
    {PEAK_BACKWARD: [{"cpu": counters(0)}]},
    {PEAK_FORWARD: [{}], PEAK_BACKWARD: []},
    {},
    {s: [{"cuda:0": counters(100 * i)}, {"cuda:0": counters(50 * i)}] for i, s in enumerate(STATES)},
]


def counted(raw: dict[str, list[dict[str, list[int]]]]) -> CountedModuleReport:
    return CountedModuleReport({s: [dict(b) for b in c] for s, c in raw.items()}, {})


def test_the_same_answers_as_the_snapshot_dicts_without_building_them() -> None:
    for raw in SHAPES:
        plain = ModuleReport({s: [breakdown_of(b) for b in c] for s, c in raw.items()}, {})
        fresh, built = counted(raw), counted(raw)
        assert built.snapshots == plain.snapshots  # built's dicts exist from here on
        for mod in (fresh, built, plain):
            assert peaks(mod) == tuple(plain.peak_total(s) if plain.snapshots.get(s) else None
                                       for s in (PEAK_FORWARD, PEAK_BACKWARD)), raw
            assert list(module_peaks({"m": mod})) == [("m", plain.peak_total(PEAK_FORWARD),
                                                       plain.peak_total(PEAK_BACKWARD))], raw
            assert all_calls({"m": mod}) == sum(len(c) for c in plain.snapshots.values()), raw
        assert fresh.counters is not None  # read from the counters only: no dicts built
    for modules in ({str(i): counted(raw) for i, raw in enumerate(SHAPES)},
                    {str(i): ModuleReport({s: [breakdown_of(b) for b in c] for s, c in raw.items()}, {})
                     for i, raw in enumerate(SHAPES)}):
        assert list(module_peaks(modules)) == [(k, m.peak_total(PEAK_FORWARD), m.peak_total(PEAK_BACKWARD))
                                               for k, m in modules.items()]
        assert all_calls(modules) == sum(len(c) for m in modules.values() for c in m.snapshots.values())


def report(step: int, n_modules: int = 20) -> StepReport:
    keys = ["<root>"] + [f"layers.{i}" for i in range(n_modules - 1)]
    mods: dict[str, ModuleReport] = {
        k: counted({s: [{"cpu": counters(1000 * (i + 1) + (step if s == PEAK_FORWARD else 0))}] for s in STATES})
        for i, k in enumerate(keys)
    }
    for mod in mods.values():
        mod.times = {"before_pre_forward": [10], "after_post_forward": [30]}
    b = {"cpu": dict(zip(CATEGORY_KEYS, counters(5000), strict=True))}
    return StepReport(step=step, rank=0, world_size=1, mode="light", fsdp_version=2, peak=b, modules=mods,
                      module_order=keys, current=b, allocator={}, timestamp=1_700_000_000.0 + step)


def built(r: StepReport) -> set[str]:
    return {k for k, m in r.modules.items() if isinstance(m, CountedModuleReport) and m.counters is None}


def test_jsonl_builds_the_dicts_only_for_the_lines_that_carry_them(tmp_path: Path) -> None:
    reports = [report(step) for step in range(1, 6)]
    assert report_bytes(reports[1]) > 0 and not built(reports[1])  # on the training thread: nothing built
    exp = JSONLExporter(str(tmp_path / "run.jsonl"))
    for r in reports:
        exp.export(r)
    assert exp.flush(30)
    exp.shutdown()
    assert built(reports[0]) == set(reports[0].modules)  # step 1 carries the snapshots
    assert all(not built(r) for r in reports[1:])  # the peaks moved by 1 byte: the others do not
    assert exp.lines_without_modules == 4
    back = list(read_reports(str(tmp_path / "run.jsonl")))
    assert [r.step for r in back] == [1, 2, 3, 4, 5]


def test_prometheus_reads_module_peaks_without_building_the_dicts() -> None:
    r = report(3)
    collector = StepReportCollector(Identity("j", 0, 0, 1, "h"))
    collector.update(r)
    text = collector.exposition().decode()
    assert not built(r)
    assert 'fsdp_mem_module_peak_bytes{job_name="j",local_rank="0",module="layers.4",phase="forward",rank="0",' \
           'world_size="1"} 6003.0\n' in text
    detailed = StepReportCollector(Identity("j", 0, 0, 1, "h"), detail=True, detail_top_k=2)
    detailed.update(r)
    detailed.exposition()
    assert built(r) == {"layers.18", "layers.17"}  # detail series: only the top-k modules' dicts


def test_the_recorders_peak_totals_are_read_first() -> None:
    """A report carrying the recorder's two peak totals is answered from them (not the counters),
    until its snapshots are replaced."""
    raw = SHAPES[0]
    mod = CountedModuleReport({s: [dict(b) for b in c] for s, c in raw.items()}, {}, (123, None))
    assert peaks(mod) == (123, None)
    assert list(module_peaks({"m": mod})) == [("m", 123, 0)]
    mod.snapshots = {s: [breakdown_of(b) for b in c] for s, c in raw.items()}
    assert peaks(mod) == (7000, 8960)
