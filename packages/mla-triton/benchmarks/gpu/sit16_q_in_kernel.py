"""Sitting 16: Q's QDQ in the Gluon prefill kernel (``GluonPrefillConfig.q_in_kernel``)
against the pass before the launch, on AUTO_CONFIGS' tilings: out and LSE bit for bit
(fp8 and nvfp4 recipes, dynamic and static Q, a NaN and an inf in Q), then both timed
round robin beside FA3 bf16 (``do_bench`` medians, 5 rounds) at prefill.py's shapes: fp8 and
nvfp4 with Q's scale dynamic and static (a calibrated MLA_QUANT's), nvfp4 also with 2:4. With
dynamic nvfp4 Q the launcher keeps the pass, so its two rows time one kernel (the noise floor).

Usage (device, bundle installed): ``python packages/mla-triton/benchmarks/gpu/sit16_q_in_kernel.py``
with ``PYTHONPATH`` as ``sit15.sh bench`` sets it.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton

sys.path.insert(0, "packages/mla-triton/benchmarks")
import prefill as pb

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton import gluon_prefill as gp
from mla_triton import prefill
from mla_triton.prefill import Recipe

RECIPES = {
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "fp8-static-q": AttentionQuant(q=OperandQuant("fp8", 8.0), k="fp8", p="fp8", v="fp8"),
    "nvfp4-static-q": AttentionQuant(q=OperandQuant("nvfp4", 6.0), k="nvfp4", p="nvfp4", v="nvfp4"),
    "q-fp8-only": AttentionQuant(q="fp8"),
}


def bit_for_bit() -> bool:
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [1, 15, 300, 1000, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    total, heads = sum(lens), 16
    q = torch.randn(total, heads, 192, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, 4, 192, device="cuda", generator=gen).bfloat16()
    v = torch.randn(total, 4, 128, device="cuda", generator=gen).bfloat16()
    q_bad = q.clone()
    q_bad[20, 3, 7] = float("nan")
    q_bad[400, 5, 100] = float("inf")
    for name, quant in RECIPES.items():
        sparse = [None] if name.startswith("q-") else [None, "2:4"]
        for qq in (q, q_bad):
            for causal in (True, False):
                for sp in sparse:
                    sparsity = NMSparsity(2, 4) if sp else None
                    config = gp.auto_config(Recipe.of(quant), sp is not None)
                    got = [prefill(qq, k, v, cu, cu, softmax_scale=0.07, causal=causal,
                                   return_lse=True, quant=quant, sparsity=sparsity,
                                   impl="gluon", config=replace(config, q_in_kernel=on))
                           for on in (True, False)]  # fmt: skip
                    same = all(torch.equal(a.isnan(), b.isnan())
                               and torch.equal(a.nan_to_num(), b.nan_to_num())
                               for a, b in zip(*got, strict=True))  # fmt: skip
                    nan = bool(got[0][0].isnan().any())
                    print(f"bit-for-bit {name:15s} bad={qq is q_bad!s:5s} causal={causal!s:5s} "
                          f"nm={sp}: {same} (NaN rows: {nan})", flush=True)  # fmt: skip
                    ok &= same and nan == (qq is q_bad)
    return ok


def time_shape(shape: str) -> None:
    lens, heads = pb.SHAPES[shape]
    x = pb._inputs(lens, heads)
    out = torch.empty(sum(lens), heads, pb.DV, dtype=torch.bfloat16, device="cuda")

    def call(quant: AttentionQuant, on: bool, sparse: bool = False) -> Callable[[], Any]:
        config = replace(gp.auto_config(Recipe.of(quant), sparse), q_in_kernel=on)
        return lambda: prefill(
            x["q"], x["k"], x["v"], x["cu"], x["cu"], softmax_scale=pb.DQK**-0.5, causal=True,
            max_seqlen_q=x["max"], max_seqlen_k=x["max"], quant=quant, out=out, impl="gluon",
            config=config, sparsity=NMSparsity(2, 4) if sparse else None,
        )  # fmt: skip

    fns: dict[str, Callable[[], Any]] = {"fa3": pb.fa3(x["q"], x["k"], x["v"], x["cu"], x["max"])}
    for name in ("fp8", "fp8-static-q", "nvfp4", "nvfp4-static-q"):
        for on in (False, True):
            fns[f"{name} q_in_kernel={on}"] = call(RECIPES[name], on)
    for name in ("nvfp4", "nvfp4-static-q"):
        for on in (False, True):
            fns[f"{name}+2:4 q_in_kernel={on}"] = call(RECIPES[name], on, True)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    rounds: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(5):
        for name, fn in fns.items():
            rounds[name].append(triton.testing.do_bench(fn, warmup=25, rep=200))
    fa3 = statistics.median(rounds["fa3"])
    print(f"{shape}:")
    for name, ms in rounds.items():
        med = statistics.median(ms)
        print(f"  {name:34s} median {med:7.3f} ms (rounds {min(ms):.3f}-{max(ms):.3f}) "
              f"{fa3 / med:6.3f}x FA3", flush=True)  # fmt: skip


def main() -> None:
    ok = bit_for_bit()
    print(f"bit-for-bit all: {ok}", flush=True)
    for shape in sys.argv[1:] or list(pb.SHAPES):
        time_shape(shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
