#!/usr/bin/env bash
# Sitting 17 (device calls after the bundle's parts, on one warm machine; install.sh run by the
# first mode that finds no /tmp/site/vllm): issue 17's q_in_kernel (Q's QDQ in the Gluon
# prefill kernel, built in sitting 16) measured, with AUTO_CONFIGS' default as committed.
# Mode q: the 8 ``-k s16`` ids of test_prefill_gpu.py (q_in_kernel bit for bit against the
# pass), gpu/sit16_q_in_kernel.py (its own bit-for-bit batch, then q_in_kernel on and off beside
# FA3 at prefill.py's three shapes, 5 rounds round robin), then prefill.py --quick --rounds 5
# (the benchmark: every recipe through auto, FA3 and SDPA in the same process; JSON).
# Mode final: sit14.sh's final mode on this tree (the prefill GPU suite but the tiling sweeps,
# the decode and shadow GPU suites whole, the Gluon decode kernels' nvfp4 ids; 8 shards).
# (In sitting 17 mode q ran the s16 ids with ``-n 4``: pytest-benchmark's warning under xdist
# is an error with ``-W error``, so they did not run there; mode final ran them. Serial now.)
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit17.sh q|final
set -u
MODE=${1:?q or final}
[ -d /tmp/site/vllm ] || bash /root/parts/install.sh > "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 MLA_REQUIRE_GPU=1
export PYTHONUNBUFFERED=1
B=packages/mla-triton/benchmarks
T=packages/mla-triton/tests
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/s17-$MODE-device.txt"
if [ "$MODE" = q ]; then
    PYTHONPATH=$PYTHONPATH:$T timeout "${TEST_S:-200}" python -m pytest -q -rA -p no:cacheprovider \
        -W error $T/test_prefill_gpu.py -k s16 > "$OUT/s17-s16-tests.txt" 2>&1
    echo "rc=$?" >> "$OUT/s17-s16-tests.txt"; tail -3 "$OUT/s17-s16-tests.txt"
    timeout "${SIT16_S:-240}" python $B/gpu/sit16_q_in_kernel.py > "$OUT/s17-q-in-kernel.txt" 2>&1
    echo "rc=$?" >> "$OUT/s17-q-in-kernel.txt"
    grep -E "all:|False|x FA3|rc=|Error" "$OUT/s17-q-in-kernel.txt" | cut -c1-110
    timeout "${BENCH_S:-250}" python $B/prefill.py --quick --rounds 5 --out "$OUT/prefill" \
        > "$OUT/s17-prefill.log" 2>&1; echo "prefill.py rc=$?" >> "$OUT/s17-prefill.log"
    grep -E "FA3|rc=|Error" "$OUT/s17-prefill.log" | cut -c1-110
fi
if [ "$MODE" = final ]; then
    TEST_S=${TEST_S:-500} bash $B/gpu/sit14.sh final
    mv "$OUT/s14-final.txt" "$OUT/s17-final.txt"
fi
