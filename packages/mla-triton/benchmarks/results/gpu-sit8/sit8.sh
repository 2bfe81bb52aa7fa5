#!/usr/bin/env bash
# Sitting 8 (lead): one mode per device call, on the snapshot gpu_ab/snap8 (branch flips8:
# gluon_decode_ws.DEFAULT_CONFIG = VARIANTS[3] (TMA) for none and V̂ = K̂ shadows,
# WS_SHADOW_AUTO / WS_SHADOW_NVFP4_AUTO on, prefill AUTO_CONFIGS pp-128x128x2-ek-ri (none,
# fp8), nt-128x64x3 (nvfp4), ws-128x128x2-ek (N:M)). Build the snapshot with
#   rm -rf gpu_ab/snap8 && mkdir -p gpu_ab/snap8 && git archive flips8 packages tests-vllm-e2e \
#     | tar -x -C gpu_ab/snap8 && git rev-parse --short flips8 > gpu_ab/snap8/COMMIT
#   A: the GPU suites the flips touch, side by side (<= 470 s): test_gluon_decode_ws.py
#      (2 shards), test_decode_gpu.py -k gluon, the warm-up GPU test, test_shadow_gpu.py's
#      test_gluon_shadow_bf16 (impl="gluon": the ws kernel now; 4 shards), the whole prefill
#      GPU suite + test_gluon_prefill's GPU tests (5 shards)
#   B: decode_ws_sit8.sh then on_read_sit8.sh (<= 375 s), each folder tarred
#   C: prefill_sit8.sh (<= 215 s)
#   D: serve empty cache 4k (gpu_serve_empty_cache.sh, CONFIGS/BUDGET from the env)
set -u
cd gpu_ab/snap8
echo "commit $(cat COMMIT) mode $1"
S=packages/mla-triton/src/mla_triton
grep -h "^DEFAULT_CONFIG\|^WS_AUTO\|^WS_SHADOW_AUTO\|^WS_SHADOW_NVFP4_AUTO\|^_PINGPONG\|^_NO_TURNS\|^_WS =" $S/*.py
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
SECONDS=0
mkdir -p $OUT
case "$1" in
A)
  export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src MLA_REQUIRE_GPU=1
  T=packages/mla-triton/tests; L=/tmp/sitA; rm -rf $L; mkdir -p $L
  TO=${TO:-440}
  run() { local name=$1 to=$2; shift 2
          timeout -k 5 "$to" python3 -m pytest -q -rfE -p no:cacheprovider "$@" > "$L/$name.txt" 2>&1
          echo "$name rc=$? after ${SECONDS}s: $(grep -E ' in [0-9.]+s' "$L/$name.txt" | tail -1)" >> "$L/rc.txt"; }
  ids() { python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" \
          | sed 's|^.*\(packages/mla-triton/tests/\)|\1|'; }
  ids $T/test_gluon_decode_ws.py > $L/ws-ids.txt &
  ids $T/test_prefill_gpu.py > $L/pf-ids.txt &
  ids $T/test_gluon_prefill.py -k on_a_gpu > $L/pf2-ids.txt &
  ids $T/test_shadow_gpu.py -k test_gluon_shadow_bf16 > $L/sh-ids.txt &
  wait; cat $L/pf2-ids.txt >> $L/pf-ids.txt
  echo "ids: ws $(wc -l < $L/ws-ids.txt), prefill $(wc -l < $L/pf-ids.txt), shadow $(wc -l < $L/sh-ids.txt) after ${SECONDS}s" | tee -a $L/rc.txt
  for i in 0 1; do (mapfile -t x < <(awk -v i=$i 'NR % 2 == i' $L/ws-ids.txt); run ws$i $TO "${x[@]}") & done
  run decode-gluon $TO $T/test_decode_gpu.py -k gluon &
  run warmup 300 $T/test_warmup.py::test_nothing_compiles_after_warmup_gpu &
  for i in 0 1 2 3; do (mapfile -t x < <(awk -v i=$i 'NR % 4 == i' $L/sh-ids.txt); run sh$i $TO "${x[@]}") & done
  for i in 0 1 2 3 4; do (mapfile -t x < <(awk -v i=$i 'NR % 5 == i' $L/pf-ids.txt); run pf$i $TO "${x[@]}") & done
  wait
  cat $L/rc.txt; grep -h "^FAILED\|^ERROR" $L/*.txt | head -30
  tar czf $OUT/suitesA.tgz -C $L .; cp $L/rc.txt $OUT/A-summary.txt
  grep -h "^FAILED\|^ERROR" $L/*.txt > $OUT/A-failed.txt
  ;;
B)
  mkdir -p /tmp/B/dec /tmp/B/onread
  OUT=/tmp/B/dec timeout -k 5 ${DEC_S:-205} bash packages/mla-triton/benchmarks/gpu/decode_ws_sit8.sh > /tmp/B/dec-stdout.txt 2>&1
  echo "decode_ws_sit8 rc=$? after ${SECONDS}s"; tail -40 /tmp/B/dec-stdout.txt
  cp /tmp/B/dec-stdout.txt /tmp/B/dec/stdout.txt; tar czf $OUT/dec.tgz -C /tmp/B dec
  OUT=/tmp/B/onread timeout -k 5 ${ONR_S:-155} bash packages/mla-triton/benchmarks/gpu/on_read_sit8.sh > /tmp/B/onread-stdout.txt 2>&1
  echo "on_read_sit8 rc=$? after ${SECONDS}s"; tail -30 /tmp/B/onread-stdout.txt
  cp /tmp/B/onread-stdout.txt /tmp/B/onread/stdout.txt; tar czf $OUT/onread.tgz -C /tmp/B onread
  cp /tmp/B/dec-stdout.txt $OUT/dec-stdout.txt; cp /tmp/B/onread-stdout.txt $OUT/onread-stdout.txt
  ;;
C)
  OUT=/tmp/C timeout -k 5 ${PF_S:-215} bash packages/mla-triton/benchmarks/gpu/prefill_sit8.sh > /tmp/C-stdout.txt 2>&1
  echo "prefill_sit8 rc=$? after ${SECONDS}s"; tail -45 /tmp/C-stdout.txt
  cp /tmp/C-stdout.txt /tmp/C/stdout.txt; tar czf $OUT/prefill.tgz -C /tmp C; cp /tmp/C-stdout.txt $OUT/
  ;;
D)
  OUT=$OUT BUDGET=${BUDGET:-535} bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh 2>&1 | tail -60 ;;
esac
echo "mode $1 done after ${SECONDS}s"; ls -R $OUT | head -30
