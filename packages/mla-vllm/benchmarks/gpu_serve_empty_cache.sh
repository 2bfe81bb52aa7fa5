#!/usr/bin/env bash
# Issue 15, time to the first finished batch with an EMPTY Triton cache (helper h30).
# One H200, one device call, at most 540 s wall (every step has a hard timeout).
#
# Run from the repository root of a snapshot (tree with h30's commits: the split kernels'
# unspecialized num_blocks, the warm-up at the first metadata build, serve.py :restart),
# vLLM 0.33 / torch 2.14 / Triton 3.8 in /tmp/site:
#
#     OUT=$OUT bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh
#
# serve.py at 4 layers, batch 64, 4096 prompt + 256 generated, CUDA graphs 1..64, one
# engine per configuration in this priority order, stopping at the deadline (the default
# CONFIGS: the rows sitting 6 left, serve-4k-h200-3/README.txt):
#   FLASHMLA:fresh, quant-fp8-shadow:fresh, quant-fp8:fresh, quant-nvfp4:fresh
#                               (each its own empty TRITON_CACHE_DIR: a new machine)
#   FLASHMLA:restart, quant-fp8-shadow:restart, quant-fp8:restart, quant-nvfp4:restart
#                               (the cache that configuration's :fresh engine filled)
# Before them, PRIME=1 imports vLLM and starts CUDA once, so FLASHMLA:fresh, the first
# engine, does not pay the machine's first start.
# An engine starts only with >= MIN_LEFT s left (default 80: in sitting 6 an empty-cache
# engine took 62-75 s of wall with its batches, a restart about 25 s). Files under $OUT
# (5): serve-4k.json, serve-4k.png, summary.txt, logs.tgz (every engine's log and JSON),
# env.txt.
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-535}           # seconds for the whole script
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/h30-serve-XXXX)
SRC=$(ls -d packages/*/src | paste -sd: -)
export PYTHONPATH=/tmp/site:$SRC:tests-vllm-e2e
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-h30}
CONFIGS=${CONFIGS:-FLASHMLA:fresh,quant-fp8-shadow:fresh,quant-fp8:fresh,quant-nvfp4:fresh,FLASHMLA:restart,quant-fp8-shadow:restart,quant-fp8:restart,quant-nvfp4:restart}

{
  echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  timeout -k 5 60 python3 -c "import os, torch, triton; print('torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', os.cpu_count())"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
  grep -c "first metadata build" packages/mla-vllm/src/mla_vllm/warmup.py \
    | sed 's/^/warm_before_capture in this tree (lines): /'
  grep -c '"num_blocks"' packages/mla-triton/src/mla_triton/kernels/decode_kernel.py \
    | sed 's/^/num_blocks unspecialized in decode_kernel (lines): /'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The first vLLM engine on a just-started machine spends ~45 s before "Loading model" that
# later engines do not (sitting 6: FLASHMLA:fresh 90.8 s start, 53.0 s six minutes later,
# the same 46 s of init engine): import vLLM and start CUDA once first (PRIME=0: skip).
if [ "${PRIME:-1}" = 1 ]; then
  p0=$(date +%s)
  timeout -k 5 120 python3 -c "import torch, vllm; torch.zeros(1, device='cuda'); \
torch.cuda.synchronize()" > /dev/null 2>&1
  echo "primed (import vllm, CUDA start) in $(( $(date +%s) - p0 )) s" | tee -a "$OUT/env.txt"
fi

left=$(( BUDGET - ($(date +%s) - T0) - 12 ))   # 12 s kept for the summary and the tar
# serve.py counts its --deadline from after its own imports (torch, vLLM: ~10-20 s), and
# kills an engine at its per-engine limit (the whole process group); the outer timeout is
# only a safety net (it would leave a running engine's process group behind)
deadline=$(( left - 25 ))
echo "== serve.py 4k, deadline $deadline s after its imports: $CONFIGS"
timeout -k 5 "$left" python3 packages/mla-vllm/benchmarks/serve.py \
  --out "$WORK/serve-4k" --tag 4k --layers 4 --batch 64 --prompt 4096 --gen 256 \
  --capture-sizes 1,2,4,8,16,32,64 --configs "$CONFIGS" \
  --timeout 150 --min-left "${MIN_LEFT:-80}" --deadline "$deadline" > "$WORK/serve.out" 2>&1
echo "serve rc=$? after $(( $(date +%s) - T0 )) s"
tail -n 25 "$WORK/serve.out"

# the summary: serve.py's table, then per engine its warm-up lines and variant counts
timeout -k 2 10 python3 - "$WORK/serve-4k/serve-4k.json" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as exc:  # no JSON: the run failed before the first engine finished
    print(f"no results: {exc}")
    sys.exit(0)
print(doc.get("summary", ""))
print()
print("first batch = engine start + cold batch; first/FM against the FLASHMLA row of the same")
print("cache state (:fresh = empty Triton cache; :restart = the cache its :fresh run filled).")
print("Target (issue 15): first/FM <= 1.30 for every recipe, cold/warm <= 1.2, JIT 0.")
print()
for r in doc.get("results", []):
    v = r.get("mla_variants") or {}
    print(f"{r['name']}: status {r.get('status')}, mla_triton variants after start "
          f"{v.get('after_start')}, after cold {v.get('after_cold')}, after warm {v.get('after_warm')}")
    for line in r.get("mla_warmup") or []:
        print(f"    {line}")
    if r.get("jit_kernels"):
        print(f"    JIT during inference: {r['jit_kernels']}")
PY
cat "$OUT/summary.txt"

# files back: the JSON, the plot, the summary, env.txt, and every log and JSON tarred
cp "$WORK/serve-4k/serve-4k.json" "$WORK/serve-4k/serve-4k.png" "$OUT/" 2>/dev/null
cp "$WORK/serve.out" "$WORK/serve-4k/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude=model serve-4k 2>/dev/null
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
