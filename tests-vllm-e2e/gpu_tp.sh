#!/usr/bin/env bash
# The tensor-parallel check on the lent nvidia-h200-x2, in two device calls that run
# back to back after the bundle's parts were copied (docs/contributing.md "The tensor-parallel check"):
#   bash tests-vllm-e2e/gpu_tp.sh tp1   # install vLLM + our wheels, TP=1 reference (~5 min)
#   bash tests-vllm-e2e/gpu_tp.sh tp2   # TP=2 set and the TP=1/TP=2 comparison (~9 min)
# Needs .e2e-pin/wheels (tests-vllm-e2e/pin_packages.sh) carried, and /root/parts
# complete for tp1. Results go to $OUT (at most 8 files: tarballs and summaries).
set -uo pipefail
step=${1:?usage: gpu_tp.sh tp1|tp2}
out=${OUT:-/tmp/out}; mkdir -p "$out"
# NVLink multicast stays off (device KINDS.md); vLLM's symmetric-memory all-reduce too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       VLLM_ALLREDUCE_USE_SYMM_MEM=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 \
       VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# Our wheels first (their dist-info carries the vllm.general_plugins entry point that
# the spawned TP workers need), then the vLLM bundle. No src/ folders on PYTHONPATH.
export PYTHONPATH=/tmp/mla-site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
RUNS="triton_eager quant_none_eager nvfp4_eager triton_graphs quant_none_graphs nvfp4_graphs"
case "$step" in
  tp1)
    bash /root/parts/install.sh || exit 1
    python3 -m pip install -q --no-deps --no-index --no-compile --upgrade \
      --target /tmp/mla-site .e2e-pin/wheels/*.whl || exit 1
    nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; from importlib.metadata import entry_points as e; \
print('gpus', torch.cuda.device_count(), 'triton', triton.__version__, \
[(p.value, str(p.dist._path)) for p in e(group='vllm.general_plugins') if 'mla' in p.value])"
    timeout -k 5 420 python3 tests-vllm-e2e/run_e2e.py --tp 1 --only $RUNS --jobs 2 \
      --deadline 400 --out /tmp/e2e-tp1
    echo "tp1 exit code $?"
    tar -czf "$out/e2e-tp1.tgz" -C /tmp e2e-tp1; cp /tmp/e2e-tp1/summary.txt "$out/summary-tp1.txt"
    ;;
  tp2)
    timeout -k 5 545 python3 tests-vllm-e2e/run_e2e.py --tp 2 --jobs 4 --deadline 520 \
      --out /tmp/e2e-tp2
    echo "tp2 exit code $?"
    python3 tests-vllm-e2e/run_e2e.py --compare-tp /tmp/e2e-tp1,/tmp/e2e-tp2 --out /tmp/e2e-tp2
    echo "compare exit code $?"
    tar -czf "$out/e2e-tp2.tgz" -C /tmp e2e-tp2
    cp /tmp/e2e-tp2/summary.txt "$out/summary-tp2.txt"
    cp /tmp/e2e-tp2/tp_compare.txt /tmp/e2e-tp2/tp_compare.json "$out/" 2>/dev/null
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
ls -la "$out"
