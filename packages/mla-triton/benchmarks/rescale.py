"""A/B benchmark of ``DecodeConfig.lazy_rescale``: decode and decode_shadow, each with its
default tiles, with the output accumulator rescaled in every tile and only when a row's
running maximum grew, in the same run.

Run on a CUDA GPU from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/rescale.py --out OUTDIR

Shapes, data and counting as in ``shadow.py`` (b128 h128 L8192 and b128 h16 L8192,
page 64, random bf16 latent written through ``update_cache``, FlashMLA's FLOPs).
Per (shape, path, recipe): the median ``do_bench`` time with ``lazy_rescale`` off
and on, their ratio, and whether the two outputs and LSEs are the same bits (they
must be: a skipped rescale multiplies by exactly 1). Writes ``rescale.json`` and
``rescale.txt``. ``--tiny``: a CPU smoke run of the script (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import shadow as bench  # the shadow benchmark: pool, entries, timing

VARIANTS = (
    ("on-read", "none"),
    ("on-read", "fp8"),
    ("on-read", "nvfp4"),
    ("shadow-fp16", "nvfp4"),
    ("shadow-fp16", "fp8"),
)


def entries(shapes: dict[str, tuple[int, int, int, int]]) -> list[bench.Entry]:
    out = []
    for shape, (_, heads, _, _) in shapes.items():
        for path, recipe in VARIANTS:
            cfg = bench._config(bench.Entry(shape, recipe, path), heads)
            for lazy in (False, True):
                out.append(bench.Entry(shape, recipe, path, replace(cfg, lazy_rescale=lazy)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    shapes = bench.TINY_SHAPES if args.tiny else bench.SHAPES
    todo = entries(shapes)
    if not args.tiny:
        todo = bench.precompile(todo, args.workers)
    rows: list[dict[str, object]] = []
    for shape, (batch, heads, seq, _) in shapes.items():
        pool = bench.Pool(shapes[shape], device, tiny=args.tiny)
        pool.fill("nvfp4", "fp16")  # random latent in the raw cache (it starts as zeros)
        results: dict[bench.Entry, tuple[float, torch.Tensor, torch.Tensor]] = {}
        for entry in (e for e in todo if e.shape == shape):
            splits = bench._splits(entry, shapes, device)
            out = torch.empty(batch, heads, 512, device=device, dtype=pool.q.dtype)
            lse = torch.empty(batch, heads, device=device, dtype=torch.float32)
            run = bench._runner(entry, pool, splits, out, lse)
            ms = bench._bench(run, args.tiny, 50, 200)
            run()
            results[entry] = (ms, out.clone(), lse.clone())
        for path, recipe in VARIANTS:
            pair = [e for e in results if (e.path, e.recipe) == (path, recipe)]
            if len(pair) != 2:
                continue
            eager, lazy = sorted(pair, key=lambda e: e.config is not None and e.config.lazy_rescale)
            (t0, o0, l0), (t1, o1, l1) = results[eager], results[lazy]
            row: dict[str, object] = {
                "shape": shape,
                "path": path,
                "recipe": recipe,
                "config": asdict(eager.config) if eager.config else None,
                "ms_eager": t0,
                "ms_lazy": t1,
                "speedup": t0 / t1,
                "tflops_eager": bench.flops(batch, heads, seq) / t0 / 1e9,
                "tflops_lazy": bench.flops(batch, heads, seq) / t1 / 1e9,
                "same_bits": bool(torch.equal(o0, o1) and torch.equal(l0, l1)),
            }
            rows.append(row)
        del pool
    lines = [
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}",
        f"{'shape':18s} {'path':12s} {'recipe':6s} {'tiles':10s} {'eager ms':>9s} "
        f"{'lazy ms':>9s} {'speedup':>8s} {'TFLOP/s lazy':>13s} same bits",
    ]
    for r in rows:
        c = r["config"]
        assert isinstance(c, dict)
        tiles = f"{c['block_h']},{c['block_n']},{c['num_warps']},{c['num_stages']}"
        lines.append(
            f"{r['shape']:18s} {r['path']:12s} {r['recipe']:6s} {tiles:10s} "
            f"{r['ms_eager']:9.3f} {r['ms_lazy']:9.3f} {r['speedup']:7.3f}x "
            f"{r['tflops_lazy']:13.1f} {r['same_bits']}"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rescale.json").write_text(json.dumps(rows, indent=1))
        (args.out / "rescale.txt").write_text("\n".join(lines) + "\n")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
