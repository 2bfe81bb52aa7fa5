"""Benchmark of ``mla_triton.decode`` (absorbed MLA, split-K, in-kernel Q/K/P/V QDQ).

Run on a CUDA GPU from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/decode.py --plan main --out OUTDIR

Prints one table: per shape and recipe, the median time of ``triton.testing.do_bench``
(after a warm-up), TFLOP/s counted as FlashMLA does (``2 H L (576 + 512)`` per
request) and GB/s (latent rows read once + q + out). Inputs are random bf16, the
block table a random permutation of the cache's pages, every request at full
length ``L``. ``--plan sweep`` adds tile configurations (see ``PLANS``); the
``*-k``, ``*-v``, ``*-p``, ``*-q`` recipes quantize one operand only, to show where
the time of on-read QDQ goes. Measured ceilings of the card (a device-to-device
copy and a bf16 matmul) and the eager reference at one small shape are printed too.

``--impls auto,triton,gluon`` times each default entry through each of ``decode``'s
``impl`` values (a row records which split kernel ran: ``auto`` picks the Gluon one on
sm90 where it takes the call); ``--flashmla`` times FlashMLA bf16 (vLLM's wheel,
``flash_mla_with_kvcache``) on the same cache per shape, in the same process, and every
row gets its ratio to it; ``--shapes`` and ``--recipes`` narrow the plan.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton.decode import DecodeConfig, decode, decode_config, decode_num_splits
from mla_triton.gluon_decode import gluon_decode_config, gluon_facts, gluon_unsupported

SHAPES: dict[str, tuple[int, int, int, int]] = {  # batch, heads, seq len, page size
    "b128-h128-L8192": (128, 128, 8192, 64),
    "b128-h16-L8192": (128, 16, 8192, 64),
    "b32-h128-L32768": (32, 128, 32768, 64),
    "b8-h128-L32768": (8, 128, 32768, 64),  # the serving benchmark's 32k batch
}

RECIPES: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "nvfp4-q": AttentionQuant(q="nvfp4"),
    "nvfp4-k": AttentionQuant(k="nvfp4"),
    "nvfp4-v": AttentionQuant(v="nvfp4"),
    "nvfp4-p": AttentionQuant(p="nvfp4"),
    "fp8-k": AttentionQuant(k="fp8"),
    "fp8-v": AttentionQuant(v="fp8"),
    "fp8-p": AttentionQuant(p="fp8"),
}


@dataclass(frozen=True)
class Entry:
    shape: str
    recipe: str
    config: DecodeConfig | None = None  # None: decode_config's default
    num_splits: int | None = None  # None: the default policy
    impl: str = "auto"  # decode's impl (a DecodeConfig runs the Triton kernel)


def _cfg(bh: int, bn: int, warps: int, stages: int) -> DecodeConfig:
    return DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)


MAIN = [Entry(s, r) for s in SHAPES for r in ("none", "fp8", "nvfp4")]
BREAKDOWN = [
    Entry("b128-h128-L8192", r)
    for r in ("nvfp4-q", "nvfp4-k", "nvfp4-v", "nvfp4-p", "fp8-k", "fp8-v", "fp8-p")
]
H128 = "b128-h128-L8192"
SWEEP = (
    [Entry(H128, "none", _cfg(64, bn, 8, st)) for bn, st in ((64, 3), (32, 3))]
    + [Entry(H128, "none", None, 2)]
    + [Entry(H128, "fp8", _cfg(64, bn, 8, st)) for bn, st in ((32, 2), (32, 3), (64, 2), (16, 4))]
    + [Entry(H128, "nvfp4", _cfg(64, bn, 8, st)) for bn, st in ((64, 2), (16, 3))]
    + [Entry("b128-h16-L8192", "none", _cfg(16, bn, 4, st)) for bn, st in ((32, 4), (64, 4))]
    + [
        Entry("b128-h16-L8192", r, _cfg(16, bn, 4, st))
        for r in ("fp8", "nvfp4")
        for bn, st in ((16, 4), (64, 2))
    ]
)
PLANS = {"main": MAIN, "breakdown": MAIN + BREAKDOWN, "sweep": MAIN + BREAKDOWN + SWEEP}


def flops(batch: int, heads: int, seq: int) -> float:
    """FlashMLA's count: ``2 H L (576 + 512)`` per request."""
    return 2.0 * batch * heads * seq * (576 + 512)


def nbytes(batch: int, heads: int, seq: int) -> float:
    """Latent rows read once, q read, out written (bf16)."""
    return 2.0 * (batch * seq * 576 + batch * heads * 576 + batch * heads * 512)


