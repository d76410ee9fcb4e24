#!/usr/bin/env bash
# A = git archive 7b6ec27 (this stop's start), B = git archive b57c161 (this stop's light-cost
# changes); this tree's benchmarks/, one run at a time, A and B alternating.
set -u
cd "$(dirname "$0")/../../.."
out=benchmarks/results/light-cost-2026-11-28
run() { OMP_NUM_THREADS=1 PYTHONPATH=/tmp/$1 .venv/bin/torchrun --nproc-per-node 2 "${@:2}"; }
for size in "16 30" "64 20"; do
  set -- $size
  for v in A B A B; do
    run $v benchmarks/hook_timing.py --blocks $1 --steps $2 --rounds 5 >> $out/d$1_$v.txt 2>&1
  done
done
for v in A B; do
  run $v benchmarks/steady.py --models dispatch-16,dispatch-64,compute-4 --rounds 61 --steps 2 --warmup 40 \
    --json $out/steady_$v.json > $out/steady_$v.txt 2>&1
done
for v in A B; do
  run $v benchmarks/overhead.py --rounds 5 --steps 10 --models dispatch-16 --variants "deep,deep_every=100" \
    > $out/overhead_deep_$v.txt 2>&1
done
echo done > $out/.done
