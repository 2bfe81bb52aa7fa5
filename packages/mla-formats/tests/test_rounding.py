"""E4M3 and E2M1 rounding against torch's fp8 cast and a brute-force grid search."""

from __future__ import annotations

import pytest
import torch

from mla_formats import e2m1_round, e4m3_round


def _all_fp16_values() -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.float16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise equality of float32 tensors, any NaN equal to any NaN."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def test_e4m3_matches_fp8_cast_on_every_fp16_bit_pattern() -> None:
    x16 = _all_fp16_values()
    want = x16.to(torch.float8_e4m3fn).float()
    got = e4m3_round(x16.float())
    assert bool(_same_bits(got, want).all())
    assert got.isnan().sum() == x16.isnan().sum()  # NaN kept, inf saturates
    assert got[~got.isnan()].abs().max() == 448.0


def test_e4m3_matches_fp8_cast_on_random_float32() -> None:
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    # Exact midpoints between neighbouring E4M3 values exercise the tie rule.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e38, -1e38, 464.0, 480.0])
    x = torch.cat([x, mids, -mids, special, torch.nextafter(mids, torch.zeros_like(mids))])
    want = x.to(torch.float8_e4m3fn).float()
    assert bool(_same_bits(e4m3_round(x), want).all())


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_brute_force(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value by exhaustive search; ties to the even code (even index)."""
    mag = x.double().abs().clamp(max=6.0)
    dist = (mag[:, None] - E2M1_GRID[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # Among tied candidates, prefer the even index (mantissa bit 0).
    even = torch.arange(8) % 2 == 0
    pick = torch.where(
        (candidates & even).any(dim=1),
        (candidates & even).int().argmax(1),
        candidates.int().argmax(1),
    )
    out = E2M1_GRID[pick] * torch.sign(x.double())
    return torch.where(x.isnan(), x.double(), out).float()


def test_e2m1_matches_brute_force_on_every_fp16_value() -> None:
    x = _all_fp16_values().float()
    got = e2m1_round(x)
    want = _e2m1_brute_force(x)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (7.0, 6.0),
        (-5.0, -4.0),
        (float("inf"), 6.0),
        (-float("inf"), -6.0),
        (0.2500001, 0.5),
    ],
)
def test_e2m1_ties_and_saturation(value: float, expected: float) -> None:
    assert e2m1_round(torch.tensor([value])).item() == expected


def test_rounding_rejects_non_float32() -> None:
    with pytest.raises(ValueError, match="x: expected a float32"):
        e4m3_round(torch.zeros(4, dtype=torch.float16))
