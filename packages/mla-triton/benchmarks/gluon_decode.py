"""Check and time the Gluon sm90 decode (unquantized) against the oracle, the Triton
decode and (``--flashmla``) FlashMLA bf16 from vLLM's wheel, in one process.

Run on an H200 from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/gluon_decode.py --out OUTDIR [--flashmla]

Correctness (``--plan check`` or ``all``): random bf16 inputs (q scaled by 0.5, the
block table a random permutation of pages), ``mla_reference.decode`` in float64 on
the GPU (no QDQ in this recipe, so the GPU oracle is exact enough) and
``mla_triton.decode``; per case the max row error ``max|o - r| / max|r|`` (the
metric of test_decode_gpu.py), the relative L2 error, and the LSE's max abs error.
Every case runs in its own try/except; a failure prints its traceback and the run
goes on. Timing (``--plan bench`` or ``all``): the median of
``triton.testing.do_bench`` per shape, TFLOP/s counted as FlashMLA does
(``2 H L (576 + 512)`` per request). JSON goes to ``OUTDIR/gluon_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from mla_formats import AttentionQuant

SCALE = 576**-0.5
ROW_TOL = 1.5e-2  # P in bf16 for the dot: test_decode_gpu.TOL_P_BF16
LSE_TOL = 2e-5

# (name, batch, heads, lens (None: all at L; "rand": uniform in [1, L]), L, page,
# num_splits (None: the policy)). Split counts stay within {1, 2, 3, 4}, the bench's
# too: each is a compile of both kernels.
CHECKS: list[tuple[str, int, int, list[int] | str | None, int, int, int | None]] = [
    ("b1-h128-L1", 1, 128, None, 1, 64, 1),
    ("b1-h16-L8192-s4", 1, 16, None, 8192, 64, 4),
    ("b4-h128-mixed", 4, 128, [1, 65, 1000, 4097], 0, 64, 1),
    ("b4-h128-mixed-s3", 4, 128, [0, 63, 1000, 4097], 0, 64, 3),
    ("b4-h16-mixed-s3", 4, 16, [17, 64, 129, 8191], 0, 64, 3),
    ("b32-h128-rand", 32, 128, "rand", 8192, 64, None),
    ("b32-h16-rand-s4", 32, 16, "rand", 8192, 64, 4),
    ("b4-h20-page16-s3", 4, 20, [15, 16, 300, 2049], 0, 16, 3),
    ("b4-h128-page128", 4, 128, [17, 300, 2049, 5000], 0, 128, 1),
]
# fp8 (q̂, K̂ = V̂, P̂ of AttentionQuant.uniform("fp8")): a CPU oracle (a quantized q's
# global scale divides as the SPEC says only there: test_decode_gpu.py), so small cases.
CHECKS_FP8: list[tuple[str, int, int, list[int] | str | None, int, int, int | None]] = [
    ("fp8-b4-h128-mixed", 4, 128, [1, 65, 1000, 4097], 0, 64, 1),
    ("fp8-b4-h16-mixed-s3", 4, 16, [0, 64, 129, 2049], 0, 64, 3),
]
RECIPES: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
}
PHASE_SHARES = {("none", "check"): 4.0, ("none", "bench"): 3.0, ("fp8", "check"): 1.5,
                ("fp8", "bench"): 2.0}  # fmt: skip
"""Relative time budget of each (recipe, phase)."""
BENCH: list[tuple[str, int, int, int]] = [
    ("b128-h128-L8192", 128, 128, 8192),
    ("b32-h128-L32768", 32, 128, 32768),
    ("b128-h16-L8192", 128, 16, 8192),
]


def make_inputs(
    lens: list[int], heads: int, page: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, H, 576]``, cache ``[pages, page, 576]`` (bf16), table, seq_lens (int32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    used = [max(1, -(-n // page)) for n in lens]
    total = sum(used) + 2
    gpu = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(total, page, 576, generator=gpu, device="cuda").to(torch.bfloat16)
    pages = torch.randperm(total, generator=g)
    table = torch.zeros(len(lens), max(used), dtype=torch.int32)
    k = 0
    for b, n in enumerate(used):
        table[b, :n] = pages[k : k + n]
        k += n
    q = (torch.randn(len(lens), heads, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, cache, table.cuda(), seq


def compare(
    out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, rlse: torch.Tensor
) -> dict[str, Any]:
    """Errors of ``(out, lse)`` against ``(ref, rlse)``; rows with an infinite ref LSE
    (empty requests) must be out 0 and LSE -inf."""
    empty = torch.isinf(rlse)
    full = ~empty
    o, r = out.double(), ref.double()
    row = ((o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-3))[full]
    diff = (o - r)[full]
    return {
        "finite": bool(torch.isfinite(out).all()),
        "empty_ok": bool(torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()),
        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "rel_l2": float(diff.norm() / r[full].norm().clamp_min(1e-30)) if diff.numel() else 0.0,
        "max_row_err": float(row.max()) if row.numel() else 0.0,
        "n_rows": int(row.numel()),
        "n_rows_over_4e-3": int((row > 4e-3).sum()),
        "lse_max_abs": float((lse[full].double() - rlse[full].double()).abs().max())
        if row.numel()
        else 0.0,
    }


def _ok(e: dict[str, Any], p_quantized: bool = False) -> bool:
    """test_decode_gpu.py's bounds: P in bf16 rows 1.5e-2; P quantized (exact products)
    rows 4e-3 but for at most 2% of them (a P code next to a midpoint may flip), < 0.5."""
    if p_quantized:
        rows = e["n_rows_over_4e-3"] <= max(1, int(0.02 * e["n_rows"])) and e["max_row_err"] <= 0.5
    else:
        rows = e["max_row_err"] <= ROW_TOL
    return bool(e["finite"] and e["empty_ok"] and rows and e["lse_max_abs"] <= LSE_TOL)


def _case_lens(ci: int, batch: int, lens: list[int] | str | None, length: int) -> list[int]:
    if lens == "rand":
        g = torch.Generator().manual_seed(ci)
        return [int(x) for x in torch.randint(1, length + 1, (batch,), generator=g)]
    return list(lens) if isinstance(lens, list) else [length] * batch


def _check_case(
    ci: int, case: tuple[str, int, int, list[int] | str | None, int, int, int | None],
    deadline: float, quant: AttentionQuant | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """One case: the oracle and the Triton decode once, then every Gluon variant."""
    import mla_reference
    from mla_triton.decode import decode
    from mla_triton.gluon_decode import VARIANTS

    name, batch, heads, lens, length, page, splits = case
    q, cache, table, seq = make_inputs(_case_lens(ci, batch, lens, length), heads, page, ci)
    if quant is None:
        ref, rlse = mla_reference.decode(
            q, cache, table, seq, softmax_scale=SCALE, compute_dtype=torch.float64
        )
    else:
        ref, rlse = mla_reference.decode(
            q.cpu(), cache.cpu(), table.cpu(), seq.cpu(), softmax_scale=SCALE, quant=quant
        )
        ref, rlse = ref.to(q.device), rlse.to(q.device)
    tri, tlse = decode(
        q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits, impl="triton"
    )
    p_quantized = quant is not None and not quant.p.is_identity
    triton_err = compare(tri, tlse, ref, rlse)
    results: list[dict[str, Any]] = []
    for cfg in VARIANTS:
        rec: dict[str, Any] = {"case": name, "config": cfg.name, "triton_vs_reference": triton_err}
        results.append(rec)
        if time.monotonic() > deadline:
            rec["status"] = "not run: time budget spent"
            print(f"{name:22s} {cfg.name:12s} NOT RUN (budget)", flush=True)
            continue
        try:
            t0 = time.monotonic()
            out, lse = decode(
                q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits,
                config=cfg,
            )  # fmt: skip
            torch.cuda.synchronize()
            rec["gluon_first_call_s"] = round(time.monotonic() - t0, 2)
            rec["vs_reference"] = e = compare(out, lse, ref, rlse)
            rec["vs_triton"] = compare(out, lse, tri, tlse)
            rec["status"] = "pass" if _ok(e, p_quantized) else "FAIL"
            print(
                f"{name:22s} {cfg.name:12s} {rec['status']:4s} row {e['max_row_err']:.2e} "
                f"relL2 {e['rel_l2']:.2e} maxabs {e['max_abs']:.2e} lse {e['lse_max_abs']:.1e} "
                f"| vs triton row {rec['vs_triton']['max_row_err']:.2e} "
                f"| triton row {triton_err['max_row_err']:.2e}",
                flush=True,
            )
        except Exception as exc:  # one variant's failure must not end the run
            rec["status"] = "ERROR"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()
            print(f"{name:22s} {cfg.name:12s} ERROR\n{rec['traceback']}", flush=True)
    return results


def run_checks(
    deadline: float, recipe: str = "none", results: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every case of ``CHECKS`` (``CHECKS_FP8`` for fp8) into ``results`` (one try/except
    a case, one a variant)."""
    results = [] if results is None else results
    quant = RECIPES[recipe]
    for ci, case in enumerate(CHECKS if quant is None else CHECKS_FP8):
        if time.monotonic() > deadline:
            results.append({"case": case[0], "status": "not run: time budget spent"})
            print(f"{case[0]:22s} NOT RUN (budget)", flush=True)
            continue
        try:
            for rec in _check_case(ci, case, deadline, quant):
                rec["recipe"] = recipe
                results.append(rec)
        except Exception as exc:  # the oracle, the Triton decode or the inputs failed
            tb = traceback.format_exc()
            results.append(
                {"case": case[0], "recipe": recipe, "status": "ERROR", "error": str(exc),
                 "traceback": tb}
            )  # fmt: skip
            print(f"{case[0]:22s} ERROR (inputs, oracle or Triton)\n{tb}", flush=True)
    return results


