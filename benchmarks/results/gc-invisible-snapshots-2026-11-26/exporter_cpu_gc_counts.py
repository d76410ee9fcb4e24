import sys, gc, time
sys.path.insert(0, "/work/main/benchmarks")
import exporter_cpu as ec
stats = {"n": [0, 0, 0], "t": [0.0, 0.0, 0.0]}
t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        stats["n"][info["generation"]] += 1; stats["t"][info["generation"]] += time.perf_counter() - t0[0]
gc.callbacks.append(cb)
orig = ec.replay
def replay(reports, exporters, *a):
    stats["n"] = [0, 0, 0]; stats["t"] = [0.0, 0.0, 0.0]
    cpu = orig(reports, exporters, *a)
    print(len(exporters), "exporters", round(cpu * 1e3, 3), "ms/step; gc", stats["n"], [round(x * 1e3 / len(reports), 3) for x in stats["t"]], "ms/step", flush=True)
    return cpu
ec.replay = replay
sys.argv = ["exporter_cpu.py", "--steps", "300", "--modules", "100", "--rounds", "2"]
ec.main()
