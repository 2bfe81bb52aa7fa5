#!/usr/bin/env bash
# Issue 17 (helper h33): the Gluon prefill's N:M sparsity and ping-pong tilings on one H200.
# Run from the repository root of a snapshot, vLLM 0.33 bundle (torch 2.14, Triton 3.8) in
# /tmp/site:   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/prefill_tilings.sh
# Wall: <= 200 s (a global deadline; every step has its own `timeout`, so a deadlock in
# the ping-pong barrier protocol, never run on a GPU before, costs only its step).
# Output ($OUT, 6 files): summary.txt, smoke.txt, tests.txt, warm.txt, sweep.txt,
# gluon-prefill-sweep.json. Steps:
#  1. smoke (<= 45 s): each ping-pong tiling once, in its own process, against mla_reference
#     on the GPU (varlen causal, chunked, nvfp4 + 2:4; NaN in V on a masked tile). A tiling that hangs or
#     fails is left out of steps 2-4 (PINGPONG=0 below).
#  2. GPU tests (<= 95 s, 8 shards, CPU oracle): test_prefill_gpu.py -k "gluon_tilings or
#     nm_sparsity or nan_rule or auto_runs_gluon" (N:M on Gluon vs oracle and Triton, every
#     Gluon tiling incl. ping-pong and N:M, the NaN rule on ping-pong) and
#     test_gluon_prefill.py's GPU test. Side by side: step 3 (compiles the sweep's variants
#     into Triton's cache, 4 processes).
#  4. sweep (the rest, >= 45 s): benchmarks/gluon_prefill.py --sweep: FA3 bf16, Triton and
#     every tiling x recipe none / fp8 / nvfp4 / nvfp4+2:4 at b4 h128 L4096 and b1 h16
#     L16384 in one process; ratio to FA3 per row, fastest tiling per recipe.
set -u
TAG=h33 BUDGET=195
. "$(dirname "$0")/prefill_env.sh"

# 1. smoke: each ping-pong tiling in its own process (prefill_smoke.py), in parallel
PP_TILINGS="pp-128x64x3 pp-128x64x2 pp-128x128x2"
T=$(left 45)
for t in $PP_TILINGS; do
  ( timeout "$T" python3 packages/mla-triton/benchmarks/gpu/prefill_smoke.py "$t" \
      >"$TMP/smoke-$t.txt" 2>&1; echo "rc=$?" >>"$TMP/smoke-$t.txt" ) &
done
wait
PINGPONG=1
for t in $PP_TILINGS; do
  cat "$TMP/smoke-$t.txt" >>"$OUT/smoke.txt"
  rc=$(tail -1 "$TMP/smoke-$t.txt")
  note "smoke $t: $rc $(grep -c ' OK$' "$TMP/smoke-$t.txt")/3 OK"
  [ "$rc" = "rc=0" ] || PINGPONG=0
done
grep -E "OK$|BAD$|Error|error" "$OUT/smoke.txt" | head -12
note "ping-pong in the steps below: $PINGPONG"

# 2. GPU tests, sharded (ids round robin), and 3. the sweep's compiles side by side
TS=packages/mla-triton/tests
KEXPR="gluon_tilings or nm_sparsity or nan_rule or auto_runs_gluon or matches_the_oracle"
[ "$PINGPONG" = 1 ] || KEXPR="($KEXPR) and not pp"
# (prefill_next.sh's cases are not this script's: NEXT_CASES and the new NaN-rule ids)
KEXPR="($KEXPR) and not (pp128-ek or nt128 or nt64 or ws64-ek or pp64-ri or plain-ri or per)"
collect_ids "$TMP/ids.txt" $TS/test_prefill_gpu.py $TS/test_gluon_prefill.py -k "$KEXPR"
SHARDS=8
note "tests: $(wc -l <"$TMP/ids.txt") ids in $SHARDS shards"
T=$(left 95)
shards "$TMP/ids.txt" $SHARDS "$T" -q -rA
NOPP=""
[ "$PINGPONG" = 1 ] || NOPP="--no-pingpong"
WARM=4
for i in $(seq 0 $((WARM - 1))); do
  ( timeout "$T" python3 packages/mla-triton/benchmarks/gluon_prefill.py --sweep $NOPP --warm "$i/$WARM" \
      >"$TMP/warm-$i.txt" 2>&1; echo "rc=$?" >>"$TMP/warm-$i.txt" ) &
done
wait
for i in $(seq 0 $((SHARDS - 1))); do
  { echo "=== shard $i"; cat "$TMP/tests-$i.txt"; } >>"$OUT/tests.txt"
  note "shard $i: $(grep -E ' in [0-9.]+s' "$TMP/tests-$i.txt" | tail -1) $(tail -1 "$TMP/tests-$i.txt")"
done
grep -h '^FAILED\|^ERROR' "$TMP"/tests-*.txt | tee -a "$S"
for i in $(seq 0 $((WARM - 1))); do cat "$TMP/warm-$i.txt" >>"$OUT/warm.txt"; done
note "warm: $(grep -c '^warm' "$OUT/warm.txt") calls, $(grep -c 'Error\|error' "$OUT/warm.txt") errors"

# 4. the sweep: FA3, Triton, every tiling x recipe, one process
T=$(left 200)
note "sweep: ${T}s left"
timeout "$T" python3 packages/mla-triton/benchmarks/gluon_prefill.py --sweep $NOPP --out "$OUT" \
  >"$OUT/sweep.txt" 2>&1
note "sweep rc=$?"
sed -n '/fastest Gluon tiling/,$p' "$OUT/sweep.txt" | tee -a "$S"
grep -E "x FA3$" "$OUT/sweep.txt" | awk '{printf "%-14s %-10s %-16s %8s ms %7s TFLOP/s %s FA3\n", $1, $2, $3, $4, $6, $8}' | tee -a "$S"
note "total"
rm -rf "$TMP"
