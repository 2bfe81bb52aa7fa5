#!/usr/bin/env bash
# Issue 17, third step (helper h38): the Gluon prefill's schedule options on one H200 -
# early_k (K slots released after Q K^T, K loaded a tile ahead of V), turns=False (two
# consumer warpgroups without turn barriers: FA3's head-dim-192 schedule), row_inf_check
# (the NaN rule's -inf check by row minima), persistent (one program an SM looping over the
# query tiles). Never run on a GPU before this script.
# Run from the repository root of a snapshot, vLLM 0.33 bundle (torch 2.14, Triton 3.8) in
# /tmp/site:   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/prefill_next.sh
# Wall: <= 170 s (a global deadline, BUDGET_S; every step has its own `timeout`, so a
# deadlock in a new barrier protocol costs only its step).
# Output ($OUT): summary.txt (also on stdout), smoke.txt, tests.txt, warm.txt, sweep.txt,
# gluon-prefill-sweep.json. Steps:
#  1. smoke (<= 45 s): each new tiling (NEW) in its own process against mla_reference on
#     the GPU: varlen causal with a NaN in V on a masked tile, chunked non-causal,
#     nvfp4 + 2:4, an infinite K element on an unmasked tile (the row-minimum check), and a
#     4096 + 1000-token batch (several query tiles a persistent program).
#     A tiling that hangs or fails is left out of step 3. Side by side: the reference
#     tilings' (REF) and the Triton kernel's sweep compiles.
#  2. GPU tests (<= 55 s, 6 shards, CPU oracle): test_prefill_gpu.py's NEXT_CASES
#     (test_gluon_tilings) and the new test_nan_rule_gluon_tilings ids; side by side the
#     surviving new tilings' sweep compiles (8 processes).
#  3. sweep (the rest, about 55-65 s): benchmarks/gluon_prefill.py --sweep --tilings REF + the
#     surviving NEW: FA3 bf16, Triton and each tiling x none / fp8 / nvfp4 / nvfp4+2:4 at
#     b4 h128 L4096, b1 h16 L16384 and the mixed varlen batch of the issue's targets
#     (varlen-mixed-h128: 2189, 2740, 1101, 6164, 3500 and 690 tokens, h128; FA3 on the same
#     cu_seqlens), one process; ratio to FA3 per row, fastest per recipe.
#     ABLATE=1 (with a larger BUDGET_S, about +90 s): then the same tilings without the
#     softmax step (recipe "none-no-softmax"): each schedule's MMA-issue bound against FA3.
# Parameters (the environment; prefill_sit8.sh sets them): TAG, BUDGET, NEW, REF, KEXPR
# (step 2's -k on the tilings' test ids), TESTK (step 2's whole -k), SHARDS and TEST_S (its
# processes and their timeout), PACK=1 (at the end
# every output but summary.txt and the sweep's JSON packed into all.tgz).
set -u
TAG=${TAG:-h38} BUDGET=${BUDGET:-165}
. "$(dirname "$0")/prefill_env.sh"
BENCH=packages/mla-triton/benchmarks/gluon_prefill.py
NEW=${NEW:-"pp-128x64x3-ek pp-128x128x2-ek pp-128x128x2-ek-ri nt-128x64x3 nt-128x128x2-ek ws-128x64x3-ek ws-128x128x2-ek pp-128x64x3-per pp-128x128x2-ek-per ws-128x64x3-ek-per"}
REF=${REF:-"pp-128x64x3 ws-128x64x3"}  # AUTO_CONFIGS' tilings (none / fp8 / nvfp4; N:M)
csv() { echo "$*" | tr ' ' ','; }

# 1. smoke: each new tiling in its own process, in parallel; REF compiles beside them
T=$(left 45)
for t in $NEW; do
  ( timeout "$T" python3 packages/mla-triton/benchmarks/gpu/prefill_smoke.py "$t" --inf-k --long \
      >"$TMP/smoke-$t.txt" 2>&1; echo "rc=$?" >>"$TMP/smoke-$t.txt" ) &
done
for i in 0 1; do
  ( timeout "$T" python3 $BENCH --sweep --tilings "$(csv $REF)" --warm "$i/2" >"$TMP/warm-ref-$i.txt" 2>&1
    echo "rc=$?" >>"$TMP/warm-ref-$i.txt" ) &
