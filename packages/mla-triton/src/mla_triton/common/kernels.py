"""Triton device functions the attention kernels share (docs/numerics.md).

- ``softmax_step``: the online-softmax step of every attention kernel (decode,
  shadow-cache decode, prefill): base-2 scores, an integer running maximum (every
  rescale an exact power of two), ``P = 2^(t - m)``, the row sums of the
  unquantized P.
- The split-K decode program, as both split kernels (``ops.decode.triton_kernels``, on read;
  ``shadow_kernel``, from the shadow cache) run it: ``split_invariants`` (the
  tiling's static checks), ``split_bounds`` (which request and split a program
  owns), ``load_q`` (q or q̂, the per-row factor and the running state),
  ``tile_pages`` (a tile's pages, a bad page poisoning the denominators),
  ``scores`` (``S = q̂ K̂ᵀ`` in base 2), ``qdq_latent`` and ``qdq_p`` (on-read QDQ of
  latent tiles and of P), ``finish_split`` (out and LSE, or the split's partials)
  and ``write_out`` (the normalized rows, also the merge kernel's).

Grouped arguments are tuples, unpacked here: ``q = (qn_ptr, qp_ptr, qgs_ptr)``,
``q_strides = (stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h)``, ``out =
(out_ptr, lse_ptr)``, ``o_strides = (stride_o_b, stride_o_h, stride_lse_b,
stride_lse_h)``, ``partials = (wacc_ptr, wml_ptr)``, and a scale triple ``(gs, 1 /
gs, 1 / (6 gs))``. Everything is inlined: the tuples cost nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_triton.common import qdq as dev

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# The axis along which ``qdq_latent`` blocks latent rows: K along the features, V
# along the tokens.
AXIS_FEATURES: tl.constexpr = tl.constexpr(1)
AXIS_TOKENS: tl.constexpr = tl.constexpr(0)

SPLIT_ALIGN = 64
"""Split bounds are multiples of this many tokens (a multiple of every ``BLOCK_N``)."""


# ---------------------------------------------------------------- online softmax


@triton.jit
def softmax_step(m_i, l_i, x, row_scale, SCALED: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """One online-softmax step over a tile of scores ``x [ROWS, N]`` float32.

    Base-2 scores are ``t = x * row_scale`` (``SCALED``: the product is fused into
    the exponent; else ``x`` is already ``t``). The running maximum stays an
    integer, ``m_new = max(m_i, ceil(max t))``, so the accumulator's rescale
    ``alpha = 2^(m_i - m_new)`` is an exact power of two; ``P = 2^(t - m_new)`` and
    ``l = l alpha + sum P`` (unquantized P). ``EMPTY_ROWS``: a row may have seen no
    key yet (``m_new = -inf``): it takes 0 as its maximum (P and alpha 0, no NaN).
    Returns ``(m_new, alpha [ROWS], p [ROWS, N], l [ROWS])``.
    """
    if SCALED:
        m_new = tl.maximum(m_i, tl.ceil(tl.max(x, axis=1) * row_scale))
    else:
        m_new = tl.maximum(m_i, tl.ceil(tl.max(x, axis=1)))
    if EMPTY_ROWS:  # noqa: SIM108 (constexpr branches: only one is traced)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    if SCALED:
        p = tl.exp2(tl.fma(x, row_scale[:, None], -m_use[:, None]))
    else:
        p = tl.exp2(x - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, alpha, p, l_i


# ---------------------------------------------------------------- on-read QDQ


@triton.jit
def fp8_latent(x, gs, inv_gs, EXACT: tl.constexpr, HW_FP8: tl.constexpr):
    """Factored fp8 value ``E4M3(clamp(x / gs, ±448))`` of a float32 tile; NaN for ±inf.

    ``EXACT``: the reference's division (any ``gs``); else ``x * inv_gs`` formed as
    ``fma(x, inv_gs, x - x)`` (``inv_gs = 1 / gs`` exact: a power of two), the same
    rounded product for a finite ``x`` and NaN for ±inf, which the hardware
    conversion would saturate. ``HW_FP8``: that conversion (``cvt.rn.satfinite``,
    sm89+), else the float32 rounding of ``qdq_device`` (sm80, interpreter); both
    round to nearest even.
    """
    if EXACT:
        y = dev.e4m3_round_hw(dev.poison(tl.math.div_rn(x, gs), x), HW_FP8)
    else:
        y = dev.e4m3_round_hw(tl.fma(x, inv_gs, x - x), HW_FP8)
    return y


@triton.jit
def qdq_latent(
    x,
    scales,
    FMT: tl.constexpr,
    EXACT: tl.constexpr,
    HW_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    AXIS: tl.constexpr,
):
    """Factored QDQ of latent rows, float32 ``[ROWS, COLS]``: as K (``AXIS_FEATURES``,
    blocks along the features) or as V (``AXIS_TOKENS``, blocks along the tokens).

    ``scales = (gs, 1 / gs, 1 / (6 gs))``: scalars, or ``[ROWS, 1]`` along the
    features. A power-of-two ``gs`` (``EXACT`` false) multiplies by reciprocals,
    bit-exact for 16-bit input (nvfp4: ``qdq_device.nvfp4_qdq_fast`` with
    ``snap_ties``); any other ``gs`` divides per element like the reference
    (``EXACT``): slower, bit-exact. Along the tokens the tile starts at a position
    that is a multiple of 16 and rows past the end of the sequence are zeros (the
    open tail block).
    """
    gs, inv_gs, inv_6gs = scales
    if FMT == 1:  # per element: the axis does not matter
        y = fp8_latent(x, gs, inv_gs, EXACT, HW_FP8)
    elif EXACT:
        y = dev.nvfp4_qdq(x, gs, ROWS, COLS, AXIS, True)
    else:
        y = dev.nvfp4_qdq_fast(x, gs, inv_6gs, ROWS, COLS, AXIS, HW_FP8, True)
    return y


@triton.jit
def qdq_p(
    p, scales, FMT: tl.constexpr, HW_FP8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    OUT: tl.constexpr = tl.float32,
):  # fmt: skip
    """Factored QDQ of P ``[ROWS, COLS]`` (values in [0, 1]) along axis 1 (tokens), in
    ``OUT`` (the P V dot's operand dtype: the hardware paths convert to it directly).

    ``scales = (gs, 1 / gs, 1 / (6 gs))``, static; the fast forms of ``qdq_device``.
    """
    gs, inv_gs, inv_6gs = scales
    if FMT == 1:
        p = dev.fp8_qdq_p(p, inv_gs, HW_FP8, OUT)
    elif FMT == 2:
        p = dev.nvfp4_qdq_p(p, gs, inv_6gs, ROWS, COLS, HW_FP8, OUT)
    else:
        p = p.to(OUT)
    return p


# ---------------------------------------------------------------- split-K decode


@triton.jit
def split_invariants(
    D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_ALIGN_: tl.constexpr,
):
    """The split kernels' tiling, checked at compile time."""
    tl.static_assert(BLOCK_H >= 16, "BLOCK_H: at least 16 heads (the smallest dot)")
    tl.static_assert(BLOCK_N % 16 == 0, "BLOCK_N: 16-token V and P blocks at absolute positions")
    tl.static_assert(SPLIT_ALIGN_ % BLOCK_N == 0, "split bounds are multiples of BLOCK_N")
    tl.static_assert(D1 % 16 == 0 and D2 % 16 == 0, "feature widths: multiples of 16")


@triton.jit
def request_len(seq_lens_ptr, b, stride_sl, capacity):
    """``(seq_len, poisoned)``: request ``b``'s length within ``[0, capacity]`` and whether
    the given one lay outside it (the request's rows are then NaN)."""
    raw = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    poisoned = (raw < 0) | (raw > capacity)
    return tl.minimum(tl.maximum(raw, 0), capacity), poisoned


@triton.jit
def split_chunk(seq_len, num_splits, ALIGN: tl.constexpr):
    """Tokens per split of a request: ``ceil(seq_len / num_splits)`` rounded up to ``ALIGN``."""
    per = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((per + ALIGN - 1) // ALIGN, 1) * ALIGN


@triton.jit
def split_bounds(
    seq_lens_ptr,
    stride_sl,
    capacity,
    num_splits,
    HEAD_GROUPS: tl.constexpr,
    SPLIT_ALIGN_: tl.constexpr,
):
    """What program ``program_id(0)`` of a split kernel owns: ``(hg, split, b, seq_len,
    poisoned, lo, hi)``, its head group, split and request, the request's length
    (``request_len``) and the chunk ``[lo, hi)`` of its tokens.

    Grid axis 0 enumerates (head group, split, request), head group fastest (programs
    that read the same latent rows run together). A request's tokens are cut into
    ``num_splits`` chunks whose bounds are multiples of ``SPLIT_ALIGN_`` at absolute
    positions (the chunk size depends on the request's own length only).
    """
    pid = tl.program_id(0)
    hg = pid % HEAD_GROUPS
    split = (pid // HEAD_GROUPS) % num_splits
    b = (pid // HEAD_GROUPS // num_splits).to(tl.int64)
    seq_len, poisoned = request_len(seq_lens_ptr, b, stride_sl, capacity)
    chunk = split_chunk(seq_len, num_splits, SPLIT_ALIGN_)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    return hg, split, b, seq_len, poisoned, lo, hi


@triton.jit
def load_q(
    q,
    q_strides,
    b,
    offs_h,
    h_mask,
    num_heads,
    score_scale,
    Q_SCALED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
):
    """A split program's q and starting state: request ``b``'s q (or q̂, factored by
    ``decode_q_kernel``) for heads ``offs_h``.

    Returns ``(q1 [BLOCK_H, D1], q2 [BLOCK_H, D2], row_scale [BLOCK_H], m_i, l_i, acc
    [BLOCK_H, D1])``: the row scale is ``score_scale`` (softmax scale times log2(e),
    and K's static global scale), times each row's q global scale when q is quantized
    (``Q_SCALED``); the running maximum, denominator and accumulator start at -inf, 0, 0.
    """
    qn_ptr, qp_ptr, qgs_ptr = q
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h = q_strides
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
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D1], tl.float32)
    return q1, q2, row_scale, m_i, l_i, acc


@triton.jit
def split_program(split, SHAPE: tl.constexpr, num_splits):
    """What a split kernel's program owns (``split_bounds``): ``(hg, split, b, seq_len,
    poisoned, lo, hi)``, after the tiling's static checks.

    ``split``: the arguments every split kernel takes first (``decode.split_kernel_args``),
    ``(q, cache, bt_ptr, seq_lens_ptr, out, partials, q_strides, cache_strides,
    bt_strides, stride_sl, o_strides, sizes, score_scale)``, with ``q``, ``out``,
    ``partials``, ``q_strides`` and ``o_strides`` as in this module's docstring, ``cache``
    the family's cache pointers (the raw cache's first) and ``cache_strides`` their (page,
    row) strides, ``bt_strides = (stride_bt_b, stride_bt_p)``, ``sizes = (num_heads,
    capacity)`` (the Triton split kernels take the cache's block count as their own
    unspecialized ``num_blocks``; a kernel without that argument, the Gluon one, finds it
    as ``sizes[2]``). ``SHAPE = (D1, D2, PAGE, BLOCK_H, BLOCK_N, HEAD_GROUPS,
    SPLIT_ALIGN_)``; ``num_splits``: the split count (a runtime value; the constant 1 where
    the kernel's ``MULTI_SPLIT`` is false: one split's program needs no division).
    """
    split_invariants(SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[4], SHAPE[6])
    seq_lens_ptr, stride_sl, capacity = split[3], split[9], split[11][1]
    return split_bounds(seq_lens_ptr, stride_sl, capacity, num_splits, SHAPE[5], SHAPE[6])


@triton.jit
def split_start(split, prog, Q_SCALED: tl.constexpr, SHAPE: tl.constexpr):
    """A split program's q and starting state (``load_q``), for ``prog`` (``split_program``'s).

    Returns ``(heads, offs_n, bt_row, q1, q2, row_scale, m_i, l_i, acc)``: ``heads =
    (offs_h, h_mask)``, the program's heads and which exist; ``offs_n``, a tile's token
    offsets ``[BLOCK_N]``; ``bt_row``, the request's block-table row.
    """
    D1: tl.constexpr = SHAPE[0]
    D2: tl.constexpr = SHAPE[1]
    BLOCK_H: tl.constexpr = SHAPE[3]
    q, bt_ptr, q_strides, bt_strides, score_scale = (
        split[0],
        split[2],
        split[6],
        split[8],
        split[12],
    )
    num_heads = split[11][0]
    offs_h = prog[0] * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_n = tl.arange(0, SHAPE[4])
    q1, q2, row_scale, m_i, l_i, acc = load_q(
        q, q_strides, prog[2], offs_h, h_mask, num_heads, score_scale, Q_SCALED, BLOCK_H, D1, D2
    )
    bt_row = bt_ptr + prog[2] * bt_strides[0]
    return (offs_h, h_mask), offs_n, bt_row, q1, q2, row_scale, m_i, l_i, acc


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
def scores(
    q1,
    q2,
    k1,
    k2,
    row_scale,
    col_scale,
    valid,
    RAW: tl.constexpr,
    COL_SCALED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Base-2 scores ``t [BLOCK_H, BLOCK_N] = (q1 k1ᵀ + q2 k2ᵀ) * row_scale`` (float32).

    ``RAW`` (an unquantized q or K): an infinite score becomes NaN (the rounded
    product formed by an fma with ``s - s``). ``COL_SCALED``: times K's per-token
    global scales ``col_scale [BLOCK_N]``. ``MASKED``: tokens not ``valid`` get -inf.
    """
    s = tl.dot(q1, tl.trans(k1))
    s = tl.dot(q2, tl.trans(k2), s)
    if RAW:  # noqa: SIM108 (constexpr branches: only one is traced)
        t = tl.fma(s, row_scale[:, None], s - s)  # the rounded product, + NaN if not finite
    else:
        t = s * row_scale[:, None]
    if COL_SCALED:
        t = t * col_scale[None, :]
    if MASKED:
        t = tl.where(valid[None, :], t, float("-inf"))
    return t


@triton.jit
def write_out(
    acc,
    m_i,
    l_i,
    nonempty,
    poisoned,
    out_scale,
    out,
    o_strides,
    b,
    offs_h,
    h_mask,
    D1: tl.constexpr,
):
    """Finished rows of request ``b``: ``out = acc / l`` times ``out_scale`` and ``lse = (log2 l
    + m) ln 2``, stored for heads ``offs_h``.

    The NaN rule (docs/numerics.md): a row whose accumulator holds a non-finite value
    is NaN in every feature; a NaN denominator (a non-finite score, or a page outside
    the cache: ``tile_pages``) makes out and LSE NaN; ``poisoned`` (a request length
    outside the table, a scalar) makes every row NaN. Rows of an empty request
    (``nonempty`` false): 0 and -inf.
    """
    out_ptr, lse_ptr = out
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h = o_strides
    l_i = tl.where(poisoned, float("nan"), l_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    keep = nonempty | poisoned
    inv_l = tl.where(keep, out_scale / l_safe, 0.0)
    o = dev.poison(acc * inv_l[:, None], tl.sum(acc, axis=1)[:, None])
    lse = tl.where(keep, (tl.log2(l_safe) + m_i) * LN2, float("-inf"))
    offs_d1 = tl.arange(0, D1)
    o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d1[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    tl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)


@triton.jit
def finish_split(
    acc, m_i, l_i, prog, heads, split, out_scale, num_splits, SHAPE: tl.constexpr,
    MULTI_SPLIT: tl.constexpr,
):  # fmt: skip
    """A split program's epilogue (``prog``, ``heads`` and ``split`` as ``split_program``'s
    and ``split_start``'s; ``MULTI_SPLIT``: ``num_splits > 1``): with one
    split, out and LSE (``write_out``); else the split's partial ``acc``, ``m``, ``l`` into
    the workspace ``partials``: acc ``[B, num_splits, H, D1]`` and (m, l) ``[B, num_splits,
    H, 2]`` float32, written only by a split that holds tokens."""
    D1: tl.constexpr = SHAPE[0]
    _, s, b, seq_len, poisoned, lo, _ = prog
    offs_h, h_mask = heads
    out, partials, o_strides, num_heads = split[4], split[5], split[10], split[11][0]
    if not MULTI_SPLIT:
        write_out(
            acc, m_i, l_i, seq_len > 0, poisoned, out_scale, out, o_strides, b, offs_h, h_mask, D1
        )
    else:
        wacc_ptr, wml_ptr = partials
        offs_d1 = tl.arange(0, D1)
        row = (b * num_splits + s) * num_heads + offs_h  # int64 [BLOCK_H]
        st_mask = h_mask & (lo < seq_len)
        tl.store(wacc_ptr + row[:, None] * D1 + offs_d1[None, :], acc, mask=st_mask[:, None])
        tl.store(wml_ptr + row * 2, m_i, mask=st_mask)
        tl.store(wml_ptr + row * 2 + 1, l_i, mask=st_mask)
