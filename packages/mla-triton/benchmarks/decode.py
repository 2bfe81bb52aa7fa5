"""Decode reading the raw cache ("on read"): ``mla_triton.decode`` against FlashMLA bf16 and
vLLM's Triton MLA, timed in the same process.

From the repository root, on a CUDA GPU (vLLM 0.33 importable for the anchors)::

    python packages/mla-triton/benchmarks/decode.py [--shapes b128-h128-L8192,...]
        [--recipes none,fp8,nvfp4] [--impl auto,flashmla,triton_mla] [--modes graph,eager]
        [--rounds 3] [--out CSV] [--dry-run]
    TRITON_INTERPRET=1 python packages/mla-triton/benchmarks/decode.py --smoke   # CPU

Per shape (``b<batch>-h<heads>-L<len>[-p<page>]``, page 64 by default: random bf16 q and
cache, every request at full length, the block table a random permutation of the pages)
and recipe (``AttentionQuant.uniform(fmt)``), each ``--impl``: ``auto`` (the shipped
dispatch), a forced implementation of ``mla_triton.tuning.IMPLS["decode"]`` (through
``tuning.use``; one that cannot take the call is skipped with a note), ``flashmla`` and
``triton_mla`` (recipe none, bf16). Calls are as vLLM makes them: workspace, out and lse
preallocated, ``max_seq_len`` given. Each mode (``graph``: replays of a CUDA graph of one
call; ``eager``) gives a row, and ``host`` rows the host's CPU time of an eager call.
``--baseline DIR``: another tree's ``mla_triton`` timed in this process (impl
``baseline``). Ratios: FlashMLA's time
over the row's, same mode. The first two requests of every case are checked against
``mla_reference``. Rows are appended to ``results/decode.csv``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch
from harness import (  # before mla_triton: --smoke sets TRITON_INTERPRET=1
    BASELINE,
    DECODE_ANCHORS,
    SCALE,
    Case,
    DecodeInputs,
    Shape,
    add_baseline,
    add_common,
    anchor_note,
    build,
    case_rows,
    check,
    checked_modes,
    decode_inputs,
    destination,
    environment,
    load_baseline,
    measure,
    parse_recipe,
    parse_shapes,
    precompile,
    prepare,
    reference_decode,
    split_list,
    write_rows,
)

import mla_triton
from mla_triton import tuning

OP = "decode"
SHAPES = "b128-h128-L8192,b128-h16-L8192,b8-h128-L32768,b32-h128-L32768"
SMOKE_SHAPE = Shape(2, 16, 80, 16)
OURS = ("auto", *tuning.IMPLS["decode"])
ANCHOR = "flashmla"
TOL = 1e-2  # relative L2 error against the oracle (bf16 output)


def ours(x: DecodeInputs, recipe: str, impl: str, module: Any = mla_triton) -> Case:
    """``module.decode`` as vLLM's backend calls it (``impl`` forced via ``tuning.use``;
    ``module``: this tree's ``mla_triton`` or, with impl ``baseline``, another tree's)."""
    quant, sparsity = parse_recipe(recipe)
    if sparsity is not None:
        raise SystemExit(f"--recipes: {recipe!r}: decode takes no sparsity")
    s, q = x.shape, x.q
    dev = q.device if q.device.type == "cuda" else None
    ws_bytes = module.decode_workspace_size(s.batch, s.heads, s.seq, device=dev)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
    out = torch.empty(s.batch, s.heads, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(s.batch, s.heads, dtype=torch.float32, device=q.device)

    def run() -> Any:
        return module.decode(
            q, x.cache, x.table, x.lens, softmax_scale=SCALE, quant=quant, workspace=ws,
            out=out, lse=lse, max_seq_len=s.seq,
        )  # fmt: skip

    def context() -> Any:
        return tuning.use(impl)

    return Case(recipe, impl, run, view=lambda r: r[0], flops=x.flops, nbytes=x.nbytes(),
                tokens=s.batch,
                **({} if impl in ("auto", BASELINE) else {"context": context}))  # fmt: skip


def compile_job(spec: tuple[Shape, str, str]) -> str:
    """One case's first call in a worker process (fills Triton's cache)."""
    shape, recipe, impl = spec
    case = ours(decode_inputs(shape, torch.device("cuda"), torch.bfloat16), recipe, impl)
    try:
        with case.context():
            case.run()
        torch.cuda.synchronize()
    except ValueError as exc:
        return f"{shape.name} {recipe} {impl}: refused ({exc})"[:200]
    return f"{shape.name} {recipe} {impl}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_common(parser, op=OP, shapes=SHAPES, recipes="none,fp8,nvfp4",
               impls="auto,flashmla,triton_mla", modes="graph,eager",
               impl_help=f"comma-separated of {', '.join((*OURS, *DECODE_ANCHORS))}")  # fmt: skip
    add_baseline(parser)
    args = parser.parse_args(argv)
    base = load_baseline(args.baseline) if args.baseline is not None else None
    base_note = f"baseline {args.baseline_label or args.baseline.name}" if base else ""
    impls = split_list(args.impl, (*OURS, *DECODE_ANCHORS), "impl")
    recipes = split_list(args.recipes, ("none", "fp8", "nvfp4"), "recipes")
    modes, shapes, rounds = checked_modes(args.modes), parse_shapes(args.shapes), args.rounds
    path, dry = destination(args, OP)
    if args.smoke:
        device, dtype, shapes, modes, rounds = (
            torch.device("cpu"),
            torch.float16,
            [SMOKE_SHAPE],
            ["eager"],
            1,
        )
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("decode.py: needs a CUDA GPU (or --smoke on the CPU)", file=sys.stderr)
        return 2
    env = environment(device)
    mine = [i for i in impls if i in OURS]
    anchors = [] if args.smoke else [i for i in impls if i in DECODE_ANCHORS]
    if device.type == "cuda":
        specs = [(s, r, i) for s in shapes for r in recipes for i in mine]
        precompile(compile_job, specs, args.jobs)
    ok = True
    for shape in shapes:
        print(f"== {shape.name}", flush=True)
        x = decode_inputs(shape, device, dtype)
        skipped: list[str] = []
        if args.smoke and any(i in DECODE_ANCHORS for i in impls):
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
        for name in anchors:
            cases += build(partial(DECODE_ANCHORS[name], x), name, skipped)
        cases = prepare(cases, skipped)
        measure(cases, modes, rounds, device, args.warmup_ms, args.rep_ms)
        for recipe in recipes:
            want = reference_decode(x, parse_recipe(recipe)[0])
            mine_r = [c for c in cases if c.recipe == recipe and c.impl in (*OURS, BASELINE)]
            ok &= check(mine_r, want, slice(0, 2), TOL)
            if recipe == "none":
                ok &= check([c for c in cases if c.impl in DECODE_ANCHORS], want, slice(0, 2), TOL)
        rows = case_rows(env, OP, shape.name, cases, modes, ANCHOR,
                         anchor_note(ANCHOR, impls, skipped), rounds)  # fmt: skip
        write_rows(rows, path, dry)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
