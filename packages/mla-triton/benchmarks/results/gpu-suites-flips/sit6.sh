#!/usr/bin/env bash
# Sitting 6 (lead): one mode per device call, on the flips snapshot gpu_ab/snap6.
#   A: install done before; decode WS suite (2 shards), test_decode_gpu -k gluon, the warm-up
#      GPU test, the whole prefill GPU suite (6 shards), all side by side
#   B: shadow_gluon.sh (Gluon shadow recipes, on read, the contract through gluon; bench)
#   C: serve empty cache 4k (gpu_serve_empty_cache.sh, CONFIGS/BUDGET from the env)
#   D: serve 32k (CONFIGS, DEADLINE from the env), the Triton caches of C merged
# UNFLIP="ws onread nm pp": switch those candidates back off in this device copy first.
set -u
cd gpu_ab/snap6; ln -sfn ../../.whl .whl
echo "commit $(cat COMMIT) mode $1 unflip '${UNFLIP:-}'"
S=packages/mla-triton/src/mla_triton
for u in ${UNFLIP:-}; do case $u in
  ws) sed -i 's/^WS_AUTO = True/WS_AUTO = False/' $S/gluon_decode_ws.py ;;
  onread) sed -i 's/^GLUON_ON_READ_AUTO = True/GLUON_ON_READ_AUTO = False/' $S/gluon_decode.py ;;
  nm) sed -i 's/^GLUON_NM_AUTO = True/GLUON_NM_AUTO = False/' $S/prefill.py ;;
  pp) sed -i 's/^_PINGPONG = GluonPrefillConfig(128, 64, 3, warp_specialize=True, pingpong=True)/_PINGPONG = GluonPrefillConfig(128, 64, 3, warp_specialize=True)/' $S/gluon_prefill.py ;;
esac; done
grep -h "^WS_AUTO\|^GLUON_ON_READ_AUTO\|^GLUON_NM_AUTO\|^_PINGPONG" $S/*.py
PYTHONPATH=/tmp/site python3 -c "import hypothesis" 2>/dev/null || pip install -q --no-index --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
SECONDS=0
case "$1" in
A)
  export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src MLA_REQUIRE_GPU=1
  T=packages/mla-triton/tests; L=/tmp/sitA; rm -rf $L; mkdir -p $L
  run() { local name=$1 to=$2; shift 2
          timeout -k 5 "$to" python3 -m pytest -q -rfE -p no:cacheprovider "$@" > "$L/$name.txt" 2>&1
          echo "$name rc=$? after ${SECONDS}s: $(grep -E ' in [0-9.]+s' "$L/$name.txt" | tail -1)" >> "$L/rc.txt"; }
  ids() { python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" \
          | sed 's|^.*\(packages/mla-triton/tests/\)|\1|'; }
  ids $T/test_gluon_decode_ws.py > $L/ws-ids.txt
  ids $T/test_prefill_gpu.py > $L/pf-ids.txt; ids $T/test_gluon_prefill.py -k on_a_gpu >> $L/pf-ids.txt
  echo "ids: ws $(wc -l < $L/ws-ids.txt), prefill $(wc -l < $L/pf-ids.txt)" | tee -a $L/rc.txt
  for i in 0 1; do (mapfile -t x < <(awk -v i=$i 'NR % 2 == i' $L/ws-ids.txt); run ws$i 440 "${x[@]}") & done
  run decode-gluon 400 $T/test_decode_gpu.py -k gluon &
  run warmup 300 $T/test_warmup.py::test_nothing_compiles_after_warmup_gpu &
  for i in 0 1 2 3 4 5; do (mapfile -t x < <(awk -v i=$i 'NR % 6 == i' $L/pf-ids.txt); run pf$i 400 "${x[@]}") & done
  wait
  cat $L/rc.txt; grep -h "^FAILED\|^ERROR" $L/*.txt | head -30
  mkdir -p $OUT; tar czf $OUT/suitesA.tgz -C $L .; cp $L/rc.txt $OUT/A-summary.txt
  ;;
B)
  OUT=$OUT bash packages/mla-triton/benchmarks/gpu/shadow_gluon.sh 2>&1 | tail -45 ;;
C)
  OUT=$OUT BUDGET=${BUDGET:-585} CONFIGS=$CONFIGS bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh 2>&1 | tail -50 ;;
D)
  mkdir -p /tmp/tc32; for d in /tmp/serve-triton-* /tmp/triton-cache-h30; do [ -d "$d" ] && cp -r "$d/." /tmp/tc32/; done
  export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd: -):tests-vllm-e2e TRITON_CACHE_DIR=/tmp/tc32
  W=$(mktemp -d /tmp/s32-XXXX)
  timeout -k 5 $(( ${DEADLINE:-200} + 25 )) python3 packages/mla-vllm/benchmarks/serve.py --out $W/serve-32k --tag 32k \
    --layers 4 --batch 8 --prompt 32768 --gen 256 --capture-sizes 1,2,4,8 --configs "$CONFIGS" \
    --timeout 150 --min-left ${MIN_LEFT:-60} --deadline ${DEADLINE:-200} > $W/serve.out 2>&1
  echo "serve rc=$? after ${SECONDS}s"; tail -n 25 $W/serve.out
  mkdir -p $OUT; cp $W/serve-32k/serve-32k.json $W/serve-32k/serve-32k.png $OUT/ 2>/dev/null
  cp $W/serve.out $W/serve-32k/; tar czf $OUT/logs32.tgz -C $W --exclude=model serve-32k ;;
esac
echo "mode $1 done after ${SECONDS}s"; ls $OUT
