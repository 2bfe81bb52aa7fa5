"""Varlen quantized MLA prefill: the Triton kernels (docs/numerics.md).

Algorithm and tiling
--------------------
``prefill_fwd_kernel`` is flash attention with an online softmax over packed
varlen sequences. One program owns one tile of ``BLOCK_M`` queries of one query
head of one sequence (grid: query tiles x heads x sequences; causal launches walk
the query tiles from the last, longest one down, so heavy programs start first).

1. Prologue: load the query tile once, QDQ it along the head dim (dynamic amax:
   per row over the whole head dim) into its *factored* value (the QDQ'd value
   divided by its global scale; exact in fp16 and bf16), and fold its global
   scale, the softmax scale and log2(e) into one per-row factor ``row_scale``.
2. Walk the key tiles of ``BLOCK_N`` keys from key position 0. The tiles wholly
   visible to every row of the query tile run first without any mask; the tiles
   on the causal diagonal (and the partial tile at the end of the keys) run
   second with the position checks. Per key tile:
   - ``S = Q̂ K̂ᵀ`` on 16-bit tensor cores (exact products, fp32 accumulate), the
     global scales applied to the fp32 scores;
   - N:M sparsity: within each group of ``NM_M`` keys at absolute positions, the
     ``NM_N`` best visible scores (ties to the lower index) survive, plus the
     dense sink and recent keys;
   - the running maximum ``m`` of the base-2 scores is kept at ``ceil`` (an
     integer), so every rescale ``2^(m_old - m_new)`` is exact;
     ``P = 2^(t - m)``; ``l`` is summed from the unquantized P;
   - P is QDQ'd along the key axis: its nvfp4 blocks of 16 keys start at key
     positions that are multiples of 16 from the sequence start, because every
     tile starts at a multiple of ``BLOCK_N``; P's global scale stays out of the
     accumulator;
   - ``acc += P̂ V̂`` on 16-bit tensor cores.
3. Epilogue: ``out = acc * (gs_p * gs_v) / l`` and ``lse = ln(l) + m ln 2``; a row
   with no visible key writes 0 and -inf.

Head dims that are not powers of two are split into a power-of-two part ``D1``
and a remainder ``D2`` (192 = 128 + 64, 576 = 512 + 64): two dots, no tensor-core
work on padding. A remainder that is not a power of two is padded with zeros.

K and V are quantized once, not once per tile pair: ``kv_qdq_kernel`` writes
factored copies of the fresh K and V (and K's per-token global scales when K's
amax is dynamic) in one pass before the attention kernel; its programs stride
over each sequence's tokens, so the pass covers every key whatever ``max_seqlen_k``
the grid was sized from. With ``KV_FUSED`` the attention kernel quantizes each
K and V tile itself instead; the wrapper picks that only when every K/V tile is
read by a single program (one query tile per sequence and no GQA sharing), where
it is the same single QDQ without the extra pass over memory. QDQ is
deterministic, so both give the same numbers (on an H200 the pass is 8x faster
than per-tile QDQ for long sequences: docs/benchmarks.md).

Non-finite operands (the NaN rule of docs/numerics.md): QDQ turns them into NaN
and poisons their scale's block or row (``qdq_device``). A score that is -inf
before masking (an unquantized infinite operand, ``QK_RAW``) becomes NaN, and
N:M sparsity never drops a NaN score, so a row that sees a non-finite q̂ or k̂
gets a NaN ``l`` and a NaN output and LSE. The epilogue writes a row whose
accumulator holds a non-finite element all NaN (a non-finite v̂ the row sees).
On the causal diagonal tiles a row can load a key it does not see, where
``0 * NaN`` would poison it: there the keys whose v̂ row is non-finite are
zeroed, and the rows that see one of them are set to NaN (``_diagonal_v``).

Cost on Hopper: the loop is a FlashAttention-2 schedule (no warp specialization in
Triton 3.6 for sm_90), so P's QDQ and N:M ranking run on the CUDA cores between
the tensor-core dots rather than beside them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_triton.common import qdq as dev
from mla_triton.common.kernels import LN2, qdq_p, softmax_step


@triton.jit
def _to_dot(x, DOT: tl.constexpr):
    """Cast a dot operand to the dot type code ``DOT``: fp16 (1), bf16 (2), or leave
    it (0: float32 operands, IEEE dots). The wrapper picks the codes."""
    if DOT == 1:
        x = x.to(tl.float16)
    elif DOT == 2:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _load_tile(
    ptr, rows, cols, stride_row, n_rows, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr
):
    """``ptr[rows, cols]`` (row stride ``stride_row``, unit column stride), 0 outside."""
    ptrs = ptr + rows[:, None] * stride_row + cols[None, :]
    if MASK_ROWS and MASK_COLS:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_split(
    base, rows, stride_row, n_rows, D1: tl.constexpr, D2: tl.constexpr, D2_VALID: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):  # fmt: skip
    """Rows of a head dim split as ``D1 + D2``: ``(x1 [R, D1], x2 [R, D2])`` in the input
    dtype, zeros past ``D2_VALID`` (and past ``n_rows`` with ``MASK_ROWS``); ``x2`` is
    ``x1`` when ``D2 == 0``."""
    x1 = _load_tile(base, rows, tl.arange(0, D1), stride_row, n_rows, D1, MASK_ROWS, False)
    if D2 > 0:
        x2 = _load_tile(
            base + D1, rows, tl.arange(0, D2), stride_row, n_rows, D2_VALID, MASK_ROWS,
            D2_VALID < D2,
        )  # fmt: skip
    else:
        x2 = x1
    return x1, x2


@triton.jit
def _qdq_features(
    x, gs, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, HW: tl.constexpr
):
    """Factored QDQ of float32 ``[ROWS, COLS]`` along the feature axis; ``gs`` ``[ROWS]``.

    Bit-exact for any global scale: the reference's rounded divisions (``HW``: a
    compiled sm89+ kernel, with fused FMAs and the fp8 conversion instruction).
    Non-finite elements give NaN (the fp8 conversion instruction saturates ±inf).
    """
    if FMT == 1:
        inv = tl.math.div_rn(1.0, gs)[:, None]
        y = dev.poison(dev.e4m3_round_hw(dev.div_rn_fma(x, gs[:, None], inv, HW), HW), x)
    elif FMT == 2:
        y = dev.nvfp4_qdq(x, gs[:, None], ROWS, COLS, 1, True, HW)
    else:
        y = x
    return y


@triton.jit
def _qdq_split(
    x1, x2, gs_static, FMT: tl.constexpr, DYNAMIC: tl.constexpr, ROWS: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """Factored QDQ of float32 rows split over ``x1`` and ``x2`` (``_load_split``) along
    the features: ``(y1, y2, gs)`` with the rows' global scales ``gs [ROWS]`` (dynamic:
    ``amax / unit_amax`` over the whole row, NaN for a row with a non-finite element;
    static: ``gs_static``)."""
    if DYNAMIC:
        gs = dev.dynamic_global_scale(x1, x2, FMT, 1)
    else:
        gs = tl.zeros([ROWS], tl.float32) + gs_static
    y1 = _qdq_features(x1, gs, FMT, ROWS, D1, HW)
    if D2 > 0:  # noqa: SIM108 (y2 is y1 when D2 == 0)
        y2 = _qdq_features(x2, gs, FMT, ROWS, D2, HW)
    else:
        y2 = y1
    return y1, y2, gs


@triton.jit
def _qdq_features_fast(
    x, gs, inv, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, HW: tl.constexpr
):
    """``_qdq_features`` for 16-bit inputs and a static power-of-two ``gs`` (a scalar).

    Multiplications by reciprocals (``inv``: ``1 / gs`` for fp8, ``1 / (6 gs)`` for
    nvfp4) with ``snap_ties``, bit-exact under those conditions (qdq_device).
    """
    if FMT == 1:
        y = dev.poison(dev.e4m3_round_hw(x * inv, HW), x)
    else:
        y = dev.nvfp4_qdq_fast(x, gs, inv, ROWS, COLS, 1, HW, True)
    return y


@triton.jit
def _qdq_tokens(
    x, gs, inv, FMT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, FAST: tl.constexpr,
    HW: tl.constexpr,
):  # fmt: skip
    """Factored QDQ of float32 ``[ROWS, COLS]`` along the token axis; ``gs`` a scalar.

    Rows are tokens; the tile starts at a multiple of 16 from the sequence start
    and rows past the sequence's end hold zeros (the open tail block's padding).
    ``FAST``: the reciprocal path of ``_qdq_features_fast`` (same conditions).
    """
    if FMT == 1:
        if FAST:
            y = dev.e4m3_round_hw(x * inv, HW)
        else:
            y = dev.e4m3_round_hw(dev.div_rn_fma(x, gs, tl.math.div_rn(1.0, gs), HW), HW)
        y = dev.poison(y, x)
    elif FAST:
        y = dev.nvfp4_qdq_fast(x, gs, inv, ROWS, COLS, 0, HW, True)
    elif FMT == 2:
        y = dev.nvfp4_qdq(x, gs, ROWS, COLS, 0, True, HW)
    else:
        y = x
    return y


@triton.jit
def _nm_keep(
    s,
    key_pos,
    q_pos,
    n_sink,
    n_recent,
    dense_all,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NM_N: tl.constexpr,
    NM_M: tl.constexpr,
    DENSE: tl.constexpr,
):
    """Boolean ``[BLOCK_M, BLOCK_N]``: the keys N:M sparsity keeps (docs/numerics.md "LSE, masks
    and input checks").

    ``s`` holds the scores with invisible keys at -inf; groups are ``NM_M``
    consecutive keys at absolute positions (the tile starts at a multiple of
    ``NM_M``). Each score becomes a unique int32 sort key: its float32 bits made
    order-preserving, the lowest log2(NM_M) bits replaced by ``NM_M - 1 - member``
    so that ties go to the lower index. The kept keys are those at or above the
    group's ``NM_N``-th largest key, found by ``NM_N`` max-reductions over the
    group. (Scores equal in all but those lowest bits rank as ties: a few ulps,
    below the rounding noise of the scores themselves.) With ``DENSE``, sink keys
    (``key_pos < n_sink``) and recent keys (``0 <= q_pos - key_pos < n_recent``)
    are kept too; ``dense_all`` (a single-query sequence) keeps everything.
    """
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as int order
    member = tl.arange(0, BLOCK_N) % NM_M
    key = (key & -NM_M) | (NM_M - 1 - member)[None, :]
    key3 = tl.reshape(key, (BLOCK_M, BLOCK_N // NM_M, NM_M))
    nth = tl.max(key3, axis=2)
    for _ in tl.static_range(NM_N - 1):
        nth = tl.max(tl.where(key3 < nth[:, :, None], key3, -2147483648), axis=2)
    nth = tl.where(dense_all, -2147483648, nth)  # every key is at or above that
    keep = tl.reshape(key3 >= nth[:, :, None], (BLOCK_M, BLOCK_N))
    if DENSE:
        distance = q_pos[:, None] - key_pos[None, :]
        keep = keep | (key_pos[None, :] < n_sink) | ((distance >= 0) & (distance < n_recent))
    return keep


@triton.jit
def _scores(
    q1,
    q2,
    k_base,
    ks_base,
    start_n,
    limit,
    k_gs,
    stride_kt,
    stride_kst,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D2_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYNAMIC: tl.constexpr,
    KV_FUSED: tl.constexpr,
    QK_DOT: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """``Q̂ K̂ᵀ`` ``[BLOCK_M, BLOCK_N]`` (float32) for keys ``start_n, ...``.

    K's per-token global scales are applied (static ones live in ``row_scale``).
    ``MASKED``: keys at or past ``limit`` load as zeros.
    """
    key_pos = start_n + tl.arange(0, BLOCK_N)
    k1, k2 = _load_split(k_base, key_pos, stride_kt, limit, D1, D2, D2_VALID, MASKED)
    if KV_FUSED and K_FMT != 0:  # K QDQ'd here, once per query tile (see module doc)
        k1, k2, col_gs = _qdq_split(
            k1.to(tl.float32), k2.to(tl.float32), k_gs, K_FMT, K_DYNAMIC, BLOCK_N, D1, D2,
            HW_FP8,
        )  # fmt: skip
    elif K_DYNAMIC:
        ks_ptrs = ks_base + key_pos * stride_kst
        if MASKED:  # noqa: SIM108
            col_gs = tl.load(ks_ptrs, mask=key_pos < limit, other=1.0)
        else:
            col_gs = tl.load(ks_ptrs)
    s = tl.dot(q1, tl.trans(_to_dot(k1, QK_DOT)), input_precision="ieee")
    if D2 > 0:
        s = tl.dot(q2, tl.trans(_to_dot(k2, QK_DOT)), s, input_precision="ieee")
    if K_DYNAMIC:
        s = s * col_gs[None, :]
    return s


@triton.jit
def _softmax_tile(
    s,
    m_i,
    l_i,
    row_scale,
    start_n,
    seq_len_k,
    q_pos,
    p_gs,
    p_inv_gs,
    n_sink,
    n_recent,
    dense_all,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_RAW: tl.constexpr,
    P_FMT: tl.constexpr,
    NM_N: tl.constexpr,
    NM_M: tl.constexpr,
    NM_DENSE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Masks, N:M, the integer running max, ``P = 2^(t - m)``, ``l``, and P's QDQ.

    ``QK_RAW`` (Q or K unquantized): a score that is -inf before the masks (an
    infinite operand) becomes NaN. N:M keeps NaN scores. Returns ``(p, alpha, l,
    m)``: P's factored values, the exact power-of-two rescale ``2^(m_old - m_new)``
    of the accumulator, and the updated row state.
    """
    key_pos = start_n + tl.arange(0, BLOCK_N)  # absolute key positions in the sequence
    if QK_RAW:
        s = tl.where(s == float("-inf"), float("nan"), s)
    if MASKED:
        visible = key_pos[None, :] < seq_len_k
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    if NM_N > 0:
        keep = _nm_keep(
            s, key_pos, q_pos, n_sink, n_recent, dense_all, BLOCK_M, BLOCK_N, NM_N, NM_M,
            NM_DENSE,
        )  # fmt: skip
        s = tl.where(keep | (s != s), s, float("-inf"))
    # base-2 scores t = s * row_scale; a row may have seen no key yet (causal)
    m_new, alpha, p, l_i = softmax_step(m_i, l_i, s, row_scale, True, True)
    # p_inv_gs: 1 / gs for fp8, 1 / (6 gs) for nvfp4 (the one each form reads)
    p = qdq_p(p, (p_gs, p_inv_gs, p_inv_gs), P_FMT, HW_FP8, BLOCK_M, BLOCK_N)
    return p, alpha, l_i, m_new


@triton.jit
def _diagonal_v(v, key_pos, q_pos):
    """The NaN rule on a causal diagonal tile ``v [BLOCK_N, DVP]``: rows of keys that
    some queries do not see would reach them as ``0 * NaN``. Returns ``v`` with the
    keys whose row holds a non-finite element zeroed, and ``[BLOCK_M]`` True for the
    query rows that see one of those keys (they become NaN)."""
    row = tl.sum(v - v, axis=1)  # NaN for a non-finite row, else 0 (in v's dtype)
    bad = row != row
    v = tl.where(bad[:, None], tl.zeros_like(v), v)
    seen = (key_pos[None, :] <= q_pos[:, None]) & bad[None, :]
    return v, tl.max(seen.to(tl.int32), axis=1) > 0


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q1,
    q2,
    row_scale,
    bases,
    lo,
    hi,
    seq_len_k,
    q_pos,
    scales,
    nm,
    strides,
    DIMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_RAW: tl.constexpr,
    RECIPE: tl.constexpr,
):
    """Online softmax over the key tiles starting at ``lo, lo + BLOCK_N, ... < hi``.

    ``MASKED`` tiles check key positions against the sequence end and, when
    ``CAUSAL``, against each row's query position ``q_pos`` (and apply
    ``_diagonal_v``). Grouped as ``prefill_fwd_kernel`` passes them: ``bases = (k,
    v, ks)`` (the sequence's and head's first rows), ``scales = (k_gs, v_gs, p_gs,
    p_inv_gs)``, ``nm = (n_sink, n_recent, dense_all)``, ``strides = (stride_kt,
    stride_vt, stride_kst)``, ``DIMS = (D1, D2, D2_VALID, DV, DVP)``, ``RECIPE =
    (K_FMT, K_DYNAMIC, V_FMT, KV_FUSED, P_FMT, NM_N, NM_M, NM_DENSE, QK_DOT, PV_DOT,
    HW_FP8)``.
    """
    D1: tl.constexpr = DIMS[0]
    D2: tl.constexpr = DIMS[1]
    D2_VALID: tl.constexpr = DIMS[2]
    DV: tl.constexpr = DIMS[3]
    DVP: tl.constexpr = DIMS[4]
    K_FMT: tl.constexpr = RECIPE[0]
    K_DYNAMIC: tl.constexpr = RECIPE[1]
    V_FMT: tl.constexpr = RECIPE[2]
    KV_FUSED: tl.constexpr = RECIPE[3]
    P_FMT: tl.constexpr = RECIPE[4]
    NM_N: tl.constexpr = RECIPE[5]
    NM_M: tl.constexpr = RECIPE[6]
    NM_DENSE: tl.constexpr = RECIPE[7]
    QK_DOT: tl.constexpr = RECIPE[8]
    PV_DOT: tl.constexpr = RECIPE[9]
    HW_FP8: tl.constexpr = RECIPE[10]
    k_base, v_base, ks_base = bases
    k_gs, v_gs, p_gs, p_inv_gs = scales
    n_sink, n_recent, dense_all = nm
    stride_kt, stride_vt, stride_kst = strides
    offs_dv = tl.arange(0, DVP)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        s = _scores(
            q1, q2, k_base, ks_base, start_n, seq_len_k, k_gs, stride_kt, stride_kst, D1,
            D2, D2_VALID, BLOCK_N, MASKED, K_FMT, K_DYNAMIC, KV_FUSED, QK_DOT, HW_FP8,
        )  # fmt: skip
        p, alpha, l_i, m_i = _softmax_tile(
            s, m_i, l_i, row_scale, start_n, seq_len_k, q_pos, p_gs, p_inv_gs, n_sink,
            n_recent, dense_all, BLOCK_M, BLOCK_N, MASKED, CAUSAL, QK_RAW, P_FMT, NM_N,
            NM_M, NM_DENSE, HW_FP8,
        )  # fmt: skip
        key_pos = start_n + tl.arange(0, BLOCK_N)
        v = _load_tile(v_base, key_pos, offs_dv, stride_vt, seq_len_k, DV, MASKED, DVP != DV)
        if KV_FUSED and V_FMT != 0:
            v = _qdq_tokens(v.to(tl.float32), v_gs, 1.0, V_FMT, BLOCK_N, DVP, False, HW_FP8)
        if MASKED and CAUSAL:
            v, sees_bad = _diagonal_v(v, key_pos, q_pos)
        acc = acc * alpha[:, None]
        acc = tl.dot(_to_dot(p, PV_DOT), _to_dot(v, PV_DOT), acc, input_precision="ieee")
        if MASKED and CAUSAL:
            acc = tl.where(sees_bad[:, None], float("nan"), acc)
    return acc, l_i, m_i


