"""Smoke test of one installed wheel: import it and make one real call.

Usage: ``python smoke.py <module>``; run by ``nox -s build`` in a venv holding that
wheel alone (plus its declared dependencies), so it proves the package stands on
its own.
"""

from __future__ import annotations

import os
import sys

import torch


def smoke_mla_formats() -> None:
    from mla_formats import qdq

    x = torch.linspace(-3.0, 3.0, 32)
    y = qdq(x, "nvfp4")
    assert y.shape == x.shape and torch.isfinite(y).all()


def smoke_mla_reference() -> None:
    import mla_reference

    q = torch.randn(4, 2, 32)
    k = torch.randn(4, 2, 32)
    v = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = mla_reference.prefill(q, k, v, cu, cu, softmax_scale=0.2, quant=None)
    assert out.shape == (4, 2, 16) and torch.isfinite(out).all()


def smoke_mla_triton() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import mla_triton

    cache = torch.randn(2, 16, 576, dtype=torch.float16)
    q = torch.randn(1, 2, 576, dtype=torch.float16)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    out, lse = mla_triton.decode(q, cache, block_table, seq_lens, softmax_scale=0.1)
    assert out.shape == (1, 2, 512) and torch.isfinite(out).all() and torch.isfinite(lse).all()


SMOKES = {
    "mla_formats": smoke_mla_formats,
    "mla_reference": smoke_mla_reference,
    "mla_triton": smoke_mla_triton,
}

if __name__ == "__main__":
    module = sys.argv[1]
    SMOKES[module]()
    print(f"{module}: installed alone, imported and called")
