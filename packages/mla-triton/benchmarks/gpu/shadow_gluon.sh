#!/usr/bin/env bash
# Run: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/shadow_gluon.sh (repository root)
# h31: first GPU run of decode_shadow(impl="gluon") with a V̂ section (issue 16): nvfp4,
# calibrated, dynamic K, V-only shadows; nvfp4 on read through decode(impl="gluon") (V_OWN);
# plus a regression check of the changed kernel on the paths verified before (decode on
# read none/fp8, the fp8 shadow, the contract suite through Gluon). Paste as the device
# `run` command (nvidia-h200; repo root is the cwd; torch 2.14 + Triton 3.8 + vLLM 0.33 in
# /tmp/site). <= 510 s wall: tests <= 420 s (three parallel shards, each under `timeout`),
# then timing alone on the GPU <= 80 s (BENCH=0 skips it). $OUT: summary.txt, tests.txt,
# shadow-bench.txt, shadow_gluon_bench.json.
TAG=h31
. "$(dirname "$0")/env.sh"
export MLA_REQUIRE_GPU=1
L=/tmp/h31-logs; rm -rf "$L"; mkdir -p "$L"; SECONDS=0
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='tree of commit %h %s' 2>/dev/null | cut -c1-100; } > "$OUT/summary.txt" 2>&1
T=packages/mla-triton/tests/test_shadow_gpu.py; G=$T::test_gluon_shadow_bf16
shard() { timeout -k 5 420 python3 -m pytest -q -s -p no:cacheprovider "${@:2}" > "$L/$1.txt" 2>&1
          echo "shard $1 rc=$? after ${SECONDS}s" >> "$L/rc.txt"; }
# 1) tests: the new V̂-section shadows, then the paths the kernel change could regress
# five shards: nine in parallel all hit a 150 s limit on the H200 (2026-12-01, compile
# contention); three shards of two GPU cases each took 93-111 s there
# sitting 6 (gpu-suites-flips) passed nvfp4, kdyn-nvfp4-vfp8-fp16, fp8 (16 and 128 heads),
# v-only-16, fp8-scale-3-16 and 31 of the 36 on-read cases before its 300 s shard timeouts
# (five shards of four GPU cases each); this run takes the cases left, two a shard, 420 s
shard calibrated "$G[calibrated-16]" "$G[calibrated-128]" &
shard vonly-scale3 "$G[v-only-128]" "$G[fp8-scale-3-128]" &
shard on-read packages/mla-triton/tests/test_gluon_decode.py \
  -k "on_read_gated_matches_reference and (lens1-128-16-3-qp-nvfp4 or lens2-16-64-4)" &
SHARDS="calibrated vonly-scale3 on-read"
wait; echo "tests done after ${SECONDS}s" >> "$L/rc.txt"
# 2) timing, alone on the GPU: fp8 and nvfp4 through the shadow, triton vs gluon vs FlashMLA
[ "${BENCH:-1}" = 1 ] && timeout -k 5 80 python3 packages/mla-triton/benchmarks/gluon_shadow.py "$OUT" nvfp4 fp8 \
  > "$OUT/shadow-bench.txt" 2>&1
echo "bench rc=$? after ${SECONDS}s" >> "$L/rc.txt"
for f in $SHARDS; do
  { echo "===== $f"; cat "$L/$f.txt"; } >> "$OUT/tests.txt"
done
{ cat "$L/rc.txt"
  for f in $SHARDS; do
    echo "== $f"; grep -E "bit-identical|passed|failed|error|Error|assert" "$L/$f.txt" | tail -n 6
  done
  echo "== bench"; grep -E "gluon vs triton|TFLOP/s|gluon/triton|Error|unavailable" \
    "$OUT/shadow-bench.txt" | tail -n 30; } >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
