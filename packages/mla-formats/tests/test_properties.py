"""Property tests: sign symmetry, monotonicity, fixed points, power-of-two equivariance,
the definition on the enumerated grids, and refusal of bad arguments by name."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_formats import (
    AttentionQuant,
    OperandQuant,
    e2m1_round,
    e4m3_round,
    get_format,
    qdq,
    qdq_factored,
    resolve_amax,
)

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


# --------------------------------------------------------------------------------------
# qdq and qdq_factored against a float64 computation on the enumerated grids
#
# Every float32 step of the definition (docs/numerics.md "Formats and scales": "all QDQ
# maths is done in float32") is taken here as a float64 operation rounded to float32,
# which for one +, *, / is the same number (float64 has more than 2 * 24 + 2 bits); the
# roundings onto the E4M3 and E2M1
# grids are searches over the grids' values, enumerated from their bit layouts.


def _e4m3_grid() -> list[float]:
    """The 127 non-negative finite E4M3FN values: 3 mantissa bits, bias 7, subnormals at
    exponent field 0, the all-ones code (exponent 15, mantissa 7) NaN."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue
            if exponent == 0:
                values.append(mantissa / 8 * 2.0**-6)
            else:
                values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


E4M3_GRID = torch.tensor(_e4m3_grid(), dtype=torch.float64)
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _round_to_grid(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value of float64 ``y`` by magnitude, ties to the even code (grid
    index), saturating at the grid's top, the sign kept (also of zero), NaN kept."""
    mag = y.abs().clamp(max=float(grid[-1]))
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    even = tied & (torch.arange(grid.numel()) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
    out = torch.copysign(grid[index], y)
    return torch.where(y.isnan(), y, out)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to float32 and back: one float32 operation's result."""
    return x.to(torch.float32).to(torch.float64)


def _reference_qdq(
    x: torch.Tensor, fmt: str, axis: int, amax: float | str | torch.Tensor | None, offset: int
) -> torch.Tensor:
    """QDQ by definition in float64 (float32 steps rounded as above); float32 result."""
    unit = {"fp8": 448.0, "nvfp4": 2688.0}[fmt]
    rows = _f32(x.double()).movedim(axis, -1)  # x.float(): the input rounded to float32
    bad = ~rows.isfinite()
    rows = torch.where(bad, torch.nan, rows)
    if amax == "dynamic":
        a = rows.abs().amax(dim=-1, keepdim=True)
        a = torch.where(a == 0, unit, a)
    elif amax is None:
        a = torch.full((*rows.shape[:-1], 1), unit, dtype=torch.float64)
    elif isinstance(amax, torch.Tensor):
        a = _f32(amax.double()).movedim(axis, -1).expand(*rows.shape[:-1], 1)
    else:
        a = torch.full((*rows.shape[:-1], 1), float(amax), dtype=torch.float64)
    gs = _f32(_f32(a) / unit)
    if fmt == "fp8":
        codes = _round_to_grid(_f32(rows / gs).clamp(-448.0, 448.0), E4M3_GRID)
        out = _f32(codes * gs)
    else:
        lead = offset % 16
        length = rows.shape[-1]
        tail = (-(lead + length)) % 16
        padded = torch.nn.functional.pad(rows, (lead, tail))
        blocks = padded.reshape(*padded.shape[:-1], -1, 16)
        g = gs.unsqueeze(-1)
        bmax = blocks.abs().amax(dim=-1, keepdim=True)
        sb = _round_to_grid(_f32(bmax / _f32(g * 6.0)).clamp(max=448.0), E4M3_GRID)
        codes = _round_to_grid(_f32(blocks / _f32(sb * g)), E2M1_GRID)
        values = torch.where(sb == 0, blocks * 0.0, codes * sb)
        out = _f32(values * g).flatten(-2)[..., lead : lead + length]
    return out.movedim(-1, axis).float()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, the sign of zero included, any NaN equal to any NaN."""
    same = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((same | (a.isnan() & b.isnan())).all())


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def _tensors(draw: st.DrawFn, *, block_axis_multiple: int = 1) -> tuple[torch.Tensor, int]:
    """A tensor of rank 1 to 3 with mixed magnitudes, grid ties and sometimes a non-finite
    element, possibly a non-contiguous view (transposed or strided); and an axis."""
    rank = draw(st.integers(1, 3))
    axis = draw(st.integers(-rank, rank - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    shape[axis] = block_axis_multiple * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** draw(st.integers(-24, 24))
    numel = math.prod(shape)
    x = torch.randn(numel, generator=gen, dtype=torch.float64) * scale
    x = x * torch.exp2(torch.randint(-6, 7, (numel,), generator=gen).double())
    if draw(st.booleans()):  # exact grid values and midpoints (ties) at one scale
        grid = torch.cat([E2M1_GRID, (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2])
        picks = grid[torch.randint(0, grid.numel(), (numel,), generator=gen)]
        x = picks * torch.sign(torch.randn(numel, generator=gen, dtype=torch.float64)) * scale
    if draw(st.booleans()):
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        x[draw(st.integers(0, numel - 1))] = bad
    dtype = draw(st.sampled_from(DTYPES))
    x = x.reshape(shape).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and rank > 1:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, other strides
    elif layout == "strided":
        wide = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    return x, axis


AMAX = st.one_of(
    st.none(),
    st.just("dynamic"),
    st.floats(min_value=1e-4, max_value=1e5, allow_nan=False),
)


@settings(max_examples=80, deadline=None)
@given(_tensors(), st.sampled_from(["fp8", "nvfp4"]), AMAX, st.booleans(), st.data())
def test_qdq_matches_the_definition_on_the_enumerated_grids(
    drawn: tuple[torch.Tensor, int],
    fmt: str,
    amax: float | str | None,
    per_row: bool,
    data: st.DataObject,
) -> None:
    x, axis = drawn
    offset = 0
    if fmt == "nvfp4":
        offset = data.draw(st.integers(0, 40))
    amax_arg: float | str | torch.Tensor | None = amax
    if per_row and isinstance(amax, float):  # per-row scales broadcasting along axis
        shape = list(x.shape)
        shape[axis] = 1
        amax_arg = torch.rand(shape, dtype=torch.float64) * amax + 1e-3
    want = _reference_qdq(x, fmt, axis, amax_arg, offset)
    got = qdq(x, fmt, axis=axis, amax=amax_arg, offset=offset, pad=True, out_dtype=torch.float32)
    assert _same_bits(got, want)
    assert _same_bits(
        qdq(x, fmt, axis=axis, amax=amax_arg, offset=offset, pad=True), want.to(x.dtype)
    )
    values, gscale = qdq_factored(x, fmt, axis=axis, amax=amax_arg, offset=offset, pad=True)
    assert _same_bits(values * gscale, got)
    finite = values[values.isfinite()]
    assert torch.equal(finite.to(torch.float16).float(), finite)
    assert torch.equal(finite.to(torch.bfloat16).float(), finite)
    reduced = list(x.shape)
    reduced[axis] = 1
    assert list(gscale.shape) == reduced
    assert _same_bits(qdq(x, "none", axis=axis, amax=amax_arg), x)  # none: x itself


@settings(max_examples=60, deadline=None)
@given(_tensors(), st.sampled_from(["fp8", "nvfp4"]))
def test_resolve_amax_matches_the_definition(drawn: tuple[torch.Tensor, int], fmt: str) -> None:
    x, axis = drawn
    f = get_format(fmt)
    got = resolve_amax(x, f, "dynamic", axis)
    xf = _f32(x.double())
    want = torch.where(xf.isfinite(), xf, torch.nan).abs().amax(dim=axis, keepdim=True)
    assert _same_bits(got, want.float())
    unit = resolve_amax(x, f, None, axis)
    assert unit.shape == want.shape and bool((unit == f.unit_amax).all())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_rounding_primitives_match_the_enumerated_grids(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    for rounding, grid in ((e4m3_round, E4M3_GRID), (e2m1_round, E2M1_GRID)):
        assert _same_bits(rounding(x), _round_to_grid(x.double(), grid).float())


# invalid arguments: (name, value) pairs each call refuses, message starting with the name
_BAD_QDQ: list[tuple[str, object]] = [
    ("fmt", "int4"),
    ("fmt", 3),
    ("axis", 5),
    ("axis", 1.0),
    ("axis", True),
    ("amax", 0.0),
    ("amax", -2.0),
    ("amax", math.inf),
    ("amax", math.nan),
    ("amax", "static"),
    ("amax", True),
    ("amax", torch.zeros(1)),
    ("amax", torch.ones(1, dtype=torch.int32)),
    ("offset", -1),
    ("offset", 2.0),
    ("pad", "yes"),
    ("out_dtype", "float32"),
    ("out_dtype", torch.int64),
    ("out_dtype", torch.float8_e4m3fn),
    ("out_dtype", 7),
    ("x", [1.0, 2.0]),
]


@settings(max_examples=60, deadline=None)
@given(
    _tensors(block_axis_multiple=16),
    st.sampled_from(["none", "fp8", "nvfp4"]),
    st.sampled_from(_BAD_QDQ),
    st.booleans(),
)
def test_qdq_refuses_each_bad_argument_by_name(
    drawn: tuple[torch.Tensor, int], fmt: str, bad: tuple[str, object], factored: bool
) -> None:
    x, axis = drawn
    kwargs: dict[str, object] = {"axis": axis, "amax": None, "offset": 0, "pad": False}
    name, value = bad
    if name == "out_dtype" and factored:
        return  # qdq_factored has no out_dtype: its outputs are float32
    call_x: object = x
    call_fmt: object = fmt
    if name == "x":
        call_x = value
    elif name == "fmt":
        call_fmt = value
    else:
        kwargs[name] = value
    function = qdq_factored if factored else qdq
    with pytest.raises(ValueError, match=rf"^{name}: "):
        function(call_x, call_fmt, **kwargs)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["q", "k", "p", "v"]),
    st.sampled_from(["none", "fp8", "nvfp4", "int8", 3]),
    st.one_of(st.none(), st.just("dynamic"), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_attention_quant_accepts_or_names_the_role(role: str, fmt: object, amax: object) -> None:
    """Either the recipe holds what was asked (role defaults filled in), or a ValueError
    names the role (or ``fmt`` / ``amax`` for the operand itself) and nothing is built."""
    bad_fmt = fmt not in ("none", "fp8", "nvfp4")
    positive = isinstance(amax, float) and math.isfinite(amax) and amax > 0
    bad_amax = amax is not None and amax != "dynamic" and not positive
    if positive and fmt in ("fp8", "nvfp4"):  # a global scale that is a normal float32
        assert isinstance(amax, float)
        unit = get_format(fmt).unit_amax  # type: ignore[arg-type]
        bad_amax = amax > F32_MAX or amax / unit < F32_TINY
    if bad_fmt or bad_amax:
        with pytest.raises(ValueError, match="^fmt: " if bad_fmt else "^amax: "):
            OperandQuant(fmt, amax)  # type: ignore[arg-type]
        return
    operand = OperandQuant(fmt, amax)  # type: ignore[arg-type]
    dynamic_pv = role in ("p", "v") and amax == "dynamic"
    small_p = role == "p" and isinstance(amax, float) and amax < 1
    if fmt != "none" and (dynamic_pv or small_p):
        with pytest.raises(ValueError, match=f"^{role}: "):
            AttentionQuant(**{role: operand})
        return
    recipe = AttentionQuant(**{role: operand})
    got = getattr(recipe, role)
    if fmt == "none":
        assert got.is_identity and got.amax is None
        return
    defaults = {
        "q": "dynamic",
        "k": operand.format.unit_amax,
        "p": 1.0,
        "v": operand.format.unit_amax,
    }
    assert got.format is operand.format and got.amax == (defaults[role] if amax is None else amax)
    if role == "p" and not got.is_dynamic:
        assert got.static_amax() >= 1.0


# ---------------------------------------------------------------- amax range (float32)

F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38


@SETTINGS
@given(
    fmt=st.sampled_from(["fp8", "nvfp4"]),
    amax=st.floats(min_value=F32_MAX * 1.0001, max_value=1e300, allow_infinity=False),
    role=st.sampled_from(["q", "k", "v", "p"]),
)
def test_amax_beyond_float32_is_refused_naming_the_argument(
    fmt: str, amax: float, role: str
) -> None:
    """Every place a static amax enters (an operand, a recipe, ``qdq``) refuses one beyond
    float32's range before any arithmetic, naming the argument."""
    with pytest.raises(ValueError, match=r"^amax: .*beyond float32's range"):
        OperandQuant(fmt, amax=amax)
    with pytest.raises(ValueError, match=r"^amax: .*beyond float32's range"):
        qdq(torch.ones(32), fmt, amax=amax)


@SETTINGS
@given(
    fmt=st.sampled_from(["fp8", "nvfp4"]),
    exponent=st.floats(min_value=-320.0, max_value=0.0),
)
def test_amax_whose_scale_is_not_a_normal_float32_is_refused(fmt: str, exponent: float) -> None:
    """A static amax whose global scale ``amax / unit_amax`` is below float32's smallest
    normal is refused (the kernels multiply by its reciprocal); one at the boundary runs."""
    unit = get_format(fmt).unit_amax
    amax = F32_TINY * unit * 10.0**exponent * 0.999
    if amax <= 0.0:
        return
    with pytest.raises(ValueError, match=r"^amax: .*below float32's smallest normal"):
        OperandQuant(fmt, amax=amax)
    as_tensor = torch.tensor(amax)  # a float32 tensor (0 below float32's subnormals)
    message = r"^amax: .*below float32's smallest normal" if as_tensor > 0 else r"^amax: "
    with pytest.raises(ValueError, match=message):
        qdq(torch.ones(32), fmt, amax=as_tensor)


@SETTINGS
@given(
    fmt=st.sampled_from(["fp8", "nvfp4"]),
    amax=st.floats(min_value=1e-3, max_value=1e30),
)
def test_amax_in_range_gives_a_finite_recipe(fmt: str, amax: float) -> None:
    """In range, the operand, the recipe and ``qdq`` accept the amax, and the QDQ of
    values within it is finite."""
    quant = AttentionQuant(k=OperandQuant(fmt, amax=amax), v=OperandQuant(fmt, amax=amax))
    assert math.isfinite(quant.k.global_scale()) and quant.k.global_scale() > 0
    x = torch.linspace(-1.0, 1.0, 32) * min(amax, 1e30)
    assert bool(torch.isfinite(qdq(x, fmt, amax=amax)).all())
