"""Absorbed-MLA split-K decode: the Triton kernels (docs/numerics.md).

Algorithm
---------
Decode attends ``B`` requests, one query token each, ``H`` query heads that share
one latent KV head (MQA once ``W_UK`` is absorbed into q). Scores use all
``D1 + D2`` features of a latent row (kv_c 512 + k_pe 64); V is the first ``D1``.

Stage 0, ``decode_q_kernel`` (only when q is quantized): one program per
(head, request) QDQs q along the features (dynamic amax over all ``D1 + D2``
features, divided as the reference does) into factored values, exact in 16 bits,
and its global scale; once, whatever the split count, and outside the split
kernel, whose registers go to the accumulator.

Stage 1, ``decode_split_kernel``: one program per (head group, split, request); its
prologue, score, softmax and epilogue steps are ``common.kernels``'s, shared with
the shadow-cache kernel.
A request's tokens are cut into ``num_splits`` chunks whose bounds are multiples
of ``SPLIT_ALIGN`` tokens at absolute positions (the chunk size depends on the
request's own length and the split count only, never on other requests).

1. Prologue: load the q (or q̂) rows of ``BLOCK_H`` heads and fold q's global
   scale, K's static global scale, the softmax scale and log2(e) into one
   per-row factor.
2. Walk the chunk in tiles of ``BLOCK_N`` tokens. Each tile of latent rows is read
   from the paged cache once (one page lookup per tile when a page holds whole
   tiles, one per row otherwise) and quantized once per program for every head of
   the group: K along the features, V along the tokens (the tile starts at a
   multiple of 16, rows past the end are zeros: the open tail block). Then
   ``S = q̂ K̂ᵀ`` on 16-bit tensor cores (exact products, fp32 accumulate); the
   running maximum of the base-2 scores is kept at ``ceil`` (an integer), so each
   rescale is an exact power of two; ``P = 2^(t - m)``, ``l += sum P``
   (unquantized), ``P̂ = QDQ(P)`` along the tokens, ``acc += P̂ V̂``.
3. Epilogue: with one split, write ``out = acc gs_p gs_v / l`` and
   ``lse = (log2 l + m) ln 2``; with several, write the unnormalized ``acc``, ``m``
   and ``l`` to the workspace.

Stage 2, ``decode_merge_kernel`` (only with several splits): per request and
head block, combine the non-empty splits with the power-of-two weights
``2^(m_s - max_s m_s)``, then normalize as above. Rows of an empty request get 0
and -inf.

Tiling choices
--------------
- ``BLOCK_H`` heads per program (64 when H > 32): a 64 x 512 float32 accumulator
  is 128 registers a thread over 8 warps, the most one program can hold; so each
  latent tile is read, and quantized, once per 64 heads (H = 128: two programs,
  adjacent in the grid so the second finds the tile in L2), not once per 16.
  Triton splits the 512 output features of ``P̂ V̂`` over the two warpgroups (and,
  since ``S`` feeds a second dot, computes ``S`` on both: see
  docs/design/decode.md for what that costs).
- ``BLOCK_N`` tokens per tile (32 or 64): the tile is the unit of the software
  pipeline (q, K and V of ``num_stages - 1`` tiles in shared memory: 64 heads and
  64 tokens fill 216 KB with 2 stages) and, quantized, a float32 copy of it must
  fit in registers next to the accumulator, hence 32 for nvfp4 K or V.
- The 576 features run as two dots (512 + 64): no tensor-core work on padding.
- Grid axis 0 enumerates (head group, split, request) with the head group
  fastest, so programs that read the same latent rows run at the same time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_triton.common import qdq as dev
from mla_triton.common.kernels import (
    AXIS_FEATURES,
    AXIS_TOKENS,
    finish_split,
    qdq_latent,
    qdq_p,
    scores,
    softmax_step,
    split_program,
    split_start,
    tile_pages,
)

__all__ = ["decode_split_kernel"]


@triton.jit
def _k_hat(
    kv,
    kpe,
    k_scales,
    K_FMT: tl.constexpr,
    K_DYN: tl.constexpr,
    K_EXACT: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    QK_DTYPE: tl.constexpr,
):
    """K̂ of a tile of latent rows ``kv [BLOCK_N, D1]``, ``kpe [BLOCK_N, D2]``, along the
    features, in ``QK_DTYPE`` (exact): ``(k1, k2, col_scale)``, the raw rows when K is
    not quantized.

    ``k_scales = (gs, 1 / gs, 1 / (6 gs))`` static; ``K_DYN``: each token's own global
    scale (amax over its ``D1 + D2`` features), returned as ``col_scale [BLOCK_N]``
    (else ``gs``, unused).
    """
    if K_FMT == 0:
        k1 = kv
        k2 = kpe
        col_scale = k_scales[0]
    else:
        kvf = kv.to(tl.float32)
        kpf = kpe.to(tl.float32)
        if K_DYN:
            col_scale = dev.dynamic_global_scale(kvf, kpf, K_FMT, 1)
            gs_k = col_scale[:, None]
            scales = (gs_k, gs_k, gs_k)  # a dynamic scale takes the exact division
        else:
            col_scale = k_scales[0]
            scales = k_scales
        k1 = qdq_latent(kvf, scales, K_FMT, K_EXACT, HW_FP8, BLOCK_N, D1, AXIS_FEATURES)
        k1 = k1.to(QK_DTYPE)
        k2 = qdq_latent(kpf, scales, K_FMT, K_EXACT, HW_FP8, BLOCK_N, D2, AXIS_FEATURES)
        k2 = k2.to(QK_DTYPE)
    return k1, k2, col_scale


@triton.jit(do_not_specialize=["num_splits", "num_blocks"])
def decode_split_kernel(
    split,
    k_scales,
    v_scales,
    p_scales,
    out_scale,  # gs_p * gs_v
    num_splits,
    num_blocks,
    SHAPE: tl.constexpr,
    MULTI_SPLIT: tl.constexpr,
    Q_SCALED: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYN: tl.constexpr,
    K_EXACT: tl.constexpr,
    V_FMT: tl.constexpr,
    V_EXACT: tl.constexpr,
    P_FMT: tl.constexpr,
    KV_SHARED: tl.constexpr,
    PV_F16: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Stage 1: one (head group, split, request) over its chunk of the paged cache.

    ``split``: the arguments every split kernel takes (``common.split_program``), here
    with ``cache = (kv_ptr,)`` and ``cache_strides = (stride_kv_page, stride_kv_row)``;
    ``SHAPE = (D1, D2, PAGE, BLOCK_H, BLOCK_N, HEAD_GROUPS, SPLIT_ALIGN_)``; ``k_scales``,
    ``v_scales``, ``p_scales``: static ``(gs, 1 / gs, 1 / (6 gs))`` triples. ``num_splits``
    is a runtime argument, not specialized: one compiled kernel serves every split count;
    ``MULTI_SPLIT`` (``num_splits > 1``) picks the epilogue. ``num_blocks``: the cache's
    page count (the page-id bound), not specialized either: caches of any size share
    one compiled kernel.

    Shapes: q ``[B, H, D1]`` + ``[B, H, D2]``; cache rows ``D1 + D2`` wide at
    ``page * stride_kv_page + slot * stride_kv_row``; out ``[B, H, D1]``, lse
    ``[B, H]`` (one split) or workspace acc ``[B, num_splits, H, D1]`` and (m, l)
    ``[B, num_splits, H, 2]`` float32 (several splits). ``PV_F16``: run ``P̂ V̂`` on
    fp16 operands (both factored, hence exact in fp16), else in the input dtype
    (``QK`` follows q's dtype: fp16 q̂ when q and K are quantized). ``KV_SHARED``:
    fp8 K and V with one static scale, V̂ is K̂'s first ``D1`` features.
    """
    D1: tl.constexpr = SHAPE[0]
    D2: tl.constexpr = SHAPE[1]
    PAGE: tl.constexpr = SHAPE[2]
    BLOCK_H: tl.constexpr = SHAPE[3]
    BLOCK_N: tl.constexpr = SHAPE[4]
    splits = num_splits if MULTI_SPLIT else 1  # a constant with one split
    prog = split_program(split, SHAPE, splits)
    heads, offs_n, bt_row, q1, q2, row_scale, m_i, l_i, acc = split_start(
        split, prog, Q_SCALED, SHAPE
    )
    lo, hi = prog[5], prog[6]
    (kv_ptr,), (stride_kv_page, stride_kv_row), stride_bt_p = split[1], split[7], split[8][1]
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, D2)
    pv_dtype = tl.float16 if PV_F16 else kv_ptr.dtype.element_ty
    QK_RAW: tl.constexpr = K_FMT == 0 or not Q_SCALED  # raw operands: inf scores become NaN

    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        valid = tok < hi
        page, slot, l_i = tile_pages(
            bt_row, start, tok, valid, stride_bt_p, num_blocks, l_i, PAGE, BLOCK_N, False
        )
        rows = page * stride_kv_page + slot * stride_kv_row
        kv = tl.load(kv_ptr + rows[:, None] + offs_d1[None, :], mask=valid[:, None], other=0.0)
        kpe = tl.load(
            kv_ptr + rows[:, None] + D1 + offs_d2[None, :], mask=valid[:, None], other=0.0
        )
        # K̂ along the features, once per program for all BLOCK_H heads
        k1, k2, col_scale = _k_hat(
            kv, kpe, k_scales, K_FMT, K_DYN, K_EXACT, HW_FP8, BLOCK_N, D1, D2, q1.dtype
        )
        t = scores(q1, q2, k1, k2, row_scale, col_scale, valid, QK_RAW, K_DYN, True)
        m_new, alpha, p, l_i = softmax_step(m_i, l_i, t, row_scale, False, False)
        p = qdq_p(p, p_scales, P_FMT, HW_FP8, BLOCK_H, BLOCK_N)

        # V̂ along the tokens (blocks at absolute positions: the tile starts at a
        # multiple of 16; masked rows are zeros), once per program
        if KV_SHARED:
            v = k1
        elif V_FMT == 0:
            v = kv
        else:
            v = qdq_latent(
                kv.to(tl.float32), v_scales, V_FMT, V_EXACT, HW_FP8, BLOCK_N, D1, AXIS_TOKENS
            ).to(pv_dtype)
        acc = tl.dot(p.to(pv_dtype), v, acc * alpha[:, None])
        m_i = m_new

    finish_split(acc, m_i, l_i, prog, heads, split, out_scale, splits, SHAPE, MULTI_SPLIT)
