#!/usr/bin/env bash
# Issue 15 on one H200 (each mode <= 540 s): bash packages/mla-vllm/benchmarks/gpu_serve.sh 4k|32k
# Run from the repository root with vLLM 0.33 / torch 2.14 / Triton 3.8 in /tmp/site.
#   4k:  (1) mla_triton.warmup's GPU test, nothing compiles after warmup (<= 150 s), into
#            $OUT/test-warmup-gpu.txt;
#        (2) serve.py at 4 layers, batch 64, 4096 prompt + 256 generated, in this order:
#            FLASHMLA, MLA_QUANT nvfp4 shadow, the same with MLA_QUANT_WARMUP=0 and an
#            empty Triton cache (the cold-batch stall without the warmup: "before"),
#            nvfp4 on read, none, TRITON_MLA.
#   32k: serve.py at 4 layers, batch 8, 32768 prompt + 256 generated: FLASHMLA, nvfp4
#        shadow, nvfp4 on read, none, TRITON_MLA.
# One engine per configuration, CUDA graphs; configurations that do not fit the deadline
# are skipped; $OUT/serve-<mode>/serve-<mode>.json is rewritten after every engine.
set -u
mode=${1:?usage: gpu_serve.sh 4k|32k}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
SRC=$(ls -d packages/*/src | paste -sd: -)
export PYTHONPATH=/tmp/site:$SRC:tests-vllm-e2e
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-h15}
python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', \
triton.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(), flush=True)"
case "$mode" in
  4k)
    echo "== GPU test: no compile after warmup"
    if python3 -c "import pytest" 2>/dev/null; then
      MLA_REQUIRE_GPU=1 timeout -k 5 150 python3 -m pytest -q -s -rA -p no:cacheprovider \
        "packages/mla-triton/tests/test_warmup.py::test_nothing_compiles_after_warmup_gpu" \
        > "$OUT/test-warmup-gpu.txt" 2>&1
    else  # no pytest in the bundle: the test function itself, its decorators made inert
      timeout -k 5 150 python3 - > "$OUT/test-warmup-gpu.txt" 2>&1 <<'PY'
import sys, types
fake = types.ModuleType("pytest")
fake.mark = types.SimpleNamespace(skipif=lambda *a, **k: (lambda f: f),
                                  parametrize=lambda *a, **k: (lambda f: f))
fake.fixture = lambda *a, **k: (lambda f: f)
sys.modules["pytest"] = fake
sys.path.insert(0, "packages/mla-triton/tests")
import test_warmup
test_warmup.test_nothing_compiles_after_warmup_gpu()
print("PASSED test_nothing_compiles_after_warmup_gpu (without pytest)")
PY
    fi
    echo "test rc=$? after $(( $(date +%s) - T0 )) s"; tail -6 "$OUT/test-warmup-gpu.txt"
    shape=(--layers 4 --batch 64 --prompt 4096 --gen 256 --capture-sizes 1,2,4,8,16,32,64)
    configs=FLASHMLA,quant-nvfp4-shadow,quant-nvfp4-shadow:nowarm:fresh,quant-nvfp4,quant-none,TRITON_MLA
    timeout=150 ;;
  32k)
    shape=(--layers 4 --batch 8 --prompt 32768 --gen 256 --capture-sizes 1,2,4,8)
    configs=FLASHMLA,quant-nvfp4-shadow,quant-nvfp4,quant-none,TRITON_MLA
    timeout=170 ;;
  *) echo "unknown mode $mode (4k or 32k)"; exit 2 ;;
esac
left=$(( 530 - ($(date +%s) - T0) ))
echo "== serve.py $mode, deadline $left s"
python3 packages/mla-vllm/benchmarks/serve.py --out "$OUT/serve-$mode" --tag "$mode" "${shape[@]}" \
  --configs "$configs" --timeout "$timeout" --min-left 75 --deadline "$left"
echo "serve rc=$? total $(( $(date +%s) - T0 )) s"
grep -h "MLA_QUANT warmup:\|during inference" "$OUT/serve-$mode"/*.log 2>/dev/null \
  | sed 's/^.*\(MLA_QUANT warmup:\|Triton\)/\1/' | cut -c1-160 | sort | uniq -c | head -20
ls -la "$OUT/serve-$mode"
