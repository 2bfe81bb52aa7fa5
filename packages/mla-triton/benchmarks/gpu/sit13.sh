#!/usr/bin/env bash
# Sitting 13 (device calls after the bundle's parts, on one warm machine): the NaN rule's -inf
# check in the exponent (GluonPrefillConfig.fma_inf_check). Mode tests: its GPU test ids of
# test_prefill_gpu.py ("s13": against the oracle and the Triton kernel, the NaN rule, bit for
# bit against the same tilings without it), 4 shards. Mode sweep: gluon_prefill.py's sweep of
# AUTO_CONFIGS' tilings for none / fp8 / nvfp4 beside their "-fi" twins, FA3 in the process.
# Mode ab: the same tilings for none / fp8 / nvfp4 timed round robin (--rounds 9: every
# call's do_bench median 9 times in turn, its median of those; FA3 in the rotation).
# Mode vcheck: recipe none on auto's tiling with the masked tiles' V check ablated, and without
# the softmax, round robin beside FA3.
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit13.sh tests|sweep|ab|vcheck
set -u
MODE=${1:?tests, sweep, ab or vcheck}
[ -d /tmp/site/vllm ] || bash /root/parts/install.sh > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src:packages/mla-triton/tests
export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 MLA_REQUIRE_GPU=1
B=packages/mla-triton/benchmarks
if [ "$MODE" = tests ]; then
TS=packages/mla-triton/tests/test_prefill_gpu.py
python -m pytest -q --collect-only -p no:cacheprovider $TS -k "s13" 2>/dev/null | grep "::" > /tmp/ids.txt
for i in 0 1 2 3; do
    ( mapfile -t ids < <(awk -v i="$i" 'NR % 4 == i' /tmp/ids.txt)
      timeout "${TEST_S:-400}" python -m pytest -q -rA -p no:cacheprovider -W error "${ids[@]}" \
          > "/tmp/s13-tests-$i.txt" 2>&1; echo "rc=$?" >> "/tmp/s13-tests-$i.txt" ) &
done
wait
for i in 0 1 2 3; do echo "=== shard $i"; cat "/tmp/s13-tests-$i.txt"; done > "$OUT/s13-tests.txt"
echo "ids $(wc -l < /tmp/ids.txt), passed $(grep -c '^PASSED' "$OUT/s13-tests.txt"), failed $(grep -cE '^(FAILED|ERROR)' "$OUT/s13-tests.txt")" >> "$OUT/s13-tests.txt"
tail -1 "$OUT/s13-tests.txt"
fi
if [ "$MODE" = sweep ]; then
timeout "${SWEEP_S:-500}" python $B/gluon_prefill.py --sweep --rep 60 \
    --tilings pp-128x128x2-ek,pp-128x128x2-ek-fi,pp-128x128x2-ek-ri,nt-128x64x3,nt-128x64x3-fi \
    --out "$OUT" > "$OUT/s13-sweep.txt" 2>&1; echo "sweep rc=$?" >> "$OUT/s13-sweep.txt"
tail -20 "$OUT/s13-sweep.txt"
fi
if [ "$MODE" = ab ]; then
timeout "${SWEEP_S:-500}" python $B/gluon_prefill.py --sweep --rep 30 --rounds 9 --recipes none,fp8,nvfp4 \
    --tilings pp-128x128x2-ek,pp-128x128x2-ek-fi,pp-128x128x2-ek-ri,nt-128x64x3,nt-128x64x3-fi \
    --out "$OUT" > "$OUT/s13-ab.txt" 2>&1; echo "ab rc=$?" >> "$OUT/s13-ab.txt"
grep -E "FA3|rc=" "$OUT/s13-ab.txt" | tail -60
fi
if [ "$MODE" = vcheck ]; then  # what the masked tiles' V check and the softmax cost, round robin
timeout "${SWEEP_S:-400}" python $B/gluon_prefill.py --sweep --rep 30 --rounds 7 --recipes none \
    --tilings pp-128x128x2-ek --ablate no-v-check,no-softmax \
    --out "$OUT" > "$OUT/s13-vcheck.txt" 2>&1; echo "vcheck rc=$?" >> "$OUT/s13-vcheck.txt"
grep -E "FA3|rc=" "$OUT/s13-vcheck.txt" | tail -20
fi
