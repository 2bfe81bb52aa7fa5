#!/usr/bin/env bash
# Sitting 7 (lead): one mode per device call, on the snapshot gpu_ab/snap7 (HEAD, defaults as landed).
#   E: decode_ws_next.sh (h37/h39/h40 variants vs FlashMLA) then prefill_next.sh (h38 options vs FA3)
#   C: serve empty cache 4k (gpu_serve_empty_cache.sh, CONFIGS/BUDGET from the env)
#   D: serve 32k (CONFIGS, DEADLINE from the env), the Triton caches of C merged
set -u
cd gpu_ab/snap7; ln -sfn ../../.whl .whl
echo "commit $(cat COMMIT) mode $1"
PYTHONPATH=/tmp/site python3 -c "import hypothesis" 2>/dev/null || pip install -q --no-index --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
SECONDS=0
case "$1" in
E)
  mkdir -p $OUT/decode $OUT/prefill
  OUT=$OUT/decode timeout -k 5 ${DEC_S:-250} bash packages/mla-triton/benchmarks/gpu/decode_ws_next.sh 2>&1 | tee $OUT/decode/stdout.txt | tail -60
  echo "decode done after ${SECONDS}s"
  [ "${PREFILL:-1}" = 1 ] && OUT=$OUT/prefill BUDGET_S=${PF_S:-170} timeout -k 5 $(( ${PF_S:-170} + 10 )) bash packages/mla-triton/benchmarks/gpu/prefill_next.sh 2>&1 | tee $OUT/prefill/stdout.txt | tail -45
  ;;
C)
  OUT=$OUT BUDGET=${BUDGET:-535} CONFIGS=$CONFIGS bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh 2>&1 | tail -50 ;;
D)
  mkdir -p /tmp/tc32; for d in /tmp/serve-triton-* /tmp/triton-cache-h30 /tmp/h30-serve-*/*; do [ -d "$d" ] && cp -r "$d/." /tmp/tc32/ 2>/dev/null; done
  export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd: -):tests-vllm-e2e TRITON_CACHE_DIR=/tmp/tc32
  W=$(mktemp -d /tmp/s32-XXXX)
  timeout -k 5 $(( ${DEADLINE:-200} + 25 )) python3 packages/mla-vllm/benchmarks/serve.py --out $W/serve-32k --tag 32k \
    --layers 4 --batch 8 --prompt 32768 --gen 256 --capture-sizes 1,2,4,8 --configs "$CONFIGS" \
    --timeout 150 --min-left ${MIN_LEFT:-60} --deadline ${DEADLINE:-200} > $W/serve.out 2>&1
  echo "serve rc=$? after ${SECONDS}s"; tail -n 25 $W/serve.out
  grep -h "MLA_QUANT warmup:\|during inference" $W/serve-32k/*.log 2>/dev/null | sed 's/^.*\(MLA_QUANT warmup:\|Triton\)/\1/' | cut -c1-160 | sort | uniq -c | head
  mkdir -p $OUT; cp $W/serve-32k/serve-32k.json $W/serve-32k/serve-32k.png $OUT/ 2>/dev/null
  cp $W/serve.out $W/serve-32k/; tar czf $OUT/logs32.tgz -C $W --exclude=model serve-32k ;;
esac
echo "mode $1 done after ${SECONDS}s"; ls -R $OUT | head -60