def make_inputs(
    shape: str, device: str, *, tiny: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, cache (exactly the pages the batch uses, shuffled), block table, lengths.

    ``tiny`` keeps the table width and divisibility (the same compiled kernel) but
    two requests of 64 tokens: for compiling only.
    """
    batch, heads, seq, page = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_per = seq // page
    if tiny:
        batch_eff, n_blocks = 2, 8
        table = torch.randint(0, n_blocks, (batch_eff, pages_per), generator=g, dtype=torch.int32)
        lens = torch.full((batch_eff,), 64, dtype=torch.int32)
    else:
        batch_eff, n_blocks = batch, batch * pages_per
        table = torch.randperm(n_blocks, generator=g).to(torch.int32).reshape(batch, pages_per)
        lens = torch.full((batch,), seq, dtype=torch.int32)
    cache = torch.randn(n_blocks, page, 576, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch_eff, heads, 576, device=device, dtype=torch.bfloat16)
    return q, cache, table.to(device), lens.to(device)


def _splits(entry: Entry) -> int:
    batch, heads, seq, _ = SHAPES[entry.shape]
    cfg = entry.config or decode_config(heads, RECIPES[entry.recipe])
    if entry.num_splits is not None:
        return entry.num_splits
    return decode_num_splits(batch, heads, seq, device=torch.device("cuda"), block_h=cfg.block_h)


def _compile_one(entry: Entry) -> str:
    q, cache, table, lens = make_inputs(entry.shape, "cuda", tiny=True)
    t0 = time.time()
    decode(
        q,
        cache,
        table,
        lens,
        softmax_scale=0.1,
        quant=RECIPES[entry.recipe],
        num_splits=_splits(entry),
        config=entry.config,
        impl=entry.impl,
    )
    torch.cuda.synchronize()
    return f"{entry.shape} {entry.recipe} {entry.impl} {entry.config} {time.time() - t0:.1f}s"


def precompile(entries: list[Entry], workers: int) -> None:
    """Fill Triton's on-disk cache in parallel processes (compiles dominate a run)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        for line in pool.imap_unordered(_compile_one, entries):
            print("compiled", line, flush=True)


def time_entry(entry: Entry, warmup_ms: int, rep_ms: int) -> dict[str, object]:
    import triton.testing

    batch, heads, seq, _page = SHAPES[entry.shape]
    q, cache, table, lens = make_inputs(entry.shape, "cuda")
    splits = _splits(entry)
    out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, device="cuda", dtype=torch.float32)

    def run() -> None:
        decode(
            q,
            cache,
            table,
            lens,
            softmax_scale=0.1,
            quant=RECIPES[entry.recipe],
            num_splits=splits,
            config=entry.config,
            out=out,
            lse=lse,
            max_seq_len=seq,
            impl=entry.impl,
        )

    ms = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    cfg = entry.config or decode_config(heads, RECIPES[entry.recipe])
    ok = bool(torch.isfinite(out).all())
    kernel = kernel_of(entry, q, cache)
    return {
        "shape": entry.shape,
        "recipe": entry.recipe,
        "impl": entry.impl,
        "kernel": kernel,
        "config": {"gluon": gluon_decode_config(heads, RECIPES[entry.recipe]).name}
        if kernel == "gluon"
        else asdict(cfg),
        "default_config": entry.config is None,
        "num_splits": splits,
        "ms": ms,
        "tflops": flops(batch, heads, seq) / ms / 1e9,
        "gbps": nbytes(batch, heads, seq) / ms / 1e6,
        "finite": ok,
    }


def kernel_of(entry: Entry, q: torch.Tensor, cache: torch.Tensor) -> str:
    """The split kernel ``decode`` runs for ``entry``: ``"gluon"`` or ``"triton"``."""
    if entry.impl == "triton" or entry.config is not None:
        return "triton"
    if entry.impl == "gluon":
        return "gluon"
    quant = RECIPES[entry.recipe]
    return (
        "gluon"
        if gluon_unsupported(gluon_facts(q[..., :512], cache, quant, 512)) is None
        else "triton"
    )


def flashmla_run(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, seq: torch.Tensor, scale: float
) -> Callable[[], Any]:
    """A closure running FlashMLA bf16 (vLLM's wheel) on the same cache; it returns
    ``(out [B, 1, H, 512], lse)``. ``q [B, H, 576]``, ``cache [blocks, page, 576]``."""
    from vllm.v1.attention.ops import flashmla

    ok, why = flashmla.is_flashmla_dense_supported()
    if not ok:
        raise RuntimeError(f"FlashMLA unavailable: {why}")
    meta, _ = flashmla.get_mla_metadata()
    q4 = q.unsqueeze(1)  # [B, 1, H, 576]
    k4 = cache.unsqueeze(2)  # [blocks, page, 1, 576]

    def run() -> Any:
        return flashmla.flash_mla_with_kvcache(
            q4, k4, table, seq, 512, meta, None, softmax_scale=scale, causal=False
        )

    return run


