"""One Gluon prefill tiling against mla_reference on the GPU: the smoke step of the prefill
GPU scripts (prefill_tilings.sh, prefill_next.sh), one process per tiling so that a hang
costs only its own ``timeout``.

``python prefill_smoke.py NAME [--inf-k] [--long]``: ``NAME`` a ``TILINGS`` name of
``benchmarks/gluon_prefill.py``. Cases (bf16 192/128, GQA 8/2, LSE): varlen causal with a
NaN in V on a masked tile, chunked non-causal, nvfp4 + 2:4 (each with a NaN in V), with
``--inf-k`` an infinite K element on an unmasked tile (key 70 of a 200-token sequence, for
its queries 128-199), with ``--long`` a varlen causal batch of 4096 + 1000 tokens at 16
heads (1024 query tiles: several a program when persistent). A case passes when out's
and LSE's NaN positions equal the oracle's (which has some) and the finite outputs'
relative L2 error is below 1e-2 (3e-2 quantized). Prints one line a case, ending OK or
BAD; exit status 0 when all pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from gluon_prefill import TILINGS

import mla_reference
from mla_formats import AttentionQuant, NMSparsity
from mla_triton import prefill
from mla_triton.gluon_prefill import GluonPrefillConfig


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()


def main() -> int:
    name = sys.argv[1]
    cfg = GluonPrefillConfig(**TILINGS[name])
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [
        ("varlen causal", [1, 100, 300, 129], [1, 100, 300, 129], True, None, None),
        ("chunked non-causal", [1, 200, 64], [300, 1000, 64], False, None, None),
        ("nvfp4 + 2:4", [300, 200], [300, 200], True, AttentionQuant.uniform("nvfp4"),
         NMSparsity(2, 4)),
    ]  # fmt: skip
    if "--inf-k" in sys.argv:
        cases.append(("inf in K (unmasked tile)", [300, 200], [300, 200], True, None, None))
    if "--long" in sys.argv:
        cases.append(("long varlen causal", [4096, 1000], [4096, 1000], True, None, None))
    ok = True
    for what, lq, lk, causal, quant, sp in cases:
        heads = 16 if what.startswith("long") else 8
        q = torch.randn(sum(lq), heads, 192, device="cuda", generator=g).bfloat16()
        k = torch.randn(sum(lk), 2, 192, device="cuda", generator=g).bfloat16()
        v = torch.randn(sum(lk), 2, 128, device="cuda", generator=g).bfloat16()
        if what.startswith("inf"):
            k[300 + 70, 1, 100] = float("inf")
        else:
            v[sum(lk) - 70, 1, 3] = float("nan")  # on a masked tile of the last sequence
        kw = {"softmax_scale": 192**-0.5, "causal": causal, "return_lse": True, "quant": quant,
              "sparsity": sp}  # fmt: skip
        o, lse = prefill(q, k, v, _cu(lq), _cu(lk), impl="gluon", config=cfg, **kw)
        r, r_lse = mla_reference.prefill(
            q, k, v, _cu(lq), _cu(lk), compute_dtype=torch.float32, **kw
        )  # fmt: skip
        torch.cuda.synchronize()
        same_nan = torch.equal(o.isnan(), r.isnan()) and torch.equal(lse.isnan(), r_lse.isnan())
        fin = ~r.isnan() & ~o.isnan()
        d, ref = (o.float() - r.float())[fin], r.float()[fin]
        rel = (d.norm() / ref.norm().clamp_min(1e-30)).item()
        good = same_nan and bool(r.isnan().any()) and rel < (3e-2 if quant else 1e-2)
        ok &= good
        print(f"{name} {what}: rel L2 {rel:.3g}, NaN rows {int(r.isnan().all(-1).sum())}, "
              f"NaN same {same_nan} {'OK' if good else 'BAD'}", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
