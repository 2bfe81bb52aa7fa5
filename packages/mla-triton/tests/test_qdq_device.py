"""The Triton QDQ device functions against mla_formats, bit for bit (interpreter)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from mla_formats import e4m3_round, qdq_factored
from mla_triton.common import qdq as dev

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _e4m3_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, dev.e4m3_round(tl.load(x_ptr + offs)))


@triton.jit
def _nvfp4_kernel(
    x_ptr, y_ptr, gs, ROWS: tl.constexpr, COLS: tl.constexpr, ALONG_ROWS: tl.constexpr
):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs)
    y = dev.nvfp4_qdq(x, gs, ROWS, COLS, 1 if ALONG_ROWS else 0)
    tl.store(y_ptr + offs, y)


def _adversarial(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-14, 6, (rows, 1), generator=g).float()
    )
    x[0] = 0.0
    x[1, :] = 0.017578125  # block scale rounds at an E4M3 subnormal tie
    x[2, 3] = 3000.0  # one outlier saturating its block
    x[3] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * (cols // 8))  # E2M1 ties
    return x


def test_e4m3_round_matches_reference_on_all_fp16_values() -> None:
    n = 4096
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits.float()
    x = x[torch.isfinite(x)]
    x = x[: (x.numel() // n) * n]
    got = torch.empty_like(x)
    for start in range(0, x.numel(), n):
        _e4m3_kernel[(1,)](x[start : start + n], got[start : start + n], n)
    want = e4m3_round(x)
    assert torch.equal(got, want)  # numerically: the sign of zero is not kept


@pytest.mark.parametrize("gs_amax", [None, 2688.0 * 4, 100.0])
@pytest.mark.parametrize("along_rows", [True, False])
def test_nvfp4_tile_matches_reference(gs_amax: float | None, along_rows: bool) -> None:
    rows, cols = 32, 64
    x = _adversarial(rows, cols, seed=3)
    if not along_rows:
        x = x.t().contiguous()
    amax = 2688.0 if gs_amax is None else gs_amax
    gs = torch.tensor(amax, dtype=torch.float32) / 2688.0
    y = torch.empty_like(x)
    _nvfp4_kernel[(1,)](x, y, gs.item(), x.shape[0], x.shape[1], along_rows)
    want, _ = qdq_factored(x, "nvfp4", axis=1 if along_rows else 0, amax=amax)
    assert torch.equal(y, want)


@triton.jit
def _nan_max_kernel(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    if AXIS == 0:
        tl.store(y_ptr + tl.arange(0, C), dev.nan_max(x, 0))
    else:
        tl.store(y_ptr + tl.arange(0, R), dev.nan_max(x, 1))


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's reduction, not a compiled one")
@pytest.mark.parametrize("axis", [0, 1])
def test_interpreter_nan_max_in_numpy_matches_its_generic_reduce(
    axis: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nan_max`` through the interpreter's numpy path equals its element-by-element
    reduce: magnitudes with NaN, +inf, zeros and a whole NaN row or column."""
    from triton.runtime import interpreter

    assert dev.interpreter_nan_max_in_numpy, "Triton's interpreter hook is gone"
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 16, generator=g) * 100).abs()
    x[0, 3] = float("nan")
    x[2, 5] = float("inf")
    x[4] = 0.0
    x[:, 7] = float("nan")
    x[6, :] = float("nan")
    out = torch.empty(16 if axis == 0 else 8)

    def run() -> torch.Tensor:
        out.fill_(-1.0)
        _nan_max_kernel[(1,)](x, out, 8, 16, axis)
        return out.clone()

    fast = run()
    generic = interpreter.ReduceOps.apply_impl._mla_generic
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", generic)
    slow = run()
    assert torch.equal(fast.isnan(), slow.isnan())
    assert torch.equal(fast.nan_to_num(7.0), slow.nan_to_num(7.0))
    want = x.amax(axis)
    want[x.isnan().any(axis)] = float("nan")
    assert torch.equal(fast.nan_to_num(7.0), want.nan_to_num(7.0))
