"""Absorbed-MLA split-K decode: the Triton kernels (SPEC 3 to 6, docs/numerics.md).

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

Stage 1, ``decode_split_kernel``: one program per (head group, split, request).
A request's tokens are cut into ``NUM_SPLITS`` chunks whose bounds are multiples
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
  docs/benchmarks-decode.md for what that costs).
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

from mla_triton import qdq_device as dev

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# The axis along which ``_qdq_latent`` blocks latent rows: K along the features, V
# along the tokens.
AXIS_FEATURES: tl.constexpr = tl.constexpr(1)
AXIS_TOKENS: tl.constexpr = tl.constexpr(0)

SPLIT_ALIGN = 64
"""Split bounds are multiples of this many tokens (a multiple of every ``BLOCK_N``)."""


@triton.jit
def _fp8_values(x, inv_gs, HW_FP8: tl.constexpr):
    """Factored fp8 value ``E4M3(clamp(x * inv_gs, ±448))`` of a float32 tile.

    ``HW_FP8`` uses the hardware conversion (``cvt.rn.satfinite``, sm89+), else the
    float32 rounding of ``qdq_device`` (sm80, interpreter); both round to nearest even.
    ``x * inv_gs`` is formed as ``fma(x, inv_gs, x - x)``: the same rounded product for a
    finite ``x``, NaN for ±inf (which the conversion would saturate), one instruction more.
    """
    return dev.e4m3_round_hw(tl.fma(x, inv_gs, x - x), HW_FP8)


@triton.jit
def _row_global_scale(
    x1, x2, gs_static, FMT: tl.constexpr, DYNAMIC: tl.constexpr, ROWS: tl.constexpr
):
    """Global scale ``[ROWS]`` of rows whose features are split over ``x1`` and ``x2``.

    Dynamic: ``qdq_device.dynamic_global_scale`` over the whole row. Static:
    ``gs_static`` for every row.
    """
    if DYNAMIC:
        gs = dev.dynamic_global_scale(x1, x2, FMT, 1)
    else:
        gs = tl.zeros([ROWS], tl.float32) + gs_static
    return gs


@triton.jit
def _qdq_q(x, gs, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Factored QDQ of q rows ``[ROWS, COLS]`` (float32) along the features.

    ``gs``: a scalar or ``[ROWS, 1]``, divided exactly as the reference does.
    """
    if FMT == 1:
        y = dev.fp8_qdq(tl.math.div_rn(x, gs), 1.0)
    else:
        y = dev.nvfp4_qdq_rows(x, gs, ROWS, COLS, True)
    return y


@triton.jit
def _qdq_latent(
    x,
    gs,
    inv_gs,
    inv_6gs,
    FMT: tl.constexpr,
    EXACT: tl.constexpr,
    FAST: tl.constexpr,
    HW_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    AXIS: tl.constexpr,
):
    """Factored QDQ of latent rows, float32 ``[ROWS, COLS]``: as K (``AXIS_FEATURES``,
    blocks along the features) or as V (``AXIS_TOKENS``, blocks along the tokens).

    ``gs``, ``inv_gs = 1 / gs``, ``inv_6gs = 1 / (6 gs)``: scalars, or ``[ROWS, 1]``
    along the features. A power-of-two ``gs`` (``EXACT`` false) multiplies by
    reciprocals: exact for fp8, and for nvfp4 with ``FAST`` (``qdq_device``'s
    multiply-and-round form with ``snap_ties``) or the compare form. Any other
    ``gs`` divides per element like the reference (``EXACT``): slower, bit-exact.
    Along the tokens the tile starts at a position that is a multiple of 16 and
    rows past the end of the sequence are zeros (the open tail block).
    """
    if FMT == 1:  # per element: the axis does not matter
        if EXACT:  # the conversion saturates ±inf: make it NaN (the software rounding does)
            y = dev.e4m3_round_hw(dev.poison(tl.math.div_rn(x, gs), x), HW_FP8)
        else:
            y = _fp8_values(x, inv_gs, HW_FP8)
    elif AXIS == AXIS_FEATURES:
        if EXACT:
            y = dev.nvfp4_qdq_rows(x, gs, ROWS, COLS, True)
        elif FAST:
            y = dev.nvfp4_qdq_rows_fast(x, gs, inv_6gs, ROWS, COLS, HW_FP8, True)
        else:
            y = dev.nvfp4_qdq_rows(x, gs, ROWS, COLS)
    elif EXACT:
        y = dev.nvfp4_qdq_cols(x, gs, ROWS, COLS, True)
    elif FAST:
        y = dev.nvfp4_qdq_cols_fast(x, gs, inv_6gs, ROWS, COLS, HW_FP8, True)
    else:
        y = dev.nvfp4_qdq_cols(x, gs, ROWS, COLS)
    return y


