"""nvfp4 on read in the Gluon decode: whole blocks a thread (``ON_READ_BLOCKS_CONFIG``,
``V_OWN == 2``), with V̂ quantized under the S MMA (``ON_READ_OVERLAP_CONFIG``, ``V_OWN ==
3``) and K̂ under the P V MMA (``ON_READ_PIPELINED_CONFIG``, 4) against today's V_OWN
kernel (``SEPARATE_V_CONFIG``), the oracle and FlashMLA bf16, in one process.

Run on an H200 from the repository root (``benchmarks/gpu/on_read_sit8.sh`` does)::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/on_read_blocks.py --plan check|bench OUTDIR

``--plan check``: ragged lengths, splits 1 to 3 and the policy's, pages 16 and 64, 20, 64
and 128 heads, uniform nvfp4 and nvfp4 with global scales that are not powers of two (the
exact divisions); per case both kernels against ``mla_reference.decode`` (CPU, the quantized
recipe: ``gluon_decode.py``'s bounds for a quantized P) and the new kernels against the
current one bit for bit (the QDQ's arithmetic is the same, only its register layout, its
buffers and its place in the schedule move; the MMAs read the same bits). ``--plan
bench``: b128 h128 L8192 and b32 h128 L32768 (``decode.py``'s inputs), median of
``do_bench``, TFLOP/s with FlashMLA's count.
JSON: ``OUTDIR/on_read_{plan}.json``; one line a case or run on stdout.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import SHAPES, flashmla_run, flops
from decode import make_inputs as bench_inputs
from gluon_decode import _ok, compare
from gluon_decode import make_inputs as case_inputs
from gluon_shadow import bench

from mla_formats import AttentionQuant, OperandQuant
from mla_triton.gluon_decode import (
    ON_READ_BLOCKS_CONFIG,
    ON_READ_OVERLAP_CONFIG,
    ON_READ_PIPELINED_CONFIG,
    SEPARATE_V_CONFIG,
)

SCALE = 576**-0.5
NV = AttentionQuant.uniform("nvfp4")
NV3 = AttentionQuant(q="nvfp4", k=OperandQuant("nvfp4", 3.0), v=OperandQuant("nvfp4", 3.0),
                     p="nvfp4")  # fmt: skip
CONFIGS = {"v-own": SEPARATE_V_CONFIG, "v-own-blocks": ON_READ_BLOCKS_CONFIG,
           "v-own-under-s": ON_READ_OVERLAP_CONFIG,
           "v-own-pipelined": ON_READ_PIPELINED_CONFIG}  # fmt: skip
# (name, heads, lens, page, num_splits (None: the policy), quant)
CASES: list[tuple[str, int, list[int], int, int | None, AttentionQuant]] = [
    ("h128-mixed-s1", 128, [1, 65, 1000, 2049], 64, 1, NV),
    ("h128-mixed-s3", 128, [0, 63, 700, 2100], 64, 3, NV),
    ("h20-page16-s2", 20, [15, 300, 1500], 16, 2, NV),
    ("h64-page16-policy", 64, [16, 129, 1024], 16, None, NV),
    ("h128-scale3-s2", 128, [777, 1500], 64, 2, NV3),
]
BENCH = ["b128-h128-L8192", "b32-h128-L32768"]


def check(deadline: float) -> list[dict[str, Any]]:
    """Every case of ``CASES``: each kernel of ``CONFIGS`` vs the oracle, the new ones bit
    for bit vs today's (``v-own``)."""
    import mla_reference
    from mla_triton.decode import decode

    rows: list[dict[str, Any]] = []
    for ci, (name, heads, lens, page, splits, quant) in enumerate(CASES):
        rec: dict[str, Any] = {"case": name}
        rows.append(rec)
        if time.monotonic() > deadline:
            rec["status"] = "not run: time budget spent"
            print(f"{name:20s} NOT RUN (budget)", flush=True)
            continue
        try:
            q, cache, table, seq = case_inputs(lens, heads, page, ci)
            ref, rlse = mla_reference.decode(
                q.cpu(), cache.cpu(), table.cpu(), seq.cpu(), softmax_scale=SCALE, quant=quant
            )
            ref, rlse = ref.to(q.device), rlse.to(q.device)
            outs = {}
            for key, cfg in CONFIGS.items():
                outs[key] = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant,
                                   num_splits=splits, config=cfg)  # fmt: skip
                rec[key] = e = compare(*outs[key], ref, rlse)
                e["ok"] = _ok(e, p_quantized=True)
            o1, l1 = outs["v-own"]
            rec["bitwise"] = {
                k: bool(torch.equal(o1, outs[k][0]) and torch.equal(l1, outs[k][1]))
                for k in CONFIGS
                if k != "v-own"
            }
            good = all(rec["bitwise"].values()) and all(rec[k]["ok"] for k in CONFIGS)
            rec["status"] = "pass" if good else "FAIL"
            errs = " | ".join(
                f"{k} row {rec[k]['max_row_err']:.2e} lse {rec[k]['lse_max_abs']:.1e} ok "
                f"{rec[k]['ok']}"
                for k in CONFIGS
            )
            print(f"{name:20s} {rec['status']:4s} bitwise {rec['bitwise']} | {errs}", flush=True)
        except Exception as exc:  # one case's failure must not end the run
            rec["status"] = "ERROR"
            rec["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name:20s} ERROR\n{traceback.format_exc()}", flush=True)
    return rows


