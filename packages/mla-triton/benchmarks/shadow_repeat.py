"""Run-to-run spread of decode timings at b128 h16 L8192: fresh pools, one process.

Run on a CUDA GPU from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/shadow_repeat.py --out OUTDIR [--repeats 4]

``shadow.py`` measured the fp8 shadow at h16 at 0.302 and 0.359 ms in two runs.
This times, ``--repeats`` times, each in a newly allocated pool (raw cache, block
table, shadows; the same seeded data), quant none on read and the fp8 and nvfp4
fp16 shadows with their default tiles, plus the fp8 shadow at 2 stages. Writes
``shadow_repeat.txt``. ``--fp8-first`` allocates the fp8 shadow before the nvfp4 one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import shadow as bench  # the shadow benchmark: pool, entries, timing

SHAPE = "b128-h16-L8192"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--fp8-first", action="store_true", help="allocate the fp8 shadow before the nvfp4 one"
    )
    args = parser.parse_args(argv)
    shapes = {SHAPE: bench.SHAPES[SHAPE]}
    batch, heads, seq, _ = shapes[SHAPE]
    fp8_cfg = bench._config(bench.Entry(SHAPE, "fp8", "shadow-fp16"), heads)
    entries = [
        bench.Entry(SHAPE, "none", "on-read"),
        bench.Entry(SHAPE, "fp8", "shadow-fp16"),
        bench.Entry(SHAPE, "fp8", "shadow-fp16", replace(fp8_cfg, num_stages=2)),
        bench.Entry(SHAPE, "nvfp4", "shadow-fp16"),
    ]
    order = "fp8 then nvfp4" if args.fp8_first else "nvfp4 then fp8"
    lines = [
        f"device: {torch.cuda.get_device_name()}, {SHAPE}, ms per repeat (fresh pool; "
        f"shadows allocated {order})"
    ]
    times: dict[int, list[float]] = {i: [] for i in range(len(entries))}
    offsets: list[str] = []  # where each repeat's fp8 shadow starts, modulo 2 MiB
    for _ in range(args.repeats):
        pool = bench.Pool(shapes[SHAPE], "cuda", tiny=False)
        if args.fp8_first:
            pool.fill("fp8", "fp16")
        pool.fill("nvfp4", "fp16")
        for i, entry in enumerate(entries):
            splits = bench._splits(entry, shapes, "cuda")
            out = torch.empty(batch, heads, 512, device="cuda", dtype=pool.q.dtype)
            lse = torch.empty(batch, heads, device="cuda", dtype=torch.float32)
            times[i].append(
                bench._bench(bench._runner(entry, pool, splits, out, lse), False, 50, 200)
            )
        offsets.append(f"{pool.shadows[('fp8', 'fp16')].data_ptr() % (2 << 20):#x}")
        del pool
        torch.cuda.empty_cache()
    for i, entry in enumerate(entries):
        cfg = bench._config(entry, heads)
        tiles = f"{cfg.block_h},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"
        ms = " ".join(f"{t:.3f}" for t in times[i])
        gbps = bench.raw_bytes(batch, heads, seq) / min(times[i]) / 1e6
        lines.append(f"{entry.name:22s} {tiles:10s} {ms}   best {gbps:.0f} GB/s raw-equivalent")
    lines.append(f"fp8 shadow start modulo 2 MiB, per repeat: {' '.join(offsets)}")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "shadow_repeat.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
