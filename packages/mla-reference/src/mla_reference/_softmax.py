"""The steps prefill and decode share: operand QDQ, the softmax rows, normalization.

Both oracles reduce to rows: one query token in one head against its visible keys.
``quantize_operand`` turns an input into the operand a matmul uses;
``softmax_rows`` turns a row's scores into the quantized P, the denominator and
the base-2 reference point (docs/numerics.md "Softmax, P and schedule invariance");
``normalize`` turns ``P̂ V̂`` into the output and the natural-log LSE.

Non-finite operands (docs/numerics.md "Non-finite input") poison by row, never by
arithmetic accident: ``split_non_finite`` flags the rows of an operand that hold a
NaN or an infinity and zeroes those elements, the attention is computed on the
zeroed operands (so a key a row does not see cannot reach it through ``0 * NaN``),
and ``softmax_rows`` (q̂ or k̂ of a seen key) and ``poison_v`` (v̂ of a seen key)
write NaN into exactly the rows the rule names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_formats import AttentionQuant, OperandQuant, qdq

__all__ = [
    "LN2",
    "LOG2E",
    "SoftmaxRows",
    "normalize",
    "poison_v",
    "quantize_operand",
    "resolve_quant",
    "seen_any",
    "softmax_rows",
    "split_non_finite",
]

LOG2E = math.log2(math.e)
"""log2(e): base-2 scores are ``t = s * LOG2E``."""
LN2 = math.log(2.0)
"""ln(2): ``lse = ln(l) + m * LN2``."""


def resolve_quant(quant: AttentionQuant | None) -> AttentionQuant:
    """``quant=None`` means every operand ``none``."""
    return AttentionQuant() if quant is None else quant


def quantize_operand(
    x: torch.Tensor,
    operand: OperandQuant,
    *,
    axis: int,
    compute_dtype: torch.dtype,
    pad: bool = False,
) -> torch.Tensor:
    """The operand a matmul uses, in ``compute_dtype``.

    ``none`` is no rounding at all: ``x`` is only cast to ``compute_dtype``. Any other
    format is ``mla_formats.qdq`` along ``axis`` with the operand's amax (a static
    float or ``"dynamic"``, one value per row along ``axis``), computed in float32
    by definition, blocks at index 0 of ``axis`` (``pad`` zero-completes the open
    tail block), then cast to ``compute_dtype``. An empty tensor has nothing to round.
    """
    if operand.is_identity or x.numel() == 0:  # (qdq cannot block an empty tensor)
        return x.to(compute_dtype)
    return qdq(x, operand, axis=axis, pad=pad, out_dtype=torch.float32).to(compute_dtype)


def split_non_finite(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite, bad)``: ``x`` with its NaN and ±inf elements set to 0, and the bool
    flags of the vectors along ``dim`` that held one (``dim`` reduced)."""
    finite = torch.isfinite(x)
    return torch.where(finite, x, torch.zeros_like(x)), ~finite.all(dim=dim)


def seen_any(visible: torch.Tensor, bad_keys: torch.Tensor) -> torch.Tensor:
    """Rows that see a flagged key: ``visible [..., R, L]`` and ``bad_keys [..., L]``
    (broadcasting) give bool ``[..., R]``."""
    return (visible & bad_keys.unsqueeze(-2)).any(dim=-1)


@dataclass(frozen=True)
class SoftmaxRows:
    """The softmax of a batch of rows ``[..., L]`` (keys on the last axis).

    Attributes:
        p: the P that multiplies V: QDQ'd along the keys when P is quantized, 0 at
            masked keys; ``[..., L]`` in the compute dtype.
        l: the denominator, the sum of the unquantized P; ``[...]``, 0 for an empty row.
        m: the base-2 reference point ``ceil(max_j t_j)`` (integer-valued); ``[...]``,
            ``-inf`` for an empty row.
        empty: rows without a visible (kept) key; ``[...]`` bool.

    A row poisoned by q̂ or k̂ (``softmax_rows``' ``poisoned``) has ``p``, ``l`` and
    ``m`` all NaN, so its output and LSE are NaN.
    """

    p: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the contract's name for the denominator)
    m: torch.Tensor
    empty: torch.Tensor


def softmax_rows(
    s: torch.Tensor,
    keep: torch.Tensor,
    p_quant: OperandQuant,
    poisoned: torch.Tensor | None = None,
) -> SoftmaxRows:
    """Softmax numerator, denominator and quantized P of rows of scores.

    Args:
        s: scores ``(q̂ · k̂_j) * softmax_scale`` ``[..., L]`` in the compute dtype;
            the keys' positions along the last axis start at 0 (P's block origin).
        keep: bool ``[..., L]`` (broadcasting to ``s``): keys the row sees (visible
            and, with N:M, kept).
        p_quant: P's format and static amax.
        poisoned: bool ``[...]`` or None: rows whose q̂, or the k̂ of a key they see,
            holds a non-finite value; their ``p``, ``l`` and ``m`` are NaN. A row
            without a visible key is not poisoned (it reads no operand pair).

    With ``t = s * LOG2E``: ``m = ceil(max over kept keys of t)``,
    ``P_j = 2^(t_j - m)`` at kept keys and 0 elsewhere, ``l = sum_j P_j``, and
    ``p = QDQ(P)`` along the keys (P rounded to float32 first, then ``qdq`` in
    float32, back to the compute dtype), or ``P`` itself when P is not quantized.
    """
    keep = keep.expand(s.shape)
    if s.shape[-1] == 0:  # no keys at all: every row is empty
        rows = s.shape[:-1]
        return SoftmaxRows(
            p=s,
            l=s.new_zeros(rows),
            m=s.new_full(rows, -math.inf),
            empty=torch.ones(rows, dtype=torch.bool, device=s.device),
        )
    t = s * LOG2E
    t_max = torch.where(keep, t, -math.inf).amax(dim=-1)
    m = torch.ceil(t_max)
    empty = ~keep.any(dim=-1)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    p = torch.where(keep, torch.exp2(t - m_safe.unsqueeze(-1)), torch.zeros_like(t))
    l = p.sum(dim=-1)  # noqa: E741
    p_hat = quantize_operand(p, p_quant, axis=-1, compute_dtype=s.dtype, pad=True)
    if poisoned is not None:
        poisoned = poisoned & ~empty
        p_hat = torch.where(poisoned.unsqueeze(-1), math.nan, p_hat)
        l = torch.where(poisoned, math.nan, l)  # noqa: E741
        m = torch.where(poisoned, math.nan, m)
    return SoftmaxRows(p=p_hat, l=l, m=m, empty=empty)


def normalize(acc: torch.Tensor, rows: SoftmaxRows) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from ``acc = P̂ V̂`` ``[..., Dv]`` and the rows' softmax.

    ``out = acc / l`` and ``lse = ln(l) + m ln 2``; an empty row gives ``out = 0``
    and ``lse = -inf``. Both in the compute dtype.
    """
    empty = rows.empty
    l_safe = torch.where(empty, torch.ones_like(rows.l), rows.l)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(acc), acc / l_safe.unsqueeze(-1))
    lse = torch.where(empty, torch.full_like(rows.l, -math.inf), torch.log(l_safe) + rows.m * LN2)
    return out, lse


def poison_v(out: torch.Tensor, sees_bad_v: torch.Tensor) -> torch.Tensor:
    """``out [..., Dv]`` with every feature of the rows in ``sees_bad_v [...]`` (rows
    that see a key whose v̂ holds a non-finite value) set to NaN; the LSE keeps its value."""
    return torch.where(sees_bad_v.unsqueeze(-1), math.nan, out)
