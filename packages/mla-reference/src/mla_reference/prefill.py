"""Eager oracle of quantized varlen prefill attention.

The definitions: docs/numerics.md "Operands and axes" to "LSE, masks and input checks".

Written from the definitions, one sequence at a time: QDQ the operands, form every
score of a row, mask, softmax with the power-of-two reference point, QDQ P, multiply
by V̂ and divide by the unquantized denominator. No tiles, no splits, no online
softmax. To bound memory the queries of a sequence are processed in chunks of rows;
a row is always computed whole, over all of its sequence's keys, so the chunk size
cannot change any result. Non-finite operands poison by row (docs/numerics.md
"Non-finite input"): flags per operand row, the attention on zeroed operands, NaN
written into the rows that see a flagged element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_reference._softmax import (
    normalize,
    poison_v,
    quantize_operand,
    resolve_quant,
    seen_any,
    softmax_rows,
    split_non_finite,
)
from mla_reference._validate import check_prefill

__all__ = ["nm_keep", "prefill"]

_ELEMENT_BUDGET = 1 << 22
"""Upper bound on the elements of one chunk's ``[H, rows, Lk]`` score tensor (times
``m`` under N:M). About 32 MiB per such tensor in float64; a chunk holds a handful."""


def nm_keep(
    s: torch.Tensor, visible: torch.Tensor, q_pos: torch.Tensor, sparsity: NMSparsity
) -> torch.Tensor:
    """Keys an N:M-sparsified row keeps (docs/numerics.md "N:M sparsity").

    Args:
        s: scores ``[H, R, Lk]`` of ``R`` query rows; key ``j`` at absolute position ``j``.
        visible: bool ``[R, Lk]``, the keys each row sees before sparsity.
        q_pos: int ``[R]``, each row's query position on the key axis (suffix aligned).
        sparsity: ``n``, ``m`` and the dense windows.

    Returns bool ``[H, R, Lk]``: within every group ``[g m, g m + m)`` the ``n``
    visible keys of largest score (ties to the lower index), plus the visible dense
    keys (``j < dense_sink_tokens`` or ``0 <= q_pos - j < dense_recent_tokens``),
    which also take part in the ranking.
    """
    heads, rows, length = s.shape
    m = sparsity.m
    groups = -(-length // m)
    tail = groups * m - length
    s_g = F.pad(s, (0, tail)).reshape(heads, rows, groups, m)
    vis_g = F.pad(visible, (0, tail), value=False).reshape(1, rows, groups, m)
    # outranks[..., a, b]: key b of the group ranks above key a.
    s_a = s_g.unsqueeze(-1)
    s_b = s_g.unsqueeze(-2)
    index = torch.arange(m, device=s.device)
    lower = index.unsqueeze(0) < index.unsqueeze(1)  # [a, b]: b < a
    outranks = (s_b > s_a) | ((s_b == s_a) & lower)
    rank = (outranks & vis_g.unsqueeze(-2)).sum(dim=-1)  # visible keys above each key
    top = (rank < sparsity.n).reshape(heads, rows, groups * m)[..., :length]

    key_pos = torch.arange(length, device=s.device)
    distance = q_pos.unsqueeze(1) - key_pos.unsqueeze(0)  # [R, Lk]
    dense = (key_pos.unsqueeze(0) < sparsity.dense_sink_tokens) | (
        (distance >= 0) & (distance < sparsity.dense_recent_tokens)
    )
    return visible & (top | dense)


@dataclass
class _Sequence:
    out: torch.Tensor  # [Lq, H, Dv]
    lse: torch.Tensor  # [H, Lq]
    p: torch.Tensor | None  # [H, Lq, Lk] when debugging
    m: torch.Tensor | None  # [H, Lq]
    l: torch.Tensor | None  # noqa: E741  [H, Lq]
    keep: torch.Tensor | None  # [H, Lq, Lk]


def _attend_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    p_quant: OperandQuant,
    sparsity: NMSparsity | None,
    want_debug: bool,
) -> _Sequence:
    """One sequence: q̂ ``[Lq, H, D]``, k̂ ``[Lk, Hkv, D]``, V̂ ``[Lk, Hkv, Dv]``, possibly
    holding non-finite values."""
    lq, heads, dim = q.shape
    lk, kv_heads, _ = k.shape
    dv = v.shape[2]
    group = heads // kv_heads  # query head h reads kv head h // group
    q, q_bad = split_non_finite(q, dim=-1)  # q_bad [Lq, H]
    k, k_bad = split_non_finite(k, dim=-1)  # k_bad [Lk, Hkv]
    v, v_bad = split_non_finite(v, dim=-1)
    k_bad_h = k_bad.T.repeat_interleave(group, dim=0)  # [H, Lk]
    v_bad_h = v_bad.T.repeat_interleave(group, dim=0)
    k_t = k.permute(1, 2, 0)  # [Hkv, D, Lk]
    v_h = v.permute(1, 0, 2)  # [Hkv, Lk, Dv]
    key_pos = torch.arange(lk, device=q.device)
    nm = sparsity if lq > 1 else None  # a single query is never sparsified

    per_row = max(1, heads * lk * (nm.m if nm is not None else 1))
    chunk = max(1, _ELEMENT_BUDGET // per_row)
    out = q.new_zeros(lq, heads, dv)
    lse = q.new_full((heads, lq), float("-inf"))
    parts: dict[str, list[torch.Tensor]] = {"p": [], "m": [], "l": [], "keep": []}
    for i0 in range(0, lq, chunk):
        i1 = min(lq, i0 + chunk)
        rows = i1 - i0
        q_c = q[i0:i1].permute(1, 0, 2).reshape(kv_heads, group * rows, dim)
        s = (q_c @ k_t).reshape(heads, rows, lk) * softmax_scale
        q_pos = lk - lq + torch.arange(i0, i1, device=q.device)  # suffix alignment
        if causal:
            visible = key_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        else:
            visible = torch.ones(rows, lk, dtype=torch.bool, device=q.device)
        if nm is not None:
            keep = nm_keep(s, visible, q_pos, nm)
        else:
            keep = visible.unsqueeze(0).expand(heads, rows, lk)
        # "sees" is visibility before N:M: a key that N:M drops still poisons the row
        poisoned = q_bad[i0:i1].T | seen_any(visible, k_bad_h)  # [H, R]
        sm = softmax_rows(s, keep, p_quant, poisoned=poisoned)
        acc = (sm.p.reshape(kv_heads, group * rows, lk) @ v_h).reshape(heads, rows, dv)
        o, lse_c = normalize(acc, sm)
        o = poison_v(o, seen_any(visible, v_bad_h))
        out[i0:i1] = o.permute(1, 0, 2)
        lse[:, i0:i1] = lse_c
        if want_debug:
            parts["p"].append(sm.p)
            parts["m"].append(sm.m)
            parts["l"].append(sm.l)
            parts["keep"].append(keep)
    seq = _Sequence(out=out, lse=lse, p=None, m=None, l=None, keep=None)
    if want_debug:
        empty_rows = q.new_zeros(heads, 0)
        seq.p = torch.cat(parts["p"], dim=1) if lq else q.new_zeros(heads, 0, lk)
        seq.m = torch.cat(parts["m"], dim=1) if lq else empty_rows
        seq.l = torch.cat(parts["l"], dim=1) if lq else empty_rows
        seq.keep = (
            torch.cat(parts["keep"], dim=1)
            if lq
            else torch.zeros(heads, 0, lk, dtype=torch.bool, device=q.device)
        )
    return seq


@overload
def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = ...,
    quant: AttentionQuant | None = ...,
    sparsity: NMSparsity | None = ...,
    return_lse: Literal[False] = ...,
    compute_dtype: torch.dtype = ...,
    out_dtype: torch.dtype | None = ...,
    debug: dict[str, Any] | None = ...,
) -> torch.Tensor: ...


@overload
def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = ...,
    quant: AttentionQuant | None = ...,
    sparsity: NMSparsity | None = ...,
    return_lse: Literal[True],
    compute_dtype: torch.dtype = ...,
    out_dtype: torch.dtype | None = ...,
    debug: dict[str, Any] | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = ...,
    quant: AttentionQuant | None = ...,
    sparsity: NMSparsity | None = ...,
    return_lse: bool,
    compute_dtype: torch.dtype = ...,
    out_dtype: torch.dtype | None = ...,
    debug: dict[str, Any] | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    quant: AttentionQuant | None = None,
    sparsity: NMSparsity | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    out_dtype: torch.dtype | None = None,
    debug: dict[str, Any] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quantized varlen attention over packed sequences: the prefill oracle.

    Args:
        q: ``[T, H, Dqk]`` queries of all sequences, packed (DeepSeek: Dqk = 192).
        k: ``[Tk, Hkv, Dqk]`` keys, packed; ``Hkv`` divides ``H`` and query head ``h``
            reads KV head ``h // (H // Hkv)``.
        v: ``[Tk, Hkv, Dv]`` values (DeepSeek: Dv = 128). Head dims are multiples of 16.
        cu_seqlens_q: int32/int64 ``[B + 1]`` offsets of each sequence's queries in q.
        cu_seqlens_k: int32/int64 ``[B + 1]`` offsets of each sequence's keys in k.
        softmax_scale: positive factor of the dot products, ``s = (q̂ · k̂) * scale``.
        causal: query ``i`` of ``Lq`` sits at key position ``Lk - Lq + i`` (suffix
            alignment) and sees keys ``j <= Lk - Lq + i``; otherwise all ``Lk`` keys.
        quant: ``mla_formats.AttentionQuant`` or None (no quantization at all). Q and
            K are QDQ'd along the head dim (amax dynamic per token and head, or
            static); V and P along the key axis of their sequence, blocks at key
            positions 0, 16, 32, ... of the sequence, the tail block zero-padded.
        sparsity: ``mla_formats.NMSparsity`` or None; see ``nm_keep``. A sequence with
            a single query is never sparsified.
        return_lse: also return the natural-log LSE ``[H, T]``.
        compute_dtype: float64 (default) or float32, for the dots and the softmax.
            QDQ itself is float32 by definition (``mla_formats``).
        out_dtype: dtype of ``out``; q's dtype by default. The LSE has dtype
            ``promote(out_dtype, float32)`` (float32 for 16-bit outputs).
        debug: when a dict, it is filled with what the oracle used, in compute_dtype:
            ``"q"`` q̂ ``[T, H, Dqk]``, ``"k"`` k̂ ``[Tk, Hkv, Dqk]``, ``"v"`` V̂
            ``[Tk, Hkv, Dv]``; and lists with one tensor per sequence: ``"p"`` P̂
            ``[H, Lq, Lk]`` (P as multiplied into V̂; 0 at masked keys), ``"m"`` the
            base-2 reference point ``[H, Lq]`` (integers; -inf for a row without
            keys), ``"l"`` the denominator from unquantized P ``[H, Lq]``, ``"keep"``
            bool ``[H, Lq, Lk]`` the keys each row attends to (causal and N:M).

    Per row (one query, one head), with ``t_j = s_j log2(e)`` over kept keys:
    ``m = ceil(max t)``, ``P_j = 2^(t_j - m)``, ``l = sum P``, ``out = QDQ(P) · V̂ / l``,
    ``lse = ln(l) + m ln 2``; a row without keys gives ``out = 0`` and ``lse = -inf``.

    Non-finite input (NaN or ±inf in an operand after QDQ; for ``none`` the raw
    value) poisons by row: a row whose q̂, or the k̂ of a key it sees, holds one has
    out and LSE all NaN; a row that sees a key whose v̂ holds one has out all NaN and
    its LSE unchanged. "Sees" is the causal (or non-causal) visibility; a key that
    N:M drops is still seen, a key past the row's causal limit never is. A row
    without a visible key gives out 0 and LSE -inf even with a NaN query. In
    ``debug``, ``p``, ``m`` and ``l`` are NaN in rows poisoned by q̂ or k̂.

    ``cu_seqlens_q = cu_seqlens_k = [0]`` (a batch of no sequences, ``T = 0``) gives
    ``out [0, H, Dv]`` and ``lse [H, 0]``.

    Returns:
        ``out [T, H, Dv]``, or ``(out, lse [H, T])`` when ``return_lse``.
    """
    shapes = check_prefill(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
        quant=quant,
        sparsity=sparsity,
        return_lse=return_lse,
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        debug=debug,
    )
    recipe = resolve_quant(quant)
    want_debug = debug is not None
    heads, dv = shapes.heads, shapes.head_dim_v

    q_hat = quantize_operand(q, recipe.q, axis=-1, compute_dtype=compute_dtype)
    k_hat = quantize_operand(k, recipe.k, axis=-1, compute_dtype=compute_dtype)
    v_hat = torch.zeros(v.shape, dtype=compute_dtype, device=v.device)
    out = torch.zeros(q.shape[0], heads, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    lists: dict[str, list[torch.Tensor]] = {"p": [], "m": [], "l": [], "keep": []}

    for b in range(len(shapes.cu_q) - 1):
        q0, q1 = shapes.cu_q[b], shapes.cu_q[b + 1]
        k0, k1 = shapes.cu_k[b], shapes.cu_k[b + 1]
        # V's token blocks start at the sequence's first key
        v_hat[k0:k1] = quantize_operand(
            v[k0:k1], recipe.v, axis=0, compute_dtype=compute_dtype, pad=True
        )
        seq = _attend_sequence(
            q_hat[q0:q1],
            k_hat[k0:k1],
            v_hat[k0:k1],
            softmax_scale=shapes.softmax_scale,
            causal=causal,
            p_quant=recipe.p,
            sparsity=sparsity,
            want_debug=want_debug,
        )
        out[q0:q1] = seq.out
        lse[:, q0:q1] = seq.lse
        if want_debug:
            for name in lists:
                value = getattr(seq, name)
                assert value is not None
                lists[name].append(value)

    if debug is not None:
        debug.update(q=q_hat, k=k_hat, v=v_hat, **lists)
    result_dtype = out_dtype or q.dtype
    out_r = out.to(result_dtype)
    if not return_lse:
        return out_r
    return out_r, lse.to(torch.promote_types(result_dtype, torch.float32))
