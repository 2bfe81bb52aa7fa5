#!/usr/bin/env bash
# Sitting 9: one mode per device call, run from the repository root (main: the sitting-8
# defaults), torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site (../shared/gpu-vllm):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit9.sh MODE
#   S: the GPU suites sitting 8 did not reach (results/gpu-sit8/suites/passed-ids.txt lists
#      the ids that passed there; every other id of test_gluon_decode_ws.py,
#      test_prefill_gpu.py, test_gluon_prefill.py -k on_a_gpu, test_shadow_gpu.py -k
#      gluon_shadow and all of test_decode_gpu.py -k gluon), SHARDS (6) pytest processes
#      side by side, each under TO (480) s. Sitting 8 ran 13 at once and each reached a
#      third of its ids in 390 s: fewer processes, more time each. Files: S-summary.txt,
#      S-failed.txt, suites.tgz.
#   D: issue 15's empty-cache and restart engines at 4k (gpu_serve_empty_cache.sh, its
#      default CONFIGS; BUDGET 535).
#   L: 32k serving (serve.py as sitting 7: 4 layers, batch 8, 32768 + 256, graphs 1..8) with
#      the Triton caches D filled merged (CONFIGS, DEADLINE 200 from the environment).
#   K: the serving benchmark's 32k batch at the kernel level (sitting 9's serving run had
#      quant none at 0.84x FLASHMLA there, 1.01x in sitting 7): gluon_decode_ws.py --plan bench
#      --graph at b8-h128-L32768 and b32-h128-L32768 for none (VARIANTS[0], the TMA default,
#      beside the Gluon split kernel and FlashMLA), the fp8 shadow and the nvfp4 shadow (their
#      defaults); each step under TO (150) s. Files: ws-bench*.json, K.txt.
# Do not run CPU-heavy jobs on the local machine while the bundle's parts travel: in sitting 8
# each part took 55-70 s of device time with a local pytest on both cores, 5 s without.
set -u
OUT=${OUT:-/tmp/sit9-out}
mkdir -p "$OUT"
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0
echo "tree $(git rev-parse --short HEAD 2>/dev/null || echo '?') mode $1"
SECONDS=0
case "$1" in
S)
  export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
  export MLA_REQUIRE_GPU=1
  T=packages/mla-triton/tests; L=/tmp/sitS; rm -rf $L; mkdir -p $L
  PASSED=packages/mla-triton/benchmarks/results/gpu-sit8/suites/passed-ids.txt
  ids() { python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" \
          | sed 's|^.*\(packages/mla-triton/tests/\)|\1|'; }
  { ids $T/test_gluon_decode_ws.py; ids $T/test_prefill_gpu.py; ids $T/test_gluon_prefill.py -k on_a_gpu
    ids $T/test_shadow_gpu.py -k gluon_shadow; ids $T/test_decode_gpu.py -k gluon; } > $L/all-ids.txt
  grep -vxF -f "$PASSED" $L/all-ids.txt > $L/ids.txt
  echo "ids: $(wc -l < $L/all-ids.txt) collected, $(wc -l < $L/ids.txt) to run after ${SECONDS}s" | tee $L/rc.txt
  n=${SHARDS:-6}
  for i in $(seq 0 $((n - 1))); do
    (mapfile -t x < <(awk -v i=$i -v n=$n 'NR % n == i' $L/ids.txt)
     timeout -k 5 "${TO:-480}" python3 -m pytest -v -rfE -p no:cacheprovider "${x[@]}" > $L/s$i.txt 2>&1
     echo "s$i rc=$? after ${SECONDS}s: $(grep -E ' in [0-9.]+s' $L/s$i.txt | tail -1)" >> $L/rc.txt) &
  done
  wait
  cat $L/rc.txt; grep -h "^FAILED\|^ERROR" $L/s*.txt | tee $OUT/S-failed.txt | head -30
  cp $L/rc.txt $OUT/S-summary.txt; tar czf $OUT/suites.tgz -C $L .
  ;;
D)
  OUT=$OUT BUDGET=${BUDGET:-535} bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh 2>&1 | tail -60
  ;;
L)
  mkdir -p /tmp/tc32
  for d in /tmp/triton-cache-h30 /tmp/h30-serve-*/*; do [ -d "$d" ] && cp -r "$d/." /tmp/tc32/ 2>/dev/null; done
  export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd: -):tests-vllm-e2e TRITON_CACHE_DIR=/tmp/tc32
  W=$(mktemp -d /tmp/s32-XXXX)
  CONFIGS=${CONFIGS:-FLASHMLA,quant-none,quant-nvfp4-shadow,quant-fp8-shadow,quant-nvfp4,quant-fp8}
  timeout -k 5 $(( ${DEADLINE:-200} + 25 )) python3 packages/mla-vllm/benchmarks/serve.py --out $W/serve-32k \
    --tag 32k --layers 4 --batch 8 --prompt 32768 --gen 256 --capture-sizes 1,2,4,8 --configs "$CONFIGS" \
    --timeout 150 --min-left "${MIN_LEFT:-60}" --deadline "${DEADLINE:-200}" > $W/serve.out 2>&1
  echo "serve rc=$? after ${SECONDS}s"; tail -n 25 $W/serve.out
  cp $W/serve-32k/serve-32k.json $W/serve-32k/serve-32k.png $OUT/ 2>/dev/null
  cp $W/serve.out $W/serve-32k/; tar czf $OUT/logs32.tgz -C $W --exclude=model serve-32k
  ;;
K)
  export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
  B=packages/mla-triton/benchmarks/gluon_decode_ws.py; SH=b8-h128-L32768,b32-h128-L32768
  for step in "none ws-r232-p40-tile,ws-r232-p40-tile-tma" "fp8-shadow ws-r232-p40-tile-tma" \
              "nvfp4-shadow ws-r232-p40-tile-n32s2"; do
    read -r rec variants <<< "$step"
    timeout -k 5 "${TO:-150}" python3 $B --plan bench --graph --recipe "$rec" --variants "$variants" \
      --shapes $SH "$OUT" 2>&1 | tail -n 12 | tee -a "$OUT/K.txt"
    echo "K $rec rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/K.txt"
  done
  # the policy gives b8 h128 15 splits (240 programs, two waves on 132 SMs); 8 splits are 128
  # programs in one wave, FlashMLA's shape of the work (one wave, token-balanced)
  mkdir -p "$OUT/s8"
  timeout -k 5 "${TO:-150}" python3 $B --plan bench --graph --splits 8 \
    --variants ws-r232-p40-tile-tma --shapes b8-h128-L32768 "$OUT/s8" 2>&1 | tail -n 6 | tee -a "$OUT/K.txt"
  echo "K none --splits 8 rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$OUT/K.txt"
  ;;
*) echo "mode: S, D, L or K" >&2; exit 2 ;;
esac
echo "mode $1 done after ${SECONDS}s"; ls "$OUT"
