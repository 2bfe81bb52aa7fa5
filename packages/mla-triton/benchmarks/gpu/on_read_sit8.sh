#!/usr/bin/env bash
# h43: nvfp4 on read in the Gluon decode, whole blocks a thread (ON_READ_BLOCKS_CONFIG,
# V_OWN == 2) and V̂ under the S MMA (ON_READ_OVERLAP_CONFIG, V_OWN == 3) vs today's V_OWN
# kernel (SEPARATE_V_CONFIG), the oracle and FlashMLA. <= 150 s.
# Run on the device from the repository root (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/on_read_sit8.sh
# Writes 4 files to $OUT (two logs, two JSON), prints a summary.
set -u
OUT=${OUT:-/tmp/h43-out}
mkdir -p "$OUT"
export PYTHONPATH=${SITE:-/tmp/site}:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0
B=packages/mla-triton/benchmarks/on_read_blocks.py
start=$(date +%s)
# 1. ragged lengths, splits 1/2/3/policy, pages 16/64, H 20/64/128, scales 2^k and 3:
#    the three kernels vs mla_reference, the new two bit for bit vs the current one
timeout -k 5 75 python3 $B --plan check "$OUT" > "$OUT/1-check.txt" 2>&1
rc=$?
echo "check: rc=$rc ($(( $(date +%s) - start )) s)"; cat "$OUT/1-check.txt" | grep -v "^ " | tail -12
if [ $rc -ne 0 ]; then echo "check failed or hung (rc 124/137 = timeout): timing anyway, read with care"; fi
# 2. timing at b128 h128 L8192 and b32 h128 L32768: the three kernels and FlashMLA bf16
timeout -k 5 65 python3 $B --plan bench "$OUT" > "$OUT/2-bench.txt" 2>&1
rc=$?
echo "bench: rc=$rc ($(( $(date +%s) - start )) s)"; grep "TFLOP/s\|ERROR\|Error" "$OUT/2-bench.txt" | head -12
echo "total $(( $(date +%s) - start )) s"
