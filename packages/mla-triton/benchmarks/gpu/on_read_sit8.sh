#!/usr/bin/env bash
# h43: nvfp4 on read in the Gluon decode: whole blocks a thread (ON_READ_BLOCKS_CONFIG,
# V_OWN == 2), V̂ under the S MMA (ON_READ_OVERLAP_CONFIG, 3) and K̂ under the P V MMA too
# (ON_READ_PIPELINED_CONFIG, 4) vs today's V_OWN kernel (SEPARATE_V_CONFIG), the oracle and
# FlashMLA. <= 150 s.
# Run on the device from the repository root (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/on_read_sit8.sh
# Writes 6 files to $OUT (three logs, three JSON), prints a summary.
set -u
TAG=h43
. "$(dirname "$0")/env.sh"
B=packages/mla-triton/benchmarks/on_read_blocks.py
start=$(date +%s)
# 1. ragged lengths, splits 1/2/3/policy, pages 16/64, H 20/64/128, scales 2^k and 3:
#    the four kernels vs mla_reference, the new three bit for bit vs today's
timeout -k 5 75 python3 $B --plan check --budget-s 60 "$OUT" > "$OUT/1-check.txt" 2>&1
rc=$?
echo "check: rc=$rc ($(( $(date +%s) - start )) s)"; grep -v "^ " "$OUT/1-check.txt" | tail -12
if [ $rc -ne 0 ]; then echo "check failed or hung (rc 124/137 = timeout): timing anyway, read with care"; fi
# 2. timing at b128 h128 L8192 and b32 h128 L32768, each with today's kernel and FlashMLA
#    bf16 in the same process: whole blocks; then the two overlapped schedules (their own
#    process: a fault there cannot take the first's numbers)
timeout -k 5 33 python3 $B --plan bench --configs v-own-blocks --budget-s 26 "$OUT" \
  > "$OUT/2-bench-blocks.txt" 2>&1
echo "bench blocks: rc=$? ($(( $(date +%s) - start )) s)"; grep "TFLOP/s\|ERROR\|Error" "$OUT/2-bench-blocks.txt" | head -8
timeout -k 5 38 python3 $B --plan bench --configs v-own-under-s,v-own-pipelined --budget-s 31 \
  "$OUT" > "$OUT/3-bench-overlap.txt" 2>&1
echo "bench overlap: rc=$? ($(( $(date +%s) - start )) s)"; grep "TFLOP/s\|ERROR\|Error" "$OUT/3-bench-overlap.txt" | head -10
echo "total $(( $(date +%s) - start )) s"
