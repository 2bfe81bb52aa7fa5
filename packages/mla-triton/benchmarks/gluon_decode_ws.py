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
``do_bench`` of ``decode(config=)`` of every ``VARIANTS`` entry (``--variants``: the named
ones), ``gluon_decode``'s kernel and
FlashMLA bf16 at b128 h128 L8192 and b32 h128 L32768 (page 64, every request at full
length; TFLOP/s counted as FlashMLA does: ``2 H L (576 + 512)`` a request). Writes
``OUTDIR/ws-<plan>.json`` and prints a summary.

The same check in parallel processes (``benchmarks/gpu/decode_ws_next.sh``): ``outputs
--variants NAME`` (a variant's or a ``TWINS`` name, ``gluon`` or ``reference``) saves one
producer's outputs on ``CHECKS + PAGE_CHECKS`` to ``OUTDIR/out-NAME.pt`` (and, but for
the reference, compiles the bench's keys on tiny inputs); ``compare`` then checks every
saved variant against the reference and gluon (as ``check``) and bit for bit against its
``gluon_decode_ws.twin`` (one feature fewer: the same tiles in the same order), and
writes ``ws-check.json`` (its ``failed`` list is what ``bench`` skips).

``--recipe fp8-shadow`` (plans ``outputs``, ``compare``, ``bench``): the same through
``decode_shadow`` on a float16 shadow of fp8 Q/K/P/V (V̂ = K̂; ``gluon_shadow.filled_shadow``
of the case's cache): ``config=`` a ws variant (``WsShadowFamily``), ``gluon`` is
``gluon_decode``'s shadow kernel (``config=gluon_decode.VARIANTS[0]``, what
``decode_shadow(impl="gluon")`` runs while ``WS_SHADOW_AUTO`` is off), ``reference`` the
oracle with the recipe; the bounds are the quantized ones (``_verdict``); files
``out-fp8-shadow-NAME.pt``, ``ws-check-fp8-shadow.json``, ``ws-bench-fp8-shadow.json``.
``--recipe nvfp4-shadow``: the same on nvfp4 Q/K/P/V (the shadow's V̂ section, the open
V block in the kernel): the ws configurations ``NV_CONFIGS`` (``NVFP4_CONFIG``, and with S
issued early or TMA loads: bit for bit against it), ``gluon`` is ``gluon_decode``'s
``SEPARATE_V_CONFIG``; files ``*-nvfp4-shadow*``.
``bench --graph``: each timed call also replayed from a CUDA graph of one call
(``graph_ms``, ``graph_tflops``, ``graph_vs_flashmla``: the kernels without the host
between them) and the host's time to issue one call (``host_ms``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import SHAPES, flashmla_run, flops, make_inputs
from gluon_shadow import filled_shadow

from mla_formats import AttentionQuant
from mla_triton import decode_shadow
from mla_triton.decode import decode, decode_num_splits
from mla_triton.gluon_decode import SEPARATE_V_CONFIG
from mla_triton.gluon_decode import VARIANTS as GLUON_VARIANTS
from mla_triton.gluon_decode_ws import NVFP4_CONFIG, NVFP4_TMA_CONFIG, VARIANTS, twin

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
PAGE_CHECKS = [
    (3, 128, 128, [129, 1, 700], 2),  # pages of two 64-token tiles (TMA)
    (2, 64, 32, [300, 0], 2),  # 32-token pages: TMA for 32-token tiles, cp.async for 64
]
"""The ``outputs`` / ``compare`` plans' cases beyond ``CHECKS`` (two more keys)."""
BENCH_SHAPES = ("b128-h128-L8192", "b32-h128-L32768")
NV_CONFIGS = {c.name: c for c in (NVFP4_CONFIG, replace(NVFP4_CONFIG, early_s=True),
                                   NVFP4_TMA_CONFIG,
                                   replace(NVFP4_TMA_CONFIG, lazy_rescale=True))}  # fmt: skip
"""The ws configurations a V̂ section runs (``--recipe nvfp4-shadow``): 32-token tiles, two
slots, cp.async, and with TMA loads (``NVFP4_TMA_CONFIG``; page 16: cp.async), and that with
``lazy_rescale``; ``twin`` of the second and the third is the first, of the fourth the
third."""
BY_NAME = {c.name: c for c in VARIANTS} | NV_CONFIGS
TWINS = {t.name: t for c in VARIANTS if (t := twin(c)) is not None and t.name not in BY_NAME}
"""The ``twin`` configurations outside ``VARIANTS`` (``outputs --variants`` takes them: the
new variants' bit-for-bit references; checked on the GPU, not timed)."""
RECIPES: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8-shadow": AttentionQuant.uniform("fp8"),
    "nvfp4-shadow": AttentionQuant.uniform("nvfp4"),
    # the nvfp4 shadow's bound, one factor at a time (bench): q and P fp8, then P none
    "nvfp4-shadow-qp8": AttentionQuant(q="fp8", k="nvfp4", v="nvfp4", p="fp8"),
    "nvfp4-shadow-q8": AttentionQuant(q="fp8", k="nvfp4", v="nvfp4"),
}
"""``--recipe``: ``decode`` unquantized, or ``decode_shadow`` on a float16 fp8 or nvfp4
shadow (``nvfp4-shadow-*``: nvfp4 K and V, its V̂ section, with q and P fp8 or P none)."""