def run_bench(deadline: float) -> list[dict[str, Any]]:
    """FlashMLA bf16 and each kernel of ``CONFIGS`` at each shape of ``BENCH`` (the policy's
    splits)."""
    from mla_triton.decode import decode, decode_num_splits, decode_workspace_size

    rows: list[dict[str, Any]] = []
    for shape in BENCH:
        batch, heads, seq_len, _ = SHAPES[shape]
        rec: dict[str, Any] = {"shape": shape, "ms": {}, "tflops": {}}
        rows.append(rec)
        q, cache, table, lens = bench_inputs(shape, "cuda")
        splits = decode_num_splits(batch, heads, seq_len, device=q.device)
        size = decode_workspace_size(batch, heads, seq_len, num_splits=splits, device=q.device)
        kw: dict[str, Any] = {
            "softmax_scale": SCALE, "quant": NV, "num_splits": splits, "check_values": False,
            "workspace": torch.empty(size, dtype=torch.uint8, device="cuda"),
            "out": torch.empty(batch, heads, 512, dtype=q.dtype, device="cuda"),
            "lse": torch.empty(batch, heads, dtype=torch.float32, device="cuda"),
        }  # fmt: skip
        runs: dict[str, Any] = {}
        try:  # first: every later line prints its ratio to it
            runs["flashmla-bf16"] = flashmla_run(q, cache, table, lens, SCALE)
        except Exception as exc:
            rec["flashmla_error"] = f"{type(exc).__name__}: {exc}"
        for key, cfg in CONFIGS.items():
            runs[key] = functools.partial(decode, q, cache, table, lens, config=cfg, **kw)
        rec["splits"] = splits
        for key, fn in runs.items():
            if time.monotonic() > deadline:
                rec["ms"][key] = None
                print(f"{shape:17s} {key:14s} NOT RUN (budget)", flush=True)
                continue
            try:
                ms = bench(fn)
            except Exception as exc:
                rec[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"{shape:17s} {key:14s} ERROR {exc}", flush=True)
                continue
            rec["ms"][key] = ms
            rec["tflops"][key] = tf = flops(batch, heads, seq_len) / ms / 1e9
            fm = rec["ms"].get("flashmla-bf16")
            ratio = f" ({fm / ms:.3f}x FlashMLA)" if fm else ""
            print(f"{shape:17s} {key:14s} {ms:8.3f} ms {tf:7.1f} TFLOP/s{ratio}", flush=True)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    """``--plan check|bench [--configs a,b] [--budget-s S] OUTDIR``: ``--configs`` keeps
    those of ``CONFIGS`` (today's ``v-own`` always runs: the check's baseline) and tags the
    JSON's name."""
    plan, out = argv[argv.index("--plan") + 1], Path(argv[-1])
    tag = ""
    if "--configs" in argv:
        keep = argv[argv.index("--configs") + 1].split(",")
        for key in [k for k in CONFIGS if k not in keep and k != "v-own"]:
            del CONFIGS[key]
        tag = "-" + "-".join(keep)
    budget = float(argv[argv.index("--budget-s") + 1]) if "--budget-s" in argv else 55.0
    deadline = time.monotonic() + budget
    rows = check(deadline) if plan == "check" else run_bench(deadline)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"on_read_{plan}{tag}.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r.get("status") in ("FAIL", "ERROR")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
