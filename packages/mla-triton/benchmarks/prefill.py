"""Benchmark of ``mla_triton.prefill`` (varlen causal MLA prefill, 192/128, bf16).

Run on a CUDA GPU from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/prefill.py --out OUTDIR

Shapes (causal, queries = keys): b=4 h=128 L=4096; b=1 h=16 L=16384; a varlen
batch of mixed lengths totalling 16384 tokens at h=128. Recipes: quant none, fp8
on all four operands, nvfp4 on all four, nvfp4 + 2:4 sparsity, and two
ablations (nvfp4 on P alone; nvfp4 on Q, K, V with P unquantized). The baseline
is ``torch.nn.functional.scaled_dot_product_attention`` restricted to the flash
backend, V zero-padded to 192 (flash needs equal head dims), one call per
sequence for the varlen batch. Where vLLM's wheel is importable (its
FlashAttention-3, ``vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)``,
bf16, one varlen call) FA3 is timed in the same process too and every row gets its
ratio to it (``vs_fa3``); without vLLM that row is left out and noted. TFLOP/s count
``2 Lq Lk (192 + 128)`` per head, halved for causal, for every row (the baseline's
padding is not credited).

Ablations beside the four recipes (issue 17's bounds: what each part of a recipe costs
on its own, with ``auto``'s tiling for the P format it leaves): fp8 and nvfp4 on P
alone, fp8 and nvfp4 on Q, K, V with P unquantized, and 2:4 sparsity without
quantization.

The main table runs ``prefill(..., impl=IMPL)`` (``--impl``, default ``auto``: the
Gluon kernel on an sm90 GPU where it covers the recipe, see docs/gluon.md; the
tile sweep always the Triton kernel, ``PrefillConfig``).

Also measured: the K/V QDQ pass and Q's pass alone (fp8 and nvfp4), and a few tile
configurations. With
``--before SRC`` (a ``packages/mla-triton/src`` of another checkout, e.g. a git
worktree of the previous commit) the main table is timed for both versions in
this one process, interleaved, with the ratio after/before: that copy is imported
as ``mla_triton_before`` (its own imports renamed), with this checkout's
mla-formats. Every time is the
median of ``triton.testing.do_bench`` (rep 200 ms) on random inputs; the main
table is measured in ``--rounds`` passes round robin (default 2; ``ms`` and ``ms_2`` the
first two, ``ms_rounds`` all), a row's time the best of them.
Kernels are compiled first in parallel worker processes (Triton's cache is shared).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mla_formats import AttentionQuant, NMSparsity

DQK, DV = 192, 128
VARLEN = [8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1]
SHAPES: dict[str, tuple[list[int], int]] = {
    "b4-h128-L4096": ([4096] * 4, 128),
    "b1-h16-L16384": ([16384], 16),
    "varlen16k-h128": (VARLEN, 128),
}
RECIPES: dict[str, tuple[AttentionQuant | None, NMSparsity | None]] = {
    "none": (None, None),
    "fp8": (AttentionQuant.uniform("fp8"), None),
    "nvfp4": (AttentionQuant.uniform("nvfp4"), None),
    "nvfp4+2:4": (AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4)),
    "fp8-p-only": (AttentionQuant(p="fp8"), None),
    "fp8-qkv-only": (AttentionQuant(q="fp8", k="fp8", v="fp8"), None),
    "nvfp4-p-only": (AttentionQuant(p="nvfp4"), None),
    "nvfp4-qkv-only": (AttentionQuant(q="nvfp4", k="nvfp4", v="nvfp4"), None),
    "none+2:4": (None, NMSparsity(2, 4)),
}
# (block_m, block_n, num_warps, num_stages). default_config takes the first, or the
# second when P is nvfp4 (chosen from this sweep; see docs/benchmarks.md). The 64-row
# tiles with 4 warps and 2 stages fit two programs per SM (106 KB of shared memory,
# <= 255 registers), so one program's softmax can overlap the other's MMAs.
CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 2)]
SWEPT = ("none", "fp8", "nvfp4", "nvfp4+2:4")


@dataclass(frozen=True)
class Job:
    recipe: str
    config: tuple[int, int, int, int] | None = None
    before: bool = False  # the --before copy
    impl: str = "auto"  # prefill's impl (not passed to a --before copy)


def _inputs(lens: list[int], heads: int, seed: int = 0) -> dict[str, Any]:
    total = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, heads, DQK, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(total, heads, DQK, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(total, heads, DV, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "cu": cu.cuda(), "lens": lens, "max": max(lens)}


def _prefill_module(before: bool) -> Any:
    return importlib.import_module("mla_triton_before.prefill" if before else "mla_triton.prefill")


def _call(x: dict[str, Any], job: Job) -> Any:
    module = _prefill_module(job.before)
    quant, sparsity = RECIPES[job.recipe]
    config = module.PrefillConfig(*job.config) if job.config else None
    impl = {} if job.before else {"impl": "triton" if job.config else job.impl}
    return lambda: module.prefill(
        x["q"], x["k"], x["v"], x["cu"], x["cu"], softmax_scale=DQK**-0.5, causal=True,
        quant=quant, sparsity=sparsity, max_seqlen_q=x["max"], max_seqlen_k=x["max"],
        config=config, **impl,
    )  # fmt: skip


def _install_before(src: str, into: str) -> None:
    """Copy ``src/mla_triton`` to ``into/mla_triton_before`` with its imports renamed."""
    dst = Path(into) / "mla_triton_before"
    if not dst.exists():
        shutil.copytree(Path(src) / "mla_triton", dst)
        for path in dst.rglob("*.py"):
            text = path.read_text()
            path.write_text(re.sub(r"\bmla_triton\b", "mla_triton_before", text))
    if into not in sys.path:
        sys.path.insert(0, into)


def _warm(job: Job, before_dir: str | None = None) -> str:
    """Compile one job's kernels in a worker (same specializations as the real run)."""
    if before_dir is not None:
        _install_before(before_dir, before_dir + "-copy")
    t0 = time.time()
    # 256 tokens (the real shapes' divisibility by 16), longest > BLOCK_M (K/V prepass)
    x = _inputs([200, 56], 16)
    _call(x, job)()
    torch.cuda.synchronize()
    return f"{job} compiled in {time.time() - t0:.1f}s"


