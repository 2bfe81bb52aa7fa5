"""Round-to-nearest-even onto the E4M3FN and E2M1 grids, in float32 torch.

Both grids are small floating-point formats, so one routine serves both: find the
binade of each value, turn it into the grid's quantum (the distance between
neighbouring representable values there), round ``x / quantum`` half-to-even and
scale back. Every step except the rounding is an exact power-of-two scaling.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_MAX", "E4M3_MAX", "E4M3_MIN_SUBNORMAL", "e2m1_round", "e4m3_round"]

E4M3_MAX = 448.0
"""Largest finite E4M3FN value."""
E4M3_MIN_SUBNORMAL = 2.0**-9
"""Smallest positive E4M3FN value (the subnormal step)."""
E2M1_MAX = 6.0
"""Largest E2M1 value."""


def _round_to_minifloat(
    x: torch.Tensor, *, mantissa_bits: int, min_normal_exp: int, max_value: float
) -> torch.Tensor:
    """Round float32 ``x`` onto a minifloat grid, saturating at ``max_value``.

    ``min_normal_exp`` is the exponent of the smallest normal binade; below it the
    quantum stays at that binade's (subnormals). NaN stays NaN; ±inf saturates.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x: expected a float32 tensor, got {x.dtype}")
    # frexp: x = m * 2**e with |m| in [0.5, 1), so the binade exponent is e - 1.
    _, exponent = torch.frexp(x)
    binade = torch.clamp(exponent - 1, min=min_normal_exp)
    quantum = torch.ldexp(torch.ones_like(x), binade - mantissa_bits)
    rounded = torch.round(x / quantum) * quantum  # torch.round is half-to-even
    rounded = torch.clamp(rounded, -max_value, max_value)
    # frexp of ±inf is undefined; clamp of ±inf is the saturated value we want.
    return torch.where(torch.isinf(x), torch.sign(x) * max_value, rounded)
    # Keep the sign of zero (round(-0.1) is -0.0 already; -tiny/quantum too).


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to the nearest E4M3FN value, ties to even.

    Saturates at ±448 (±inf too) and keeps NaN, exactly as
    ``x.to(torch.float8_e4m3fn).float()``. Returns float32, same shape.
    """
    return _round_to_minifloat(x, mantissa_bits=3, min_normal_exp=-6, max_value=E4M3_MAX)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to the nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even.

    Saturates at ±6 (±inf too), keeps the sign (also of zero) and NaN.
    Returns float32, same shape.
    """
    return _round_to_minifloat(x, mantissa_bits=1, min_normal_exp=0, max_value=E2M1_MAX)
