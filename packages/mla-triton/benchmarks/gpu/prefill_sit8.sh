#!/usr/bin/env bash
# Issue 17, sitting 8 (helper h44): prefill_next.sh's three steps (smoke, GPU tests, sweep
# against FA3) on the combinations sitting 7's sweep pointed at, nm_pairs (2:4 ranked by
# pair maxima and minima: the same keys, 55 fewer instructions a 128-key tile) and
# nm_nan_rank (NaN scores kept by their rank, without the s != s guard: 103 fewer more).
# Run from the repository root of a snapshot, vLLM 0.33 bundle (torch 2.14, Triton 3.8) in
# /tmp/site:   OUT=$OUT bash packages/mla-triton/benchmarks/gpu/prefill_sit8.sh
# Wall: <= 200 s (global deadline 190 s, then the packing).
# NEW (benchmarks/gluon_prefill.py's SWEEP_SIT8, plus SWEEP_NEXT's nt-128x128x2-ek-ri):
#   nt-128x64x3-ek-ri, nt-128x64x3-ri, nt-128x128x2-ek-ri   (nvfp4: no turns + early_k + ri)
#   ws-128x128x2-ek-ri                                      (2:4: ws + early_k + ri)
#   ws-128x128x2-ek-np, ws-128x128x2-ek-ri-np, ws-128x64x3-ek-np   (nm_pairs on 2:4's best)
#   ws-128x128x2-ek-np-nr, ws-128x64x3-ek-np-nr                     (and nm_nan_rank)
# REF: sitting 7's fastest per recipe (none / fp8 pp-128x128x2-ek(-ri), nvfp4 nt-128x64x3,
# 2:4 ws-128x128x2-ek and ws-128x64x3-ek).
# Step 2 runs test_prefill_gpu.py's "s8-" ids: SIT8_CASES in test_gluon_tilings, two
# test_nan_rule_gluon_tilings ids and test_nm_options_bit_for_bit (nm_pairs / nm_nan_rank:
# out and LSE bit for bit against the same tiling without them, NaN-rule batch included).
# Output ($OUT, at most 8 files): summary.txt (also on stdout), gluon-prefill-sweep.json,
# all.tgz (smoke.txt, tests.txt, warm.txt, sweep.txt).
export TAG=h44 BUDGET=190 PACK=1 TESTK="s8-" SHARDS=16 TEST_S=60  # one test id a shard
export NEW="nt-128x64x3-ek-ri nt-128x64x3-ri nt-128x128x2-ek-ri ws-128x128x2-ek-ri ws-128x128x2-ek-np ws-128x128x2-ek-ri-np ws-128x64x3-ek-np ws-128x128x2-ek-np-nr ws-128x64x3-ek-np-nr"
export REF="pp-128x128x2-ek-ri pp-128x128x2-ek nt-128x64x3 ws-128x128x2-ek ws-128x64x3-ek"
exec bash "$(dirname "$0")/prefill_next.sh"