@triton.jit
def _qdq_p(
    p,
    gs,
    inv_gs,
    inv_6gs,
    FMT: tl.constexpr,
    FAST: tl.constexpr,
    HW_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Factored QDQ of P ``[ROWS, COLS]`` (values in [0, 1]) along axis 1 (tokens)."""
    if FMT == 1:
        p = dev.fp8_qdq_p(p, inv_gs, HW_FP8)
    elif FMT == 2:
        if FAST:
            p = dev.nvfp4_qdq_p(p, gs, inv_6gs, ROWS, COLS, HW_FP8)
        else:
            p = dev.nvfp4_qdq_rows(p, gs, ROWS, COLS)
    return p


@triton.jit
def _load_q(
    qn_ptr,
    qp_ptr,
    qgs_ptr,
    b,
    offs_h,
    h_mask,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    num_heads,
    score_scale,
    Q_SCALED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
):
    """Stage 1's prologue: request ``b``'s q (or q̂, factored by ``decode_q_kernel``) for
    heads ``offs_h``: ``(q1 [BLOCK_H, D1], q2 [BLOCK_H, D2], row_scale [BLOCK_H])``, the
    row scale being ``score_scale`` times each row's q global scale when q is quantized."""
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, D2)
    q1 = tl.load(
        qn_ptr + b * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_d1[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    q2 = tl.load(
        qp_ptr + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_d2[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    row_scale = tl.zeros([BLOCK_H], tl.float32) + score_scale
    if Q_SCALED:
        row_scale *= tl.load(qgs_ptr + b * num_heads + offs_h, mask=h_mask, other=1.0)
    return q1, q2, row_scale


@triton.jit
def _normalize(acc, m_i, l_i, nonempty, poisoned, out_scale):
    """``(out, lse)`` of finished rows: ``acc / l`` times ``out_scale`` and ``(log2 l + m) ln 2``.

    The NaN rule (docs/numerics.md): a row whose accumulator holds a non-finite value
    is NaN in every feature; a NaN denominator (a non-finite score, or a page outside
    the cache: ``tile_pages``) makes out and LSE NaN; ``poisoned`` (a request length
    outside the table, a scalar) makes every row NaN. Rows of an empty request
    (``nonempty`` false): 0 and -inf.
    """
    l_i = tl.where(poisoned, float("nan"), l_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    keep = nonempty | poisoned
    inv_l = tl.where(keep, out_scale / l_safe, 0.0)
    o = dev.poison(acc * inv_l[:, None], tl.sum(acc, axis=1)[:, None])
    lse = tl.where(keep, (tl.log2(l_safe) + m_i) * LN2, float("-inf"))
    return o, lse


@triton.jit
def _request_len(seq_lens_ptr, b, stride_sl, capacity):
    """``(seq_len, poisoned)``: request ``b``'s length within ``[0, capacity]`` and whether
    the given one lay outside it (the request's rows are then NaN)."""
    raw = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    poisoned = (raw < 0) | (raw > capacity)
    return tl.minimum(tl.maximum(raw, 0), capacity), poisoned


@triton.jit
def tile_pages(
    bt_row,
    start,
    tok,
    valid,
    stride_bt_p,
    num_blocks,
    l_i,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FULL: tl.constexpr,
):
    """The pages of a tile's tokens, and the running denominators ``l_i`` poisoned if bad.

    ``(page, slot)``: one page (a scalar) and the slots ``[BLOCK_N]`` when a page holds
    whole tiles (``PAGE % BLOCK_N == 0``), else a page and a slot per token ``tok``
    (masked by ``valid`` unless ``FULL``). A page id outside ``[0, num_blocks)`` is
    replaced by page 0, so no load leaves the cache, and makes ``l_i`` NaN: the
    request's rows are then NaN (out and LSE), through the split merge too. No
    loop-carried flag: the denominators carry it.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE % BLOCK_N == 0:
        page = tl.load(bt_row + (start // PAGE) * stride_bt_p).to(tl.int64)
        slot = ((start % PAGE) + offs_n).to(tl.int64)
        bad = (page < 0) | (page >= num_blocks)
        any_bad = bad
    else:
        if FULL:
            page = tl.load(bt_row + (tok // PAGE) * stride_bt_p).to(tl.int64)
        else:
            page = tl.load(bt_row + (tok // PAGE) * stride_bt_p, mask=valid, other=0).to(tl.int64)
        slot = (tok % PAGE).to(tl.int64)
        bad = (page < 0) | (page >= num_blocks)
        any_bad = tl.max(bad.to(tl.int32), axis=0) > 0
    return tl.where(bad, 0, page), slot, tl.where(any_bad, float("nan"), l_i)


@triton.jit
def _finish_split(
    acc,
    m_i,
    l_i,
    poisoned,
    out_ptr,
    lse_ptr,
    wacc_ptr,
    wml_ptr,
    b,
    split,
    lo,
    seq_len,
    offs_h,
    h_mask,
    stride_o_b,
    stride_o_h,
    stride_lse_b,
    stride_lse_h,
    num_heads,
    out_scale,
    D1: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Stage 1's epilogue: with one split, out and LSE (``_normalize``); else the split's
    partial ``acc``, ``m``, ``l`` into the workspace."""
    offs_d1 = tl.arange(0, D1)
    if NUM_SPLITS == 1:
        o, lse = _normalize(acc, m_i, l_i, seq_len > 0, poisoned, out_scale)
        o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d1[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
        tl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)
    else:
        row = (b * NUM_SPLITS + split) * num_heads + offs_h  # int64 [BLOCK_H]
        st_mask = h_mask & (lo < seq_len)
        tl.store(wacc_ptr + row[:, None] * D1 + offs_d1[None, :], acc, mask=st_mask[:, None])
        tl.store(wml_ptr + row * 2, m_i, mask=st_mask)
        tl.store(wml_ptr + row * 2 + 1, l_i, mask=st_mask)


@triton.jit
def _chunk(seq_len, NUM_SPLITS: tl.constexpr, ALIGN: tl.constexpr):
    """Tokens per split of a request: ``ceil(seq_len / NUM_SPLITS)`` rounded up to ``ALIGN``."""
    per = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    return tl.maximum((per + ALIGN - 1) // ALIGN, 1) * ALIGN


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


@triton.jit
def decode_split_kernel(
    qn_ptr,
    qp_ptr,
    qgs_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    wacc_ptr,
    wml_ptr,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_kv_page,
    stride_kv_row,
    stride_bt_b,
    stride_bt_p,
    stride_sl,
    stride_o_b,
    stride_o_h,
    stride_lse_b,
    stride_lse_h,
    num_heads,
    capacity,
    num_blocks,
    score_scale,  # softmax_scale * log2(e), times K's global scale when it is static
    k_gs,
    k_inv_gs,
    k_inv_6gs,
    v_gs,
    v_inv_gs,
    v_inv_6gs,
    p_gs,
    p_inv_gs,
    p_inv_6gs,
    out_scale,  # gs_p * gs_v
    D1: tl.constexpr,
    D2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_GROUPS: tl.constexpr,
    SPLIT_ALIGN_: tl.constexpr,
    Q_SCALED: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYN: tl.constexpr,
    K_EXACT: tl.constexpr,
    V_FMT: tl.constexpr,
    V_EXACT: tl.constexpr,
    P_FMT: tl.constexpr,
    KV_SHARED: tl.constexpr,
    PV_F16: tl.constexpr,
    FAST: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Stage 1: one (head group, split, request) over its chunk of the paged cache.

    Shapes: q ``[B, H, D1]`` + ``[B, H, D2]``; cache rows ``D1 + D2`` wide at
    ``page * stride_kv_page + slot * stride_kv_row``; out ``[B, H, D1]``, lse
    ``[B, H]`` (one split) or workspace acc ``[B, NUM_SPLITS, H, D1]`` and (m, l)
    ``[B, NUM_SPLITS, H, 2]`` float32 (several splits). ``QK_F16``/``PV_F16``: run
    that dot on fp16 operands (both factored, hence exact in fp16), else in the
    input dtype.
    """
    pid = tl.program_id(0)
    hg = pid % HEAD_GROUPS
    split = (pid // HEAD_GROUPS) % NUM_SPLITS
    b = (pid // HEAD_GROUPS // NUM_SPLITS).to(tl.int64)

    seq_len, poisoned = _request_len(seq_lens_ptr, b, stride_sl, capacity)
    chunk = _chunk(seq_len, NUM_SPLITS, SPLIT_ALIGN_)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, D2)
    offs_n = tl.arange(0, BLOCK_N)

    # ---- prologue: q (or q̂, factored by decode_q_kernel) and the per-row factor ----
    q1, q2, row_scale = _load_q(
        qn_ptr, qp_ptr, qgs_ptr, b, offs_h, h_mask, stride_qn_b, stride_qn_h, stride_qp_b,
        stride_qp_h, num_heads, score_scale, Q_SCALED, BLOCK_H, D1, D2,
    )  # fmt: skip
    qk_dtype = q1.dtype
    in_dtype = kv_ptr.dtype.element_ty
    pv_dtype = tl.float16 if PV_F16 else in_dtype

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D1], tl.float32)
    bt_row = bt_ptr + b * stride_bt_b

    # ---- main loop over the chunk's tiles ----------------------------------------
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

        # K̂ along the features, once per program for all BLOCK_H heads.
        if K_FMT == 0:
            k1 = kv
            k2 = kpe
        else:
            kvf = kv.to(tl.float32)
            kpf = kpe.to(tl.float32)
            if K_DYN:
                gs_tok = _row_global_scale(kvf, kpf, k_gs, K_FMT, True, BLOCK_N)
                gs_k = gs_tok[:, None]
                inv_gs_k = gs_k  # unused: a dynamic scale takes the exact division
                inv_6gs_k = gs_k
            else:
                gs_k = k_gs
                inv_gs_k = k_inv_gs
                inv_6gs_k = k_inv_6gs
            k1 = _qdq_latent(
                kvf,
                gs_k,
                inv_gs_k,
                inv_6gs_k,
                K_FMT,
                K_EXACT,
                FAST,
                HW_FP8,
                BLOCK_N,
                D1,
                AXIS_FEATURES,
            ).to(qk_dtype)
            k2 = _qdq_latent(
                kpf,
                gs_k,
                inv_gs_k,
                inv_6gs_k,
                K_FMT,
                K_EXACT,
                FAST,
                HW_FP8,
                BLOCK_N,
                D2,
                AXIS_FEATURES,
            ).to(qk_dtype)

        s = tl.dot(q1, tl.trans(k1))
        s = tl.dot(q2, tl.trans(k2), s)
        if K_FMT == 0 or not Q_SCALED:  # raw operands: an infinite score becomes NaN
            t = tl.fma(s, row_scale[:, None], s - s)  # the rounded product, + NaN if not finite
        else:
            t = s * row_scale[:, None]
        if K_DYN:
            t = t * gs_tok[None, :]
        t = tl.where(valid[None, :], t, float("-inf"))

        # Online softmax in base 2 with an integer running maximum: exact rescales.
        m_new = tl.maximum(m_i, tl.ceil(tl.max(t, axis=1)))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(t - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = _qdq_p(p, p_gs, p_inv_gs, p_inv_6gs, P_FMT, FAST, HW_FP8, BLOCK_H, BLOCK_N)

        # V̂ along the tokens (blocks at absolute positions: the tile starts at a
        # multiple of 16; masked rows are zeros), once per program.
        if KV_SHARED:
            v = k1
        elif V_FMT == 0:
            v = kv
        else:
            v = _qdq_latent(
                kv.to(tl.float32),
                v_gs,
                v_inv_gs,
                v_inv_6gs,
                V_FMT,
                V_EXACT,
                FAST,
                HW_FP8,
                BLOCK_N,
                D1,
                AXIS_TOKENS,
            ).to(pv_dtype)
        acc = tl.dot(p.to(pv_dtype), v, acc * alpha[:, None])
        m_i = m_new

    # ---- epilogue -----------------------------------------------------------------
    _finish_split(
        acc, m_i, l_i, poisoned, out_ptr, lse_ptr, wacc_ptr, wml_ptr, b, split, lo, seq_len, offs_h,
        h_mask, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, num_heads, out_scale, D1,
        NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def decode_merge_kernel(
    wacc_ptr,
    wml_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    stride_sl,
    stride_o_b,
    stride_o_h,
    stride_lse_b,
    stride_lse_h,
    num_heads,
    capacity,
    out_scale,
    D1: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_ALIGN_: tl.constexpr,
):
    """Stage 2: merge a request's non-empty splits for ``BLOCK_H`` heads by their LSE.

    Split maxima are integers (base 2), so the weights ``2^(m_s - M)`` are exact.
    """
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seq_len, poisoned = _request_len(seq_lens_ptr, b, stride_sl, capacity)
    chunk = _chunk(seq_len, NUM_SPLITS, SPLIT_ALIGN_)
    n_active = (seq_len + chunk - 1) // chunk

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, D1)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741 (the contract's name)
    acc = tl.zeros([BLOCK_H, D1], tl.float32)
    for s in range(n_active):
        row = (b * NUM_SPLITS + s) * num_heads + offs_h
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

    o, lse = _normalize(acc, m, l, seq_len > 0, poisoned, out_scale)
    o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    tl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)
