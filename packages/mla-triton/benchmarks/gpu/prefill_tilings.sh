#!/usr/bin/env bash
# Issue 17 (helper h33): the Gluon prefill's N:M sparsity and ping-pong tilings on one H200.
# Run from the repository root of a snapshot, vLLM 0.33 bundle (torch 2.14, Triton 3.8) in
# /tmp/site:   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/prefill_tilings.sh
# Wall: <= 200 s (a global deadline; every step has its own `timeout`, so a deadlock in
# the ping-pong barrier protocol, never run on a GPU before, costs only its step).
# Output ($OUT, 6 files): summary.txt, smoke.txt, tests.txt, warm.txt, sweep.txt,
# gluon-prefill-sweep.json. Steps:
#  1. smoke (<= 45 s): each ping-pong tiling once, in its own process, against mla_reference
#     on the GPU (varlen causal, chunked, nvfp4 + 2:4; NaN in V on a masked tile). A tiling that hangs or
#     fails is left out of steps 2-4 (PINGPONG=0 below).
#  2. GPU tests (<= 95 s, 8 shards, CPU oracle): test_prefill_gpu.py -k "gluon_tilings or
#     nm_sparsity or nan_rule or auto_runs_gluon" (N:M on Gluon vs oracle and Triton, every
#     Gluon tiling incl. ping-pong and N:M, the NaN rule on ping-pong) and
#     test_gluon_prefill.py's GPU test. Side by side: step 3 (compiles the sweep's variants
#     into Triton's cache, 4 processes).
#  4. sweep (the rest, >= 45 s): benchmarks/gluon_prefill.py --sweep: FA3 bf16, Triton and
#     every tiling x recipe none / fp8 / nvfp4 / nvfp4+2:4 at b4 h128 L4096 and b1 h16
#     L16384 in one process; ratio to FA3 per row, fastest tiling per recipe.
set -u
OUT=${OUT:-$PWD/out-h33}
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/h33.XXXX)
export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0 MLA_REQUIRE_GPU=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-h33}
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-195}))
left() { local n=$((DEADLINE - $(date +%s))); [ "$n" -gt "$1" ] && n=$1; [ "$n" -lt 5 ] && n=5; echo "$n"; }
S=$OUT/summary.txt
note() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$S"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$S"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$S"

# 1. smoke: each ping-pong tiling in its own process, in parallel
cat >"$TMP/smoke.py" <<'EOF'
# one ping-pong tiling against mla_reference on the GPU (no Triton compile to wait for)
import sys, torch, mla_reference
from mla_triton import prefill
from mla_triton.gluon_prefill import GluonPrefillConfig
from mla_formats import AttentionQuant, NMSparsity
bm, bn, st = map(int, sys.argv[1].split("x"))
cfg = GluonPrefillConfig(bm, bn, st, warp_specialize=True, pingpong=True)
g = torch.Generator(device="cuda").manual_seed(0)
def cu(lens): return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
ok = True
for lq, lk, causal, quant, sp in [([1, 100, 300, 129], [1, 100, 300, 129], True, None, None),
                                  ([1, 200, 64], [300, 1000, 64], False, None, None),
                                  ([300, 200], [300, 200], True, AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4))]:
    q = torch.randn(sum(lq), 8, 192, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(lk), 2, 192, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(lk), 2, 128, device="cuda", generator=g).bfloat16()
    v[sum(lk) - 70, 1, 3] = float("nan")  # on a masked tile of the last sequence
    kw = dict(softmax_scale=192 ** -0.5, causal=causal, return_lse=True, quant=quant, sparsity=sp)
    o, l = prefill(q, k, v, cu(lq), cu(lk), impl="gluon", config=cfg, **kw)
    r, rl = mla_reference.prefill(q, k, v, cu(lq), cu(lk), compute_dtype=torch.float32, **kw)
    torch.cuda.synchronize()
    same_nan = torch.equal(o.isnan(), r.isnan()) and torch.equal(l.isnan(), rl.isnan())
    fin = ~r.isnan() & ~o.isnan()
    d, ref = (o.float() - r.float())[fin], r.float()[fin]
    rel = (d.norm() / ref.norm().clamp_min(1e-30)).item()
    good = same_nan and rel < (3e-2 if quant else 1e-2)
    ok &= good
    print(f"pp {sys.argv[1]} causal={causal} quant={quant is not None} nm={sp is not None}: rel L2 {rel:.3g} nan same {same_nan} {'OK' if good else 'BAD'}", flush=True)
