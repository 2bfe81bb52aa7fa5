#!/usr/bin/env bash
# h37: the warp-specialized decode's new variants (gluon_decode_ws.VARIANTS[3:]: TMA tile
# loads; with S issued early; with that and a 4-slot ring of 32-token tiles) on one H200,
# at most ~150 s.
# From the repository root on the device (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/decode_ws_next.sh
# Writes $OUT/{1-out-*.txt,out-*.pt,2-compare.txt,ws-check.json,3-bench.txt,ws-bench.json}.
set -u
OUT=${OUT:-/tmp/h37-out}
mkdir -p "$OUT"
export PYTHONPATH=${SITE:-/tmp/site}:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0
B=packages/mla-triton/benchmarks/gluon_decode_ws.py
NEW=ws-r232-p40-tile-tma,ws-r232-p40-tile-tma-es,ws-r232-p40-tile-tma-n32s4-es
TWIN=ws-r232-p40-tile-tma-n32s4  # the last one's twin (not in VARIANTS: checked, not timed)
start=$(date +%s)
# 1. one process a producer, in parallel (each compiles its own keys; a hung variant costs
#    only its own process): the float64 oracle, decode(impl="gluon")'s kernel, the default
#    VARIANTS[0] (the TMA variant's twin), the three new variants and the twin $TWIN on the
#    7 check cases (ragged, empty, splits 1-4, pages 16/32/64/128, H 20/64/128), then the
#    bench's keys
pids=""
for name in reference gluon ws-r232-p40-tile ${NEW//,/ } $TWIN; do
  timeout -k 5 70 python3 $B --plan outputs --variants "$name" "$OUT" > "$OUT/1-out-$name.txt" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p"; done
echo "outputs: $(( $(date +%s) - start )) s"; for f in "$OUT"/1-out-*.txt; do echo "  $(basename "$f"): $(grep -c ' done ' "$f") cases done, $(grep -c ' error ' "$f") errors; $(tail -1 "$f" | cut -c1-100)"; done
# 2. every variant vs the oracle and gluon (rows 1.5e-2, LSE 2e-5), each new one bit for
#    bit vs its twin (gluon_decode_ws.twin); writes ws-check.json (failed: not timed)
timeout -k 5 20 python3 $B --plan compare "$OUT" > "$OUT/2-compare.txt" 2>&1
rc=$?
echo "compare: rc=$rc ($(( $(date +%s) - start )) s), $(grep -c ' ok$' "$OUT/2-compare.txt") rows ok"; grep -E "FAIL|Error|missing" "$OUT/2-compare.txt" | head -6; tail -1 "$OUT/2-compare.txt"
if [ $rc -ne 0 ]; then echo "SKIP timing: every variant failed, or the compare did not finish"; exit 1; fi
# 3. timing, one process with FlashMLA: the default, the new variants, gluon, FlashMLA at
#    b128 h128 L8192 and b32 h128 L32768 (page 64; compiled keys from step 1's cache)
timeout -k 5 55 python3 $B --plan bench --variants "ws-r232-p40-tile,$NEW" --warmup-ms 50 \
  --rep-ms 200 "$OUT" > "$OUT/3-bench.txt" 2>&1
rc=$?
echo "bench: rc=$rc ($(( $(date +%s) - start )) s)"; grep -E "TFLOP/s|Error|error" "$OUT/3-bench.txt" | head -16
echo "total $(( $(date +%s) - start )) s"