def _bench(fn: Any) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _tflops(lens: list[int], heads: int, ms: float) -> float:
    flop = sum(2.0 * n * n * (DQK + DV) / 2 for n in lens) * heads
    return flop / (ms * 1e-3) / 1e12


def _sdpa(x: dict[str, Any], heads: int) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    views = []
    for b, n in enumerate(x["lens"]):
        s = int(x["cu"][b])
        q = x["q"][s : s + n].transpose(0, 1)[None]
        k = x["k"][s : s + n].transpose(0, 1)[None]
        v = F.pad(x["v"][s : s + n], (0, DQK - DV)).transpose(0, 1)[None]
        views.append((q, k, v))

    def run() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for q, k, v in views:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DQK**-0.5)

    return run


def fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
        max_len: int) -> Any:  # fmt: skip
    """FlashAttention-3 (bf16, vLLM's wheel), causal, on the varlen batch ``cu`` (queries =
    keys); ImportError without vLLM. gluon_prefill.py times it too."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(
        q, k, v, max_len, cu, max_len, cu_seqlens_k=cu, softmax_scale=DQK**-0.5, causal=True,
        fa_version=3,
    )  # fmt: skip


def _kv_pass(x: dict[str, Any], quant: AttentionQuant) -> Any:
    """The K/V QDQ pass alone, as ``prefill`` launches it (fp16 factored outputs)."""
    from mla_triton.prefill import quantize_kv

    return lambda: quantize_kv(
        x["k"], x["v"], x["cu"], quant, max_seqlen_k=x["max"],
        k_dtype=torch.float16, v_dtype=torch.float16,
    )  # fmt: skip


def _q_pass(x: dict[str, Any], quant: AttentionQuant) -> Any:
    """Q's QDQ pass alone, as the Gluon launcher runs it (the K/V pass's K path)."""
    from mla_triton.prefill import quantize_kv

    only_q = AttentionQuant(k=quant.q)
    return lambda: quantize_kv(
        x["q"], x["q"], x["cu"], only_q, max_seqlen_k=x["max"], k_dtype=torch.float16
    )  # fmt: skip


def _q_in_kernel(quant: AttentionQuant, impl: str) -> bool:
    """Whether ``prefill(impl=impl)`` QDQs Q inside the Gluon kernel (no Q pass) here."""
    from mla_triton import gluon_prefill
    from mla_triton.prefill import Recipe

    on_sm90 = torch.cuda.get_device_capability() == (9, 0)
    if impl == "triton" or not on_sm90:
        return False
    recipe = Recipe.of(quant)
    return gluon_prefill.q_qdq_in_kernel(gluon_prefill.auto_config(recipe), recipe)


def _ceilings() -> dict[str, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = _bench(lambda: a @ a)
    buf = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    ms_cp = _bench(lambda: dst.copy_(buf))
    return {
        "bf16_matmul_tflops": 2 * 8192**3 / (ms_mm * 1e-3) / 1e12,
        "copy_tb_per_s": 2 * buf.numel() / (ms_cp * 1e-3) / 1e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for prefill-h200.json / .txt")
    parser.add_argument("--workers", type=int, default=8, help="parallel compile workers")
    parser.add_argument("--quick", action="store_true", help="main table only")
    parser.add_argument("--before", help="another checkout's packages/mla-triton/src: A/B")
    parser.add_argument("--impl", default="auto", choices=("auto", "triton", "gluon"),
                        help="prefill's impl for the main table (sm90: auto is Gluon)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2,
                        help="main table: passes over every call, round robin (>= 2)")  # fmt: skip
    args = parser.parse_args()
    if args.rounds < 2:
        raise ValueError(f"--rounds: expected at least 2, got {args.rounds}")

    jobs = [Job(r, impl=args.impl) for r in RECIPES]
    extra = [] if args.quick else [Job(r, config=c) for r in SWEPT for c in CONFIGS[1:]]
    before_dir = None
    if args.before:
        before_dir = tempfile.mkdtemp(prefix="prefill-before-")
        shutil.copytree(Path(args.before) / "mla_triton", Path(before_dir) / "mla_triton")
        _install_before(before_dir, before_dir + "-copy")
        extra += [Job(r, before=True) for r in RECIPES]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        warm = functools.partial(_warm, before_dir=before_dir)
        for line in pool.imap_unordered(warm, jobs + extra):
            print(line, flush=True)
    print(f"compiled {len(jobs + extra)} jobs in {time.time() - t0:.0f}s", flush=True)

    gpu = torch.cuda.get_device_name()
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
         "--format=csv,noheader"], capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    result: dict[str, Any] = {
        "device": gpu, "nvidia_smi": smi, "torch": torch.__version__,
        "triton": __import__("triton").__version__, "python": platform.python_version(),
        "ceilings": _ceilings(), "impl": args.impl, "rows": [], "kv_pass": [], "configs": [],
        "before": [], "rounds": args.rounds,
    }  # fmt: skip
    lines = [f"{gpu}  torch {torch.__version__}  triton {result['triton']}  ({smi})"]
    lines.append(f"ceilings: {result['ceilings']}")
    lines.append(
        f"{'shape':16s} {'recipe':15s} {'ms':>8s} {'ms_2':>8s} {'TFLOP/s':>8s} {'vs none':>8s}"
        "  vs FA3 (best of the rounds)"
    )
    for shape, (lens, heads) in SHAPES.items():
        x = _inputs(lens, heads)
        fns = {r: _call(x, Job(r, impl=args.impl)) for r in RECIPES}
        fns["sdpa-flash"] = _sdpa(x, heads)
        try:
            fns["fa3-bf16"] = fa3(x["q"], x["k"], x["v"], x["cu"], x["max"])
            fns["fa3-bf16"]()
        except ImportError as exc:
            fns.pop("fa3-bf16", None)
            lines.append(f"  no FA3 row: {exc!r}")
        passes = [{r: _bench(fn) for r, fn in fns.items()} for _ in range(args.rounds)]
        best = {r: min(p[r] for p in passes) for r in fns}
        for r in fns:
            row = {
                "shape": shape, "recipe": r, "ms": passes[0][r], "ms_2": passes[1][r],
                "ms_rounds": [p[r] for p in passes], "tflops": _tflops(lens, heads, best[r]),
                "slowdown_vs_none": best[r] / best["none"],
            }  # fmt: skip
            if "fa3-bf16" in best:
                row["vs_fa3"] = best["fa3-bf16"] / best[r]
            result["rows"].append(row)
            lines.append(
                f"{shape:16s} {r:15s} {passes[0][r]:8.3f} {passes[1][r]:8.3f} "
                f"{row['tflops']:8.1f} {row['slowdown_vs_none']:8.3f} "
                f"{row.get('vs_fa3', float('nan')):6.3f}x FA3"
            )
        # the K/V QDQ pass alone, within the fp8 and nvfp4 totals, and Q's pass (the Gluon
        # launcher's, within the total unless AUTO_CONFIGS' tiling QDQs Q in the kernel;
        # the Triton kernel quantizes Q in its prologue)
        for recipe in ("fp8", "nvfp4"):
            quant = RECIPES[recipe][0]
            assert quant is not None
            kv_ms, q_ms = _bench(_kv_pass(x, quant)), _bench(_q_pass(x, quant))
            in_kernel = _q_in_kernel(quant, args.impl)
            result["kv_pass"].append({"shape": shape, "recipe": recipe, "total_ms": best[recipe],
                                      "kv_pass_ms": kv_ms, "q_pass_ms": q_ms,
                                      "q_in_kernel": in_kernel})  # fmt: skip
            q_note = "not run: Q's QDQ is in the kernel" if in_kernel else "within the total"
            lines.append(f"  {recipe}: total {best[recipe]:.3f} ms, of which the K/V pass "
                         f"{kv_ms:.3f}; Q's pass alone {q_ms:.3f} ({q_note})")  # fmt: skip
        if args.before:  # interleaved: before, after, before, after
            for r in RECIPES:
                fns_ab = (_call(x, Job(r, before=True)), fns[r])
                ms_ab = [_bench(fns_ab[i % 2]) for i in range(4)]
                old, new = min(ms_ab[0::2]), min(ms_ab[1::2])
                result["before"].append({"shape": shape, "recipe": r, "before_ms": old,
                                         "after_ms": new, "ratio": new / old})  # fmt: skip
                lines.append(f"  before/after {r}: {old:.3f} -> {new:.3f} ms "
                             f"({new / old:.3f}x)")  # fmt: skip
        if not args.quick:
            for recipe in SWEPT:
                for c in CONFIGS:
                    fn = _call(x, Job(recipe, config=c))
                    ms = min(_bench(fn), _bench(fn))
                    result["configs"].append({"shape": shape, "recipe": recipe,
                                              "config": c, "ms": ms,
                                              "tflops": _tflops(lens, heads, ms)})  # fmt: skip
                    lines.append(f"  config {recipe} {c}: {ms:.3f} ms "
                                 f"{_tflops(lens, heads, ms):.1f} TFLOP/s")  # fmt: skip
        x, fns = {}, {}
        torch.cuda.empty_cache()
        _write(args.out, result, lines)  # after every shape: a cut-off run keeps its rows
    print("\n".join(lines))


def _write(out: str, result: dict[str, Any], lines: list[str]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "prefill-h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "prefill-h200.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