sys.exit(0 if ok else 1)
EOF
PP_TILINGS="128x64x3 128x64x2 128x128x2"
T=$(left 45)
for t in $PP_TILINGS; do
  ( timeout "$T" python3 "$TMP/smoke.py" "$t" >"$TMP/smoke-$t.txt" 2>&1; echo "rc=$?" >>"$TMP/smoke-$t.txt" ) &
done
wait
PINGPONG=1
for t in $PP_TILINGS; do
  cat "$TMP/smoke-$t.txt" >>"$OUT/smoke.txt"
  rc=$(tail -1 "$TMP/smoke-$t.txt")
  note "smoke pp $t: $rc $(grep -c ' OK$' "$TMP/smoke-$t.txt")/3 OK"
  [ "$rc" = "rc=0" ] || PINGPONG=0
done
grep -E "OK$|BAD$|Error|error" "$OUT/smoke.txt" | head -12
note "ping-pong in the steps below: $PINGPONG"

# 2. GPU tests, sharded (ids round robin), and 3. the sweep's compiles side by side
TS=packages/mla-triton/tests
KEXPR="gluon_tilings or nm_sparsity or nan_rule or auto_runs_gluon or matches_the_oracle"
[ "$PINGPONG" = 1 ] || KEXPR="($KEXPR) and not pp"
python3 -m pytest -q --collect-only -p no:cacheprovider $TS/test_prefill_gpu.py $TS/test_gluon_prefill.py \
  -k "$KEXPR" 2>/dev/null | grep "::" | sed 's|^.*\(packages/mla-triton/tests/\)|\1|' >"$TMP/ids.txt"
# (inside a snapshot under the repository, pytest's rootdir is the outer repo: node ids
#  come back prefixed with the snapshot's path; cut back to the cwd-relative path)
SHARDS=8
note "tests: $(wc -l <"$TMP/ids.txt") ids in $SHARDS shards"
T=$(left 95)
for i in $(seq 0 $((SHARDS - 1))); do
  awk -v n=$SHARDS -v i="$i" 'NR % n == i' "$TMP/ids.txt" >"$TMP/ids-$i.txt"
  ( mapfile -t ids <"$TMP/ids-$i.txt"
    [ "${#ids[@]}" -gt 0 ] && timeout "$T" python3 -m pytest -q -rA -p no:cacheprovider "${ids[@]}" \
      >"$TMP/tests-$i.txt" 2>&1; echo "rc=$?" >>"$TMP/tests-$i.txt" ) &
done
NOPP=""
[ "$PINGPONG" = 1 ] || NOPP="--no-pingpong"
WARM=4
for i in $(seq 0 $((WARM - 1))); do
  ( timeout "$T" python3 packages/mla-triton/benchmarks/gluon_prefill.py --sweep $NOPP --warm "$i/$WARM" \
      >"$TMP/warm-$i.txt" 2>&1; echo "rc=$?" >>"$TMP/warm-$i.txt" ) &
done
wait
for i in $(seq 0 $((SHARDS - 1))); do
  { echo "=== shard $i"; cat "$TMP/tests-$i.txt"; } >>"$OUT/tests.txt"
  note "shard $i: $(grep -E ' in [0-9.]+s' "$TMP/tests-$i.txt" | tail -1) $(tail -1 "$TMP/tests-$i.txt")"
done
grep -h '^FAILED\|^ERROR' "$TMP"/tests-*.txt | tee -a "$S"
for i in $(seq 0 $((WARM - 1))); do cat "$TMP/warm-$i.txt" >>"$OUT/warm.txt"; done
note "warm: $(grep -c '^warm' "$OUT/warm.txt") calls, $(grep -c 'Error\|error' "$OUT/warm.txt") errors"

# 4. the sweep: FA3, Triton, every tiling x recipe, one process
T=$(left 200)
note "sweep: ${T}s left"
timeout "$T" python3 packages/mla-triton/benchmarks/gluon_prefill.py --sweep $NOPP --out "$OUT" \
  >"$OUT/sweep.txt" 2>&1
note "sweep rc=$?"
sed -n '/fastest Gluon tiling/,$p' "$OUT/sweep.txt" | tee -a "$S"
grep -E "x FA3$" "$OUT/sweep.txt" | awk '{printf "%-14s %-10s %-16s %8s ms %7s TFLOP/s %s FA3\n", $1, $2, $3, $4, $6, $8}' | tee -a "$S"
note "total"
rm -rf "$TMP"
