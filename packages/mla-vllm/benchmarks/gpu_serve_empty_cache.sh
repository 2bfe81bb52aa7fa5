#!/usr/bin/env bash
# Issue 15, time to the first finished batch with an EMPTY Triton cache (helpers h30, h45).
# One H200, one device call, at most 540 s wall (every step has a hard timeout).
#
# Run from the repository root of a snapshot, vLLM 0.33 / torch 2.14 / Triton 3.8 in /tmp/site:
#
#     OUT=$OUT bash packages/mla-vllm/benchmarks/gpu_serve_empty_cache.sh
#
# serve.py at 4 layers, batch 64, 4096 prompt + 256 generated, CUDA graphs 1..64, one
# engine per configuration in this priority order, stopping at the deadline (the default
# CONFIGS: sitting 8's rows to re-measure, with the early warm-up of this tree on):
#   FLASHMLA:fresh, quant-nvfp4:fresh, quant-fp8:fresh, quant-nvfp4-shadow:fresh,
#   quant-none:fresh            (each its own empty TRITON_CACHE_DIR: a new machine)
#   FLASHMLA:restart, quant-fp8:restart, quant-nvfp4-shadow:restart
#                               (the cache that configuration's :fresh engine filled)
# EARLY=0 runs them with MLA_QUANT_WARMUP_EARLY=0 (the warm-up only at the first metadata
# build, as in sitting 7).
#
# PRIME=1 (default) first pays, once, what only the first engine on a machine pays, so that
# FLASHMLA:fresh, the first engine, is measured as every later one (sitting 7: its log had 30 s
# between "non-default args" and "Resolved architecture" that no later engine had; sitting 6:
# 38 s): starting CUDA; vLLM's model-architecture inspection (ModelRegistry's
# inspect_model_cls: a subprocess that imports vLLM, its plugins and the model's module, whose
# result vLLM caches under $VLLM_CACHE_ROOT/modelinfos, ~/.cache/vllm by default, keyed by the
# model file's hash); and the first import (bytecode compile) of the modules an engine loads
# (vLLM's LLM entry point, engine core, GPU worker and model runner, the DeepSeek-V2 model,
# the MLA backends, torch.compile's Dynamo/inductor, Triton's compiler). What it does not
# touch: the Triton cache (each :fresh engine gets an empty one) and vLLM's torch.compile
# cache (keyed by each configuration's own hash). It prints each part's seconds to env.txt.
# An engine starts only with >= MIN_LEFT s left (default 55: in sitting 7 an empty-cache
# engine took 87-116 s of wall with its batches, including vLLM's teardown at exit, which
# serve.py's child now skips; a restart about 45 s). Expected: the five :fresh rows and one
# or two :restart rows within the 535 s (the rest are listed as skipped). Files under $OUT
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
CONFIGS=${CONFIGS:-FLASHMLA:fresh,quant-nvfp4:fresh,quant-fp8:fresh,quant-nvfp4-shadow:fresh,quant-none:fresh,FLASHMLA:restart,quant-fp8:restart,quant-nvfp4-shadow:restart}
export MLA_QUANT_WARMUP_EARLY=${EARLY:-1}

{
  echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  timeout -k 5 60 python3 -c "import os, torch, triton; print('torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name(), 'cpus', os.cpu_count())"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
  grep -c "first metadata build" packages/mla-vllm/src/mla_vllm/warmup.py \
    | sed 's/^/warm_before_capture in this tree (lines): /'
  grep -c '"num_blocks"' packages/mla-triton/src/mla_triton/kernels/decode_kernel.py \
    | sed 's/^/num_blocks unspecialized in decode_kernel (lines): /'
  grep -c "^def start_early" packages/mla-vllm/src/mla_vllm/warmup.py \
    | sed 's/^/early warm-up (start_early) in this tree: /'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# What only the first engine on a machine pays (header): CUDA start, vLLM's model inspection
# (cached under $VLLM_CACHE_ROOT/modelinfos), first imports. PRIME=0: skip.
if [ "${PRIME:-1}" = 1 ]; then
  p0=$(date +%s)
  timeout -k 5 150 python3 - >> "$OUT/env.txt" 2>&1 <<'PY'
import importlib, time
t = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
print(f"prime: CUDA start {time.perf_counter() - t:.1f} s")
t = time.perf_counter()
from mla_e2e.configs import CONFIG
from mla_e2e.probes import ensure_registered
from vllm.model_executor.models.registry import ModelRegistry
ensure_registered(1)
for arch in CONFIG["architectures"]:  # the engine's inspection: subprocess, result cached
    info = ModelRegistry._try_inspect_model_cls(arch)
    print(f"prime: model inspection of {arch}: {'ok' if info else 'FAILED'}, "
          f"{time.perf_counter() - t:.1f} s")
t = time.perf_counter()
for name in ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
             "vllm.v1.worker.gpu.model_runner", "vllm.model_executor.models.deepseek_v2",
             "vllm.v1.attention.backends.mla.flashmla", "vllm.v1.attention.backends.mla.triton_mla",
             "vllm.compilation.backends", "torch._dynamo", "torch._inductor.compile_fx",
             "triton.compiler.compiler", "mla_vllm.backend"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # a module this vLLM lacks: say so, go on
        print(f"prime: import {name} failed: {exc!r}")
print(f"prime: first imports {time.perf_counter() - t:.1f} s")
PY
  echo "primed (CUDA start, model inspection, first imports) in $(( $(date +%s) - p0 )) s" \
    | tee -a "$OUT/env.txt"
fi
echo "MLA_QUANT_WARMUP_EARLY=$MLA_QUANT_WARMUP_EARLY" | tee -a "$OUT/env.txt"

left=$(( BUDGET - ($(date +%s) - T0) - 12 ))   # 12 s kept for the summary and the tar
# serve.py counts its --deadline from after its own imports (torch, vLLM: ~10-20 s), and
# kills an engine at its per-engine limit (the whole process group); the outer timeout is
# only a safety net (it would leave a running engine's process group behind)
deadline=$(( left - 25 ))
echo "== serve.py 4k, deadline $deadline s after its imports: $CONFIGS"
timeout -k 5 "$left" python3 packages/mla-vllm/benchmarks/serve.py \
  --out "$WORK/serve-4k" --tag 4k --layers 4 --batch 64 --prompt 4096 --gen 256 \
  --capture-sizes 1,2,4,8,16,32,64 --configs "$CONFIGS" \
  --timeout 150 --min-left "${MIN_LEFT:-55}" --deadline "$deadline" > "$WORK/serve.out" 2>&1
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
          f"{v.get('after_start')}, after cold {v.get('after_cold')}, after warm {v.get('after_warm')}; "
          f"model inspection {r.get('inspect_s')} s, KV cache {r.get('kv_cache_tokens')} tokens")
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
