"""Quantize-dequantize (QDQ) of a tensor along one axis, in float32 torch.

The definitions: docs/numerics.md "Formats and scales".

``qdq`` returns the simulated low-precision value in the input dtype.
``qdq_factored`` returns the same value split as ``values * global_scale``, the
form the kernels use: ``values`` holds at most 6 significant bits with magnitude
in [2^-10, 2688] (or 0), so it is exact in bf16 and fp16 and a dot of two such
operands on 16-bit tensor cores is exact; the global scales go onto the float32
accumulator.

Block origin. nvfp4 blocks are 16 consecutive elements at absolute indices that
are multiples of 16 along the blocked axis. ``offset`` is the absolute index of
``x``'s first element along that axis; with ``pad=True`` the partial blocks at
either end of a slice are completed with zeros (elements outside the slice count
as 0 for the block maximum), which is how an open tail block of a sequence is
quantized. Without ``pad`` the slice must cover whole blocks.

Non-finite input (every format but ``none``; docs/numerics.md "Non-finite input"):
+inf, -inf and NaN alike become NaN, and the NaN spreads over everything that
shares its scale: its nvfp4 block of 16 (the block scale is NaN) and, under a
dynamic amax, its whole row (the global scale is NaN). A finite value beyond the
format's range still saturates. No non-finite input ever becomes a finite value.
``none`` passes every value through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_formats.formats import Format, FormatLike, OperandQuant, check_scale, get_format
from mla_formats.rounding import E4M3_MAX, e2m1_round, e4m3_round

__all__ = ["AmaxArg", "qdq", "qdq_factored", "resolve_amax"]

AmaxArg = float | torch.Tensor | str | None
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _normalize_axis(x: torch.Tensor, axis: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis: expected an int, got {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis: {axis} is out of range for a {x.dim()}-d tensor")
    return axis % x.dim()


def resolve_amax(x: torch.Tensor, fmt: Format, amax: AmaxArg, axis: int) -> torch.Tensor:
    """The amax as a float32 tensor shaped like ``x`` with ``axis`` reduced to 1.

    ``None`` gives ``fmt.unit_amax`` (global scale 1); ``"dynamic"`` the max of
    |x| over ``axis`` (per row), NaN for a row holding a NaN or an infinity; a float
    or tensor must be positive and finite.
    """
    axis = _normalize_axis(x, axis)
    shape = list(x.shape)
    shape[axis] = 1
    if amax is None:
        return torch.full(shape, fmt.unit_amax, dtype=torch.float32, device=x.device)
    if isinstance(amax, str):
        if amax != "dynamic":
            raise ValueError(f"amax: expected a number, a tensor, None or 'dynamic', got {amax!r}")
        if x.shape[axis] == 0:  # an empty row has amax 0, like an all-zero one
            return torch.zeros(shape, dtype=torch.float32, device=x.device)
        row_max = x.detach().float().abs().amax(dim=axis, keepdim=True)  # NaN propagates
        return _nan_if_not_finite(row_max)
    if isinstance(amax, torch.Tensor):
        if not amax.is_floating_point():
            raise ValueError(f"amax: expected a floating tensor, got {amax.dtype}")
        try:
            value = amax.detach().to(device=x.device, dtype=torch.float32).broadcast_to(shape)
        except RuntimeError as err:
            raise ValueError(
                f"amax: shape {tuple(amax.shape)} does not broadcast to {tuple(shape)} "
                f"(x with axis {axis} reduced)"
            ) from err
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise ValueError("amax: every value must be positive and finite")
        if not fmt.is_identity:
            check_scale(fmt, float(value.min()), "amax")
        return value.contiguous()
    if isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise ValueError(f"amax: expected a number, a tensor, None or 'dynamic', got {amax!r}")
    if not (float(amax) > 0.0 and float(amax) != float("inf")):
        raise ValueError(f"amax: must be positive and finite, got {amax!r}")
    check_scale(fmt, float(amax), "amax")
    return torch.full(shape, float(amax), dtype=torch.float32, device=x.device)


def _nan_if_not_finite(a: torch.Tensor) -> torch.Tensor:
    """``a`` with ±inf replaced by NaN (the sign of zero kept)."""
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("nan")))


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected a floating dtype {_FLOAT_DTYPES}, got {x.dtype}")


def _checked(
    x: torch.Tensor,
    fmt: FormatLike | OperandQuant,
    axis: int,
    amax: AmaxArg,
    offset: int,
    pad: bool,
) -> tuple[Format, int, AmaxArg]:
    """Every check of ``qdq`` and ``qdq_factored``, before any work: the format, the
    normalized axis and the amax (an ``OperandQuant``'s when ``amax`` is None)."""
    _check_x(x)
    if isinstance(fmt, OperandQuant):
        if amax is None:
            amax = fmt.amax
        fmt = fmt.format
    fmt = get_format(fmt)
    axis = _normalize_axis(x, axis)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset: expected a non-negative int, got {offset!r}")
    if not isinstance(pad, bool):
        raise ValueError(f"pad: expected a bool, got {pad!r}")
    if amax != "dynamic":  # a static amax is checked (cheaply) whatever the format
        resolve_amax(x, fmt, amax, axis)
    block = fmt.block_size
    if block is not None and not pad and (offset % block or x.shape[axis] % block):
        raise ValueError(
            f"x: nvfp4 blocks of {block} along axis {axis} need whole blocks, but the axis "
            f"has length {x.shape[axis]} at offset {offset}; pass pad=True to complete "
            "partial blocks with zeros"
        )
    return fmt, axis, amax


def qdq_factored(
    x: torch.Tensor,
    fmt: FormatLike | OperandQuant,
    *,
    axis: int = -1,
    amax: AmaxArg = None,
    offset: int = 0,
    pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QDQ ``x`` along ``axis`` and return ``(values, global_scale)``, both float32.

    ``values`` has ``x``'s shape; ``global_scale`` has ``x``'s shape with ``axis``
    reduced to 1, and ``values * global_scale`` equals ``qdq(x, ...)`` in float32.
    For ``none`` the values are ``x`` in float32 and the scale is 1. ``fmt`` may be
    an ``OperandQuant``, whose amax is used when ``amax`` is None.
    """
    fmt, axis, amax = _checked(x, fmt, axis, amax, offset, pad)
    if fmt.is_identity:
        shape = list(x.shape)
        shape[axis] = 1
        return x.float(), torch.ones(shape, dtype=torch.float32, device=x.device)

    amax_t = resolve_amax(x, fmt, amax, axis)
    xf = _nan_if_not_finite(x.float())  # ±inf is quantized as NaN, never saturated
    # An all-zero row under a dynamic amax has amax 0: any scale gives zeros.
    amax_t = torch.where(amax_t == 0, torch.full_like(amax_t, fmt.unit_amax), amax_t)
    # Divide by a tensor: CUDA turns division by a Python scalar into a reciprocal multiply.
    gscale = amax_t / torch.full_like(amax_t, fmt.unit_amax)

    if fmt.block_size is None:  # fp8: one scale per row or tensor
        values = e4m3_round(torch.clamp(xf / gscale, -E4M3_MAX, E4M3_MAX))
    else:
        values = _nvfp4_values(xf, gscale, axis, fmt.block_size, offset, pad)
    return values, gscale


def _nvfp4_values(
    xf: torch.Tensor, gscale: torch.Tensor, axis: int, block: int, offset: int, pad: bool
) -> torch.Tensor:
    length = xf.shape[axis]
    lead = offset % block
    tail = (-(lead + length)) % block  # both 0 unless pad (checked in _checked)
    rows = F.pad(xf.movedim(axis, -1), (lead, tail))
    # [..., n_blocks, 16]; the block count is explicit so empty tensors reshape too
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // block, block)
    gs = gscale.movedim(axis, -1).unsqueeze(-1)  # [..., 1, 1]
    block_max = blocks.abs().amax(dim=-1, keepdim=True)  # NaN propagates: the block is NaN
    block_scale = e4m3_round(torch.clamp(block_max / (gs * 6.0), max=E4M3_MAX))
    codes = e2m1_round(blocks / (block_scale * gs))
    values = torch.where(block_scale == 0, blocks * 0.0, codes * block_scale)
    values = values.flatten(-2)[..., lead : lead + length]
    return values.movedim(-1, axis)


def qdq(
    x: torch.Tensor,
    fmt: FormatLike | OperandQuant,
    *,
    axis: int = -1,
    amax: AmaxArg = None,
    offset: int = 0,
    pad: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize-dequantize ``x`` along ``axis``; returns ``out_dtype`` or x's dtype.

    The definitions: docs/numerics.md "Formats and scales".

    Args:
        x: a floating tensor of any shape and device.
        fmt: ``"none"``, ``"fp8"``, ``"nvfp4"``, a ``Format`` or an ``OperandQuant``;
            ``none`` returns ``x`` unchanged (only cast to ``out_dtype``).
        axis: the blocked (contraction) axis; also the axis a dynamic amax reduces.
        amax: ``None`` (the format's unit amax, global scale 1), a positive float
            (one static scale), a tensor broadcasting to x with ``axis`` reduced
            (per-row scales), or ``"dynamic"`` (max |x| of each row along ``axis``).
        offset: absolute index of x's first element along ``axis`` (nvfp4 blocks).
        pad: complete partial nvfp4 blocks at either end with zeros.
        out_dtype: the returned dtype, one of float16, bfloat16, float32 and float64;
            x's dtype by default.
    """
    if out_dtype is not None and (
        not isinstance(out_dtype, torch.dtype) or out_dtype not in _FLOAT_DTYPES
    ):
        raise ValueError(f"out_dtype: expected None or one of {_FLOAT_DTYPES}, got {out_dtype!r}")
    checked, _, _ = _checked(x, fmt, axis, amax, offset, pad)
    if checked.is_identity:  # no rounding at all, not even to float32
        return x.to(out_dtype or x.dtype)
    values, gscale = qdq_factored(x, fmt, axis=axis, amax=amax, offset=offset, pad=pad)
    return (values * gscale).to(out_dtype or x.dtype)
