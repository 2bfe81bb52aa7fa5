#!/usr/bin/env bash
# Sitting 14 (device calls after the bundle's parts, on one warm machine): P's QDQ converted
# straight to the P V operand dtype and carried between key steps in it (half the registers of
# float32: no spills in recipe none's ping-pong tiling), nvfp4's block-scale reciprocal as one
# MUFU.RCP (qdq_device.recip_hw) and its codes times block scales in f16x2, the masked V
# tiles' check summed in V's dtype.
# Mode tests: the bit-for-bit tests of recip_hw and of P's nvfp4 QDQ, the prefill GPU suite's
# impl="gluon" ids (every varlen recipe through AUTO_CONFIGS' tilings, the NaN rule on the
# ping-pong tilings), its nvfp4 varlen ids on the Triton kernel and every nvfp4 id of the
# decode GPU suites (8 shards); beside them, the Gluon and Triton kernels of mode ab compiled
# for this tree and the one before it (8 warm processes). Mode ab: this tree against the tree
# before it (ab-old/: HEAD's mla-triton src by `git archive`, not committed), gluon_prefill.py's
# sweep of AUTO_CONFIGS' tilings for every recipe, FA3 in each process, processes new, old,
# new, old (5 rounds round robin each).
# Mode final (after poison's fix: ``y + a * 0`` instead of ``y + (a - a)``, which LLVM fused
# with the multiply that made ``a``): the prefill GPU suite but for the tiling sweeps, the decode
# and shadow GPU suites whole, the Gluon decode kernels' nvfp4 ids (8 shards).
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit14.sh tests|ab|final
set -u
MODE=${1:?tests, ab or final}
[ -d /tmp/site/vllm ] || bash /root/parts/install.sh > "$OUT/install.log" 2>&1
SRC=packages/mla-formats/src:packages/mla-reference/src
NEW=/tmp/site:$SRC:packages/mla-triton/src:packages/mla-triton/tests
OLD=/tmp/site:$SRC:ab-old/packages/mla-triton/src:packages/mla-triton/tests
export PYTHONPATH=$NEW
export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 MLA_REQUIRE_GPU=1
B=packages/mla-triton/benchmarks
T=packages/mla-triton/tests
TILINGS=pp-128x128x2-ek,nt-128x64x3,ws-128x128x2-ek-np-nr
RECIPES=none,fp8,nvfp4,nvfp4+2:4
shards() {  # run the ids of /tmp/ids.txt in 8 shards into $OUT/$1.txt (waits for every job)
    for i in 0 1 2 3 4 5 6 7; do
        ( mapfile -t ids < <(awk -v i="$i" 'NR % 8 == i' /tmp/ids.txt)
          timeout "${TEST_S:-520}" python -m pytest -q -rA -p no:cacheprovider -W error "${ids[@]}" \
              > "/tmp/$1-$i.txt" 2>&1; echo "rc=$?" >> "/tmp/$1-$i.txt" ) &
    done
    wait
    for i in 0 1 2 3 4 5 6 7; do echo "=== shard $i"; cat "/tmp/$1-$i.txt"; done > "$OUT/$1.txt"
    echo "ids $(wc -l < /tmp/ids.txt), passed $(grep -c '^PASSED' "$OUT/$1.txt"), failed $(grep -cE '^(FAILED|ERROR)' "$OUT/$1.txt")" >> "$OUT/$1.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/$1.txt" | head -20; grep "^rc=" "$OUT/$1.txt" | tr '\n' ' '
    tail -1 "$OUT/$1.txt"
}
if [ "$MODE" = final ]; then
{ python -m pytest -q --collect-only -p no:cacheprovider $T/test_prefill_gpu.py -k "not gluon_tilings and not s13"
  python -m pytest -q --collect-only -p no:cacheprovider $T/test_decode_gpu.py $T/test_shadow_gpu.py
  python -m pytest -q --collect-only -p no:cacheprovider $T/test_gluon_decode.py $T/test_gluon_decode_ws.py -k nvfp4
} 2>/dev/null | grep "::" > /tmp/ids.txt
shards s14-final
fi
if [ "$MODE" = tests ]; then
K="(gluon and not gluon_tilings and not s13) or recip_hw or qdq_p_hardware or hardware_e4m3"
K="$K or (nvfp4 and triton and varlen)"
{ python -m pytest -q --collect-only -p no:cacheprovider $T/test_prefill_gpu.py -k "$K"
  python -m pytest -q --collect-only -p no:cacheprovider $T/test_decode_gpu.py \
      $T/test_shadow_gpu.py $T/test_gluon_decode.py $T/test_gluon_decode_ws.py -k nvfp4
} 2>/dev/null | grep "::" > /tmp/ids.txt
for tree in NEW OLD; do for i in 0 1 2 3; do
    ( PYTHONPATH=${!tree} timeout 520 python $B/gluon_prefill.py --sweep --tilings $TILINGS \
        --recipes $RECIPES --warm "$i/4" > "/tmp/s14-warm-$tree-$i.txt" 2>&1 ) &
done; done
shards s14-tests  # its wait: the warm processes too
for f in /tmp/s14-warm-*.txt; do echo "== $f"; cat "$f"; done > "$OUT/s14-warm.txt"
echo "warm: $(grep -c '^warm' "$OUT/s14-warm.txt") calls, $(grep -c 'Error' "$OUT/s14-warm.txt") errors"
fi
if [ "$MODE" = ab ]; then
for run in new1 old1 new2 old2; do
    tree=NEW; [ "${run#old}" != "$run" ] && tree=OLD
    mkdir -p "$OUT/$run"
    PYTHONPATH=${!tree} timeout 140 python $B/gluon_prefill.py --sweep --rep 30 --rounds 5 \
        --recipes $RECIPES --tilings $TILINGS --out "$OUT/$run" > "$OUT/s14-$run.txt" 2>&1
    echo "$run rc=$?" >> "$OUT/s14-$run.txt"
    grep -E "x FA3|rc=" "$OUT/s14-$run.txt" | grep -v triton | sed "s/^/$run /" | cut -c1-100
done
fi