def flops(batch: int, heads: int, seq: int) -> float:
    return 2.0 * batch * heads * seq * (576 + 512)


def _bench_shape(
    rec: dict[str, Any], batch: int, heads: int, length: int, deadline: float,
    with_flashmla: bool, quant: AttentionQuant | None,
) -> None:  # fmt: skip
    """Time every implementation at one shape into ``rec["timings"]``."""
    import triton

    from mla_triton.decode import decode, decode_num_splits, decode_workspace_size
    from mla_triton.gluon_decode import VARIANTS, GluonDecodeConfig

    q, cache, table, seq = make_inputs([length] * batch, heads, 64, seed=7)
    timings: dict[str, Any] = {}
    rec["timings"] = timings
    nbytes = decode_workspace_size(batch, heads, length, device=q.device)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    out = torch.empty(batch, heads, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)

    def triton_run() -> tuple[torch.Tensor, torch.Tensor]:
        return decode(
            q, cache, table, seq, softmax_scale=SCALE, quant=quant, workspace=ws, out=out,
            lse=lse, check_values=False, impl="triton",
        )  # fmt: skip

    runs: dict[str, Any] = {"triton": triton_run}
    # the Gluon kernel through decode (config= picks the variant) on preallocated buffers
    rec["gluon_splits"] = decode_num_splits(batch, heads, length, device=q.device, block_h=64)
    o_g = torch.empty_like(out)
    l_g = torch.empty_like(lse)

    def gluon_run(cfg: GluonDecodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return decode(
            q, cache, table, seq, softmax_scale=SCALE, quant=quant, workspace=ws, out=o_g,
            lse=l_g, check_values=False, config=cfg,
        )  # fmt: skip

    for cfg in VARIANTS:
        runs[f"gluon-{cfg.name}"] = lambda cfg=cfg: gluon_run(cfg)
    if with_flashmla and quant is None:
        try:
            from decode import flashmla_run  # benchmarks/decode.py (this script's folder)

            runs["flashmla"] = flashmla_run(q, cache, table, seq, SCALE)
        except Exception as exc:
            timings["flashmla"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(traceback.format_exc(), flush=True)
    ref_out: torch.Tensor | None = None
    for key, fn in runs.items():
        if PROFILE["only"] and key != PROFILE["only"]:
            continue
        if PROFILE["on"]:  # under a profiler: three plain launches, no timing loop
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            timings[key] = {"status": "profiled: 3 launches"}
            continue
        if time.monotonic() > deadline:
            timings[key] = {"status": "not run: time budget spent"}
            continue
        try:
            o = fn()[0].reshape(batch, heads, 512).double()
            torch.cuda.synchronize()
            if ref_out is None:
                ref_out = o
            rows = (o - ref_out).abs().amax(-1) / ref_out.abs().amax(-1).clamp_min(1e-3)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            timings[key] = {
                "ms": ms,
                "tflops": rec["flops"] / (ms * 1e-3) / 1e12,
                "max_row_err_vs_triton": float(rows.max()),
            }
        except Exception as exc:
            tb = traceback.format_exc()
            timings[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}
            print(f"{rec['shape']} {key} ERROR\n{tb}", flush=True)
    base_key = "flashmla" if "ms" in timings.get("flashmla", {}) else "triton"
    base = timings.get(base_key, {}).get("ms")
    for key, t in timings.items():
        if "ms" in t:
            ratio = f" ({base / t['ms']:.2f}x {base_key})" if base else ""
            print(
                f"{rec['shape']:18s} {key:18s} {t['ms']:8.3f} ms {t['tflops']:7.1f} TFLOP/s "
                f"row-vs-triton {t['max_row_err_vs_triton']:.1e}{ratio}",
                flush=True,
            )


PROFILE: dict[str, Any] = {"on": False, "only": None, "shapes": None}
"""``--profile``, ``--only`` and ``--shapes``: set by ``main``."""


def run_bench(
    deadline: float, with_flashmla: bool, recipe: str = "none",
    results: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every shape of ``BENCH`` with ``recipe`` into ``results`` (FlashMLA: quant none)."""
    results = [] if results is None else results
    for name, batch, heads, length in BENCH:
        if PROFILE["shapes"] and name not in PROFILE["shapes"]:
            continue
        rec: dict[str, Any] = {
            "shape": name,
            "recipe": recipe,
            "flops": flops(batch, heads, length),
        }
        results.append(rec)
        if time.monotonic() > deadline:
            rec["status"] = "not run: time budget spent"
            print(f"{name}: NOT RUN (budget)", flush=True)
            continue
        try:
            _bench_shape(rec, batch, heads, length, deadline, with_flashmla, RECIPES[recipe])
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
            print(traceback.format_exc(), flush=True)
        torch.cuda.empty_cache()
    return results


def compile_report() -> list[dict[str, Any]]:
    """Every variant and recipe compiled for sm_90a here (no GPU needed): shared memory,
    registers, wgmma instructions and barriers in the PTX (bf16, page 64, two splits)."""
    import re

    from mla_triton.gluon_decode import VARIANTS, GluonRecipe, compile_variant, gluon_recipe

    rows = []
    for (name, quant), cfg in [(r, v) for r in RECIPES.items() for v in VARIANTS]:
        recipe = gluon_recipe(quant)
        assert isinstance(recipe, GluonRecipe), recipe
        c = compile_variant(cfg, num_splits=2, recipe=recipe)
        regs = re.search(r"Used (\d+) registers", c.ptxas_info)
        wgmma: dict[str, int] = {}
        for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", c.ptx):
            wgmma[m] = wgmma.get(m, 0) + 1
        row = {
            "config": cfg.name,
            "recipe": name,
            "shared_bytes": c.shared,
            "registers": int(regs.group(1)) if regs else None,
            "spills": "0 bytes spill stores, 0 bytes spill loads" not in c.ptxas_info,
            "serialized_wgmma_C7515": "C7515" in c.ptxas_info,
            "wgmma": wgmma,
            "bar_sync": len(re.findall(r"\bbar\.sync\b", c.ptx)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", choices=("check", "bench", "all", "compile"), default="all")
    ap.add_argument("--out", default=None, help="directory for gluon_decode.json")
    ap.add_argument("--flashmla", action="store_true", help="time FlashMLA bf16 too (vLLM)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop starting cases after this")
    ap.add_argument("--recipes", default="none", help="comma-separated: none, fp8")
    ap.add_argument("--shapes", default="", help="bench shapes to run (default: all of BENCH)")
    ap.add_argument("--only", default="", help="one implementation (triton, gluon-bn64-st2, ...)")
    ap.add_argument(
        "--profile", action="store_true", help="no timing loop: 3 launches each (for ncu)"
    )
    args = ap.parse_args(argv)
    PROFILE.update(
        on=args.profile,
        only=args.only or None,
        shapes=[x for x in args.shapes.split(",") if x] or None,
    )
    start = time.monotonic()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception as exc:
        report["triton"] = f"import failed: {exc}"
    print(json.dumps(report), flush=True)
    if args.plan == "compile":
        report["compile"] = compile_report()
    out_dir = args.out or os.environ.get("OUT")

    def save() -> None:  # after every phase: a run killed at its time limit keeps the rest
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "gluon_decode.json"), "w") as f:
                json.dump(report, f, indent=1)

    recipes = [r for r in args.recipes.split(",") if r]
    checks: list[dict[str, Any]] = report.setdefault("checks", [])
    bench: list[dict[str, Any]] = report.setdefault("bench", [])
    # the budget in shares per recipe and phase (checks, then timings), in order; time a
    # phase leaves unused goes to the next ones
    phases = [(r, ph) for r in recipes for ph in ("check", "bench")
              if args.plan in (ph, "all")]  # fmt: skip
    shares = [PHASE_SHARES.get((r, ph), 1.0) for r, ph in phases]
    for k, (recipe, phase) in enumerate(phases):
        until = start + args.budget_s * sum(shares[: k + 1]) / sum(shares)
        if phase == "check":
            run_checks(until, recipe, checks)
        else:
            run_bench(until, args.flashmla, recipe, bench)
        save()
    report["wall_s"] = round(time.monotonic() - start, 1)
    bad = [c for c in report.get("checks", []) if c.get("status") != "pass"]
    print(f"checks: {len(report.get('checks', [])) - len(bad)} pass, {len(bad)} not passed; "
          f"wall {report['wall_s']} s", flush=True)  # fmt: skip
    save()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
