#!/bin/bash
# A = fd2af35 (the last stop's code), B = this stop's code; alternating pairs
cd /work/main
rm -rf /tmp/A /tmp/B; mkdir -p /tmp/A /tmp/B
git archive fd2af35 fsdp_mem_otel | tar -x -C /tmp/A
git archive HEAD fsdp_mem_otel | tar -x -C /tmp/B
out=/tmp/bench13
export OMP_NUM_THREADS=1
ht() { PYTHONPATH=/tmp/$1 .venv/bin/torchrun --nproc-per-node $2 benchmarks/hook_timing.py "${@:3}"; }
ht A 2 --blocks 16 --steps 30 --rounds 3 > $out/d16_2ranks_A_1.txt 2>&1
ht B 2 --blocks 16 --steps 30 --rounds 3 > $out/d16_2ranks_B_1.txt 2>&1
ht B 2 --blocks 16 --steps 30 --rounds 3 > $out/d16_2ranks_B_2.txt 2>&1
ht A 2 --blocks 16 --steps 30 --rounds 3 > $out/d16_2ranks_A_2.txt 2>&1
ht A 2 --blocks 64 --steps 20 --rounds 3 > $out/d64_2ranks_A.txt 2>&1
ht B 2 --blocks 64 --steps 20 --rounds 3 > $out/d64_2ranks_B.txt 2>&1
ht A 1 --blocks 16 --steps 30 --rounds 5 > $out/d16_1proc_A.txt 2>&1
ht B 1 --blocks 16 --steps 30 --rounds 5 > $out/d16_1proc_B.txt 2>&1
PYTHONPATH=/tmp/B .venv/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --rounds 5 --steps 20 --models dispatch-16,dispatch-64,compute-4 --variants light > $out/overhead_B.txt 2>&1
echo done > $out/DONE