def time_flashmla(shape: str, warmup_ms: int, rep_ms: int) -> dict[str, object]:
    """FlashMLA bf16 at ``shape`` (the inputs of ``time_entry``), its agreement with
    ``decode`` (max row error) and its time."""
    import triton.testing

    batch, heads, seq, _page = SHAPES[shape]
    q, cache, table, lens = make_inputs(shape, "cuda")
    row: dict[str, object] = {"shape": shape, "recipe": "none", "impl": "flashmla"}
    try:
        run = flashmla_run(q, cache, table, lens, 0.1)
        out = run()[0].reshape(batch, heads, 512).double()
        ref = decode(q, cache, table, lens, softmax_scale=0.1, impl="triton")[0].double()
        row["max_row_err_vs_triton"] = float(
            ((out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-3)).max()
        )
        ms = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except Exception as exc:  # FlashMLA missing or failing: recorded, the run goes on
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    row.update(ms=ms, tflops=flops(batch, heads, seq) / ms / 1e9, finite=True)
    return row


def ceilings() -> dict[str, float]:
    """The card's measured copy bandwidth (read + write) and bf16 matmul rate."""
    import triton.testing

    x = torch.empty(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    copy_gbps = 2 * x.numel() * 2 / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": 2 * 8192**3 / ms / 1e9}


def reference_sanity() -> dict[str, object]:
    """The eager oracle at one small shape: its time and the kernel's agreement."""
    import mla_reference

    q, cache, table, _ = make_inputs("b128-h16-L8192", "cuda")
    q, table = q[:2], table[:2]
    lens = torch.full((2,), 1000, device="cuda", dtype=torch.int32)
    quant = AttentionQuant.uniform("nvfp4")
    mla_reference.decode(q, cache, table, lens, softmax_scale=0.1, quant=quant)  # warm-up
    torch.cuda.synchronize()
    t0 = time.time()
    mla_reference.decode(q, cache, table, lens, softmax_scale=0.1, quant=quant)
    torch.cuda.synchronize()
    ref_s = time.time() - t0
    # agreement against the oracle on the CPU: on CUDA, mla_formats divides the global
    # scale by multiplying with a reciprocal (PyTorch's division by a Python scalar)
    pages = sorted(set(table[:, : 1000 // 64 + 1].flatten().tolist()))
    remap = torch.zeros(cache.shape[0], dtype=torch.int32)
    remap[torch.tensor(pages)] = torch.arange(len(pages), dtype=torch.int32)
    ref_out, ref_lse = mla_reference.decode(
        q.cpu(),
        cache[torch.tensor(pages, device="cuda")].cpu(),
        remap[table.cpu().long()],
        lens.cpu(),
        softmax_scale=0.1,
        quant=quant,
    )
    ref_out, ref_lse = ref_out.cuda(), ref_lse.cuda()
    out, lse = decode(q, cache, table, lens, softmax_scale=0.1, quant=quant)
    err = (
        ((out.double() - ref_out.double()).abs().amax(-1) / ref_out.double().abs().amax(-1))
        .max()
        .item()
    )
    return {
        "shape": "b2-h16-L1000 nvfp4",
        "reference_s": ref_s,
        "max_row_rel_err": err,
        "max_lse_err": (lse.double() - ref_lse.double()).abs().max().item(),
    }


def sanitize() -> None:
    """Small decodes for ``compute-sanitizer --tool memcheck``: both kernels, both page paths."""
    for page, splits in ((16, 3), (64, 1)):
        g = torch.Generator(device="cpu").manual_seed(page)
        cache = torch.randn(40, page, 576, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(40, generator=g)[:30].to(torch.int32).reshape(3, 10).cuda()
        lens = torch.tensor([0, 17, min(10 * page, 300)], dtype=torch.int32, device="cuda")
        q = torch.randn(3, 20, 576, device="cuda", dtype=torch.bfloat16)
        for quant in (None, AttentionQuant.uniform("fp8"), AttentionQuant.uniform("nvfp4")):
            out, _ = decode(
                q, cache, table, lens, softmax_scale=0.1, quant=quant, num_splits=splits
            )
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
    print("sanitize: ran 6 decodes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="main")
    parser.add_argument("--out", default=None, help="folder for decode-<plan>.json/.txt")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--warmup-ms", type=int, default=50)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--sanitize", action="store_true", help="run small decodes only")
    parser.add_argument("--sanity-only", action="store_true", help="only the eager-oracle check")
    parser.add_argument("--impls", default="auto", help="comma-separated: auto, triton, gluon")
    parser.add_argument("--flashmla", action="store_true", help="time FlashMLA bf16 (vLLM)")
    parser.add_argument("--shapes", default="", help="comma-separated shapes (default: the plan's)")
    parser.add_argument("--recipes", default="", help="comma-separated recipes (default: all)")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the card's ceilings")
    parser.add_argument(
        "--once",
        nargs=2,
        metavar=("SHAPE", "RECIPE"),
        help="run one default entry twice (a profiler's target: skip 1 launch)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sanitize:
        sanitize()
        return 0
    if args.sanity_only:
        print(json.dumps(reference_sanity()))
        return 0
    if args.once:
        entry = Entry(args.once[0], args.once[1])
        q, cache, table, lens = make_inputs(entry.shape, "cuda")
        for _ in range(2):
            decode(
                q,
                cache,
                table,
                lens,
                softmax_scale=0.1,
                quant=RECIPES[entry.recipe],
                num_splits=_splits(entry),
            )
        torch.cuda.synchronize()
        return 0
    entries = [
        e
        for e in PLANS[args.plan]
        if (not args.shapes or e.shape in args.shapes.split(","))
        and (not args.recipes or e.recipe in args.recipes.split(","))
    ]
    impls = [i for i in args.impls.split(",") if i]
    entries = [  # an entry with its own DecodeConfig runs the Triton kernel only
        replace(e, impl=i) for e in entries for i in (impls if e.config is None else ["triton"])
    ]
    t0 = time.time()
    precompile(entries, args.workers)
    print(f"precompiled {len(entries)} entries in {time.time() - t0:.0f}s", flush=True)
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    rows = []
    for entry in entries:
        rows.append(time_entry(entry, args.warmup_ms, args.rep_ms))
        r = rows[-1]
        print(f"{r['shape']:17s} {r['recipe']:8s} {r['impl']:6s} {r['ms']:8.3f} ms", flush=True)
    flash: dict[str, dict[str, object]] = {}
    if args.flashmla:
        for shape in dict.fromkeys(e.shape for e in entries):
            flash[shape] = time_flashmla(shape, args.warmup_ms, args.rep_ms)
            print(f"{shape:17s} flashmla {flash[shape].get('ms', flash[shape].get('error'))}")
    for r in rows:
        base = flash.get(str(r["shape"]), {}).get("ms")
        if isinstance(base, float):
            r["vs_flashmla"] = base / float(r["ms"])  # type: ignore[arg-type]
    ceil = ceilings() if not args.no_ceilings else {"copy_GBps": 0.0, "bf16_matmul_TFLOPs": 0.0}
    sanity = reference_sanity()

    lines = [
        f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}",
        f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read+write), "
        f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
        f"{'shape':17s} {'recipe':8s} {'impl':6s} {'kernel':6s} "
        f"{'config (bh,bn,warps,stages)':34s} {'splits':>6s} "
        f"{'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>7s} {'xFlashMLA':>9s}",
    ]
    for r in rows:
        c = r["config"]
        assert isinstance(c, dict)
        tag = (
            str(c["gluon"])
            if "gluon" in c
            else f"{c['block_h']},{c['block_n']},{c['num_warps']},{c['num_stages']}"
        ) + (" (default)" if r["default_config"] else "")
        ratio = f"{r['vs_flashmla']:9.2f}" if "vs_flashmla" in r else f"{'':9s}"
        lines.append(
            f"{r['shape']:17s} {r['recipe']:8s} {r['impl']:6s} {r['kernel']:6s} {tag:34s} "
            f"{r['num_splits']:>6} {r['ms']:8.3f} {r['tflops']:8.1f} {r['gbps']:7.0f} {ratio}"
            + ("" if r["finite"] else "  NON-FINITE")
        )
    for fl in flash.values():
        if "ms" in fl:
            lines.append(
                f"{fl['shape']:17s} none     flashmla bf16 {fl['ms']:8.3f} ms {fl['tflops']:8.1f} "
                f"TFLOP/s (max row err vs triton {fl['max_row_err_vs_triton']:.1e})"
            )
        else:
            lines.append(f"{fl['shape']:17s} flashmla: {fl.get('error')}")
    lines.append(
        f"reference sanity ({sanity['shape']}): eager oracle {sanity['reference_s']:.2f}s, "
        f"kernel max row rel err {sanity['max_row_rel_err']:.2e}, "
        f"lse err {sanity['max_lse_err']:.1e}"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"decode-{args.plan}.json"), "w") as f:
            json.dump(
                {"info": info, "ceilings": ceil, "rows": rows, "flashmla": list(flash.values()),
                 "reference": sanity}, f, indent=1,
            )  # fmt: skip
        with open(os.path.join(args.out, f"decode-{args.plan}.txt"), "w") as f:
            f.write(text + "\n")
    return (
        0
        if all(r["finite"] for r in rows) and math.isfinite(float(sanity["max_row_rel_err"]))
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
