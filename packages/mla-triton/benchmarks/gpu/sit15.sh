#!/usr/bin/env bash
# Sitting 15 (device calls after the bundle's parts, on one warm machine; install.sh run by
# the last part's call or here): issue 17's record.
# Mode final: sit14.sh's final mode on this tree (poison's fix, 1d5b93d, in it): the prefill
# GPU suite but for the tiling sweeps, the decode and shadow GPU suites whole, the Gluon
# decode kernels' nvfp4 ids (8 shards).
# Mode bench: benchmarks/prefill.py's main table with prefill's default (impl auto: the Gluon
# kernel on sm90), FA3 bf16 and SDPA flash in the same process, 5 rounds round robin, every
# recipe and the ablations that bound them (fp8 / nvfp4 on P alone, on Q, K, V alone, 2:4
# without quantization); then gluon_prefill.py's dispatch table (auto against the Triton
# kernel and FA3).
# Mode varlen: gpu/sit15_varlen.py (prefill.py and the dispatch table 5% apart on the varlen batch).
# Usage: OUT=$OUT bash packages/mla-triton/benchmarks/gpu/sit15.sh final|bench|varlen
set -u
MODE=${1:?final, bench or varlen}
[ -d /tmp/site/vllm ] || bash /root/parts/install.sh > "$OUT/install.log" 2>&1
if [ "$MODE" = final ]; then
    TEST_S=${TEST_S:-500} bash packages/mla-triton/benchmarks/gpu/sit14.sh final
    mv "$OUT/s14-final.txt" "$OUT/s15-final.txt"
fi
if [ "$MODE" = bench ]; then
    export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
    export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
    B=packages/mla-triton/benchmarks
    timeout "${BENCH_S:-330}" python $B/prefill.py --quick --rounds 5 --out "$OUT/prefill" \
        > "$OUT/s15-prefill.log" 2>&1; echo "prefill.py rc=$?" >> "$OUT/s15-prefill.log"
    grep -E "FA3|rc=|Error" "$OUT/s15-prefill.log" | cut -c1-110
    timeout "${DISPATCH_S:-200}" python $B/gluon_prefill.py --dispatch --fa3 --out "$OUT/dispatch" \
        > "$OUT/s15-dispatch.log" 2>&1; echo "dispatch rc=$?" >> "$OUT/s15-dispatch.log"
    tail -25 "$OUT/s15-dispatch.log" | cut -c1-110
fi
if [ "$MODE" = varlen ]; then  # sit15_varlen.py: the varlen batch's two timings in one process
    export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
    export TRITON_INTERPRET=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
    timeout "${BENCH_S:-400}" python packages/mla-triton/benchmarks/gpu/sit15_varlen.py \
        2>&1 | tee "$OUT/s15-varlen.txt"
fi
