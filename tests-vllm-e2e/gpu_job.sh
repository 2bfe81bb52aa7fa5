#!/usr/bin/env bash
# The GPU checks and benchmarks on a GPU machine without a package index, where vLLM
# 0.33 (torch 2.14, Triton 3.8) is installed from a wheel bundle into a folder that
# shadows the machine's own torch (docs/contributing.md "On a GPU without an index").
# One stage a call, from the repository root:
#   bash tests-vllm-e2e/gpu_job.sh install             # the bundle into $SITE, versions
#   bash tests-vllm-e2e/gpu_job.sh suites [pytest args] # every test_*_gpu.py, skips fail
#   bash tests-vllm-e2e/gpu_job.sh bench OP [args]      # OP: decode, shadow, prefill
#   bash tests-vllm-e2e/gpu_job.sh serve [args]         # mla-vllm's serving benchmark
#   bash tests-vllm-e2e/gpu_job.sh vbackends [pytest args]  # vLLM's MLA backend tests
#   bash tests-vllm-e2e/gpu_job.sh memcheck [pytest args]   # GPU suites under compute-sanitizer
# Environment: BUNDLE (the bundle's parts with install.sh), SITE (where it installs),
# OUT (results: CSV rows, junit XML, logs), N (pytest workers), T (seconds a stage may
# take before pytest is interrupted and reports). Benchmarks write their rows to
# $OUT/<op>.csv; append them to the repository's CSV on your machine.
set -uo pipefail
stage=${1:?usage: gpu_job.sh install|suites|bench|serve|vbackends|memcheck [args]}
shift
BUNDLE=${BUNDLE:-/root/parts}
SITE=${SITE:-/tmp/site}
out=${OUT:-/tmp/out}
mkdir -p "$out"
N=${N:-8}
T=${T:-540}
root=$(pwd)
src=$root/packages/mla-formats/src:$root/packages/mla-reference/src:$root/packages/mla-triton/src
src=$src:$root/packages/mla-report/src:$root/packages/mla-vllm/src
export PYTHONPATH=$SITE:$src${PYTHONPATH:+:$PYTHONPATH}
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# NVLink multicast stays off on multi-GPU machines (the device notes say why)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

versions() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: absent"
}

# pytest with a deadline: interrupted (SIGINT) at T seconds so that it still reports
run_pytest() {
  local name=$1
  shift
  # (-p no:benchmark: a machine's pytest-benchmark warns under xdist, an error here)
  timeout -s INT -k 20 "$T" python3 -m pytest -p no:cacheprovider -p no:benchmark -rfE --durations=15 \
    --junitxml="$out/$name.xml" "$@" 2>&1 | tee "$out/$name.log" | tail -60
  return "${PIPESTATUS[0]}"
}

gpu_suites() {
  ls packages/*/tests/test_*_gpu.py tests-integration/test_*_gpu.py 2>/dev/null
}

case "$stage" in
  install)
    bash "$BUNDLE/install.sh" || exit 1
    versions
    ;;
  suites)
    versions
    MLA_REQUIRE_GPU=1 run_pytest suites -n "$N" --dist worksteal $(gpu_suites) "$@"
    ;;
  bench)
    op=${1:?bench OP: decode, shadow or prefill}
    shift
    versions
    timeout -k 10 "$T" python3 "packages/mla-triton/benchmarks/$op.py" --out "$out/$op.csv" "$@" \
      2>&1 | tee "$out/bench-$op.log" | tail -80
    ;;
  serve)
    versions
    timeout -k 10 "$T" python3 packages/mla-vllm/benchmarks/serve.py --out "$out/serve.csv" "$@" \
      2>&1 | tee "$out/serve.log" | tail -60
    ;;
  vbackends)
    versions
    # tests-vllm-backends/README.md: offline, the backends this GPU machine runs
    export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_HOME=${HF_HOME:-/tmp/hf-home}
    export MLA_BACKENDS=${MLA_BACKENDS:-FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA,MLA_QUANT,MLA_QUANT_SHADOW}
    run_pytest vbackends -n "$N" --dist worksteal tests-vllm-backends "$@"
    ;;
  memcheck)
    versions
    command -v compute-sanitizer >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
    MLA_REQUIRE_GPU=1 timeout -s INT -k 20 "$T" compute-sanitizer --tool memcheck \
      --error-exitcode 9 --log-file "$out/memcheck.txt" python3 -m pytest -p no:cacheprovider -p no:benchmark \
      -q -x $(gpu_suites) "$@" 2>&1 | tail -40
    echo "memcheck exit code ${PIPESTATUS[0]}"
    tail -5 "$out/memcheck.txt"
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
