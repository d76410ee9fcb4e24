#!/usr/bin/env bash
# After the layout fix (a76d2f0, this tree): steady.py's A/A check (both copies untracked), then
# the committed code with twice the rounds.
set -u
cd "$(dirname "$0")/../../.."
out=benchmarks/results/light-cost-2026-11-28
run() { OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/torchrun --nproc-per-node 2 "$@"; }
run benchmarks/steady.py --aa --models dispatch-16,dispatch-64,compute-4 --rounds 61 --steps 2 --warmup 40 \
  --json $out/steady_AA.json > $out/steady_AA.txt 2>&1
run benchmarks/steady.py --models dispatch-16,dispatch-64,compute-4 --rounds 121 --steps 2 --warmup 40 \
  --json $out/steady_C.json > $out/steady_C.txt 2>&1
