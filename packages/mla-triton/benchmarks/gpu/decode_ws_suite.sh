#!/usr/bin/env bash
# h35: what must pass on an H200 before flipping mla_triton.gluon_decode_ws.WS_AUTO.
# From the repository root on the device (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/decode_ws_suite.sh 1    # required: tests/test_gluon_decode_ws.py, ~3-6 min
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/decode_ws_suite.sh 2    # extra: decode's GPU suites with WS_AUTO on, ~2-3 min
# Each step is one device command (< 10 min); writes $OUT/<step>-*.txt, prints a summary.
set -u
TAG=h35
. "$(dirname "$0")/env.sh"
export MLA_REQUIRE_GPU=1
T=packages/mla-triton/tests
start=$(date +%s)
case "${1:-1}" in
1)
  # every variant x every case vs gluon_decode's kernel and the oracle, the NaN rule, and
  # (WS_AUTO monkeypatched on) decode == decode(config=VARIANTS[0]) bit for bit + nothing compiles after warmup
  timeout -k 10 560 python3 -m pytest -q -p no:cacheprovider $T/test_gluon_decode_ws.py \
    --durations=10 > "$OUT/1-ws-tests.txt" 2>&1
  rc=$?
  echo "step 1: rc=$rc ($(( $(date +%s) - start )) s)"; grep -E "passed|failed|FAILED|Error" "$OUT/1-ws-tests.txt" | tail -15
  ;;
2)
  # the decode contract suite and test_decode_gpu's Gluon cases with the switch on, in
  # process (recipe none then runs the warp-specialized kernel: offsets beyond 2^31, CUDA
  # graphs, poisoned memory, split/batch invariance); the one test that pins
  # gluon_decode's kernel under "auto" is deselected
  timeout -k 10 560 python3 - > "$OUT/2-switch-on-suites.txt" 2>&1 <<'PY'
import os, sys
import pytest
import mla_triton.gluon_decode_ws as ws
ws.WS_AUTO = True
T = "packages/mla-triton/tests"
os.environ.update(MLA_CONTRACT_DEVICE="cuda", MLA_CONTRACT_IMPL="gluon")
a = pytest.main(["-q", "-p", "no:cacheprovider", f"{T}/test_decode_gpu.py", "-k",
                 "gluon and not test_auto_runs_the_gluon_kernel_on_sm90", "--durations=5"])
b = pytest.main(["-q", "-p", "no:cacheprovider", f"{T}/test_decode_contract.py", "--durations=5"])
print("WS_AUTO", ws.WS_AUTO, "test_decode_gpu rc", int(a), "contract rc", int(b))
sys.exit(int(a) or int(b))
PY
  rc=$?
  echo "step 2: rc=$rc ($(( $(date +%s) - start )) s)"; grep -E "passed|failed|FAILED|WS_AUTO" "$OUT/2-switch-on-suites.txt" | tail -15
  ;;
esac
