#!/usr/bin/env bash
# Sitting 12 (one device call after the bundle's parts): recipe none and the fp8 shadow at
# 16 heads through the warp-specialized kernel against FlashMLA and the Triton kernel; the
# nvfp4 shadow's bound, one factor at a time (32-token tiles on the fp8 shadow, q and P fp8,
# P none); then the GPU tests of this sitting's changes (the h16 dispatch, the packed shadow).
# Mode prefill: the prefill GPU suite's impl="gluon" ids (AUTO_CONFIGS' tilings, 8 shards),
# then gluon_prefill.py's sweep of AUTO_CONFIGS' tilings with --ablate (each schedule without
# its softmax: the MMA-issue floor) beside FA3.
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit12.sh bench|tests|prefill (calls on
# one warm machine: the bundle is installed once)
set -u
MODE=${1:?bench, tests or prefill}
[ -d /tmp/site/vllm ] || bash /root/parts/install.sh > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src:packages/mla-triton/tests
export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 MLA_REQUIRE_GPU=1
B=packages/mla-triton/benchmarks
H16=b128-h16-L8192
WS=ws-r232-p40-tile-tma    # DEFAULT_CONFIG
N32=ws-r232-p40-tile-n32s2  # NVFP4_CONFIG's tiles: 32 tokens, 2 slots, cp.async
ws() {  # name, timeout, then gluon_decode_ws.py's arguments
    local name=$1 to=$2; shift 2
    timeout "$to" python $B/gluon_decode_ws.py --plan bench --graph "$@" "$OUT/$name" \
        > "$OUT/$name.txt" 2>&1; echo "$name rc=$?" >> "$OUT/$name.txt"
}
if [ "$MODE" = bench ]; then
# 16 heads: recipe none (the new auto) and the fp8 shadow, ws against FlashMLA
ws h16-none 60 --recipe none --shapes $H16 --variants $WS
ws h16-fp8 60 --recipe fp8-shadow --shapes $H16 --variants $WS
# and the Triton kernels there, FlashMLA in the same process
timeout 90 python $B/decode.py --flashmla --impls triton,auto --recipes none,fp8 --shapes $H16 \
    --no-ceilings --out "$OUT/h16-decode" > "$OUT/h16-decode.txt" 2>&1; echo "rc=$?" >> "$OUT/h16-decode.txt"
# the nvfp4 shadow's bound at 128 heads: the same 32-token 2-slot tiles on the fp8 shadow
# (1152 bytes a token, V̂ = K̂), nvfp4 K/V with q and P fp8, with q fp8 and P none
ws abl-fp8 90 --shapes b128-h128-L8192 --recipe fp8-shadow --variants $WS,ws-r232-p40-tile,$N32
ws abl-nv 60 --shapes b128-h128-L8192 --recipe nvfp4-shadow --variants $N32
ws abl-nv-qp8 60 --shapes b128-h128-L8192 --recipe nvfp4-shadow-qp8 --variants $N32
ws abl-nv-q8 60 --shapes b128-h128-L8192 --recipe nvfp4-shadow-q8 --variants $N32
ws abl-none 60 --shapes b128-h128-L8192 --recipe none --variants $WS,$N32
fi
if [ "$MODE" = tests ]; then
# GPU tests: the h16 dispatch, every test_gluon_shadow_bf16 id (the packed shadow now too), ws at
# few heads
timeout 500 python -m pytest -q -p no:cacheprovider -W error packages/mla-triton/tests/test_decode_gpu.py \
    "packages/mla-triton/tests/test_shadow_gpu.py::test_gluon_shadow_bf16" \
    -k "gluon_shadow_bf16 or auto_runs or (head_counts and gluon)" > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"
fi
if [ "$MODE" = prefill ]; then
TS=packages/mla-triton/tests/test_prefill_gpu.py
python -m pytest -q --collect-only -p no:cacheprovider $TS \
    -k "gluon and not gluon_tilings and not nm_options" 2>/dev/null | grep "::" > /tmp/ids.txt
for i in 0 1 2 3 4 5 6 7; do
    ( mapfile -t ids < <(awk -v i="$i" 'NR % 8 == i' /tmp/ids.txt)
      timeout "${TEST_S:-200}" python -m pytest -q -rA -p no:cacheprovider -W error "${ids[@]}" \
          > "/tmp/pf-tests-$i.txt" 2>&1; echo "rc=$?" >> "/tmp/pf-tests-$i.txt" ) &
done
wait
for i in 0 1 2 3 4 5 6 7; do echo "=== shard $i"; cat "/tmp/pf-tests-$i.txt"; done > "$OUT/prefill-tests.txt"
echo "ids $(wc -l < /tmp/ids.txt), passed $(grep -c '^PASSED' "$OUT/prefill-tests.txt"), failed $(grep -cE '^(FAILED|ERROR)' "$OUT/prefill-tests.txt")" >> "$OUT/prefill-tests.txt"
timeout "${SWEEP_S:-300}" python $B/gluon_prefill.py --sweep --ablate --rep 60 \
    --tilings pp-128x128x2-ek,pp-128x128x2-ek-ri,nt-128x64x3,ws-128x128x2-ek-np-nr --out "$OUT" \
    > "$OUT/prefill-sweep.txt" 2>&1; echo "sweep rc=$?" >> "$OUT/prefill-sweep.txt"
fi
tail -n 4 "$OUT"/*.txt
