"""qdq and qdq_factored against straightforward per-block code written here."""

from __future__ import annotations

import itertools

import pytest
import torch

from mla_formats import qdq, qdq_factored

F32 = torch.float32


def _fp8_cast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def _e2m1_nearest(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value by searching the grid; ties to the even code."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    mag = y.double().abs().clamp(max=6.0)
    dist = (mag[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tie_even = (dist == best) & (torch.arange(8) % 2 == 0)
    index = torch.where(
        tie_even.any(-1), tie_even.int().argmax(-1), (dist == best).int().argmax(-1)
    )
    return (grid[index] * torch.sign(y.double())).float()


def _nvfp4_row(row: torch.Tensor, amax: float) -> torch.Tensor:
    """One 1-D float32 row, blocks of 16 from index 0, one global amax; a block holding
    a non-finite value is all NaN."""
    gs = torch.tensor(amax, dtype=F32) / torch.tensor(2688.0, dtype=F32)
    out = torch.empty_like(row)
    for start in range(0, row.numel(), 16):
        block = row[start : start + 16]
        if not bool(block.isfinite().all()):
            out[start : start + 16] = torch.nan
            continue
        bmax = block.abs().max()
        sb = _fp8_cast(torch.clamp(bmax / (gs * 6.0), max=448.0))
        if sb.item() == 0.0:
            out[start : start + 16] = 0.0
            continue
        out[start : start + 16] = _e2m1_nearest(block / (sb * gs)) * sb * gs
    return out


def _nvfp4_straightforward(x: torch.Tensor, axis: int, amax: float | str) -> torch.Tensor:
    moved = x.float().movedim(axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        if amax == "dynamic" and not bool(row.isfinite().all()):
            out[i] = torch.nan  # the row's global scale is NaN
            continue
        row_amax = row.abs().max().item() if isinstance(amax, str) else amax
        out[i] = _nvfp4_row(row, row_amax) if row_amax != 0 else 0.0
    return out.reshape(moved.shape).movedim(-1, axis)


def _fp8_straightforward(x: torch.Tensor, axis: int, amax: float | str) -> torch.Tensor:
    xf = x.float()
    bad = ~xf.isfinite()
    if amax == "dynamic":
        a = xf.abs().amax(axis, keepdim=True)
        bad = bad | bad.any(axis, keepdim=True)  # the row's global scale is NaN
    else:
        a = torch.tensor(amax)
    s = a.to(F32) / 448.0
    out = _fp8_cast(torch.clamp(xf / s, -448.0, 448.0)) * s
    return torch.where(bad, torch.nan, out)


def _adversarial_blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    blocks = [
        torch.zeros(16),
        torch.cat([torch.full((1,), 500.0), torch.randn(15, generator=g) * 1e-3]),  # outlier
        torch.full((16,), 0.017578125),  # block scale at an E4M3 subnormal tie
        torch.randn(16, generator=g) * 2e-3,  # block scale in E4M3 subnormals
        torch.randn(16, generator=g) * 1e-6,  # block scale rounds to 0
        torch.full((16,), 1e5),  # saturates the block scale at 448
        -torch.zeros(16),
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 2),  # E2M1 ties at sb=1
        torch.randn(16, generator=g),
    ]
    return torch.stack(blocks)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("amax", [2688.0, 40.0, 1e4, "dynamic"])
def test_nvfp4_adversarial_blocks(amax: float | str) -> None:
    x = _adversarial_blocks().reshape(1, -1)  # one row of 9 blocks
    got = qdq(x, "nvfp4", amax=amax)
    assert _same(got, _nvfp4_straightforward(x, -1, amax))


NON_FINITE = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("bad", NON_FINITE)
def test_nvfp4_non_finite_poisons_exactly_its_block(bad: float) -> None:
    x = torch.randn(3, 48) * 100
    x[0, 3] = bad
    x[1, 40] = bad
    y = qdq(x, "nvfp4")
    want = torch.zeros(3, 48, dtype=torch.bool)
    want[0, :16] = True
    want[1, 32:48] = True
    assert torch.equal(y.isnan(), want)  # the rest of the block is not saturated: NaN
    assert _same(y, _nvfp4_straightforward(x, -1, 2688.0))
    # the rest of each poisoned row, and the clean row, are the values without the bad one
    clean = qdq(torch.where(x.isfinite(), x, 0.0), "nvfp4")
    assert torch.equal(y[~want], clean[~want])


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_dynamic_amax_non_finite_poisons_exactly_its_row(bad: float, fmt: str, axis: int) -> None:
    x = torch.randn(32, 32)
    x[5, 7] = bad
    y = qdq(x, fmt, axis=axis, amax="dynamic")
    want = torch.zeros(32, 32, dtype=torch.bool)
    if axis == 1:
        want[5] = True
    else:
        want[:, 7] = True
    assert torch.equal(y.isnan(), want)
    values, scale = qdq_factored(x, fmt, axis=axis, amax="dynamic")
    assert torch.equal(values.isnan(), want)
    assert int(scale.isnan().sum()) == 1  # the poisoned row's global scale is NaN


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("amax", [448.0, 3.0, "tensor"])
def test_fp8_static_non_finite_is_nan_alone(bad: float, amax: float | str) -> None:
    x = torch.randn(4, 32) * 10
    x[2, 9] = bad
    x[3, 0] = 1e9  # a finite value beyond the range still saturates
    top = 5.0 if isinstance(amax, str) else amax
    scales = torch.full((4, 1), top) if isinstance(amax, str) else top
    y = qdq(x, "fp8", amax=scales)
    want = torch.zeros(4, 32, dtype=torch.bool)
    want[2, 9] = True
    assert torch.equal(y.isnan(), want)
    assert y[3, 0].item() == top  # E4M3 448 times the global scale amax / 448


@pytest.mark.parametrize("bad", NON_FINITE)
def test_nvfp4_non_finite_block_at_absolute_positions(bad: float) -> None:
    """With ``offset`` the poisoned block is the one at absolute positions, the padded
    positions outside the slice not counted."""
    x = torch.randn(2, 40, 4)
    x[1, 12, 2] = bad  # absolute position 5 + 12 = 17: block [16, 32) = slice rows 11..26
    y = qdq(x, "nvfp4", axis=1, offset=5, pad=True)
    want = torch.zeros(2, 40, 4, dtype=torch.bool)
    want[1, 11:27, 2] = True
    assert torch.equal(y.isnan(), want)


def test_none_passes_non_finite_values_through() -> None:
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan")] * 4)
    assert _same(qdq(x, "none"), x) and torch.isinf(qdq(x, "none")[1])
    values, scale = qdq_factored(x, "none", amax="dynamic")
    assert _same(values, x) and torch.equal(scale, torch.ones(1))


def test_nvfp4_finite_beyond_range_still_saturates() -> None:
    x = torch.full((16,), 1e30)
    assert torch.equal(qdq(x, "nvfp4"), torch.full((16,), 448.0 * 6.0))


@pytest.mark.parametrize("dims", [(32, 48), (3, 16, 32), (2, 16, 3, 32)])
@pytest.mark.parametrize("amax", [2688.0, 7.5, "dynamic"])
def test_nvfp4_every_axis(dims: tuple[int, ...], amax: float | str) -> None:
    g = torch.Generator().manual_seed(len(dims))
    base = torch.randn(dims, generator=g) * torch.exp2(
        torch.randint(-8, 8, dims, generator=g).float()
    )
    for axis in range(len(dims)):
        if dims[axis] % 16:
            continue
        got = qdq(base, "nvfp4", axis=axis, amax=amax)
        assert _same(got, _nvfp4_straightforward(base, axis, amax)), f"axis {axis}"
        negative = qdq(base, "nvfp4", axis=axis - len(dims), amax=amax)
        assert torch.equal(got, negative)


@pytest.mark.parametrize("amax", [448.0, 3.0, "dynamic"])
def test_fp8_every_axis(amax: float | str) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, 6, generator=g) * 10
    x[0, 0, 0] = 1e9  # saturates
    x[1, 1, 1] = float("nan")
    for axis in range(3):
        assert _same(qdq(x, "fp8", axis=axis, amax=amax), _fp8_straightforward(x, axis, amax))


def test_per_row_tensor_amax() -> None:
    x = torch.randn(6, 32)
    amax = torch.linspace(1.0, 6.0, 6).reshape(6, 1)
    got = qdq(x, "nvfp4", amax=amax)
    for i in range(6):
        assert torch.equal(got[i], _nvfp4_row(x[i], float(amax[i])))


def test_none_is_identity_and_dtype_kept() -> None:
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(qdq(x, "none"), x)
    assert qdq(x, "nvfp4").dtype == torch.bfloat16
    assert qdq(x, "fp8", out_dtype=torch.float32).dtype == torch.float32


def test_dynamic_all_zero_row_gives_zeros() -> None:
    x = torch.zeros(2, 32)
    x[1] = torch.randn(32)
    for fmt in ("fp8", "nvfp4"):
        y = qdq(x, fmt, amax="dynamic")
        assert torch.equal(y[0], torch.zeros(32)) and y[1].abs().sum() > 0


@pytest.mark.parametrize(("offset", "length"), [(0, 40), (5, 11), (5, 27), (16, 16), (37, 60)])
def test_offset_matches_the_padded_whole_sequence(offset: int, length: int) -> None:
    """A slice at absolute position ``offset`` quantizes as it would inside its sequence,
    with the positions before and after the slice taken as zeros."""
    g = torch.Generator().manual_seed(offset)
    seq = torch.zeros(3, offset + length + 20, 8)
    seq[:, offset : offset + length] = torch.randn(3, length, 8, generator=g)
    sliced = seq[:, offset : offset + length]
    got = qdq(sliced, "nvfp4", axis=1, offset=offset, pad=True)
    full_len = -(-(offset + length) // 16) * 16
    want = qdq(seq[:, :full_len], "nvfp4", axis=1)[:, offset : offset + length]
    assert torch.equal(got, want)
    if offset % 16 or (offset + length) % 16:
        with pytest.raises(ValueError, match="pad=True"):
            qdq(sliced, "nvfp4", axis=1, offset=offset)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("amax", [None, 100.0, "dynamic"])
def test_factored_values_are_exact_in_16_bit(fmt: str, amax: float | str | None) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 64, generator=g) * torch.exp2(
        torch.randint(-12, 10, (64, 1), generator=g).float()
    )
    x = torch.cat([x, _adversarial_blocks().reshape(9, 16).repeat(1, 4)])
    values, gs = qdq_factored(x, fmt, amax=amax)
    assert torch.equal(values.to(torch.bfloat16).float(), values)
    assert torch.equal(values.to(torch.float16).float(), values)
    nonzero = values[values != 0].abs()
    assert nonzero.min() >= 2.0**-10 and nonzero.max() <= 2688.0
    assert torch.equal(values * gs, qdq(x, fmt, amax=amax, out_dtype=torch.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fmt": "int4"}, "fmt: unknown format"),
        ({"x": torch.arange(32)}, "x: expected a floating dtype"),
        ({"x": torch.randn(4, 24)}, "x: nvfp4 blocks of 16"),
        ({"amax": 0.0}, "amax: must be positive"),
        ({"amax": -1.0}, "amax: must be positive"),
        ({"amax": float("inf")}, "amax: must be positive"),
        ({"amax": float("nan")}, "amax: must be positive"),
        ({"amax": torch.tensor([[1.0], [0.0], [1.0], [1.0]])}, "amax: every value"),
        ({"amax": torch.ones(3, 1)}, "amax: shape"),
        ({"amax": "static"}, "amax: expected"),
        ({"axis": 2}, "axis: 2 is out of range"),
        ({"axis": -3}, "axis: -3 is out of range"),
        ({"offset": -1}, "offset: expected a non-negative int"),
        ({"pad": 1}, "pad: expected a bool"),
        ({"out_dtype": "float32"}, "out_dtype: expected None or one of"),
        ({"out_dtype": "cpu"}, "out_dtype: expected None or one of"),
        ({"out_dtype": torch.int32}, "out_dtype: expected None or one of"),
        ({"out_dtype": torch.float8_e4m3fn}, "out_dtype: expected None or one of"),
        ({"out_dtype": 5}, "out_dtype: expected None or one of"),
    ],
)
def test_bad_input_raises_value_error(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"x": torch.randn(4, 32), "fmt": "nvfp4"}
    args.update(kwargs)
    x = args.pop("x")
    fmt = args.pop("fmt")
    with pytest.raises(ValueError, match=f"^{message}"):
        qdq(x, fmt, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_out_dtype_accepts_the_floating_dtypes(out_dtype: torch.dtype) -> None:
    x = torch.randn(2, 32)
    assert qdq(x, "nvfp4", out_dtype=out_dtype).dtype == out_dtype
    assert torch.equal(qdq(x, "nvfp4", out_dtype=out_dtype), qdq(x, "nvfp4").to(out_dtype))


def test_amax_validation_applies_to_fp8_too() -> None:
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="amax"):
            qdq(torch.randn(8), "fp8", amax=bad)


def test_all_dims_and_dtypes_run() -> None:
    for dtype, fmt in itertools.product(
        (torch.float16, torch.bfloat16, torch.float64), ("fp8", "nvfp4")
    ):
        x = torch.randn(2, 32, dtype=dtype)
        assert qdq(x, fmt).dtype == dtype


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize(("shape", "axis"), [((0, 16), -1), ((0, 2, 32), 0), ((3, 0, 32), -1)])
def test_empty_tensors_keep_their_shape(fmt: str, shape: tuple[int, ...], axis: int) -> None:
    x = torch.randn(shape)
    assert qdq(x, fmt, axis=axis).shape == x.shape
    values, scale = qdq_factored(x, fmt, axis=axis, amax="dynamic")
    assert values.shape == x.shape and scale.shape[axis] == 1
