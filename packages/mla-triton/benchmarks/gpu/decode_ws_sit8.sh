#!/usr/bin/env bash
# h42 (sitting 8): the warp-specialized decode's TMA loads through the shadows, and where the
# time goes: decode_ws_next.sh's steps (one producer a process: oracle, gluon, the ws
# configurations, each on the 7 check cases; compare vs the oracle and gluon, TMA bit for bit
# vs its cp.async twin; bench vs FlashMLA bf16 at b128 h128 L8192 and b32 h128 L32768) on
#   none:         VARIANTS[0] ws-r232-p40-tile, ws-r232-p40-tile-tma
#   fp8 shadow:   ws-r232-p40-tile, ws-r232-p40-tile-tma (both timed), gluon's shadow kernel
#   nvfp4 shadow: NVFP4_CONFIG ws-r232-p40-tile-n32s2, NVFP4_TMA_CONFIG ws-r232-p40-tile-tma-n32s2
#                 (new: K̂ and V̂ tiles by TMA), that with lazy_rescale (-lr: rescales only where
#                 a maximum moved; bit for bit vs the TMA one), gluon's SEPARATE_V_CONFIG
# with GRAPH=1: every timed call also replayed from a CUDA graph (no host work between the
# kernels, as vLLM's decode graphs run them) and its host issue time, which says whether the
# shadows' eager times are the kernels' or the host's (docs/gluon.md, "Bounds, counted in SASS").
# At most 200 s: timeouts 72 + 15 + 22 + 33 + 48 s, 2 s kill grace each (sitting 7: outputs
# 70 s for 14 processes, compare 10 s, benches 16, 23 and 32 s without graphs). From the repository
# root on the device (torch 2.14 + Triton 3.8 + vLLM 0.33 in /tmp/site):
#   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/decode_ws_sit8.sh
# Loose files back: summary.txt, ws-bench.json, ws-bench-fp8-shadow.json,
# ws-bench-nvfp4-shadow.json, ws-check-all.json; everything else in all.tgz (6 files).
set -u
OUT=${OUT:-/tmp/h42-out}
WORK=$(mktemp -d)
here=$(dirname "$0")
NEW=ws-r232-p40-tile-tma TWIN="" \
  SHADOW=ws-r232-p40-tile,ws-r232-p40-tile-tma SHADOW_TIMED=ws-r232-p40-tile,ws-r232-p40-tile-tma \
  NV=ws-r232-p40-tile-n32s2,ws-r232-p40-tile-tma-n32s2,ws-r232-p40-tile-tma-n32s2-lr \
  T_OUT=72 T_CMP=15 T_NONE=22 T_FP8=33 T_NV=48 GRAPH=1 OUT=$WORK \
  bash "$here/decode_ws_next.sh" 2>&1 | tee "$WORK/summary.txt"
mkdir -p "$OUT"
cp "$WORK/summary.txt" "$OUT/"
for f in ws-bench.json ws-bench-fp8-shadow.json ws-bench-nvfp4-shadow.json; do
  [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
python3 - "$WORK" "$OUT/ws-check-all.json" <<'PY'
import json, os, sys
work, dst = sys.argv[1:]
got = {}
for tag in ("", "-fp8-shadow", "-nvfp4-shadow"):
    p = os.path.join(work, f"ws-check{tag}.json")
    if os.path.exists(p):
        with open(p) as f:
            got[tag or "none"] = json.load(f)
with open(dst, "w") as f:
    json.dump(got, f, indent=1)
PY
tar czf "$OUT/all.tgz" -C "$WORK" --exclude='*.pt' .
echo "files: $(ls "$OUT" | tr '\n' ' ')"
