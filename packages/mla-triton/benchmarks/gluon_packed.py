"""Check and time the packed nvfp4 shadow in the warp-specialized Gluon decode.

Run on an H200 from the repository root (vLLM 0.33 bundle for FlashMLA)::

    export PYTHONPATH=/tmp/site:packages/mla-formats/src:packages/mla-reference/src
    export PYTHONPATH=$PYTHONPATH:packages/mla-triton/src
    python packages/mla-triton/benchmarks/gluon_packed.py --plan check OUTDIR
    python packages/mla-triton/benchmarks/gluon_packed.py --plan bench --graph OUTDIR

``check``: on ``gluon_decode_ws.CHECKS + PAGE_CHECKS`` (ragged lengths, open 16-token V
blocks, an empty request, 1 to 4 splits, pages 16 to 128, 20 and 128 heads), nvfp4
Q/K/P/V: ``decode_shadow`` on the packed shadow with each packed configuration must equal
``NVFP4_CONFIG`` on the ``fp16`` shadow of the same cache bit for bit (out and LSE: the
producer decodes the same float16 tiles), and stay within the quantized bounds of the
float64 oracle (``gluon_decode_ws._verdict``); writes ``packed-check.json``, exit status 1
on a mismatch. ``bench``: median ``do_bench`` (and ``--graph``: the CUDA-graph replay) of
FlashMLA bf16, ``NVFP4_CONFIG`` on the fp16 shadow and each packed configuration at
``--shapes``, FlashMLA in the same process; TFLOP/s counted as FlashMLA does, ``GB/s`` the
bytes each path reads (its shadow's ``token_bytes`` a token, FlashMLA 1152, plus q and
out) and ``bw_vs_flashmla`` the ratio of those rates (the bandwidth-equivalent speed);
writes ``packed-bench.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import SHAPES, flashmla_run, flops, make_inputs
from gluon_decode_ws import CHECKS, PAGE_CHECKS, SCALE, _graph_and_host, _inputs, _verdict

from mla_formats import AttentionQuant
from mla_triton import allocate_shadow, decode_shadow, shadow_layout, update_cache
from mla_triton.decode import decode_num_splits
from mla_triton.gluon_decode_ws import NVFP4_CONFIG, NVFP4_PACKED_CONFIG

QUANT = AttentionQuant.uniform("nvfp4")
PACKED = {
    c.name: c
    for c in (
        NVFP4_PACKED_CONFIG,
        replace(NVFP4_PACKED_CONFIG, math_regs=216, producer_regs=72),
        replace(NVFP4_PACKED_CONFIG, math_regs=200, producer_regs=104),
    )
}
"""The packed configurations checked and timed (register splits)."""


def filled(cache: torch.Tensor, storage: str) -> torch.Tensor:
    """The ``storage`` shadow of every row of ``cache [blocks, page, 576]``."""
    shadow = allocate_shadow(cache.shape[0], cache.shape[1], QUANT, storage=storage,
                             device=cache.device)  # fmt: skip
    flat = cache.reshape(-1, 576).clone()
    slots = torch.arange(flat.shape[0], device=cache.device, dtype=torch.int64)
    update_cache(flat[:, :512], flat[:, 512:], cache, slots, shadow, quant=QUANT, storage=storage)
    return shadow


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def check(names: list[str]) -> list[dict[str, Any]]:
    import mla_reference

    rows: list[dict[str, Any]] = []
    for batch, heads, page, lens, splits in CHECKS + PAGE_CHECKS:
        q, cache, table, seq = _inputs(batch, heads, page, lens)
        sh16, shpk = filled(cache, "fp16"), filled(cache, "packed")
        kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": QUANT, "num_splits": splits}
        o16, l16 = decode_shadow(q, cache, sh16, table, seq, config=NVFP4_CONFIG, **kw)
        ref = tuple(mla_reference.decode(q.cpu(), cache.cpu(), table.cpu(), seq.cpu(),
                                         softmax_scale=SCALE, quant=QUANT))  # fmt: skip
        case = f"b{batch} h{heads} p{page} {lens} s{splits}"
        for name in names:
            cfg = PACKED[name]
            try:
                o, lse = decode_shadow(q, cache, shpk, table, seq, storage="packed", config=cfg,
                                       **kw)  # fmt: skip
                torch.cuda.synchronize()
                row = {"case": case, "config": name, "same_as_fp16": _same(o, o16) and
                       _same(lse, l16), **_verdict(o, lse, o16, ref, quantized=True)}  # fmt: skip
                row["ok"] = row["ok"] and row["same_as_fp16"]
            except Exception as exc:  # recorded: the other cases still run
                row = {"case": case, "config": name, "ok": False, "error": repr(exc)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        tri, _ = decode_shadow(q, cache, shpk, table, seq, storage="packed", impl="triton", **kw)
        err = float((tri.float() - o16.float()).abs().max()) if tri.numel() else 0.0
        rows.append({"case": case, "config": "triton-packed", "max_abs_vs_fp16_ws": err})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench(
    shapes: list[str], warmup: int, rep: int, graph: bool, names: list[str]
) -> list[dict[str, Any]]:
    import triton.testing

    rows: list[dict[str, Any]] = []
    lay16 = shadow_layout(QUANT, storage="fp16")
    laypk = shadow_layout(QUANT, storage="packed")
    for shape in shapes:
        batch, heads, seq_len, _ = SHAPES[shape]
        q, cache, table, lens = make_inputs(shape, "cuda")
        cache.copy_(torch.randn_like(cache))
        splits = decode_num_splits(batch, heads, seq_len, device=q.device, block_h=64)
        out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
        kw: dict[str, Any] = {
            "softmax_scale": 0.1, "quant": QUANT, "num_splits": splits, "max_seq_len": seq_len,
            "out": out, "lse": torch.empty(batch, heads, device="cuda", dtype=torch.float32),
            "workspace": torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
        }  # fmt: skip
        sh16 = filled(cache, "fp16")
        shpk = filled(cache, "packed")
        fp16 = functools.partial(decode_shadow, q, cache, sh16, table, lens, **kw)
        pk = functools.partial(decode_shadow, q, cache, shpk, table, lens, storage="packed", **kw)
        runs: dict[str, tuple[Any, int]] = {
            "flashmla": (flashmla_run(q, cache, table, lens, 0.1), 1152),
            "fp16-" + NVFP4_CONFIG.name: (
                functools.partial(fp16, config=NVFP4_CONFIG),
                lay16.token_bytes,
            ),
            "fp16-auto": (fp16, lay16.token_bytes),
            "packed-triton": (functools.partial(pk, impl="triton"), laypk.token_bytes),
        }
        for name in names:
            runs["packed-" + name] = (functools.partial(pk, config=PACKED[name]),
                                      laypk.token_bytes)  # fmt: skip
        base = None
        for name, (run, token_bytes) in runs.items():
            t0 = time.time()
            try:
                run()
                torch.cuda.synchronize()
                if name == "fp16-" + NVFP4_CONFIG.name:
                    base = out.clone()
                same = None if base is None or name == "flashmla" else bool(torch.equal(out, base))
                ms = triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")
                timed = _graph_and_host(run, warmup, rep) if graph else {}
            except Exception as exc:  # recorded, the run goes on
                rows.append({"shape": shape, "impl": name, "error": repr(exc)})
                print(rows[-1], flush=True)
                continue
            moved = batch * seq_len * token_bytes + 2 * batch * heads * (576 + 512)
            row = {"shape": shape, "impl": name, "splits": splits, "ms": ms,
                   "tflops": flops(batch, heads, seq_len) / ms / 1e9, "token_bytes": token_bytes,
                   "gbps": moved / ms / 1e6, "same_as_fp16_ws": same,
                   "wall_s": time.time() - t0, **timed}  # fmt: skip
            if "graph_ms" in timed:
                row["graph_tflops"] = flops(batch, heads, seq_len) / timed["graph_ms"] / 1e9
                row["graph_gbps"] = moved / timed["graph_ms"] / 1e6
            rows.append(row)
        fl = next((r for r in rows if r["shape"] == shape and r["impl"] == "flashmla"
                   and "ms" in r), None)  # fmt: skip
        for r in rows:
            if r["shape"] != shape or "ms" not in r or fl is None:
                continue
            r["vs_flashmla"] = fl["ms"] / r["ms"]
            r["bw_vs_flashmla"] = r["gbps"] / fl["gbps"]
            if "graph_ms" in r and "graph_ms" in fl:
                r["graph_vs_flashmla"] = fl["graph_ms"] / r["graph_ms"]
                r["graph_bw_vs_flashmla"] = r["graph_gbps"] / fl["graph_gbps"]
            print(f"{shape:17s} {r['impl']:34s} {r['ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s "
                  f"{r['vs_flashmla']:5.2f}x FlashMLA, {r['gbps']:6.0f} GB/s "
                  f"{r['bw_vs_flashmla']:5.2f}x | graph {r.get('graph_vs_flashmla', 0):5.2f}x "
                  f"bw {r.get('graph_bw_vs_flashmla', 0):5.2f}x same {r['same_as_fp16_ws']}",
                  flush=True)  # fmt: skip
        del runs, fp16, pk, sh16, shpk
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", choices=("check", "bench"), required=True)
    parser.add_argument("--shapes", default="b128-h128-L8192,b32-h128-L32768,b8-h128-L32768,"
                        "b128-h16-L8192")  # fmt: skip
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--configs", default=",".join(PACKED), help="packed configurations")
    parser.add_argument("out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plan == "check":
        rows = check(args.configs.split(","))
        bad = [r for r in rows if r.get("ok") is False]
        path = os.path.join(args.out, "packed-check.json")
        with open(path, "w") as f:
            json.dump({"rows": rows, "failed": bad}, f, indent=1)
        print(f"{len(bad)} failed of {sum('ok' in r for r in rows)}; {path}")
        return 1 if bad else 0
    rows = bench(
        args.shapes.split(","), args.warmup_ms, args.rep_ms, args.graph, args.configs.split(",")
    )
    with open(os.path.join(args.out, "packed-bench.json"), "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name()}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
