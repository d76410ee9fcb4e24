#!/bin/bash
cd /work/main
out=/tmp/bench13
export OMP_NUM_THREADS=1
ht() { PYTHONPATH=/tmp/$1 .venv/bin/torchrun --nproc-per-node $2 benchmarks/hook_timing.py "${@:3}"; }
ht B 2 --blocks 64 --steps 20 --rounds 3 > $out/d64_2ranks_B_2.txt 2>&1
ht A 2 --blocks 64 --steps 20 --rounds 3 > $out/d64_2ranks_A_2.txt 2>&1
echo done > $out/DONE2
