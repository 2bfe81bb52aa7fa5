"""decode_shadow through the Gluon kernel: impl triton vs gluon vs FlashMLA bf16 (one process).

Shapes b128 h128 L8192 and b32 h128 L32768 (page 64, every request at full length,
benchmarks/decode.py's inputs), recipes fp8 and nvfp4 Q/K/P/V through the fp16 shadow
(fp8: V̂ = K̂, 64-token tiles; nvfp4: a V̂ section, 32-token tiles, the open V block
quantized in the kernel), plus decode on read for context (impl="auto"; for nvfp4 also
impl="gluon", K̂ in place and V̂ in a ring of its own), and FlashMLA
bf16 on the same cache with each recipe's rows. Median of triton.testing.do_bench;
TFLOP/s with FlashMLA's count. Checks the Gluon result against the Triton shadow
kernel (max row error, LSE) before timing.
Usage (repository root, an sm90 GPU, vLLM's wheel for FlashMLA):
``python packages/mla-triton/benchmarks/gluon_shadow.py OUTDIR [fp8] [nvfp4]`` (default
both; writes ``OUTDIR/shadow_gluon_bench.json``). Not run on a GPU yet.
``python packages/mla-triton/benchmarks/gluon_shadow.py --compile`` (any machine): the
Gluon variants these shadows run, compiled for sm_90a: shared memory, registers, spills.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).parent))
from decode import SHAPES, flashmla_run, flops, make_inputs  # the decode benchmark's inputs

from mla_formats import AttentionQuant
from mla_triton import allocate_shadow, decode, decode_shadow, update_cache
from mla_triton.decode import decode_num_splits, decode_workspace_size

RECIPES = {"fp8": AttentionQuant.uniform("fp8"), "nvfp4": AttentionQuant.uniform("nvfp4")}
SCALE = 0.1


def bench(fn: Any) -> float:
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


def row_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-3)).max())


def filled_shadow(cache: torch.Tensor, quant: AttentionQuant) -> torch.Tensor:
    """The fp16 shadow of every row of ``cache [blocks, page, 576]`` (``update_cache`` over
    all its slots; the raw rows are rewritten with their own values)."""
    shadow = allocate_shadow(cache.shape[0], cache.shape[1], quant, device=cache.device)
    flat = cache.reshape(-1, 576).clone()
    slots = torch.arange(flat.shape[0], device=cache.device, dtype=torch.int64)
    update_cache(flat[:, :512], flat[:, 512:], cache, slots, shadow, quant=quant)
    return shadow


def one(shape: str, recipe: str) -> dict[str, Any]:
    """Check and time one shape and recipe: the row of the JSON."""
    quant = RECIPES[recipe]
    batch, heads, seq, _ = SHAPES[shape]
    q, cache, table, lens = make_inputs(shape, "cuda")
    shadow = filled_shadow(cache, quant)
    splits = decode_num_splits(batch, heads, seq, device=q.device)
    size = decode_workspace_size(batch, heads, seq, num_splits=splits, device=q.device)
    kw: dict[str, Any] = {
        "softmax_scale": SCALE,
        "quant": quant,
        "num_splits": splits,
        "workspace": torch.empty(size, dtype=torch.uint8, device="cuda"),
        "out": torch.empty(batch, heads, 512, dtype=q.dtype, device="cuda"),
        "lse": torch.empty(batch, heads, dtype=torch.float32, device="cuda"),
    }

    def shadow_run(impl: str) -> Any:
        return lambda: decode_shadow(q, cache, shadow, table, lens, impl=impl, **kw)

    runs: dict[str, Any] = {f"shadow-{impl}": shadow_run(impl) for impl in ("triton", "gluon")}
    runs["on-read-auto"] = lambda: decode(q, cache, table, lens, impl="auto", **kw)
    if recipe == "nvfp4":  # auto is Triton here (GLUON_ON_READ_AUTO off): Gluon beside it
        runs["on-read-gluon"] = lambda: decode(q, cache, table, lens, impl="gluon", **kw)
    tri = [t.clone() for t in runs["shadow-triton"]()]
    glu = [t.clone() for t in runs["shadow-gluon"]()]
    check = {
        "max_row_err": row_err(glu[0], tri[0]),
        "max_lse_diff": float((glu[1] - tri[1]).abs().max()),
        "bit_identical_rows": float((glu[0] == tri[0]).all(-1).float().mean()),
        "finite": bool(torch.isfinite(glu[0]).all()),
    }
    print(f"{shape} {recipe}: gluon vs triton shadow {check}", flush=True)
    try:
        runs["flashmla-bf16"] = flashmla_run(q, cache, table, lens, SCALE)
    except Exception as exc:
        print(f"{shape}: flashmla unavailable: {exc}")
    times: dict[str, float] = {}
    for name, fn in runs.items():
        try:
            times[name] = bench(fn)
        except Exception as exc:
            print(f"{shape} {name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        tf = flops(batch, heads, seq) / times[name] / 1e9
        print(
            f"{shape:17s} {recipe:6s} {name:14s} {times[name]:8.3f} ms {tf:7.1f} TFLOP/s",
            flush=True,
        )
    row: dict[str, Any] = {
        "shape": shape,
        "recipe": recipe,
        "splits": splits,
        "check": check,
        "ms": times,
        "tflops": {k: flops(batch, heads, seq) / v / 1e9 for k, v in times.items()},
    }
    if "flashmla-bf16" in times:
        row["vs_flashmla"] = {k: times["flashmla-bf16"] / v for k, v in times.items()}
    if "shadow-triton" in times and "shadow-gluon" in times:
        row["gluon_over_triton"] = times["shadow-triton"] / times["shadow-gluon"]
    return row


def main(out_dir: str, recipes: list[str]) -> None:
    """Every recipe and shape; the JSON is rewritten after each row (a time limit that
    stops the run keeps the rows done)."""
    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    rows = []
    for recipe in recipes:
        for shape in ("b128-h128-L8192", "b32-h128-L32768"):
            rows.append(one(shape, recipe))
            torch.cuda.empty_cache()
            with open(f"{out_dir}/shadow_gluon_bench.json", "w") as f:
                json.dump({"info": info, "recipes": "uniform, fp16 shadow", "rows": rows}, f,
                          indent=1)  # fmt: skip
            r = rows[-1]
            print(
                r["shape"],
                r["recipe"],
                {k: round(v, 3) for k, v in r.get("vs_flashmla", {}).items()},
                "gluon/triton",
                round(r.get("gluon_over_triton", float("nan")), 3),
                flush=True,
            )


def compile_stats() -> None:
    """Each recipe's Gluon shadow variant (bf16, page 64, two splits) for sm_90a, printed."""
    import re

    from mla_triton.gluon_decode import (
        SEPARATE_V_CONFIG,
        GluonRecipe,
        compile_variant,
        gluon_decode_config,
    )
    from mla_triton.shadow import gluon_shadow_recipe, shadow_layout

    for name, quant in RECIPES.items():
        recipe = gluon_shadow_recipe(quant, shadow_layout(quant), torch.bfloat16)
        assert isinstance(recipe, GluonRecipe), recipe
        cfg = SEPARATE_V_CONFIG if recipe.v_sep else gluon_decode_config(128)
        c = compile_variant(cfg, num_splits=2, recipe=recipe)
        regs = re.search(r"Used (\d+) registers", c.ptxas_info)
        spills = "0 bytes spill stores, 0 bytes spill loads" not in c.ptxas_info
        bars = len(re.findall(r"\bbar\.sync\b", c.ptx))
        print(f"{name} {cfg.name}: shared {c.shared} B, registers {regs and regs.group(1)}, "
              f"spills {spills}, bar.sync {bars}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        compile_stats()
        raise SystemExit(0)
    names = sys.argv[2:] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"recipes: expected some of {list(RECIPES)}, got {unknown}")
    main(sys.argv[1], names)
