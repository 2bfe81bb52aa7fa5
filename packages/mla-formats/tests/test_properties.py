"""Property tests: sign symmetry, monotonicity, fixed points, power-of-two equivariance."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_formats import e2m1_round, e4m3_round, qdq

FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
BLOCKS = st.lists(FINITE, min_size=32, max_size=32)
SETTINGS = settings(max_examples=60, deadline=None)


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@SETTINGS
@given(BLOCKS, st.sampled_from(["fp8", "nvfp4"]), st.sampled_from([None, 3.0, "dynamic"]))
def test_sign_symmetry(values: list[float], fmt: str, amax: float | str | None) -> None:
    x = _t(values)
    assert torch.equal(qdq(-x, fmt, amax=amax), -qdq(x, fmt, amax=amax))


@SETTINGS
@given(st.lists(FINITE, min_size=2, max_size=64))
def test_rounding_primitives_are_monotonic(values: list[float]) -> None:
    x = torch.sort(_t(values)).values
    for rounding in (e4m3_round, e2m1_round):
        y = rounding(x)
        assert bool((y[1:] >= y[:-1]).all())


@SETTINGS
@given(st.lists(FINITE, min_size=2, max_size=64), st.floats(min_value=1e-3, max_value=1e4))
def test_fp8_static_is_monotonic(values: list[float], amax: float) -> None:
    x = torch.sort(_t(values)).values
    y = qdq(x, "fp8", amax=amax)
    assert bool((y[1:] >= y[:-1]).all())


@SETTINGS
@given(BLOCKS, st.integers(min_value=0, max_value=15), st.floats(min_value=0.0, max_value=1.0))
def test_nvfp4_monotonic_within_a_block_with_fixed_maximum(
    values: list[float], index: int, fraction: float
) -> None:
    """Raising one non-maximal element, the block maximum fixed, never lowers its QDQ value."""
    x = _t(values)
    block = x[:16].abs()
    top = int(block.argmax())
    if index == top:
        return
    raised = x.clone()
    raised[index] = x[index] + fraction * (block[top] - x[index])
    assert qdq(raised, "nvfp4")[index] >= qdq(x, "nvfp4")[index]


@SETTINGS
@given(
    st.lists(st.integers(min_value=-7, max_value=7), min_size=16, max_size=16),
    st.integers(min_value=48, max_value=126),  # E4M3 byte of a normal block scale
    st.integers(min_value=0, max_value=15),
)
def test_values_on_the_grid_are_fixed_points(codes: list[int], scale_byte: int, pos: int) -> None:
    """A block that is already E2M1 * sb with a normal sb and one code at ±6 is unchanged."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    elements = [grid[abs(c)] * (1 if c >= 0 else -1) for c in codes]
    elements[pos] = 6.0
    sb = torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = _t(elements) * sb
    assert torch.equal(qdq(x, "nvfp4"), x)
    x8 = e4m3_round(x)
    assert torch.equal(qdq(x8, "fp8"), x8)


def test_idempotence_fails_where_the_block_scale_is_subnormal() -> None:
    """Pinned counterexample: the scale 0.017578125 / 6 is an E4M3 subnormal tie."""
    x = torch.full((16,), 0.017578125)
    once = qdq(x, "nvfp4")
    twice = qdq(once, "nvfp4")
    assert once[0].item() == 0.015625
    assert twice[0].item() == 0.01171875


@SETTINGS
@given(BLOCKS, st.integers(min_value=-20, max_value=20))
def test_dynamic_amax_is_power_of_two_equivariant(values: list[float], k: int) -> None:
    x = _t(values)
    for fmt in ("fp8", "nvfp4"):
        assert torch.equal(
            qdq(x * 2.0**k, fmt, amax="dynamic"), qdq(x, fmt, amax="dynamic") * 2.0**k
        )


@SETTINGS
@given(
    st.lists(st.floats(min_value=0.5, max_value=2000.0, width=32), min_size=16, max_size=16),
    st.lists(st.booleans(), min_size=16, max_size=16),
    st.integers(min_value=-4, max_value=4),
)
def test_static_amax_equivariant_outside_subnormals(
    magnitudes: list[float], negative: list[bool], k: int
) -> None:
    """Scaling x by 2^k with a fixed static amax scales QDQ(x) by 2^k while block scales stay
    normal (>= 2^-6) and unsaturated, and fp8 values stay normal."""
    x = _t([-m if n else m for m, n in zip(magnitudes, negative, strict=False)])
    x = x / x.abs().max() * 100.0  # block scale 100 / 6: normal, unsaturated for k in [-4, 4]
    assert torch.equal(qdq(x * 2.0**k, "nvfp4"), qdq(x, "nvfp4") * 2.0**k)
    small = x / 2.0**6  # fp8 values in normal E4M3 range for k in [-4, 4]
    small = small[small.abs() >= 2.0**-2]
    assert torch.equal(qdq(small * 2.0**k, "fp8"), qdq(small, "fp8") * 2.0**k)
