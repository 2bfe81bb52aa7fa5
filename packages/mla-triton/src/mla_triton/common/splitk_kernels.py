"""The split-K decode's shared Triton kernels: q̂ (stage 0) and the merge (stage 2).

Stage 0, ``decode_q_kernel`` (only when q is quantized): one program per (head,
request) QDQs q along the features (dynamic amax over all ``D1 + D2`` features,
divided as the reference does) into factored values, exact in 16 bits, and its global
scale; once, whatever the split count, and outside the split kernels, whose registers
go to the accumulator.

Stage 2, ``decode_merge_kernel`` (only with several splits): per request and head
block, combine the non-empty splits with the power-of-two weights
``2^(m_s - max_s m_s)``, then normalize. Rows of an empty request get 0 and -inf.
Every split kernel (on read, Gluon, warp-specialized, shadow) shares both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_triton.common import qdq as dev
from mla_triton.common.kernels import request_len, split_chunk, write_out

__all__ = ["decode_merge_kernel", "decode_q_kernel"]


@triton.jit
def _qdq_q(x, gs, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Factored QDQ of q rows ``[ROWS, COLS]`` (float32) along the features.

    ``gs``: a scalar or ``[ROWS, 1]``, divided exactly as the reference does.
    """
    if FMT == 1:
        y = dev.fp8_qdq(tl.math.div_rn(x, gs), 1.0)
    else:
        y = dev.nvfp4_qdq(x, gs, ROWS, COLS, 1, True)
    return y


@triton.jit
def decode_q_kernel(
    qn_ptr,
    qp_ptr,
    qhat_ptr,
    qgs_ptr,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    num_heads,
    q_gs,
    D1: tl.constexpr,
    D2: tl.constexpr,
    Q_FMT: tl.constexpr,
    Q_DYN: tl.constexpr,
):
    """q̂ once per request and head, before the split kernel (which may run many splits).

    One program per (head, request). Writes the factored q̂ ``[B, H, D1 + D2]`` (in
    ``qhat_ptr``'s dtype, exact) and its global scale ``[B, H]`` float32: dynamic
    amax over all ``D1 + D2`` features (or the static ``q_gs``), divided exactly as
    the reference does. The scale is a scalar per program: no per-row vector
    crosses layouts. Keeping this out of the split kernel keeps its registers for
    the accumulator.
    """
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d1 = tl.arange(0, D1)[None, :]
    offs_d2 = tl.arange(0, D2)[None, :]
    qn = tl.load(qn_ptr + b * stride_qn_b + h * stride_qn_h + offs_d1).to(tl.float32)
    qp = tl.load(qp_ptr + b * stride_qp_b + h * stride_qp_h + offs_d2).to(tl.float32)
    gs = dev.dynamic_global_scale(qn, qp, Q_FMT, None) if Q_DYN else q_gs
    row = (b * num_heads + h) * (D1 + D2)
    dtype = qhat_ptr.dtype.element_ty
    tl.store(qhat_ptr + row + offs_d1, _qdq_q(qn, gs, Q_FMT, 1, D1).to(dtype))
    tl.store(qhat_ptr + row + D1 + offs_d2, _qdq_q(qp, gs, Q_FMT, 1, D2).to(dtype))
    tl.store(qgs_ptr + b * num_heads + h, gs)


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge_kernel(
    partials,
    seq_lens_ptr,
    out,
    stride_sl,
    o_strides,
    num_heads,
    capacity,
    out_scale,
    num_splits,
    D1: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_ALIGN_: tl.constexpr,
):
    """Stage 2: merge a request's non-empty splits for ``BLOCK_H`` heads by their LSE.

    ``partials``, ``out``, ``o_strides``: as the split kernels' (``common``). Split
    maxima are integers (base 2), so the weights ``2^(m_s - M)`` are exact. ``num_splits``:
    a runtime argument (one compiled kernel for every split count).
    """
    wacc_ptr, wml_ptr = partials
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seq_len, poisoned = request_len(seq_lens_ptr, b, stride_sl, capacity)
    chunk = split_chunk(seq_len, num_splits, SPLIT_ALIGN_)
    n_active = (seq_len + chunk - 1) // chunk

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, D1)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741 (the contract's name)
    acc = tl.zeros([BLOCK_H, D1], tl.float32)
    for s in range(n_active):
        row = (b * num_splits + s) * num_heads + offs_h
        m_s = tl.load(wml_ptr + row * 2, mask=h_mask, other=0.0)
        l_s = tl.load(wml_ptr + row * 2 + 1, mask=h_mask, other=0.0)
        a_s = tl.load(
            wacc_ptr + row[:, None] * D1 + offs_d[None, :], mask=h_mask[:, None], other=0.0
        )
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        l = l * alpha + l_s * beta  # noqa: E741
        m = m_new

    write_out(acc, m, l, seq_len > 0, poisoned, out_scale, out, o_strides, b, offs_h, h_mask, D1)
