#!/usr/bin/env bash
# Light mode in place, three packages side by side, alternating (A, A0, B, then B, A0, A):
#   A  = 29039ab's package (before: learnt steps replayed, the default then)
#   A0 = the same with replay_steps=False as its default (replay off)
#   B  = this change (every step measured; no step script, no replay memo)
# Each is `git archive <tree> fsdp_mem_otel` in /tmp/<name> (A and A0 with this change's tools/
# copied in, which hook_timing.py imports), the same hook_timing.py for all.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
OUT=benchmarks/results/light-measured-2026-11-29
for blocks in 16 64; do
  steps=30; [ "$blocks" = 64 ] && steps=20
  for pkg in A A0 B B A0 A; do
    echo "== $pkg blocks=$blocks"
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/$pkg .venv/bin/torchrun --nproc-per-node 2 /tmp/hook_timing.py \
      --blocks "$blocks" --steps "$steps" --rounds 3 2>&1 | grep -v "^\[W\|Warning"
  done
done
