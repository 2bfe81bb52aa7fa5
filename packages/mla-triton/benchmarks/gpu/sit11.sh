#!/usr/bin/env bash
# Sitting 11 (one device call after the bundle's parts): the packed nvfp4 shadow in the
# warp-specialized Gluon decode, checked bit for bit against the fp16 shadow's kernel and
# timed against FlashMLA in the same process; then shadow.py's FlashMLA columns at h16.
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit11.sh
set -u
bash /root/parts/install.sh > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
B=packages/mla-triton/benchmarks
timeout "${TO_CHECK:-170}" python $B/gluon_packed.py --plan check --configs ws-r208-p88-tile-n32s2 \
    "$OUT/check" > "$OUT/check.txt" 2>&1; echo "check rc=$?" >> "$OUT/check.txt"
timeout "${TO_BENCH:-240}" python $B/gluon_packed.py --plan bench --graph "$OUT/bench" \
    > "$OUT/bench.txt" 2>&1; echo "bench rc=$?" >> "$OUT/bench.txt"
timeout "${TO_SHADOW:-90}" python $B/shadow.py --flashmla --shapes b128-h16-L8192 --skip-update \
    --out "$OUT/shadow-h16" > "$OUT/shadow-h16.txt" 2>&1; echo "shadow rc=$?" >> "$OUT/shadow-h16.txt"
tail -3 "$OUT"/*.txt
