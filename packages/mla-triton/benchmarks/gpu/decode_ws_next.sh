#!/usr/bin/env bash
# h37: the warp-specialized decode's new variants (gluon_decode_ws.VARIANTS[3:]: TMA tile
# loads; with S issued early; with that and a 4-slot ring of 32-token tiles) on one H200;
# h39: the same kernel on fp8 Q/K/P/V through the float16 shadow (V̂ = K̂;
# decode_shadow(config=WsConfig())): checked against decode_shadow's Gluon split kernel and
# the oracle, timed beside it and FlashMLA; h40: the same on nvfp4 Q/K/P/V through the shadow
# (its V̂ section, the open V block in the kernel; decode_shadow(config=NVFP4_CONFIG), 32-token
# tiles, two slots). At most ~240 s (timeouts 70 + 20 + 55 + 45 + 40 s, 2 s kill grace each).
# From the repository root on the device (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/decode_ws_next.sh
# Writes $OUT/{1-out-*.txt,out-*.pt,2-compare*.txt,ws-check*.json,3-bench.txt,ws-bench.json,
# 4-bench-fp8-shadow.txt,ws-bench-fp8-shadow.json,5-bench-nvfp4-shadow.txt,
# ws-bench-nvfp4-shadow.json} (the shadows' files: "-fp8-shadow", "-nvfp4-shadow").
# The variant lists, the step timeouts and GRAPH (1: the bench steps also time CUDA-graph
# replays and the host's issue time, --graph) may be set in the environment
# (decode_ws_sit8.sh does); the defaults are sitting 7's run.
set -u
TAG=h37
. "$(dirname "$0")/env.sh"
B=packages/mla-triton/benchmarks/gluon_decode_ws.py
NEW=${NEW-ws-r232-p40-tile-tma,ws-r232-p40-tile-tma-es,ws-r232-p40-tile-tma-n32s4-es}
TWIN=${TWIN-ws-r232-p40-tile-tma-n32s4}  # the last one's twin (not in VARIANTS: checked, not timed)
# fp8 through the shadow: the default, TMA (its twin: the default), TMA + S early (twin: TMA)
SHADOW=${SHADOW-ws-r232-p40-tile,ws-r232-p40-tile-tma,ws-r232-p40-tile-tma-es}
SHADOW_TIMED=${SHADOW_TIMED-ws-r232-p40-tile,ws-r232-p40-tile-tma-es}
# nvfp4 through the shadow: NVFP4_CONFIG and with S issued early (its twin: NVFP4_CONFIG)
NV=${NV-ws-r232-p40-tile-n32s2,ws-r232-p40-tile-n32s2-es}
# step timeouts (s): outputs, compare, bench none, bench fp8 shadow, bench nvfp4 shadow
T_OUT=${T_OUT:-70} T_CMP=${T_CMP:-20} T_NONE=${T_NONE:-55} T_FP8=${T_FP8:-45} T_NV=${T_NV:-40}
GRAPH_ARG=""
if [ "${GRAPH:-0}" = 1 ]; then GRAPH_ARG=--graph; fi
start=$(date +%s)
# 1. one process a producer, in parallel (each compiles its own keys; a hung variant costs
#    only its own process): the float64 oracle, decode(impl="gluon")'s kernel, the default
#    VARIANTS[0] (the TMA variant's twin), the three new variants and the twin $TWIN on the
#    7 check cases (ragged, empty, splits 1-4, pages 16/32/64/128, H 20/64/128), then the
#    bench's keys
pids=""
for name in reference gluon ws-r232-p40-tile ${NEW//,/ } $TWIN; do
  timeout -k 2 "$T_OUT" python3 $B --plan outputs --variants "$name" "$OUT" > "$OUT/1-out-$name.txt" 2>&1 &
  pids="$pids $!"
done
# the fp8 shadow's producers (decode_shadow on the cases' filled shadows): the oracle with
# the recipe, gluon_decode's shadow kernel, the three ws variants; then their bench keys
for name in reference gluon ${SHADOW//,/ }; do
  timeout -k 2 "$T_OUT" python3 $B --plan outputs --recipe fp8-shadow --variants "$name" "$OUT" \
    > "$OUT/1-out-fp8-shadow-$name.txt" 2>&1 &
  pids="$pids $!"
done
# the nvfp4 shadow's: the oracle with the recipe, gluon_decode's SEPARATE_V_CONFIG, the two
for name in reference gluon ${NV//,/ }; do
  timeout -k 2 "$T_OUT" python3 $B --plan outputs --recipe nvfp4-shadow --variants "$name" "$OUT" \
    > "$OUT/1-out-nvfp4-shadow-$name.txt" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p"; done
echo "outputs: $(( $(date +%s) - start )) s"; for f in "$OUT"/1-out-*.txt; do echo "  $(basename "$f"): $(grep -c ' done ' "$f") cases done, $(grep -c ' error ' "$f") errors; $(tail -1 "$f" | cut -c1-100)"; done
# 2. every variant vs the oracle and gluon (rows 1.5e-2, LSE 2e-5; the fp8 shadow: at most
#    2% of rows beyond 4e-3, all within 0.5, LSE 2e-5), each new one bit for bit vs its twin
#    (gluon_decode_ws.twin); writes ws-check.json and ws-check-fp8-shadow.json (failed: not
#    timed); the two compares in parallel (CPU only)
timeout -k 2 "$T_CMP" python3 $B --plan compare "$OUT" > "$OUT/2-compare.txt" 2>&1 &
p_none=$!
timeout -k 2 "$T_CMP" python3 $B --plan compare --recipe fp8-shadow "$OUT" \
  > "$OUT/2-compare-fp8-shadow.txt" 2>&1 &
p_shadow=$!
timeout -k 2 "$T_CMP" python3 $B --plan compare --recipe nvfp4-shadow "$OUT" \
  > "$OUT/2-compare-nvfp4-shadow.txt" 2>&1 &
p_nv=$!
wait $p_none; rc=$?
wait $p_shadow; rc_shadow=$?
wait $p_nv; rc_nv=$?
for f in 2-compare 2-compare-fp8-shadow 2-compare-nvfp4-shadow; do
  echo "$f: ($(( $(date +%s) - start )) s) $(grep -c ' ok$' "$OUT/$f.txt") rows ok"; grep -E "FAIL|Error|missing" "$OUT/$f.txt" | head -6; tail -1 "$OUT/$f.txt"
done
# bench NAME RC TIMEOUT FILE ARGS...: one timing step of benchmarks/gluon_decode_ws.py
# --plan bench (one process with FlashMLA bf16, b128 h128 L8192 and b32 h128 L32768,
# page 64; compiled keys from step 1's cache) into $OUT/FILE, skipped where its
# correctness step RC failed
bench() {
  local name=$1 rc=$2 limit=$3 file=$4; shift 4
  if [ "$rc" -ne 0 ]; then
    echo "SKIP timing ($name): rc=$rc, every variant failed or the compare did not finish"
    return
  fi
  timeout -k 2 "$limit" python3 $B --plan bench "$@" $GRAPH_ARG --warmup-ms 50 --rep-ms 200 "$OUT" \
    > "$OUT/$file" 2>&1
  echo "bench $name: rc=$? ($(( $(date +%s) - start )) s)"
  grep -E "TFLOP/s|Error|error" "$OUT/$file" | head -16 | cut -c1-220
}
# 3. recipe none: the default, the new variants, gluon_decode's kernel, FlashMLA
bench none $rc "$T_NONE" 3-bench.txt --variants "ws-r232-p40-tile,$NEW"
# 4. the fp8 shadow: the ws default and TMA + S early through decode_shadow, gluon's shadow
#    kernel (what decode_shadow(impl="gluon") runs today), FlashMLA on the raw cache (the
#    shadow filled by update_cache over every slot)
bench "fp8 shadow" $rc_shadow "$T_FP8" 4-bench-fp8-shadow.txt --recipe fp8-shadow --variants "$SHADOW_TIMED"
# 5. the nvfp4 shadow: NVFP4_CONFIG and with S early, gluon_decode's SEPARATE_V_CONFIG
#    (decode_shadow(impl="gluon") today: 258 TFLOP/s, 0.48-0.50x), FlashMLA
bench "nvfp4 shadow" $rc_nv "$T_NV" 5-bench-nvfp4-shadow.txt --recipe nvfp4-shadow --variants "$NV"
echo "total $(( $(date +%s) - start )) s"