@triton.jit
def seq_span(cu_seqlens, seq, rows):
    """Sequence ``seq`` of a packed tensor of ``rows`` rows: ``(start, length, bad)`` from
    the int32 offsets ``cu_seqlens [B + 1]``, clamped into ``[0, rows]`` so that no
    offset, checked or vouched for, moves a read or a write outside the tensor
    (docs/numerics.md "Vouched offsets"). ``bad``: the offsets left ``[0, rows]`` or
    decreased."""
    raw_start = tl.load(cu_seqlens + seq)
    raw_end = tl.load(cu_seqlens + seq + 1)
    start = tl.minimum(tl.maximum(raw_start, 0), rows)
    end = tl.minimum(tl.maximum(raw_end, start), rows)
    return start, end - start, (start != raw_start) | (end != raw_end)


@triton.jit
def query_tile(cu_seqlens_q, rows_q, CAUSAL: tl.constexpr):
    """This program's query tile: ``(start_m, head, seq, q_start, seq_len_q, bad)`` from
    the grid (query tiles x heads x sequences; causal grids walk the tiles from the last,
    heaviest one down) and the offsets ``cu_seqlens_q`` into q's ``rows_q`` rows
    (``seq_span``). Shared with the Gluon kernel (``gluon_kernels``)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if CAUSAL:  # noqa: SIM108
        start_m = tl.num_programs(0) - 1 - pid_m  # longest query tiles first
    else:
        start_m = pid_m
    q_start, seq_len_q, bad = seq_span(cu_seqlens_q, seq, rows_q)
    return start_m, head, seq, q_start, seq_len_q, bad


@triton.jit
def store_tile(
    Out, Lse, out, lse, q_start, seq_len_q, offs_m, offs_dv, head, stride_ot, stride_oh,
    stride_lh, DV: tl.constexpr, RETURN_LSE: tl.constexpr,
):  # fmt: skip
    """Write a query tile's ``out [BLOCK_M, DVP]`` (float32, cast to Out's dtype) and
    ``lse [BLOCK_M]``: rows ``offs_m`` of the sequence at ``q_start`` below
    ``seq_len_q``, features ``offs_dv`` below ``DV``."""
    row_ok = offs_m < seq_len_q
    o_ptrs = (
        Out
        + (q_start.to(tl.int64) + offs_m[:, None]) * stride_ot
        + head * stride_oh
        + offs_dv[None, :]
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if RETURN_LSE:
        tl.store(Lse + head * stride_lh + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def poison_tile(
    Out, Lse, q_start, seq_len_q, start_m, head, stride_ot, stride_oh, stride_lh,
    BLOCK_M: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, RETURN_LSE: tl.constexpr,
):  # fmt: skip
    """NaN into the query tile's output rows (and LSE): a sequence whose offsets left
    the tensors (``seq_span``'s ``bad``)."""
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nan = tl.full([BLOCK_M, DVP], float("nan"), tl.float32)
    store_tile(Out, Lse, nan, tl.sum(nan, axis=1), q_start, seq_len_q, offs_m,
               tl.arange(0, DVP), head, stride_ot, stride_oh, stride_lh, DV,
               RETURN_LSE)  # fmt: skip


@triton.jit
def key_bounds(
    start_m, seq_len_q, seq_len_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    """The key range of query tile ``start_m``: ``(hi, mid)``, keys ``[0, hi)`` visible to
    some row (causal: suffix alignment, query ``i`` at key position ``Lk - Lq + i``), the
    tiles before ``mid`` (a multiple of ``BLOCK_N``) visible to every row, unmasked."""
    if CAUSAL:
        first_pos = seq_len_k - seq_len_q + start_m * BLOCK_M
        last_pos = seq_len_k - seq_len_q + tl.minimum(start_m * BLOCK_M + BLOCK_M, seq_len_q) - 1
        hi = tl.maximum(tl.minimum(seq_len_k, last_pos + 1), 0)
        mid = tl.maximum(tl.minimum(first_pos + 1, seq_len_k), 0) // BLOCK_N * BLOCK_N
    else:
        hi = seq_len_k
        mid = seq_len_k // BLOCK_N * BLOCK_N
    return hi, mid


@triton.jit(do_not_specialize=["rows_q", "rows_k"])
def prefill_fwd_kernel(
    Q,
    K,
    V,
    KS,
    Out,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    rows_q,
    rows_k,
    qk_scale,
    q_gs,
    k_gs,
    v_gs,
    p_gs,
    p_inv_gs,
    out_scale,
    n_sink,
    n_recent,
    group,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kst,
    stride_ot,
    stride_oh,
    stride_lh,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D2_VALID: tl.constexpr,
    DV: tl.constexpr,
    DVP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    Q_FMT: tl.constexpr,
    Q_DYNAMIC: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYNAMIC: tl.constexpr,
    V_FMT: tl.constexpr,
    KV_FUSED: tl.constexpr,
    P_FMT: tl.constexpr,
    NM_N: tl.constexpr,
    NM_M: tl.constexpr,
    NM_DENSE: tl.constexpr,
    QK_DOT: tl.constexpr,
    PV_DOT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Attention of one query tile (``BLOCK_M`` rows) of one head of one sequence.

    Q ``[T, H, D1 + D2_VALID]``, K ``[Tk, Hkv, D1 + D2_VALID]`` and V ``[Tk, Hkv, DV]``
    (raw, or the factored values from ``kv_qdq_kernel``); KS ``[Tk, Hkv]`` K's
    per-token global scales (``K_DYNAMIC``, not fused); Out ``[T, H, DV]``; Lse
    ``[H, T]`` float32. Scalars: ``qk_scale`` = softmax_scale * log2(e) times the
    static Q and K global scales; ``q_gs``, ``k_gs``, ``v_gs``, ``p_gs`` static
    global scales (``p_inv_gs = 1 / p_gs``); ``out_scale`` = P's times V's global scale;
    ``rows_q`` / ``rows_k``: T and Tk, the bounds of the offsets (``seq_span``; a
    sequence whose offsets leave them gets NaN rows). Format codes: 0 none, 1 fp8,
    2 nvfp4.
    """
    tl.static_assert(BLOCK_N % 16 == 0, "BLOCK_N: P's 16-key blocks start at multiples of 16")
    tl.static_assert(NM_N == 0 or BLOCK_N % NM_M == 0, "BLOCK_N: whole N:M groups a tile")
    start_m, head, seq, q_start, seq_len_q, bad_q = query_tile(cu_seqlens_q, rows_q, CAUSAL)
    if start_m * BLOCK_M >= seq_len_q:
        return
    k_start, seq_len_k, bad_k = seq_span(cu_seqlens_k, seq, rows_k)
    if bad_q | bad_k:
        poison_tile(Out, Lse, q_start, seq_len_q, start_m, head, stride_ot, stride_oh,
                    stride_lh, BLOCK_M, DV, DVP, RETURN_LSE)  # fmt: skip
        return
    kv_head = head // group

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows in the sequence
    q_pos = seq_len_k - seq_len_q + offs_m  # their key positions (suffix alignment)
    offs_dv = tl.arange(0, DVP)

    # -- prologue: the query tile, QDQ'd once ---------------------------------
    q_base = Q + q_start.to(tl.int64) * stride_qt + head * stride_qh
    q1, q2 = _load_split(q_base, offs_m, stride_qt, seq_len_q, D1, D2, D2_VALID, True)
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)
    row_scale = tl.zeros([BLOCK_M], tl.float32) + qk_scale
    if Q_FMT != 0:
        q1, q2, gs_q = _qdq_split(q1, q2, q_gs, Q_FMT, Q_DYNAMIC, BLOCK_M, D1, D2, HW_FP8)
        if Q_DYNAMIC:
            row_scale = row_scale * gs_q
    q1 = _to_dot(q1, QK_DOT)
    q2 = _to_dot(q2, QK_DOT)
    QK_RAW: tl.constexpr = Q_FMT == 0 or K_FMT == 0

    # -- key tiles: unmasked ones first, then the causal diagonal / the tail ---
    hi, mid = key_bounds(start_m, seq_len_q, seq_len_k, BLOCK_M, BLOCK_N, CAUSAL)
    dense_all = seq_len_q == 1  # a single query is never sparsified

    k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    ks_base = KS + k_start.to(tl.int64) * stride_kst + kv_head
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    bases = (k_base, v_base, ks_base)
    scales = (k_gs, v_gs, p_gs, p_inv_gs)
    nm = (n_sink, n_recent, dense_all)
    strides = (stride_kt, stride_vt, stride_kst)
    DIMS: tl.constexpr = (D1, D2, D2_VALID, DV, DVP)
    RECIPE: tl.constexpr = (
        K_FMT, K_DYNAMIC, V_FMT, KV_FUSED, P_FMT, NM_N, NM_M, NM_DENSE, QK_DOT, PV_DOT, HW_FP8
    )  # fmt: skip
    # two stages, one inner loop (FlashAttention's schedule): stage 0 the key tiles
    # every row of the tile sees in full (no masks), stage 1 the causal diagonal and
    # the partial tile at the end of the keys (masked)
    for STAGE in tl.static_range(2):
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q1, q2, row_scale, bases, 0 if STAGE == 0 else mid,
            mid if STAGE == 0 else hi, seq_len_k, q_pos, scales, nm, strides, DIMS, BLOCK_M,
            BLOCK_N, STAGE == 1, CAUSAL, QK_RAW, RECIPE,
        )  # fmt: skip

    # -- epilogue --------------------------------------------------------------
    empty = l_i == 0.0
    inv_l = out_scale / tl.where(empty, 1.0, l_i)
    out = acc * inv_l[:, None]  # acc is 0 on empty rows
    out = out + tl.sum(acc - acc, axis=1)[:, None]  # a non-finite element: the row is NaN
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    store_tile(Out, Lse, out, lse, q_start, seq_len_q, offs_m, offs_dv, head, stride_ot,
               stride_oh, stride_lh, DV, RETURN_LSE)  # fmt: skip


@triton.jit
def _kv_qdq_tile(
    K, V, KQ, VQ, KS, k_start, seq_len, t0, kv_head, k_gs, v_gs, k_inv, v_inv,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kqt, stride_kqh, stride_vqt,
    stride_vqh, stride_kst, D1: tl.constexpr, D2: tl.constexpr, D2_VALID: tl.constexpr,
    DV: tl.constexpr, DVP: tl.constexpr, BLOCK_T: tl.constexpr, K_FMT: tl.constexpr,
    K_DYNAMIC: tl.constexpr, V_FMT: tl.constexpr, K_FAST: tl.constexpr, V_FAST: tl.constexpr,
    HW_FP8: tl.constexpr,
):  # fmt: skip
    """``kv_qdq_kernel``'s work on the tokens ``t0 .. t0 + BLOCK_T`` of one sequence."""
    rows = t0 + tl.arange(0, BLOCK_T)  # token positions in the sequence
    row_ok = rows < seq_len
    if K_FMT != 0:
        offs_d1 = tl.arange(0, D1)
        k_base = K + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        kq_base = KQ + k_start.to(tl.int64) * stride_kqt + kv_head * stride_kqh
        k1, k2 = _load_split(k_base, rows, stride_kt, seq_len, D1, D2, D2_VALID, True)
        k1 = k1.to(tl.float32)
        k2 = k2.to(tl.float32)
        if K_FAST:
            k1 = _qdq_features_fast(k1, k_gs, k_inv, K_FMT, BLOCK_T, D1, HW_FP8)
            if D2 > 0:
                k2 = _qdq_features_fast(k2, k_gs, k_inv, K_FMT, BLOCK_T, D2, HW_FP8)
        else:
            k1, k2, gs = _qdq_split(k1, k2, k_gs, K_FMT, K_DYNAMIC, BLOCK_T, D1, D2, HW_FP8)
        tl.store(
            kq_base + rows[:, None] * stride_kqt + offs_d1[None, :],
            k1.to(KQ.dtype.element_ty),
            mask=row_ok[:, None],
        )
        if D2 > 0:
            offs_d2 = tl.arange(0, D2)
            tl.store(
                kq_base + D1 + rows[:, None] * stride_kqt + offs_d2[None, :],
                k2.to(KQ.dtype.element_ty),
                mask=row_ok[:, None] & (offs_d2[None, :] < D2_VALID),
            )
        if K_DYNAMIC:
            tl.store(KS + (k_start + rows) * stride_kst + kv_head, gs, mask=row_ok)
    if V_FMT != 0:
        offs_dv = tl.arange(0, DVP)
        v_base = V + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        vq_base = VQ + k_start.to(tl.int64) * stride_vqt + kv_head * stride_vqh
        v = _load_tile(v_base, rows, offs_dv, stride_vt, seq_len, DV, True, DVP != DV)
        v = _qdq_tokens(v.to(tl.float32), v_gs, v_inv, V_FMT, BLOCK_T, DVP, V_FAST, HW_FP8)
        tl.store(
            vq_base + rows[:, None] * stride_vqt + offs_dv[None, :],
            v.to(VQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        )


@triton.jit(do_not_specialize=["rows_k"])
def kv_qdq_kernel(
    K,
    V,
    KQ,
    VQ,
    KS,
    cu_seqlens_k,
    rows_k,
    k_gs,
    v_gs,
    k_inv,
    v_inv,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kqt,
    stride_kqh,
    stride_vqt,
    stride_vqh,
    stride_kst,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D2_VALID: tl.constexpr,
    DV: tl.constexpr,
    DVP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYNAMIC: tl.constexpr,
    V_FMT: tl.constexpr,
    K_FAST: tl.constexpr,
    V_FAST: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """QDQ the fresh keys and values of one KV head of one sequence, once.

    Writes the factored K (along the head dim) to KQ, its per-token global scales
    to KS ``[Tk, Hkv]`` when dynamic, and the factored V (along the tokens, blocks
    from the sequence start) to VQ. Grid: token tiles x KV heads x sequences; a
    program takes the tiles ``pid, pid + num_programs, ...`` of ``BLOCK_T`` tokens,
    so every token is covered whatever the grid's first dimension, and none outside
    K's ``rows_k`` rows (``seq_span``). ``K_FAST`` /
    ``V_FAST``: 16-bit input and a static power-of-two global scale, where the
    reciprocal path (``k_inv``, ``v_inv``) is bit-exact and cheaper.
    """
    pid_t = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    k_start, seq_len, _ = seq_span(cu_seqlens_k, seq, rows_k)
    for t0 in range(pid_t * BLOCK_T, seq_len, tl.num_programs(0) * BLOCK_T):
        _kv_qdq_tile(
            K, V, KQ, VQ, KS, k_start, seq_len, t0, kv_head, k_gs, v_gs, k_inv, v_inv,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_kqt, stride_kqh, stride_vqt,
            stride_vqh, stride_kst, D1, D2, D2_VALID, DV, DVP, BLOCK_T, K_FMT, K_DYNAMIC,
            V_FMT, K_FAST, V_FAST, HW_FP8,
        )  # fmt: skip
