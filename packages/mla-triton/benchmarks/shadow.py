"""Decode through the quantized shadow: ``update_cache`` fills it, ``decode_shadow`` reads it;
against FlashMLA bf16 and vLLM's Triton MLA on the raw cache, timed in the same process.

From the repository root, on a CUDA GPU (vLLM 0.33 importable for the anchors)::

    python packages/mla-triton/benchmarks/shadow.py [--shapes b128-h128-L8192,...]
        [--recipes fp8,nvfp4] [--storage fp16,packed] [--impl auto,flashmla,triton_mla]
        [--modes graph,eager] [--rounds 3] [--out CSV] [--dry-run] [--no-update]
    TRITON_INTERPRET=1 python packages/mla-triton/benchmarks/shadow.py --smoke   # CPU

Per shape (as ``decode.py``: page 64, every request at full length, a permuted block
table) the raw cache and one shadow per recipe (``AttentionQuant.uniform(fmt)``) and
storage are written by ``update_cache`` from the same random latent; ``decode_shadow``
then runs as vLLM's backend calls it (workspace, out and lse preallocated,
``max_seq_len`` given), through ``auto`` or a forced implementation of
``mla_triton.tuning.IMPLS`` (``tuning.use``). Rows (op ``decode_shadow``) have recipe
``<fmt>-<storage>``; GB/s count the shadow's ``token_bytes`` per token; ratios are
FlashMLA's time over the row's, same mode. Unless ``--no-update``, rows of op
``update_cache`` time one decode step's write (one token per request, raw row and
shadow). The first two requests of every case are checked against ``mla_reference``
(the recipe on read from the raw cache). ``--baseline DIR``: another tree's
``mla_triton`` timed in this process (impl ``baseline``, on a shadow it wrote). Rows are
appended to ``results/shadow.csv``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch
from harness import (  # before mla_triton: --smoke sets TRITON_INTERPRET=1
    BASELINE,
    D_QK,
    D_V,
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

OP = "shadow"
SHAPES = "b128-h128-L8192,b128-h16-L8192,b8-h128-L32768,b32-h128-L32768"
SMOKE_SHAPE = Shape(2, 16, 80, 16)
OURS = ("auto", *tuning.IMPLS.get("shadow", tuning.IMPLS["decode"]))
STORAGES = ("fp16", "packed")
ANCHOR = "flashmla"
TOL = 1e-2  # relative L2 error against the oracle (bf16 output)
CHUNK = 1 << 16  # tokens a fill call writes


def fill(x: DecodeInputs, recipe: str, storage: str, module: Any = mla_triton) -> Any:
    """A shadow of ``recipe``/``storage`` and the raw cache, written by ``module``'s
    ``update_cache`` in position order from the same seeded latent every time."""
    quant, _ = parse_recipe(recipe)
    blocks, page = x.cache.shape[0], x.cache.shape[1]
    dev = x.cache.device
    shadow = module.allocate_shadow(blocks, page, quant, storage=storage, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    total = blocks * page
    for lo in range(0, total, CHUNK):
        n = min(CHUNK, total - lo)
        lat = torch.randn(n, D_QK, generator=g, device=dev).to(x.cache.dtype)
        slots = torch.arange(lo, lo + n, device=dev)
        module.update_cache(lat[:, :D_V], lat[:, D_V:], x.cache, slots, shadow,
                            quant=quant, storage=storage)  # fmt: skip
    return shadow


def ours(
    x: DecodeInputs, shadow: Any, recipe: str, storage: str, impl: str, module: Any = mla_triton
) -> Case:
    """``decode_shadow`` as vLLM's backend calls it (``impl`` forced via ``tuning.use``;
    ``module``: this tree's ``mla_triton`` or, with impl ``baseline``, another tree's,
    reading a shadow that tree wrote)."""
    quant, _ = parse_recipe(recipe)
    s, q = x.shape, x.q
    dev = q.device if q.device.type == "cuda" else None
    ws_bytes = module.decode_workspace_size(s.batch, s.heads, s.seq, device=dev)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
    out = torch.empty(s.batch, s.heads, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(s.batch, s.heads, dtype=torch.float32, device=q.device)
    token_bytes = module.shadow_layout(quant, storage=storage).token_bytes

    def run() -> Any:
        return module.decode_shadow(
            q, x.cache, shadow, x.table, x.lens, softmax_scale=SCALE, quant=quant,
            storage=storage, workspace=ws, out=out, lse=lse, max_seq_len=s.seq,
        )  # fmt: skip

    def context() -> Any:
        return tuning.use(impl)

    return Case(f"{recipe}-{storage}", impl, run, view=lambda r: r[0], flops=x.flops,
                nbytes=x.nbytes(token_bytes), tokens=s.batch,
                **({} if impl in ("auto", BASELINE) else {"context": context}))  # fmt: skip


def update_case(x: DecodeInputs, shadow: Any, recipe: str, storage: str) -> Case:
    """``update_cache`` of one decode step: one new token per request (its last slot)."""
    quant, _ = parse_recipe(recipe)
    s, dev = x.shape, x.cache.device
    g = torch.Generator(device=dev).manual_seed(2)
    lat = torch.randn(s.batch, D_QK, generator=g, device=dev).to(x.cache.dtype)
    last = s.seq - 1
    slots = x.table[:, last // s.page].long() * s.page + last % s.page
    token_bytes = mla_triton.shadow_layout(quant, storage=storage).token_bytes

    def run() -> None:
        mla_triton.update_cache(lat[:, :D_V], lat[:, D_V:], x.cache, slots, shadow,
                                quant=quant, storage=storage)  # fmt: skip

    return Case(f"{recipe}-{storage}", "auto", run, tokens=s.batch,
                nbytes=s.batch * (D_QK * x.cache.element_size() + token_bytes))  # fmt: skip


def compile_job(spec: tuple[Shape, str, str, str]) -> str:
    """One case's first call in a worker process (fills Triton's cache)."""
    shape, recipe, storage, impl = spec
    x = decode_inputs(shape, torch.device("cuda"), torch.bfloat16)
    case = ours(x, fill(x, recipe, storage), recipe, storage, impl)
    try:
        with case.context():
            case.run()
        torch.cuda.synchronize()
    except ValueError as exc:
        return f"{shape.name} {recipe}-{storage} {impl}: refused ({exc})"[:200]
    return f"{shape.name} {recipe}-{storage} {impl}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_common(parser, op=OP, shapes=SHAPES, recipes="fp8,nvfp4",
               impls="auto,flashmla,triton_mla", modes="graph,eager",
               impl_help=f"comma-separated of {', '.join((*OURS, *DECODE_ANCHORS))}")  # fmt: skip
    parser.add_argument("--storage", default="fp16,packed", help="fp16 and/or packed")
    parser.add_argument("--no-update", action="store_true", help="no update_cache rows")
    add_baseline(parser)
    args = parser.parse_args(argv)
    base = load_baseline(args.baseline) if args.baseline is not None else None
    base_note = f"baseline {args.baseline_label or args.baseline.name}" if base else ""
    impls = split_list(args.impl, (*OURS, *DECODE_ANCHORS), "impl")
    recipes = split_list(args.recipes, ("fp8", "nvfp4"), "recipes")
    storages = split_list(args.storage, STORAGES, "storage")
    modes, shapes, rounds = checked_modes(args.modes), parse_shapes(args.shapes), args.rounds
    path, dry = destination(args, OP)
    if args.smoke:
        device, dtype, shapes, modes, rounds = (
            torch.device("cpu"), torch.float16, [SMOKE_SHAPE], ["eager"], 1
        )  # fmt: skip
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("shadow.py: needs a CUDA GPU (or --smoke on the CPU)", file=sys.stderr)
        return 2
    env = environment(device)
    mine = [i for i in impls if i in OURS]
    anchors = [] if args.smoke else [i for i in impls if i in DECODE_ANCHORS]
    pairs = [(r, st) for r in recipes for st in storages]
    if device.type == "cuda":
        specs = [(s, r, st, i) for s in shapes for r, st in pairs for i in mine]
        precompile(compile_job, specs, args.jobs)
    ok = True
    for shape in shapes:
        print(f"== {shape.name}", flush=True)
        x = decode_inputs(shape, device, dtype)
        shadows = {pair: fill(x, *pair) for pair in pairs}
        base_shadows = {pair: fill(x, *pair, module=base) for pair in pairs} if base else {}
        skipped: list[str] = []
        if args.smoke and any(i in DECODE_ANCHORS for i in impls):
            skipped.append(f"{ANCHOR} not run: the smoke run has no CUDA GPU")
        cases: list[Case] = []
        for (recipe, storage), shadow in shadows.items():
            for impl in mine:
                make = partial(ours, x, shadow, recipe, storage, impl)
                cases += build(make, f"{impl} {recipe}-{storage}", skipped)
            if base is not None:
                make = partial(ours, x, base_shadows[recipe, storage], recipe, storage, BASELINE,
                               base)  # fmt: skip
                got = build(make, f"baseline {recipe}-{storage}", skipped)
                for case in got:
                    case.notes.append(base_note)
                cases += got
        for name in anchors:
            cases += build(partial(DECODE_ANCHORS[name], x), name, skipped)
        cases = prepare(cases, skipped)
        measure(cases, modes, rounds, device, args.warmup_ms, args.rep_ms)
        for recipe in recipes:
            want = reference_decode(x, parse_recipe(recipe)[0])
            mine_r = [c for c in cases if c.recipe.startswith(recipe + "-")]
            ok &= check(mine_r, want, slice(0, 2), TOL)
        if anchors:
            want = reference_decode(x, None)
            ok &= check([c for c in cases if c.impl in DECODE_ANCHORS], want, slice(0, 2), TOL)
        rows = case_rows(env, "decode_shadow", shape.name, cases, modes, ANCHOR,
                         anchor_note(ANCHOR, impls, skipped), rounds)  # fmt: skip
        if not args.no_update:  # after the checks: it overwrites each request's last token
            updates = [update_case(x, shadows[pair], *pair) for pair in pairs]
            updates = prepare(updates, skipped)
            measure(updates, modes, rounds, device, args.warmup_ms, args.rep_ms)
            rows += case_rows(env, "update_cache", shape.name, updates, modes, None, "", rounds)
        write_rows(rows, path, dry)
        del cases, shadows, base_shadows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
