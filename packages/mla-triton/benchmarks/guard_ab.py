"""A/B timing of ``decode`` and ``decode_shadow`` against a baseline copy, in one process.

Measures what a change to the kernels costs (issue 13: the NaN rule and the page
guards) without the noise of separate processes: the baseline is a copy of an
older ``mla_triton`` renamed ``mla_triton_base`` (``--base`` adds its folder to
``sys.path``); both run on the same random bf16 inputs, alternating, and each
timing is a ``triton.testing.do_bench`` median. Kernels are compiled first by a
pool of processes (Triton's disk cache), then timed in the main process. Also
prints the largest difference between the two outputs (0 when the change leaves
clean inputs' bits alone). Run on a CUDA GPU from the repository root::

    cp -r <old checkout>/packages/mla-triton/src/mla_triton /tmp/base/mla_triton_base
    sed -i 's/mla_triton/mla_triton_base/g' $(find /tmp/base -name '*.py')
    PYTHONPATH=packages/mla-formats/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/guard_ab.py --base /tmp/base --out OUTDIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from mla_formats import AttentionQuant

SHAPES: dict[str, tuple[int, int, int, int]] = {  # batch, heads, seq len, page size
    "b128-h128-L8192": (128, 128, 8192, 64),
    "b32-h128-L32768": (32, 128, 32768, 64),
    "b128-h16-L8192": (128, 16, 8192, 64),
}
CASES: list[tuple[str, str, str]] = [  # (kind, recipe, storage)
    ("decode", "none", ""),
    ("decode", "fp8", ""),
    ("decode", "nvfp4", ""),
    ("shadow", "fp8", "fp16"),
    ("shadow", "nvfp4", "fp16"),
    ("shadow", "nvfp4", "packed"),
]
IMPLS: tuple[str, ...] = ("mla_triton_base", "mla_triton")


def recipe(name: str) -> AttentionQuant | None:
    return None if name == "none" else AttentionQuant.uniform(name)


def make_inputs(shape: str, seed: int = 0) -> dict[str, Any]:
    batch, heads, length, page = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch * (length // page)
    cache = torch.randn(pages + 1, page, 576, device="cuda", generator=g).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=g).view(batch, -1).int()
    q = (torch.randn(batch, heads, 576, device="cuda", generator=g) * 0.5).bfloat16()
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    return {"q": q, "cache": cache, "table": table, "lens": lens}


def build(impl: str, kind: str, rec: str, storage: str, x: dict[str, Any]) -> Any:
    """A closure running one decode (the shadow, if any, written once here)."""
    mod = importlib.import_module(impl)
    quant = recipe(rec)
    common = {"softmax_scale": 0.0625, "max_seq_len": int(x["lens"].max())}
    if kind == "decode":
        return lambda: mod.decode(x["q"], x["cache"], x["table"], x["lens"], quant=quant, **common)
    assert quant is not None
    cache = x["cache"]
    shadow = mod.allocate_shadow(cache.shape[0], cache.shape[1], quant, storage=storage,
                                 device="cuda")  # fmt: skip
    rows = cache.view(-1, 576)
    slots = torch.arange(rows.shape[0], device="cuda")
    mod.update_cache(rows[:, :512], rows[:, 512:], cache, slots, shadow, quant=quant,
                     storage=storage)  # fmt: skip
    return lambda: mod.decode_shadow(x["q"], cache, shadow, x["table"], x["lens"], quant=quant,
                                     storage=storage, **common)  # fmt: skip


def _compile(job: tuple[Any, ...]) -> str:
    global SHAPES
    base, impl, shape, kind, rec, storage, _, _, SHAPES = job
    sys.path.insert(0, base)
    x = make_inputs(shape)
    build(impl, kind, rec, storage, x)()
    torch.cuda.synchronize()
    return f"{impl} {shape} {kind} {rec} {storage}"


def main() -> None:
    global IMPLS, CASES, SHAPES
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="folder holding mla_triton_base")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--extra", action="append", default=[], help="another renamed copy")
    parser.add_argument("--case", action="append", default=None, help="KIND:RECIPE:STORAGE")
    parser.add_argument("--shape", action="append", default=None, choices=sorted(SHAPES))
    args = parser.parse_args()
    sys.path.insert(0, args.base)
    IMPLS = (*IMPLS, *args.extra)
    if args.case:
        CASES = [(k, r, s) for k, r, s in (c.split(":") for c in args.case)]
    if args.shape:
        SHAPES = {k: SHAPES[k] for k in args.shape}
    import triton

    jobs = [
        (args.base, impl, shape, kind, rec, storage, IMPLS, CASES, SHAPES)
        for shape in SHAPES
        for kind, rec, storage in CASES
        for impl in IMPLS
    ]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for done in pool.imap_unordered(_compile, jobs):
            print("compiled", done, flush=True)

    rows = []
    for shape in SHAPES:
        x = make_inputs(shape)
        for kind, rec, storage in CASES:
            fns = {impl: build(impl, kind, rec, storage, x) for impl in IMPLS}
            outs = {impl: fn()[0].float() for impl, fn in fns.items()}
            diff = float((outs["mla_triton"] - outs["mla_triton_base"]).abs().max())
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for _ in range(args.rounds):
                for impl in IMPLS:
                    times[impl].append(
                        triton.testing.do_bench(fns[impl], warmup=args.warmup_ms,
                                                rep=args.rep_ms, return_mode="median")
                    )  # fmt: skip
            base_ms = statistics.median(times["mla_triton_base"])
            new_ms = statistics.median(times["mla_triton"])
            others = {impl: statistics.median(times[impl]) / base_ms for impl in IMPLS[2:]}
            row = {
                "shape": shape, "kind": kind, "recipe": rec, "storage": storage,
                "base_ms": base_ms, "new_ms": new_ms, "new_over_base": new_ms / base_ms,
                "max_abs_diff": diff, "times": times, "others_over_base": others,
            }  # fmt: skip
            rows.append(row)
            print(f"{shape:16} {kind:6} {rec:5} {storage:6} base {base_ms:.4f} ms  new "
                  f"{new_ms:.4f} ms  new/base {new_ms / base_ms:.4f}  max|diff| {diff:.3g}"
                  + "".join(f"  {k}/base {v:.4f}" for k, v in others.items()),
                  flush=True)  # fmt: skip
            del fns, outs
        del x
        torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "guard-ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
