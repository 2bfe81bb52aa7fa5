"""Varlen causal prefill (head dims 192/128): ``mla_triton.prefill`` against FlashAttention-3
bf16 (vLLM's wheel), timed in the same process.

From the repository root, on a CUDA GPU (vLLM 0.33 importable for the anchor)::

    python packages/mla-triton/benchmarks/prefill.py [--shapes b4-h128-L4096,...]
        [--recipes none,fp8,nvfp4,nvfp4+2:4] [--impl auto,fa3] [--modes eager]
        [--rounds 3] [--out CSV] [--dry-run]
    TRITON_INTERPRET=1 python packages/mla-triton/benchmarks/prefill.py --smoke   # CPU

Per shape (``b<sequences>-h<heads>-L<tokens each>``, queries = keys, causal, one varlen
batch; random bf16 q, k ``[T, H, 192]`` and v ``[T, H, 128]``) and recipe
(``AttentionQuant.uniform(fmt)``, ``+N:M`` adding ``NMSparsity(N, M)``), each ``--impl``:
``auto`` (the shipped dispatch), a forced implementation of
``mla_triton.tuning.IMPLS["prefill"]`` (``tuning.use``), ``fa3`` (recipe none, bf16);
with ``--baseline DIR``, also ``baseline``: another tree's ``mla_triton.prefill`` (its
auto dispatch) in the same process, to measure what a change costs.
TFLOP/s count ``2 (192 + 128) H L^2 / 2`` per sequence. Ratios: FA3's time over the
row's, same mode. The first 256 query rows of the first sequence are checked against
``mla_reference.prefill`` (causal rows depend on earlier keys only). Rows are appended
to ``results/prefill.csv``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from harness import (  # before mla_triton: --smoke sets TRITON_INTERPRET=1
    BASELINE,
    Case,
    Shape,
    add_baseline,
    add_common,
    anchor_note,
    build,
    case_rows,
    check,
    checked_modes,
    destination,
    environment,
    load_baseline,
    measure,
    parse_recipe,
    parse_shapes,
    precompile,
    prepare,
    split_list,
    write_rows,
)

import mla_reference
import mla_triton
from mla_triton import tuning

OP = "prefill"
SHAPES = "b4-h128-L4096,b1-h16-L16384,b16-h128-L1024"
SMOKE_SHAPE = Shape(2, 4, 48)
OURS = ("auto", *tuning.IMPLS["prefill"])
ANCHORS = ("fa3",)
ANCHOR = "fa3"
D_QK, D_V = 192, 128
SCALE = D_QK**-0.5
CHECK_ROWS = 256
TOL = 1e-2  # relative L2 error against the oracle (bf16 output)


@dataclass
class PrefillInputs:
    shape: Shape
    q: Any
    k: Any
    v: Any
    cu: Any

    @property
    def flops(self) -> float:
        s = self.shape
        return s.batch * 2.0 * (D_QK + D_V) * s.heads * s.seq * s.seq / 2


def prefill_inputs(shape: Shape, device: Any, dtype: Any, seed: int = 0) -> PrefillInputs:
    g = torch.Generator(device=device).manual_seed(seed)
    total = shape.batch * shape.seq

    def rand(width: int) -> Any:
        return torch.randn(total, shape.heads, width, generator=g, device=device, dtype=dtype)

    cu = torch.arange(0, total + 1, shape.seq, dtype=torch.int32, device=device)
    return PrefillInputs(shape, rand(D_QK), rand(D_QK), rand(D_V), cu)


def ours(x: PrefillInputs, recipe: str, impl: str, module: Any = mla_triton) -> Case:
    """``module.prefill`` (this tree's ``mla_triton``, or the baseline's with impl
    ``baseline``) with ``impl``'s dispatch."""
    quant, sparsity = parse_recipe(recipe)
    s = x.shape
    out = torch.empty(x.q.shape[0], s.heads, D_V, dtype=x.q.dtype, device=x.q.device)

    def run() -> Any:
        return module.prefill(
            x.q, x.k, x.v, x.cu, x.cu, softmax_scale=SCALE, causal=True, quant=quant,
            sparsity=sparsity, out=out, max_seqlen_q=s.seq, max_seqlen_k=s.seq,
        )  # fmt: skip

    def context() -> Any:
        return tuning.use(impl)

    return Case(recipe, impl, run, flops=x.flops, tokens=s.batch * s.seq,
                **({} if impl in ("auto", BASELINE) else {"context": context}))  # fmt: skip


