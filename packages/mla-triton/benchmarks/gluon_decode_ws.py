"""Check and time the warp-specialized Gluon decode (``mla_triton.gluon_decode_ws``).

Run on an H200 from the repository root (vLLM 0.33 bundle for FlashMLA)::

    export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src
    export PYTHONPATH=$PYTHONPATH:packages/mla-triton/src
    python packages/mla-triton/benchmarks/gluon_decode_ws.py --plan check OUTDIR
    ... --plan bench OUTDIR

``check``: ``decode(config=VARIANTS[0])`` (and ``[1]`` at page 64) against
``gluon_decode``'s kernel (``decode(config=gluon_decode.VARIANTS[0])``: the same
whatever ``gluon_decode_ws.WS_AUTO`` says) and ``mla_reference.decode`` (float64) on small shapes
(ragged lengths, an empty request, 1 to 4 splits, pages 16 and 64, H 20 and 128);
exit status 1 on a mismatch. ``bench``: the median of
``do_bench`` of ``decode(config=)`` of every ``VARIANTS`` entry, ``gluon_decode``'s kernel and
FlashMLA bf16 at b128 h128 L8192 and b32 h128 L32768 (page 64, every request at full
length; TFLOP/s counted as FlashMLA does: ``2 H L (576 + 512)`` a request). Writes
``OUTDIR/ws-<plan>.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import SHAPES, flashmla_run, flops, make_inputs

from mla_triton.decode import decode, decode_num_splits
from mla_triton.gluon_decode import VARIANTS as GLUON_VARIANTS
from mla_triton.gluon_decode_ws import VARIANTS

SCALE = 576**-0.5
SKIP = {n for n in os.environ.get("WS_SKIP", "").split(",") if n}
"""Variants not to run (``WS_SKIP``, names comma-separated: the GPU script's, after a
tiny case failed or hung)."""
CHECKS = [  # batch, heads, page, lengths (ragged; 0 = empty), splits
    (1, 128, 64, [64], 1),
    (3, 128, 64, [1, 0, 130], 1),
    (4, 20, 16, [300, 0, 77, 1000], 2),
    (2, 128, 64, [4096, 513], 4),
    (5, 20, 16, [0, 0, 65, 191, 2000], 3),
]  # three compile keys a variant: (page 64, 2 head groups) x (1, several splits), (16, 1)


def _inputs(batch: int, heads: int, page: int, lens: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(batch * 1000 + heads + page)
    max_blocks = max(1, -(-max(lens) // page))
    blocks = batch * max_blocks + 3
    q = torch.randn(batch, heads, 576, generator=g).to("cuda", torch.bfloat16)
    cache = torch.randn(blocks, page, 576, generator=g).to("cuda", torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    return q, cache, table.to("cuda", torch.int32), torch.tensor(lens, dtype=torch.int32).cuda()


def check() -> tuple[set[str], list[dict[str, Any]]]:
    """``decode(config=)`` of the ws variants against the Gluon decode and the float64
    oracle on ``CHECKS``: the names of the variants that failed a case, and the rows."""
    import mla_reference

    rows: list[dict[str, Any]] = []
    failed: set[str] = set(SKIP)
    for batch, heads, page, lens, splits in CHECKS:
        q, cache, table, seq = _inputs(batch, heads, page, lens)
        o_g, _ = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                        config=GLUON_VARIANTS[0])  # fmt: skip
        # the default (whole tile) on every case, the chunked variant on the page-64 ones
        for cfg in VARIANTS[:2] if page == 64 else VARIANTS[:1]:
            if cfg.name in failed:
                continue
            try:
                o_w, l_w = decode(q, cache, table, seq, softmax_scale=SCALE,
                                  num_splits=splits, config=cfg)  # fmt: skip
                torch.cuda.synchronize()
            except Exception as exc:  # recorded; the other variants go on
                failed.add(cfg.name)
                rows.append({"case": [batch, heads, page, lens, splits], "config": cfg.name,
                             "error": repr(exc), "ok": False})  # fmt: skip
                print(f"check {cfg.name}: FAIL {exc!r}", flush=True)
                continue
            o_r, l_r = mla_reference.decode(
                q.double().cpu(), cache.double().cpu(), table.cpu(), seq.cpu(),
                softmax_scale=SCALE,
            )  # fmt: skip
            den = o_r.abs().amax(-1).clamp_min(1e-3)
            err_ref = float(((o_w.double().cpu() - o_r).abs().amax(-1) / den).max())
            err_gl = float(((o_w.double() - o_g.double()).abs().amax(-1).cpu() / den).max())
            lse_fin = torch.isfinite(l_r)
            diff = (l_w.double().cpu() - l_r)[lse_fin]
            lse_err = float(diff.abs().max()) if diff.numel() else 0.0
            lse_inf = bool((l_w.cpu()[~lse_fin] == float("-inf")).all())
            good = err_ref < 1.5e-2 and err_gl < 1.5e-2 and lse_err < 2e-5 and lse_inf
            good &= bool(torch.isfinite(o_w).all())
            if not good:
                failed.add(cfg.name)
            rows.append({"case": [batch, heads, page, lens, splits], "config": cfg.name,
                         "err_vs_ref": err_ref, "err_vs_gluon": err_gl, "lse_err": lse_err,
                         "ok": good})  # fmt: skip
            print(f"check B{batch} H{heads} page{page} lens{lens} splits{splits} {cfg.name}: "
                  f"vs ref {err_ref:.2e} vs gluon {err_gl:.2e} lse {lse_err:.1e} "
                  f"{'ok' if good else 'FAIL'}", flush=True)  # fmt: skip
    return failed, rows


def _runs(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, splits: int,
    seq_len: int, out: torch.Tensor, lse: torch.Tensor, ws: torch.Tensor, skip: set[str],
) -> dict[str, Any]:  # fmt: skip
    """The timed closures of one shape: ``gluon_decode``'s kernel (its default config) and
    each ws variant not in ``skip``."""
    kw: dict[str, Any] = {"softmax_scale": 0.1, "num_splits": splits, "out": out, "lse": lse,
                          "workspace": ws, "max_seq_len": seq_len}  # fmt: skip
    gluon = GLUON_VARIANTS[0]
    runs: dict[str, Any] = {"gluon": lambda: decode(q, cache, table, lens, config=gluon, **kw)}
    for cfg in VARIANTS:
        if cfg.name in skip:
            continue
        runs[cfg.name] = functools.partial(decode, q, cache, table, lens, config=cfg, **kw)
    return runs


def bench(warmup: int, rep: int, skip: set[str]) -> list[dict[str, Any]]:
    """Median times at the two long-context shapes: ws variants (but ``skip``), gluon,
    FlashMLA."""
    import triton.testing

    rows: list[dict[str, Any]] = []
    for shape in ("b128-h128-L8192", "b32-h128-L32768"):
        batch, heads, seq_len, _ = SHAPES[shape]
        q, cache, table, lens = make_inputs(shape, "cuda")
        splits = decode_num_splits(batch, heads, seq_len, device=q.device, block_h=64)
        out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, heads, device="cuda", dtype=torch.float32)
        ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        runs = _runs(q, cache, table, lens, splits, seq_len, out, lse, ws, skip)
        try:
            runs["flashmla"] = flashmla_run(q, cache, table, lens, 0.1)
        except Exception as exc:  # recorded, the run goes on
            rows.append({"shape": shape, "impl": "flashmla", "error": repr(exc)})
        base = decode(q, cache, table, lens, softmax_scale=0.1, num_splits=splits,
                      config=GLUON_VARIANTS[0])[0].clone()  # fmt: skip
        for name, run in runs.items():
            t0 = time.time()
            try:
                run()
                torch.cuda.synchronize()
                agree = None
                if name != "flashmla":
                    agree = float((out.float() - base.float()).abs().max())
                ms = triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")
            except Exception as exc:
                rows.append({"shape": shape, "impl": name, "error": repr(exc)})
                continue
            rows.append({"shape": shape, "impl": name, "splits": splits, "ms": ms,
                         "tflops": flops(batch, heads, seq_len) / ms / 1e9,
                         "max_abs_diff_vs_gluon": agree, "wall_s": time.time() - t0})  # fmt: skip
        fl = next((r for r in rows if r["shape"] == shape and r["impl"] == "flashmla"
                   and "ms" in r), None)  # fmt: skip
        for r in rows:
            if r["shape"] == shape and "ms" in r and fl is not None:
                r["vs_flashmla"] = fl["ms"] / r["ms"]
            if r["shape"] == shape and "ms" in r:
                print(f"{shape:17s} {r['impl']:14s} {r['ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s "
                      f"{r.get('vs_flashmla', float('nan')):5.2f}x FlashMLA "
                      f"diff {r.get('max_abs_diff_vs_gluon')}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", choices=("check", "bench"), required=True)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("out", help="output folder")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.plan == "check":
        failed, rows = check()
        # the third variant is the chunked one's code with another register split: it
        # stands or falls with it
        if VARIANTS[1].name in failed:
            failed.add(VARIANTS[2].name)
        result: dict[str, Any] = {"info": info, "failed": sorted(failed), "rows": rows}
        print("failed variants:", sorted(failed) or "none")
        code = 0 if len(failed) < len(VARIANTS) else 1  # time what passed
    else:
        skip = set(SKIP)
        done = os.path.join(args.out, "ws-check.json")
        if os.path.exists(done):
            with open(done) as f:
                skip |= set(json.load(f)["failed"])
        result = {
            "info": info,
            "skipped": sorted(skip),
            "rows": bench(args.warmup_ms, args.rep_ms, skip),
        }
        code = 0
    with open(os.path.join(args.out, f"ws-{args.plan}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
