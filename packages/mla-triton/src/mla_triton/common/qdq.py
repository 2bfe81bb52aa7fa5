"""Triton device functions for in-kernel QDQ, in float32 arithmetic (docs/numerics.md "Formats and
scales", "Where it runs").

No fp8 casts: the rounding is done with float32 compares, floors and exponent
bit manipulation, so it runs on sm80 and in Triton's CPU interpreter (whose fp8
casts round wrongly), and it matches ``mla_formats`` bit for bit.

Every function returns the *factored* value (the QDQ'd value divided by its
global scale: ``E2M1(..) * sb`` for nvfp4, ``E4M3(..)`` for fp8), exact in fp16
and bf16; callers apply global scales to float32 accumulators.

Non-finite input (docs/numerics.md, the NaN rule): NaN and ±inf become NaN and
poison what shares their scale: block maxima propagate NaN (``nan_max``), an
infinite maximum turns its scale into NaN (``poison``), and the element roundings
keep NaN and turn ±inf into NaN. A finite value beyond the range still saturates.
``a * 0`` is 0 for a finite ``a`` and NaN otherwise, so ``y + a * 0`` poisons ``y``
in one ``fma`` (a zero result loses its sign, which no dot sees). Not ``y + (a - a)``:
compiled for a GPU, LLVM contracts ``a - a`` with the multiply that made ``a`` into
``fma(b, c, -a)``, the product's rounding error instead of 0 (software
E4M3 scales of ``bmax * inv_6gs`` came out as 447.99997 or 5.7e-14).

E2M1 without a division: ``E2M1(a / scale)`` only depends on which of the grid's
midpoints ``a / scale`` passes, so ``a`` is compared with ``midpoint * scale``.
Midpoints have two significant bits and ``scale = sb * gs`` is an E4M3 value times
the global scale, so for ``gs`` a power of two (the defaults) these products are
exact and the compares equal the reference's rounded division.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter

# Format codes, passed to kernels as constexpr ints.
FMT_NONE: tl.constexpr = tl.constexpr(0)
FMT_FP8: tl.constexpr = tl.constexpr(1)
FMT_NVFP4: tl.constexpr = tl.constexpr(2)
FORMAT_CODES = {"none": 0, "fp8": 1, "nvfp4": 2}


@triton.jit
def _maximum_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(x, axis: tl.constexpr):
    """``max`` along ``axis`` that returns NaN when any element is NaN (``tl.max`` skips it)."""
    return tl.reduce(x, axis, _maximum_nan)


def _interpreter_nan_max_in_numpy() -> bool:
    """Let Triton's CPU interpreter reduce ``nan_max`` with ``np.max``, as it does ``tl.max``.

    The interpreter runs a ``tl.reduce`` whose combine function it does not know one
    element at a time in Python: 95% of an interpreted nvfp4 decode (148 of 155 s for a
    4-request batch). ``np.max`` is ``np.maximum`` reduced, and ``np.maximum`` is what the
    interpreter runs for ``_maximum_nan``'s ``tl.maximum(..., PropagateNan.ALL)``: the same
    values, NaN included (max does not depend on the order; ``nan_max`` is only given
    magnitudes, so no signed zeros). Compiled kernels are untouched; without this
    interpreter's hook (another Triton) the generic path stays. Returns whether it is set.
    """
    ops = getattr(interpreter, "ReduceOps", None)
    generic = getattr(ops, "apply_impl", None)
    if ops is None or generic is None or not hasattr(ops, "min_max"):
        return False
    if hasattr(generic, "_mla_generic"):  # set already
        return True

    def apply_impl(self: Any, input: Any) -> Any:
        if self.combine_fn is _maximum_nan:
            return self.min_max(input[0], val_reduce_op=np.max, idx_reduce_op=None)
        return generic(self, input)

    apply_impl._mla_generic = generic  # type: ignore[attr-defined]
    ops.apply_impl = apply_impl
    return True


interpreter_nan_max_in_numpy = _interpreter_nan_max_in_numpy()
"""Whether the interpreter reduces ``nan_max`` with ``np.max`` (set at import)."""


@triton.jit
def poison(y, a):
    """``y`` where ``a`` is finite, else NaN (``a`` broadcasts against ``y``); exact
    whether or not the compiler fuses it into ``fma(a, 0, y)``."""
    return y + a * 0.0


@triton.jit
def dynamic_global_scale(x1, x2, FMT: tl.constexpr, AXIS: tl.constexpr):
    """Global scale of a dynamic amax over the rows of ``x1`` and ``x2`` together (float32).

    ``amax / unit_amax`` (448 fp8, 2688 nvfp4; the reference's rounded division) with
    the amax reduced along ``AXIS`` of both tiles; an all-zero row takes the unit
    amax (its values quantize to zeros); a row with a non-finite element gets NaN.
    """
    return global_scale_of_amax(amax_update(nan_max(tl.abs(x1), AXIS), x2, AXIS), FMT)


@triton.jit
def amax_update(amax, x, AXIS: tl.constexpr):
    """``max(amax, max |x|)`` with ``|x|`` reduced along ``AXIS``: NaN where either holds
    a NaN (a dynamic amax over several tiles)."""
    return _maximum_nan(amax, nan_max(tl.abs(x), AXIS))


@triton.jit
def global_scale_of_amax(amax, FMT: tl.constexpr):
    """``dynamic_global_scale`` of a reduced ``amax``: ``amax / unit_amax`` (the
    reference's rounded division), the unit amax for 0, NaN for a non-finite amax."""
    unit = 448.0 if FMT == 1 else 2688.0
    return poison(tl.math.div_rn(tl.where(amax == 0.0, unit, amax), unit), amax)


@triton.jit
def e4m3_round(x):
    """Round float32 ``x`` to E4M3FN, ties to even, saturating finite values at ±448.

    NaN stays NaN and ±inf becomes NaN."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormal step stays 2^-9
    quantum = ((binade - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - binade + 3) << 23).to(tl.float32, bitcast=True)
    t = a * inv_quantum  # exact: power-of-two scaling, t < 16
    whole = tl.floor(t)
    frac = t - whole
    odd = whole - 2.0 * tl.floor(whole * 0.5)
    up = (frac > 0.5) | ((frac == 0.5) & (odd == 1.0))
    r = (whole + tl.where(up, 1.0, 0.0)) * quantum
    r = tl.where(x < 0, -r, r)
    return poison(r, x)


@triton.jit
def e2m1_magnitude(a, scale):
    """``E2M1(a / scale)`` for ``a >= 0`` and ``scale > 0``, ties to even, saturating at 6.

    Computed from compares with the grid midpoints times ``scale`` (no division).
    """
    r = tl.where(a > 0.25 * scale, 0.5, 0.0)
    r += tl.where(a >= 0.75 * scale, 0.5, 0.0)
    r += tl.where(a > 1.25 * scale, 0.5, 0.0)
    r += tl.where(a >= 1.75 * scale, 0.5, 0.0)
    r += tl.where(a > 2.5 * scale, 1.0, 0.0)
    r += tl.where(a >= 3.5 * scale, 1.0, 0.0)
    r += tl.where(a > 5.0 * scale, 2.0, 0.0)
    return r


@triton.jit
def nvfp4_block_scale(block_max, gs):
    """E4M3 block scale ``E4M3(min(block_max / (6 gs), 448))``, with the reference's division.

    NaN when ``block_max`` is not finite (the whole block becomes NaN)."""
    return poison(e4m3_round(tl.minimum(tl.math.div_rn(block_max, gs * 6.0), 448.0)), block_max)


@triton.jit
def div_rn_fma(a, b, inv_b, FMA: tl.constexpr):
    """``a / b`` rounded to nearest, given ``inv_b``, the correctly rounded ``1 / b``.

    With ``FMA`` (compiled code, where ``tl.fma`` is fused): ``q = a * inv_b`` is
    within an ulp, the residual ``a - b q`` is exact in one FMA, and ``q + r inv_b``
    rounds to the correctly rounded quotient (Markstein's correction); three
    instructions instead of a full division. Without ``FMA`` (the interpreter
    evaluates ``tl.fma`` unfused): ``div_rn``. Finite quotients only.
    """
    if FMA:
        q = a * inv_b
        return tl.fma(tl.fma(-q, b, a), inv_b, q)
    return tl.math.div_rn(a, b)


@triton.jit
def e2m1_scaled(a, scale, EXACT: tl.constexpr, FMA: tl.constexpr = False):
    """``E2M1(a / scale)`` for ``a >= 0``; ``EXACT`` divides exactly first.

    The compare form (``EXACT=False``) is bit-exact when ``scale`` times the grid
    midpoints is exact (a power-of-two global scale); ``EXACT=True`` reproduces the
    reference's rounded division for any global scale (dynamic amax, calibrated
    static amax) at the cost of one division per element (NaN-free input; ``FMA``:
    see ``div_rn_fma``).
    """
    if EXACT:
        # the correctly rounded quotient, then round-to-nearest-even onto E2M1 by
        # one magic-number addition (e2m1_round_nonneg, below); a zero scale (an
        # all-zero or all-tiny block) gives 0 once the block scale multiplies the
        # code, whatever the code: divide by 1 instead of 0
        scale = tl.where(scale == 0.0, 1.0, scale)
        return e2m1_round_nonneg(div_rn_fma(a, scale, tl.math.div_rn(1.0, scale), FMA))
    return e2m1_magnitude(a, scale)


@triton.jit
def blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr):
    """A float32 tile ``[ROWS, COLS]`` as 16-element blocks along ``AXIS``: ``[ROWS, COLS
    // 16, 16]`` along the features (1), ``[ROWS // 16, 16, COLS]`` along the tokens (0:
    the tile starts at a multiple of 16). A block's 16 elements lie along ``AXIS + 1``."""
    tl.static_assert(AXIS == 0 or AXIS == 1, "AXIS: 1 (features) or 0 (tokens)")
    tl.static_assert((COLS if AXIS == 1 else ROWS) % 16 == 0, "16-element blocks")
    if AXIS == 1:
        xb = tl.reshape(x, (ROWS, COLS // 16, 16))
    else:
        xb = tl.reshape(x, (ROWS // 16, 16, COLS))
    return xb


@triton.jit
def nvfp4_qdq(
    x,
    gs,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    AXIS: tl.constexpr,
    EXACT: tl.constexpr = False,
    FMA: tl.constexpr = False,
):
    """NVFP4 QDQ of a float32 tile ``[ROWS, COLS]`` in blocks of 16 along ``AXIS``.

    ``AXIS`` 1: blocks of 16 columns (features), ``gs`` a scalar or ``[ROWS, 1]``. 0:
    blocks of 16 rows (tokens): the tile must start at an absolute token position
    that is a multiple of 16, with zeros in rows past the end of the sequence; ``gs``
    a scalar. Returns the factored value. ``EXACT``, ``FMA``: see ``e2m1_scaled``
    (needed for bit-exactness when ``gs`` is not a power of two).
    """
    xb = blocks(x, ROWS, COLS, AXIS)
    sb = nvfp4_block_scale(nan_max(tl.abs(xb), AXIS + 1), gs)  # the 16-element axis reduced
    sb3 = tl.expand_dims(sb, AXIS + 1)
    scale3 = tl.expand_dims(sb * gs, AXIS + 1)  # (gs may be [ROWS, 1]: multiply, then expand)
    mag = e2m1_scaled(tl.abs(xb), scale3, EXACT, FMA) * sb3
    return tl.reshape(tl.where(xb < 0, -mag, mag), (ROWS, COLS))


@triton.jit
def fp8_qdq(x, inv_scale):
    """FP8 QDQ factored value ``E4M3(clamp(x * inv_scale, ±448))``.

    ``inv_scale`` is ``1 / s`` (``448 / amax``); callers that need the reference's
    exact division pass ``x`` already divided with ``tl.math.div_rn``.
    """
    return e4m3_round(x * inv_scale)


# -- fast paths for P (nonnegative, at most 1, quantized once per tile pair) ------
#
# P is quantized inside the attention loop, where every instruction per element
# counts against the tensor cores. These variants drop the sign handling, replace
# divisions by multiplications with reciprocals, round E2M1 with one magic-number
# addition instead of seven compares, and may use the hardware E4M3 conversion.
# They can differ from the reference by one code where a value sits within an ulp
# of a rounding midpoint, the same order as the exp2 rounding of P itself.


@triton.jit
def e4m3_round_hw(x, HW: tl.constexpr):
    """E4M3 rounding of float32 ``x`` (NaN-free); ``HW``: the sm89+ conversion instruction.

    ``HW`` is for GPUs only: the interpreter rounds fp8 casts wrongly.
    """
    if HW:
        return x.to(tl.float8e4nv).to(tl.float32)  # cvt.rn.satfinite
    return e4m3_round(x)


@triton.jit
def recip_hw(x, HW: tl.constexpr):
    """``1 / x`` for float32 ``x`` in ``[1e-30, 2^126)`` or NaN; ``HW``: one ``MUFU.RCP``.

    Triton's ``1.0 / x`` is ``div.full.f32``: ``MUFU.RCP`` of ``x`` times 1 on that range,
    behind range checks and rescales (seven instructions more, in the SASS); with
    ``HW`` (GPUs only: the interpreter runs no PTX) the same reciprocal is asked for
    directly (``rcp.approx.ftz.f32``), the same bits. Block scales times global scales
    fall in that range: at least the ``1e-30`` they are clamped to, at most 448 times a
    global scale of a finite bf16 amax (``3.4e38 / 2688``).
    """
    if HW:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return 1.0 / x


@triton.jit
def e2m1_round_nonneg(y):
    """E2M1 round-to-nearest-even of ``y >= 0`` (NaN-free), saturating at 6.

    The grid's step is half the binade of ``max(y, 1)`` (0.5 below 2, 1 below 4, 2
    up to 6). Adding and subtracting ``1.5 * 2^23 * step`` rounds ``y`` to a
    multiple of the step, ties to even, in one float32 rounding; even multiples
    of the step are exactly E2M1's even codes.
    """
    y = tl.minimum(y, 6.0)
    binade = (tl.maximum(y, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(
        tl.float32, bitcast=True
    )
    magic = binade * 6291456.0  # 1.5 * 2^23 * (binade / 2)
    return (y + magic) - magic


@triton.jit
def nvfp4_qdq_p(
    p, gs, inv_6gs, ROWS: tl.constexpr, COLS: tl.constexpr, HW: tl.constexpr,
    OUT: tl.constexpr = tl.float32,
):  # fmt: skip
    """Fast NVFP4 QDQ of a nonnegative float32 tile ``[ROWS, COLS]`` along axis 1.

    ``gs`` the (scalar) global scale and ``inv_6gs = 1 / (6 gs)``. Returns the
    factored value ``E2M1(p / (sb gs)) * sb`` in ``OUT`` (exact in fp16 and bf16); see
    the section comment for how it may differ from ``nvfp4_qdq``. With ``HW`` the
    reciprocal is ``recip_hw``'s (the same bits) and the codes are multiplied by their
    block scales in fp16, two a ``mul.f16x2`` (exact: at most 6 significant bits, within
    ``[2^-10, 2688]``).
    """
    xb = tl.reshape(p, (ROWS, COLS // 16, 16))
    sb = e4m3_round_hw(tl.max(xb, axis=2) * inv_6gs, HW)  # saturates at 448
    # a zero block scale: any finite code times 0 gives the reference's 0
    inv = recip_hw(tl.maximum(sb * gs, 1e-30), HW)
    code = e2m1_round_nonneg(xb * tl.expand_dims(inv, 2))
    if HW:
        h = code.to(tl.float16) * tl.expand_dims(sb.to(tl.float16), 2)
        return tl.reshape(h, (ROWS, COLS)).to(OUT)
    return tl.reshape(code * tl.expand_dims(sb, 2), (ROWS, COLS)).to(OUT)


@triton.jit
def fp8_qdq_p(p, inv_scale, HW: tl.constexpr, OUT: tl.constexpr = tl.float32):
    """Fast FP8 QDQ factored value ``E4M3(min(p * inv_scale, 448))`` of ``p >= 0``, in
    ``OUT`` (exact in fp16 and bf16)."""
    return e4m3_round_hw(p * inv_scale, HW).to(OUT)  # both roundings saturate at 448


# -- fast paths for 16-bit K and V tiles, quantized on read in the decode loop ------
#
# The same multiply-and-magic-number rounding as above, signed, plus ``snap_ties``:
# a product with a reciprocal lands within 2^-21 of ``a / scale``, which at an exact
# tie (``a`` equal to a midpoint times the scale: common in 16-bit data) can fall on
# the wrong side. For a 16-bit ``a`` and a power-of-two global scale, ``a / scale``
# is either exactly a midpoint (at most 7 significant bits) or at least 2^-11 from
# one (relative), so rounding the product to 13 significant bits restores exact
# ties and moves nothing else across a midpoint: the result equals ``mla_formats``
# bit for bit. Without ``SNAP`` (global scales that are not powers of two) it may
# differ by one code within 2^-21 of a midpoint. A non-finite element makes its
# block scale NaN, hence its whole block.


@triton.jit
def snap_ties(y):
    """Round float32 ``y >= 0`` to 13 significant bits (half up): exact ties come back."""
    return ((y.to(tl.int32, bitcast=True) + 0x400) & -2048).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_fast_blocks(a, bmax, gs, inv_6gs, HW: tl.constexpr, SNAP: tl.constexpr):
    """Codes times block scales for magnitudes ``a`` whose block maxima ``bmax`` are given.

    A non-finite ``bmax`` gives a NaN block scale (the block's codes times it: NaN)."""
    v = bmax * inv_6gs
    if SNAP:
        v = snap_ties(v)
    sb = poison(e4m3_round_hw(v, HW), bmax)  # both roundings saturate finite values at 448
    inv = recip_hw(tl.maximum(sb * gs, 1e-30), HW)  # sb = 0: finite codes times 0 give 0
    return sb, inv


@triton.jit
def nvfp4_qdq_fast(
    x,
    gs,
    inv_6gs,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    AXIS: tl.constexpr,
    HW: tl.constexpr,
    SNAP: tl.constexpr,
):
    """Fast NVFP4 QDQ of a float32 tile ``[ROWS, COLS]`` in blocks of 16 along ``AXIS``.

    ``AXIS`` as ``nvfp4_qdq`` (0: the tile starts at a multiple of 16, rows past the
    sequence's end are zeros). ``gs`` and ``inv_6gs = 1 / (6 gs)``: scalars, or
    ``[ROWS, 1]`` along the features. Returns the factored value; see the section
    comment for exactness.
    """
    xb = blocks(x, ROWS, COLS, AXIS)
    a = tl.abs(xb)
    sb, inv = _nvfp4_fast_blocks(a, nan_max(a, AXIS + 1), gs, inv_6gs, HW, SNAP)
    y = a * tl.expand_dims(inv, AXIS + 1)
    if SNAP:
        y = snap_ties(y)
    mag = e2m1_round_nonneg(y) * tl.expand_dims(sb, AXIS + 1)
    return tl.reshape(tl.where(xb < 0, -mag, mag), (ROWS, COLS))