def fa3(x: PrefillInputs) -> Case:
    """FlashAttention-3 bf16 (``vllm.vllm_flash_attn.flash_attn_varlen_func``, fa_version 3)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    n = x.shape.seq

    def run() -> Any:
        return flash_attn_varlen_func(
            x.q, x.k, x.v, n, x.cu, n, cu_seqlens_k=x.cu, softmax_scale=SCALE, causal=True,
            fa_version=3,
        )  # fmt: skip

    return Case("none", "fa3", run, flops=x.flops, tokens=x.shape.batch * n)


def reference(x: PrefillInputs, recipe: str, rows: int) -> Any:
    """``mla_reference.prefill`` on the first ``rows`` tokens of the first sequence."""
    quant, sparsity = parse_recipe(recipe)
    cu = torch.tensor([0, rows], dtype=torch.int32, device=x.q.device)
    return mla_reference.prefill(
        x.q[:rows], x.k[:rows], x.v[:rows], cu, cu, softmax_scale=SCALE, causal=True,
        quant=quant, sparsity=sparsity,
    )  # fmt: skip


def compile_job(spec: tuple[Shape, str, str]) -> str:
    shape, recipe, impl = spec
    case = ours(prefill_inputs(shape, torch.device("cuda"), torch.bfloat16), recipe, impl)
    try:
        with case.context():
            case.run()
        torch.cuda.synchronize()
    except ValueError as exc:
        return f"{shape.name} {recipe} {impl}: refused ({exc})"[:200]
    return f"{shape.name} {recipe} {impl}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_common(parser, op=OP, shapes=SHAPES, recipes="none,fp8,nvfp4,nvfp4+2:4",
               impls="auto,fa3", modes="eager",
               impl_help=f"comma-separated of {', '.join((*OURS, *ANCHORS))}")  # fmt: skip
    add_baseline(parser)
    args = parser.parse_args(argv)
    base = load_baseline(args.baseline) if args.baseline is not None else None
    base_note = f"baseline {args.baseline_label or args.baseline.name}" if base else ""
    impls = split_list(args.impl, (*OURS, *ANCHORS), "impl")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for recipe in recipes:
        parse_recipe(recipe)  # validates
    modes, shapes, rounds = checked_modes(args.modes), parse_shapes(args.shapes), args.rounds
    path, dry = destination(args, OP)
    if args.smoke:
        device, dtype, shapes, modes, rounds = (
            torch.device("cpu"), torch.float16, [SMOKE_SHAPE], ["eager"], 1
        )  # fmt: skip
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("prefill.py: needs a CUDA GPU (or --smoke on the CPU)", file=sys.stderr)
        return 2
    env = environment(device)
    mine = [i for i in impls if i in OURS]
    anchors = [] if args.smoke else [i for i in impls if i in ANCHORS]
    if device.type == "cuda":
        specs = [(s, r, i) for s in shapes for r in recipes for i in mine]
        precompile(compile_job, specs, args.jobs)
    ok = True
    for shape in shapes:
        print(f"== {shape.name}", flush=True)
        x = prefill_inputs(shape, device, dtype)
        skipped: list[str] = []
        if args.smoke and ANCHOR in impls:
            skipped.append(f"{ANCHOR} not run: the smoke run has no CUDA GPU")
        cases: list[Case] = []
        for recipe in recipes:
            for impl in mine:
                cases += build(partial(ours, x, recipe, impl), f"{impl} {recipe}", skipped)
            if base is not None:
                got = build(partial(ours, x, recipe, BASELINE, base), f"baseline {recipe}", skipped)
                for case in got:
                    case.notes.append(base_note)
                cases += got
        if "fa3" in anchors:
            cases += build(partial(fa3, x), "fa3", skipped)
        cases = prepare(cases, skipped)
        measure(cases, modes, rounds, device, args.warmup_ms, args.rep_ms)
        rows = min(CHECK_ROWS, shape.seq)
        for recipe in recipes:
            want = reference(x, recipe, rows)
            mine_r = [c for c in cases if c.recipe == recipe and c.impl in (*OURS, BASELINE)]
            ok &= check(mine_r, want, slice(0, rows), TOL)
            if recipe == "none":
                ok &= check([c for c in cases if c.impl in ANCHORS], want, slice(0, rows), TOL)
        out_rows = case_rows(env, OP, shape.name, cases, modes, ANCHOR,
                             anchor_note(ANCHOR, impls, skipped), rounds)  # fmt: skip
        write_rows(out_rows, path, dry)
        del cases, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
