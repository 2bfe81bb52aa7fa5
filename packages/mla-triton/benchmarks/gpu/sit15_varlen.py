"""Sitting 15: why prefill.py and gluon_prefill.py --dispatch time recipe none's varlen batch
5% apart (6.72-6.79 against 7.06 ms, same lens, both impl auto): one process, every variant
of the call timed round robin (``do_bench`` medians, 200 ms each, 7 rounds) beside FA3 bf16.

Variants: the inputs of each script (prefill.py's ``_inputs``; gluon_prefill.py's ``_rand``),
with and without ``out=``, with and without ``return_lse``, and after the Triton kernel ran
(the dispatch table times ``impl="triton"`` just before ``auto``).

Usage (device, bundle installed): ``python packages/mla-triton/benchmarks/gpu/sit15_varlen.py``
with ``PYTHONPATH`` as ``sit15.sh bench`` sets it plus ``packages/mla-triton/benchmarks``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton

sys.path.insert(0, "packages/mla-triton/benchmarks")
import gluon_prefill as gp
import prefill as pb

from mla_triton import prefill


def time_shape(shape: str) -> None:
    """Every variant at ``shape`` (a ``prefill.py`` shape), 7 rounds round robin."""
    lens, heads = pb.SHAPES[shape]
    x = pb._inputs(lens, heads)
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    y = {"q": gp._rand(total, heads, pb.DQK, gen), "k": gp._rand(total, heads, pb.DQK, gen),
         "v": gp._rand(total, heads, pb.DV, gen)}  # fmt: skip
    same = all(torch.equal(x[n], y[n]) for n in "qkv")
    out = torch.empty(total, heads, pb.DV, dtype=torch.bfloat16, device="cuda")

    def call(d: dict[str, Any], impl: str = "auto", **kw: Any) -> Callable[[], Any]:
        return lambda: prefill(
            d["q"], d["k"], d["v"], x["cu"], x["cu"], softmax_scale=pb.DQK**-0.5,
            causal=True, max_seqlen_q=x["max"], max_seqlen_k=x["max"], impl=impl, **kw,
        )  # fmt: skip

    fns: dict[str, Callable[[], Any]] = {
        "fa3": pb.fa3(x["q"], x["k"], x["v"], x["cu"], x["max"]),
        "prefill.py inputs": call(x),
        "prefill.py inputs, out=": call(x, out=out),
        "gluon_prefill inputs, out=": call(y, out=out),
        "prefill.py inputs, lse": call(x, return_lse=True),
    }
    triton_fn = call(y, impl="triton", out=out)
    for fn in [*fns.values(), triton_fn]:
        fn()
    torch.cuda.synchronize()
    names = [*fns, "after triton, out="]
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(7):
        for name, fn in fns.items():
            rounds[name].append(triton.testing.do_bench(fn, warmup=25, rep=200))
        triton.testing.do_bench(triton_fn, warmup=5, rep=200)  # as --dispatch: Triton first
        after = fns["gluon_prefill inputs, out="]
        rounds[names[-1]].append(triton.testing.do_bench(after, warmup=0, rep=200))
    fa3 = statistics.median(rounds["fa3"])
    print(f"{shape}: inputs identical in both scripts: {same}")
    for name, ms in rounds.items():
        med = statistics.median(ms)
        print(f"  {name:28s} median {med:7.3f} ms (rounds {min(ms):.3f}-{max(ms):.3f}) "
              f"{fa3 / med:6.3f}x FA3 (median)", flush=True)  # fmt: skip


def main() -> None:
    for shape in sys.argv[1:] or ["varlen16k-h128", "b4-h128-L4096"]:
        time_shape(shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