done
wait
GOOD=""
for t in $NEW; do
  cat "$TMP/smoke-$t.txt" >>"$OUT/smoke.txt"
  rc=$(tail -1 "$TMP/smoke-$t.txt")
  note "smoke $t: $rc $(grep -c ' OK$' "$TMP/smoke-$t.txt")/5 OK"
  [ "$rc" = "rc=0" ] && GOOD="$GOOD $t"
done
grep -E "BAD$|Error|error" "$OUT/smoke.txt" | head -8 | tee -a "$S"
note "passed the smoke:$GOOD"

# 2. GPU tests, sharded (ids round robin); the surviving tilings' compiles side by side
TS=packages/mla-triton/tests
KEXPR=${KEXPR:-"pp128-ek or nt128 or nt64 or ws64-ek or pp64-ri or plain-ri or per"}
TESTK=${TESTK:-"(gluon_tilings or nan_rule_gluon_tilings) and not s8- and ($KEXPR)"}
collect_ids "$TMP/ids.txt" $TS/test_prefill_gpu.py -k "$TESTK"
SHARDS=${SHARDS:-6}
note "tests: $(wc -l <"$TMP/ids.txt") ids in $SHARDS shards"
T=$(left "${TEST_S:-55}")
shards "$TMP/ids.txt" $SHARDS "$T" -v -rA  # -v: a test's line as it ends (kept if cut off)
WARM=8
if [ -n "$GOOD" ]; then
  for i in $(seq 0 $((WARM - 1))); do
    ( timeout "$T" python3 $BENCH --sweep --tilings "$(csv $GOOD)" --warm "$i/$WARM" \
        >"$TMP/warm-$i.txt" 2>&1; echo "rc=$?" >>"$TMP/warm-$i.txt" ) &
  done
fi
wait
for i in $(seq 0 $((SHARDS - 1))); do
  { echo "=== shard $i"; cat "$TMP/tests-$i.txt"; } >>"$OUT/tests.txt"
  note "shard $i: $(grep -cE '^[^ ]+::[^ ]+ PASSED' "$TMP/tests-$i.txt") passed, $(grep -cE '^(FAILED|ERROR) ' "$TMP/tests-$i.txt") failed/errors; $(grep -E ' in [0-9.]+s' "$TMP/tests-$i.txt" | tail -1) $(tail -1 "$TMP/tests-$i.txt")"
done
grep -h '^FAILED\|^ERROR' "$TMP"/tests-*.txt | tee -a "$S"
cat "$TMP"/warm-*.txt >>"$OUT/warm.txt" 2>/dev/null
note "warm: $(grep -c '^warm' "$OUT/warm.txt") calls, $(grep -c 'Error\|error' "$OUT/warm.txt") errors"

# 3. the sweep: FA3, Triton, REF and the surviving new tilings x recipes, one process
T=$(left 170)
note "sweep: ${T}s left"
ABL=""
[ "${ABLATE:-0}" = 1 ] && ABL="--ablate"
timeout "$T" python3 $BENCH --sweep $ABL --rep "${REP:-60}" --tilings "$(csv $REF $GOOD)" --out "$OUT" \
  >"$OUT/sweep.txt" 2>&1
note "sweep rc=$?"
sed -n '/fastest Gluon tiling/,$p' "$OUT/sweep.txt" | tee -a "$S"
grep -E "x FA3$" "$OUT/sweep.txt" | awk '{printf "%-17s %-10s %-20s %8s ms %7s TFLOP/s %s FA3\n", $1, $2, $3, $4, $6, $8}' >>"$S"
note "total"
if [ "${PACK:-0}" = 1 ]; then  # the device returns at most 8 files
  tar czf "$TMP/all.tgz" -C "$OUT" --exclude=summary.txt . && mv "$TMP/all.tgz" "$OUT/" && \
    find "$OUT" -type f ! -name summary.txt ! -name all.tgz ! -name '*.json' -delete
  note "packed: $(ls "$OUT" | tr '\n' ' ')"
fi
rm -rf "$TMP"