def _gluon(recipe: str) -> Any:
    """``gluon_decode``'s configuration for ``recipe`` (a V̂ section: ``SEPARATE_V_CONFIG``)."""
    return SEPARATE_V_CONFIG if _v_section(recipe) else GLUON_VARIANTS[0]


def _v_section(recipe: str) -> bool:
    """Whether ``recipe`` reads the shadow's V̂ section (nvfp4 V)."""
    return recipe.startswith("nvfp4-shadow")


Decoder = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _decoder(recipe: str, cache: torch.Tensor) -> Decoder:
    """``decode`` (recipe none), or ``decode_shadow`` on ``cache``'s filled fp8 shadow with
    the recipe: called as ``decode``."""
    quant = RECIPES[recipe]
    if quant is None:
        return decode
    shadow = filled_shadow(cache, quant)

    def run(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq: torch.Tensor,
            **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return decode_shadow(q, kv, shadow, table, seq, quant=quant, **kw)

    return run


def _tag(recipe: str) -> str:
    """The file-name part of ``recipe`` (``""`` for none, ``"-fp8-shadow"``)."""
    return "" if recipe == "none" else f"-{recipe}"


def _inputs(batch: int, heads: int, page: int, lens: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(batch * 1000 + heads + page)
    max_blocks = max(1, -(-max(lens) // page))
    blocks = batch * max_blocks + 3
    q = torch.randn(batch, heads, 576, generator=g).to("cuda", torch.bfloat16)
    cache = torch.randn(blocks, page, 576, generator=g).to("cuda", torch.bfloat16)
    table = torch.randperm(blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    return q, cache, table.to("cuda", torch.int32), torch.tensor(lens, dtype=torch.int32).cuda()


def _verdict(
    o_w: torch.Tensor, l_w: torch.Tensor, o_g: torch.Tensor, ref: tuple[torch.Tensor, ...],
    quantized: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """``o_w, l_w`` (a variant's out and LSE) against the float64 oracle ``ref = (o, lse)``
    and the Gluon kernel's ``o_g``: row errors, LSE error, the verdict ``ok``. Rows within
    1.5e-2 of both; ``quantized`` (P̂ fp8: a score one ulp off can move one P code): at
    most 2% of the rows (at least one) beyond 4e-3 and every row within 0.5, as
    ``tests/test_decode_gpu.check``; LSE within 2e-5 either way."""
    o_r, l_r = ref
    den = o_r.abs().amax(-1).clamp_min(1e-3)
    rows_ref = (o_w.double().cpu() - o_r).abs().amax(-1) / den
    rows_gl = (o_w.double().cpu() - o_g.double().cpu()).abs().amax(-1) / den
    err_ref, err_gl = float(rows_ref.max()), float(rows_gl.max())
    lse_fin = torch.isfinite(l_r)
    diff = (l_w.double().cpu() - l_r)[lse_fin]
    lse_err = float(diff.abs().max()) if diff.numel() else 0.0
    lse_inf = bool((l_w.cpu()[~lse_fin] == float("-inf")).all())
    if quantized:
        allowed = max(1, math.ceil(0.02 * rows_ref.numel()))
        good = all(int((r > 4e-3).sum()) <= allowed and float(r.max()) <= 0.5
                   for r in (rows_ref, rows_gl))  # fmt: skip
    else:
        good = err_ref < 1.5e-2 and err_gl < 1.5e-2
    good = good and lse_err < 2e-5 and lse_inf and bool(torch.isfinite(o_w).all())
    return {"err_vs_ref": err_ref, "err_vs_gluon": err_gl, "lse_err": lse_err, "ok": good}


def _reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
               seq: torch.Tensor, recipe: str = "none") -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The float64 oracle (``recipe`` quantized: the bf16 inputs, quantized as the recipe)."""
    import mla_reference

    quant = RECIPES[recipe]
    if quant is None:
        return tuple(mla_reference.decode(q.double().cpu(), cache.double().cpu(), table.cpu(),
                                          seq.cpu(), softmax_scale=SCALE))  # fmt: skip
    return tuple(mla_reference.decode(q.cpu(), cache.cpu(), table.cpu(), seq.cpu(),
                                      softmax_scale=SCALE, quant=quant))  # fmt: skip


def check() -> tuple[set[str], list[dict[str, Any]]]:
    """``decode(config=)`` of the ws variants against the Gluon decode and the float64
    oracle on ``CHECKS``: the names of the variants that failed a case, and the rows."""
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
            case = {"case": [batch, heads, page, lens, splits], "config": cfg.name}
            try:
                o_w, l_w = decode(q, cache, table, seq, softmax_scale=SCALE,
                                  num_splits=splits, config=cfg)  # fmt: skip
                torch.cuda.synchronize()
            except Exception as exc:  # recorded; the other variants go on
                failed.add(cfg.name)
                rows.append(case | {"error": repr(exc), "ok": False})
                print(f"check {cfg.name}: FAIL {exc!r}", flush=True)
                continue
            row = case | _verdict(o_w, l_w, o_g, _reference(q, cache, table, seq))
            if not row["ok"]:
                failed.add(cfg.name)
            rows.append(row)
            print(f"check B{batch} H{heads} page{page} lens{lens} splits{splits} {cfg.name}: "
                  f"vs ref {row['err_vs_ref']:.2e} vs gluon {row['err_vs_gluon']:.2e} lse "
                  f"{row['lse_err']:.1e} {'ok' if row['ok'] else 'FAIL'}", flush=True)  # fmt: skip
    return failed, rows


def outputs(
    name: str, out_dir: str, recipe: str = "none", shapes: tuple[str, ...] = BENCH_SHAPES
) -> None:
    """One producer's outputs on ``CHECKS + PAGE_CHECKS`` (``name``: a ``VARIANTS`` name,
    ``"gluon"`` or ``"reference"``) saved to ``out_dir/out<tag>-<name>.pt`` (``[(out, lse)
    on the CPU, or the error's repr] a case``; ``tag``: ``_tag(recipe)``); then, but for
    the reference, the bench's compile keys on tiny inputs (so that ``bench`` finds them
    in Triton's cache)."""
    if name == "reference":
        config: Any = None
    else:
        config = _gluon(recipe) if name == "gluon" else (BY_NAME | TWINS)[name]
    saved: list[Any] = []
    for batch, heads, page, lens, splits in CHECKS + PAGE_CHECKS:
        q, cache, table, seq = _inputs(batch, heads, page, lens)
        t0 = time.time()
        try:
            if config is None:
                saved.append(_reference(q, cache, table, seq, recipe))
            else:
                dec = _decoder(recipe, cache)
                o, lse = dec(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                             config=config)  # fmt: skip
                torch.cuda.synchronize()
                saved.append((o.cpu(), lse.cpu()))
        except Exception as exc:  # recorded; the next case goes on
            saved.append(repr(exc))
        print(f"{name} B{batch} H{heads} page{page} splits{splits}: "
              f"{'error' if isinstance(saved[-1], str) else 'done'} {time.time() - t0:.1f} s",
              flush=True)  # fmt: skip
        torch.save(saved, os.path.join(out_dir, f"out{_tag(recipe)}-{name}.pt"))  # if it hangs
    if config is None:
        return
    for shape in shapes:
        batch, heads, seq_len, _ = SHAPES[shape]
        q, cache, table, lens_t = make_inputs(shape, "cuda", tiny=True)  # the bench's keys
        splits = decode_num_splits(batch, heads, seq_len, device=q.device, block_h=64)
        kw = _bench_kwargs(q, splits, seq_len)
        t0 = time.time()
        try:
            _decoder(recipe, cache)(q, cache, table, lens_t, config=config, **kw)
            torch.cuda.synchronize()
        except Exception as exc:  # bench records its own errors
            print(f"{name} warm {shape}: {exc!r}", flush=True)
        print(f"{name} warm {shape} ({splits} splits): {time.time() - t0:.1f} s", flush=True)


def compare(out_dir: str, recipe: str = "none") -> tuple[set[str], list[dict[str, Any]]]:
    """Every variant saved by ``outputs`` (for ``recipe``) against the reference and gluon
    ones (``_verdict``) and bit for bit against its ``twin`` (where saved): the failed
    variants (a missing file counts: its process hung or crashed), and the rows."""

    def load(name: str) -> list[Any] | None:
        path = os.path.join(out_dir, f"out{_tag(recipe)}-{name}.pt")
        return torch.load(path) if os.path.exists(path) else None

    cases = CHECKS + PAGE_CHECKS
    ref, gluon = load("reference"), load("gluon")
    if ref is None or gluon is None or len(ref) < len(cases) or len(gluon) < len(cases):
        raise SystemExit("compare: the reference or gluon outputs are missing")
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    for name, cfg in (BY_NAME | TWINS).items():
        got = load(name)
        if got is None:
            continue
        if len(got) < len(cases):
            failed.add(name)  # the process stopped part way (a hang: the timeout)
            rows.append({"config": name, "error": f"{len(got)} of {len(cases)} cases ran"})
        other = twin(cfg)
        twin_out = load(other.name) if other is not None else None
        for i, saved in enumerate(got):
            case = {"case": list(cases[i]), "config": name}
            if isinstance(saved, str) or isinstance(gluon[i], str):
                failed.add(name)
                rows.append(case | {"error": saved if isinstance(saved, str) else gluon[i],
                                    "ok": False})  # fmt: skip
                continue
            row = case | _verdict(saved[0], saved[1], gluon[i][0], ref[i], recipe != "none")
            if other is not None and twin_out is not None and i < len(twin_out):
                same = not isinstance(twin_out[i], str) and bool(
                    torch.equal(saved[0], twin_out[i][0]) and torch.equal(saved[1], twin_out[i][1])
                )  # fmt: skip
                row[f"bitwise_vs_{other.name}"] = same
                row["ok"] = row["ok"] and same
            if not row["ok"]:
                failed.add(name)
            rows.append(row)
            bits = {k: v for k, v in row.items() if k.startswith("bitwise")}
            print(f"{name:28s} case {i} {cases[i][:3]} splits {cases[i][4]}: vs ref "
                  f"{row['err_vs_ref']:.2e} vs gluon {row['err_vs_gluon']:.2e} lse "
                  f"{row['lse_err']:.1e} {bits or ''} {'ok' if row['ok'] else 'FAIL'}",
                  flush=True)  # fmt: skip
    return failed, rows


def _bench_kwargs(q: torch.Tensor, splits: int, seq_len: int) -> dict[str, Any]:
    """``decode``'s keyword arguments in the bench (preallocated outputs and workspace)."""
    batch, heads = q.shape[:2]
    return {"softmax_scale": 0.1, "num_splits": splits, "max_seq_len": seq_len,
            "out": torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16),
            "lse": torch.empty(batch, heads, device="cuda", dtype=torch.float32),
            "workspace": torch.empty(64 << 20, dtype=torch.uint8, device="cuda")}  # fmt: skip


def _runs(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
    kw: dict[str, Any], names: list[str], dec: Decoder = decode, gluon: Any = GLUON_VARIANTS[0],
) -> dict[str, Any]:  # fmt: skip
    """The timed closures of one shape (``kw``: ``_bench_kwargs``; ``dec``: ``_decoder``'s):
    ``gluon_decode``'s kernel (``gluon``: its config) and each ws variant of ``names``."""
    runs: dict[str, Any] = {"gluon": lambda: dec(q, cache, table, lens, config=gluon, **kw)}
    for name in names:
        runs[name] = functools.partial(dec, q, cache, table, lens, config=BY_NAME[name], **kw)
    return runs


def _graph_and_host(run: Any, warmup: int, rep: int) -> dict[str, Any]:
    """``run``'s time as the replay of a CUDA graph of one call (``graph_ms``: no host work
    between the kernels, as vLLM's decode graphs run it) and the host's time to issue one
    call (``host_ms``: ten calls, no synchronization; a call whose ``host_ms`` reaches its
    ``ms`` is timed at the host's pace by ``do_bench``)."""
    import triton.testing

    t0 = time.perf_counter()
    for _ in range(10):
        run()
    host_ms = (time.perf_counter() - t0) * 100.0
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm on a side stream, as graph capture wants
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    except Exception as exc:  # recorded; the eager time stands
        return {"host_ms": host_ms, "graph_error": repr(exc)}
    return {"host_ms": host_ms, "graph_ms": ms}


def bench(
    warmup: int,
    rep: int,
    names: list[str],
    recipe: str = "none",
    graph: bool = False,
    shapes: tuple[str, ...] = BENCH_SHAPES,
    splits_override: int | None = None,
) -> list[dict[str, Any]]:
    """Median times at ``shapes`` (default the two long-context ones): the ws variants
    ``names``, gluon, FlashMLA (bf16, on the raw cache; ``recipe`` fp8-shadow: ours
    through its shadow); ``graph``: also each call replayed from a CUDA graph, and the
    host's issue time (``_graph_and_host``); ``splits_override``: this split count instead of
    the policy's (``decode_num_splits``)."""
    import triton.testing

    rows: list[dict[str, Any]] = []
    for shape in shapes:
        batch, heads, seq_len, _ = SHAPES[shape]
        q, cache, table, lens = make_inputs(shape, "cuda")
        splits = (
            decode_num_splits(batch, heads, seq_len, device=q.device, block_h=64)
            if splits_override is None
            else splits_override
        )
        kw = _bench_kwargs(q, splits, seq_len)
        out = kw["out"]
        dec = _decoder(recipe, cache)
        runs = _runs(q, cache, table, lens, kw, names, dec, _gluon(recipe))
        try:
            runs["flashmla"] = flashmla_run(q, cache, table, lens, 0.1)
        except Exception as exc:  # recorded, the run goes on
            rows.append({"shape": shape, "impl": "flashmla", "error": repr(exc)})
        base = dec(q, cache, table, lens, softmax_scale=0.1, num_splits=splits,
                   config=_gluon(recipe))[0].clone()  # fmt: skip
        for name, run in runs.items():
            t0 = time.time()
            try:
                run()
                torch.cuda.synchronize()
                agree = None
                if name != "flashmla":
                    agree = float((out.float() - base.float()).abs().max())
                ms = triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")
                timed = _graph_and_host(run, warmup, rep) if graph else {}
            except Exception as exc:
                rows.append({"shape": shape, "impl": name, "error": repr(exc)})
                continue
            if "graph_ms" in timed:
                timed["graph_tflops"] = flops(batch, heads, seq_len) / timed["graph_ms"] / 1e9
            rows.append({"shape": shape, "impl": name, "splits": splits, "ms": ms,
                         "tflops": flops(batch, heads, seq_len) / ms / 1e9,
                         "max_abs_diff_vs_gluon": agree, "wall_s": time.time() - t0,
                         **timed})  # fmt: skip
        fl = next((r for r in rows if r["shape"] == shape and r["impl"] == "flashmla"
                   and "ms" in r), None)  # fmt: skip
        del runs, dec  # the shadow's memory before the next shape
        torch.cuda.empty_cache()
        for r in rows:
            if r["shape"] == shape and "ms" in r and fl is not None:
                r["vs_flashmla"] = fl["ms"] / r["ms"]
                if "graph_ms" in r and "graph_ms" in fl:
                    r["graph_vs_flashmla"] = fl["graph_ms"] / r["graph_ms"]
            if r["shape"] == shape and "ms" in r:
                graphed = (f" | graph {r['graph_ms']:7.3f} ms {r['graph_tflops']:6.1f} TFLOP/s "
                           f"{r.get('graph_vs_flashmla', float('nan')):5.2f}x, host "
                           f"{r['host_ms']:.3f} ms a call") if "graph_ms" in r else ""  # fmt: skip
                print(f"{shape:17s} {r['impl']:26s} {r['ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s "
                      f"{r.get('vs_flashmla', float('nan')):5.2f}x FlashMLA "
                      f"diff {r.get('max_abs_diff_vs_gluon')}{graphed}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", choices=("check", "bench", "outputs", "compare"), required=True)
    parser.add_argument("--variants", default="",
                        help="comma-separated: bench, the ws variants to time (default: all); "
                        "outputs, the one producer (a variant, gluon or reference)")  # fmt: skip
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="none",
                        help="none: decode; fp8-shadow, nvfp4-shadow: decode_shadow on an "
                        "fp8 or nvfp4 shadow (plans outputs, compare, bench)")  # fmt: skip
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--graph", action="store_true",
                        help="bench: also time each call replayed from a CUDA graph, and the "
                        "host's time to issue one call")  # fmt: skip
    parser.add_argument("--shapes", default=",".join(BENCH_SHAPES),
                        help=f"outputs, bench: comma-separated shapes of {sorted(SHAPES)} "
                        "(the serving benchmark's 32k batch: b8-h128-L32768)")  # fmt: skip
    parser.add_argument(
        "--splits",
        type=int,
        default=None,
        help="bench: this split count at every shape (default: the policy's)",
    )
    parser.add_argument("out", help="output folder")
    args = parser.parse_args()
    shapes = tuple(n for n in args.shapes.split(",") if n)
    if not shapes or set(shapes) - set(SHAPES):
        parser.error(f"--shapes: {args.shapes!r}: pick from {sorted(SHAPES)}")
    if args.splits is not None and not 1 <= args.splits <= 64:
        parser.error(f"--splits: {args.splits}: 1 to 64")
    os.makedirs(args.out, exist_ok=True)
    named = [n for n in args.variants.split(",") if n]
    extra = {"gluon", "reference", *TWINS} if args.plan == "outputs" else set()
    unknown = set(named) - set(BY_NAME) - extra
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)} (known: {sorted(BY_NAME)})")
    if args.plan == "check" and args.recipe != "none":
        parser.error("--recipe: the check plan is recipe none's (use outputs and compare)")
    tag = _tag(args.recipe)
    if args.plan == "outputs":
        if len(named) != 1:
            parser.error("--variants: outputs takes one producer")
        outputs(named[0], args.out, args.recipe, shapes)
        return 0
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.plan in ("check", "compare"):
        failed, rows = check() if args.plan == "check" else compare(args.out, args.recipe)
        # the third variant is the chunked one's code with another register split: it
        # stands or falls with it
        if args.plan == "check" and VARIANTS[1].name in failed:
            failed.add(VARIANTS[2].name)
        result: dict[str, Any] = {"info": info, "failed": sorted(failed), "rows": rows}
        print("failed variants:", sorted(failed) or "none")
        passed = {r["config"] for r in rows} - failed
        code = 0 if passed else 1  # time what passed
        plan = "check"  # the file bench reads
    else:
        skip = set(SKIP)
        done = os.path.join(args.out, f"ws-check{tag}.json")
        if os.path.exists(done):
            with open(done) as f:
                skip |= set(json.load(f)["failed"])
        default = NV_CONFIGS if _v_section(args.recipe) else [c.name for c in VARIANTS]
        names = [n for n in (named or list(default)) if n not in skip]
        result = {"info": info, "skipped": sorted(skip),
                  "rows": bench(args.warmup_ms, args.rep_ms, names, args.recipe,
                                args.graph, shapes, args.splits)}  # fmt: skip
        code = 0
        plan = "bench"
    with open(os.path.join(args.out, f"ws-{plan}{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
