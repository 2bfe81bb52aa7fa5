"""Varlen MLA prefill for Hopper (sm90) in Gluon: TMA, wgmma, mbarriers (docs/numerics.md).

fp16 / bf16 operands, fp32 accumulators; the numbers follow docs/numerics.md as
``prefill_kernel.prefill_fwd_kernel`` computes them (the integer running maximum,
``l`` summed from the unquantized P, the NaN rule). Q, K and V arrive raw or as
factored QDQ values from a pass before attention (the launcher's; dynamic global
scales per token in ``QS`` / ``KS``); P is QDQ'd here between the two MMAs (fp8 or nvfp4).

Schedule
--------
One program owns ``BLOCK_M`` queries of one query head of one sequence (grid:
query tiles x heads x sequences; causal launches walk the query tiles from the
last, heaviest one down). ``num_warps`` is ``BLOCK_M / 16``: the wgmma of each
warpgroup covers 64 of the rows.

- Q is loaded once by TMA into ``DQK / 64`` shared tiles ``[BLOCK_M, 64]`` (128-byte
  swizzle); K tiles the same way ``[BLOCK_N, 64]``, V tiles ``[BLOCK_N, DV]``, in a
  ring of ``NUM_STAGES`` buffers with one mbarrier each for K and V, so that the
  loads of the next tiles run under the current tile's work.
- Tensor descriptors are 2-d views ``[tokens, columns]`` with the token stride as
  row stride: column ``head * stride_head + d`` is element ``d`` of a head. Any
  layout with a unit stride on the head dim and a 16-byte-aligned token stride
  fits (the launcher copies other inputs). Rows past a sequence's end belong to
  the next sequence (or are TMA zero fill past the last token): the scores mask
  them, and the V rows of masked tiles are sanitized before their MMA (below).
- Key loop (FA3's intra-warpgroup overlap): at tile ``j`` the kernel issues
  ``S_j = Q K_jᵀ`` (async), then ``acc = acc * alpha_{j-1} + P_{j-1} V_{j-1}`` (async,
  P from registers), waits for ``S_j`` only, and runs tile ``j``'s softmax while the
  P V MMA of tile ``j - 1`` is still on the tensor cores.
- Ping-pong (``PINGPONG``, warp specialized): the 128 rows go to two consumer
  warpgroups (64 rows each, their own Q tiles) that take turns on the tensor cores
  through two mbarriers (FA3's warp-scheduler barriers): a turn issues ``S_j`` and
  ``P_{j-1} V_{j-1}``, then hands over, so one warpgroup's softmax runs under the
  other's MMAs (``_attend``). The V tile is shared: warpgroup 0 alone checks a masked
  one and hands the first bad key to warpgroup 1 (``_sanitize_v``).
- Softmax per tile: ``-inf`` raw scores become NaN (an infinite operand), the
  masks of the causal diagonal and of the tail (tiles at or past ``mid``), N:M
  sparsity over the visible scores (``_nm_keep``, as the Triton kernel), the
  running maximum ``m`` of the base-2 scores kept at an integer (``ceil``) so every
  rescale ``2^(m_old - m_new)`` is exact, ``P = 2^(t - m)``, ``l`` summed from P.
- Masked tiles (NaN rule): keys past the sequence end are zeroed in V's shared
  tile, keys whose V row is non-finite are zeroed too and the query rows that see
  one of them are flagged; flagged rows are written NaN (their LSE unchanged).
- Epilogue: ``out = acc / l`` (a non-finite element makes the row NaN), ``lse =
  (m + log2 l) ln 2``; a row with no visible key writes 0 and ``-inf``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla_triton.common import kernels as common
from mla_triton.common import qdq as dev
from mla_triton.ops.prefill.triton_kernels import (
    _qdq_features,
    _qdq_features_fast,
    key_bounds,
    query_tile,
    seq_span,
)

CHUNK: gl.constexpr = gl.constexpr(64)  # columns of one Q / K shared tile (128 bytes)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_k(k_desc, k_smem, k_bars, stage, row, k_col, NQ: gl.constexpr):
    """Issue the TMA loads of a K tile (rows ``row`` on, ``NQ`` chunks) into ring slot
    ``stage``, on that slot's K barrier."""
    k_bar = k_bars.index(stage)
    mbarrier.expect(k_bar, NQ * k_desc.block_type.nbytes)
    for c in gl.static_range(NQ):
        tma.async_copy_global_to_shared(
            k_desc, [row, k_col + c * CHUNK], k_bar, k_smem.index(stage * NQ + c)
        )


@gluon.jit
def _load_v(v_desc, v_smem, v_bars, stage, row, v_col):
    """Issue the TMA load of a V tile (rows ``row`` on) into ring slot ``stage``."""
    v_bar = v_bars.index(stage)
    mbarrier.expect(v_bar, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, v_col], v_bar, v_smem.index(stage))


@gluon.jit
def _load_kv(
    k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, row0, k_col, v_col,
    BLOCK_N: gl.constexpr, NQ: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Issue the TMA loads of key tile ``tile`` (rows ``row0 + tile * BLOCK_N``) into
    its ring slot: ``NQ`` K chunks on one barrier, the V tile on another."""
    stage = tile % NUM_STAGES
    row = row0 + tile * BLOCK_N
    _load_k(k_desc, k_smem, k_bars, stage, row, k_col, NQ)
    _load_v(v_desc, v_smem, v_bars, stage, row, v_col)


@gluon.jit
def _issue_qk(
    q_smem, k_smem, k_bars, tile, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, NQ: gl.constexpr, NUM_STAGES: gl.constexpr, Q0: gl.constexpr,
):  # fmt: skip
    """Wait for key tile ``tile`` and issue ``S = Q Kᵀ`` (async; Q's chunks from shared
    tile ``Q0`` on); returns its token."""
    stage = tile % NUM_STAGES
    mbarrier.wait(k_bars.index(stage), (tile // NUM_STAGES) & 1)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for c in gl.static_range(NQ):
        s = warpgroup_mma(
            q_smem.index(Q0 + c), k_smem.index(stage * NQ + c).permute((1, 0)), s,
            use_acc=c > 0, is_async=True,
        )  # fmt: skip
    return s


@gluon.jit
def _keep_2_of_4(key, dense_all, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """2:4's kept keys from unique int32 sort keys ``key [ROWS, BLOCK_N]`` (groups of 4
    consecutive columns): those at or above the group's second largest, taken as
    ``max(min(max a b, max c d), max(min a b, min c d))`` for the group's pairs ``(a, b)``
    and ``(c, d)`` (one of them holds the largest: either the other pair's maximum or
    this pair's minimum is second). In the wgmma accumulator layout a pair is one
    thread's two adjacent columns, so that is two in-thread min/max, one shuffle each for
    the pair maximum and minimum and three min/max, against two rounds of a group
    maximum with a compare and a select a key between them (``_nm_keep``'s general
    rank). Every key of a ``dense_all`` row is kept. Same mask as the general rank."""
    key4 = gl.reshape(key, [ROWS, BLOCK_N // 4, 2, 2])
    second = gl.maximum(gl.min(gl.max(key4, axis=3), axis=2), gl.max(gl.min(key4, axis=3), axis=2))
    second = gl.where(dense_all, -2147483648, second)
    keep4 = key4 >= gl.expand_dims(gl.expand_dims(second, 2), 3)
    return gl.convert_layout(gl.reshape(keep4, [ROWS, BLOCK_N]), layout)


@gluon.jit
def _nm_keep(
    s, key_pos, q_pos, nm, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NM: gl.constexpr
):  # fmt: skip
    """Boolean in ``s``'s layout ``[ROWS, BLOCK_N]``: the keys N:M sparsity keeps, as the
    Triton kernel's ``prefill_kernel._nm_keep`` ranks them (docs/numerics.md "LSE, masks and input
    checks"): per group of
    ``NM_M`` keys at absolute positions ``key_pos`` (the tile starts at a multiple of
    ``NM_M``), unique int32 sort keys (the float32 bits made order-preserving, the
    lowest log2(NM_M) bits ``NM_M - 1 - member``: ties to the lower index), the kept
    ones at or above the ``NM_N``-th largest; the sink and recent keys with
    ``NM_DENSE``; every key for a single-query sequence (``dense_all``). ``NM[3]``
    (``NM_PAIRS``): 2:4 through ``_keep_2_of_4`` (other N:M: the general rank)."""
    NM_N: gl.constexpr = NM[0]
    NM_M: gl.constexpr = NM[1]
    n_sink, n_recent, dense_all = nm
    bits = s.to(gl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as int order
    member = key_pos % NM_M
    key = (key & -NM_M) | gl.expand_dims(NM_M - 1 - member, 0)
    if NM[3] and NM_N == 2 and NM_M == 4:  # 2:4 by pair maxima and minima (NM_PAIRS)
        keep = _keep_2_of_4(key, dense_all, ROWS, BLOCK_N, s.type.layout)
    else:
        key3 = gl.reshape(key, [ROWS, BLOCK_N // NM_M, NM_M])
        nth = gl.max(key3, axis=2)
        for _ in gl.static_range(NM_N - 1):
            nth = gl.max(gl.where(key3 < gl.expand_dims(nth, 2), key3, -2147483648), axis=2)
        nth = gl.where(dense_all, -2147483648, nth)  # every key is at or above that
        keep = gl.convert_layout(
            gl.reshape(key3 >= gl.expand_dims(nth, 2), [ROWS, BLOCK_N]), s.type.layout
        )  # fmt: skip
    if NM[2]:
        distance = gl.expand_dims(q_pos, 1) - gl.expand_dims(key_pos, 0)
        recent = (distance >= 0) & (distance < n_recent)
        keep = keep | gl.expand_dims(key_pos < n_sink, 0) | recent
    return keep


@gluon.jit
def _softmax(
    s, m_i, l_i, start_n, mid, seq_len_k, q_pos, row_scale, ks_base, stride_kst, p_scales,
    nm, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr, K_DYNAMIC: gl.constexpr, P_FMT: gl.constexpr, NM: gl.constexpr,
    pv_dtype: gl.constexpr,
):  # fmt: skip
    """One tile's online softmax: ``(p, alpha, m, l)`` (p in ``s``'s layout as the P V
    dot's ``pv_dtype``: P's factored QDQ value with ``P_FMT`` 1 or 2, converted to it
    directly, and carried to the next key step at half the registers of float32; ``l``
    summed before that QDQ).

    The NaN rule: a raw ``-inf`` score (an infinite operand) is made NaN, one compare
    and a select a score; masked tiles (at or past ``mid``) then set the keys a row does
    not see to ``-inf``."""
    if K_DYNAMIC:  # K's per-key global scales (static ones live in row_scale)
        key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        col_gs = gl.load(ks_base + key_pos * stride_kst, mask=key_pos < seq_len_k, other=1.0)
        s = s * gl.expand_dims(col_gs, 0)
    s = gl.where(s == float("-inf"), float("nan"), s)  # an infinite raw operand
    if start_n >= mid:
        key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(key_pos < seq_len_k, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(key_pos, 0) <= gl.expand_dims(q_pos, 1))
        s = gl.where(visible, s, float("-inf"))
    if NM[0] > 0:  # N:M over the visible scores (the Triton kernel's _nm_keep; NaN kept)
        key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = _nm_keep(s, key_pos, q_pos, nm, BLOCK_M, BLOCK_N, NM)
        if NM[4]:  # NM_NAN_RANK: a NaN score's sort key ranks first in its group
            s = gl.where(keep, s, float("-inf"))
        else:
            s = gl.where(keep | (s != s), s, float("-inf"))
    # the integer running maximum, exact power-of-two rescales, l from unquantized P
    m_new, alpha, p, l_i = common.softmax_step(m_i, l_i, s, row_scale, True, True)
    # P's QDQ along the keys (nvfp4 blocks of 16 at multiples of 16: the tile's start)
    p = common.qdq_p(p, p_scales, P_FMT, True, BLOCK_M, BLOCK_N, pv_dtype)
    return p, alpha, m_new, l_i


@gluon.jit
def _sanitize_v(
    v_smem, v_bars, bad_smem, turn_bars, tile, ring, mid, seq_len_k, q_pos, row_nan,
    BLOCK_N: gl.constexpr, DV: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
    WG: gl.constexpr, TURNS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Wait for V tile ``tile``; on a masked tile zero its rows past the sequence end
    and its non-finite rows in shared memory, and flag the query rows that see a
    non-finite one (causal: the rows at or after the first such key; else all).
    Works on 32-row slices in V's dtype to keep registers free. Returns ``row_nan``.

    Ping-pong (``WG`` 0 or 1; -1 otherwise): the V tile is shared, so only warpgroup
    0 checks and zeroes it and leaves the first bad key in ``bad_smem[stage]``;
    warpgroup 1 reads that (its turn on the tensor cores comes after warpgroup 0's
    for the same tile, see ``_attend``) instead of a tile that may be zeroed already.
    Without ``TURNS`` nothing orders the two, so warpgroup 0 arrives on the slot's
    ``turn_bars[stage]`` once the tile is checked and warpgroup 1 waits for it (phase:
    the masked tiles before ``tile`` in that slot; masked tiles are ``mid / BLOCK_N`` on).
    ``ring``: the tile's index in the K/V ring: its slot and phase."""
    stage = ring % NUM_STAGES
    mbarrier.wait(v_bars.index(stage), (ring // NUM_STAGES) & 1)
    start_n = tile * BLOCK_N
    if start_n >= mid:
        bad_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        if WG == 1:
            if not TURNS:
                masked_before = tile - mid // BLOCK_N
                mbarrier.wait(turn_bars.index(stage), (masked_before // NUM_STAGES) & 1)
            first_bad = gl.min(bad_smem.index(stage).load(bad_layout), axis=0)
        else:
            SUB: gl.constexpr = 32
            v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            buf = v_smem.index(stage)
            first_bad = seq_len_k  # the first visible key with a non-finite v row
            for c in gl.static_range(BLOCK_N // SUB):
                sub = buf.slice(c * SUB, SUB, dim=0)
                v = sub.load(v_layout)
                key_pos = start_n + c * SUB + gl.arange(0, SUB, layout=gl.SliceLayout(1, v_layout))
                row = gl.sum(v - v, axis=1)  # NaN for a non-finite row (a sum of zeros else)
                bad = row != row
                sub.store(gl.where(gl.expand_dims(bad | (key_pos >= seq_len_k), 1), 0.0, v))
                bad_key = gl.where(bad & (key_pos < seq_len_k), key_pos, seq_len_k)
                first_bad = gl.minimum(first_bad, gl.min(bad_key, axis=0))
            if WG == 0:
                bad_smem.index(stage).store(gl.full([1], first_bad, gl.int32, bad_layout))
            fence_async_shared()
            gl.barrier()
            if WG == 0 and not TURNS:
                mbarrier.arrive(turn_bars.index(stage), count=1)
        if CAUSAL:  # noqa: SIM108
            row_nan = row_nan | (q_pos >= first_bad)
        else:
            row_nan = row_nan | (first_bad < seq_len_k)
    return row_nan


@gluon.jit
def _issue_pv(
    p, alpha, acc, v_smem, v_bars, bad_smem, turn_bars, tile, ring, mid, seq_len_k, q_pos,
    row_nan,
    row_o: gl.constexpr, p_layout: gl.constexpr, pv_dtype: gl.constexpr,
    BLOCK_N: gl.constexpr, DV: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
    WG: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """P to its operand layout, V tile ``tile`` waited for (and sanitized when masked),
    ``acc * alpha`` and the async ``acc += P V``: ``(acc token, P operand, row_nan)``.
    ``WG``: -1, or the consumer warpgroup of two without turns (``_sanitize_v``)."""
    p_op = gl.convert_layout(p.to(pv_dtype), p_layout)
    row_nan = _sanitize_v(
        v_smem, v_bars, bad_smem, turn_bars, tile, ring, mid, seq_len_k, q_pos, row_nan,
        BLOCK_N, DV, CAUSAL, NUM_STAGES, WG, False, num_warps,
    )  # fmt: skip
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    acc = warpgroup_mma(p_op, v_smem.index(ring % NUM_STAGES), acc, is_async=True)
    return acc, p_op, row_nan


@gluon.jit
def _turn_pv(
    p, alpha, acc, v_smem, v_bars, bad_smem, turn_bars, step, tile, ring, mid, seq_len_k,
    q_pos, row_nan, row_o: gl.constexpr, p_layout: gl.constexpr, pv_dtype: gl.constexpr,
    BLOCK_N: gl.constexpr, DV: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
    WG: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Ping-pong's last turn of warpgroup ``WG``: P and ``acc * alpha`` before the turn,
    then (in turn ``step``) V's check and the async ``acc += P V``; hands the turn on."""
    p_op = gl.convert_layout(p.to(pv_dtype), p_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(turn_bars.index(WG), step & 1)
    row_nan = _sanitize_v(
        v_smem, v_bars, bad_smem, turn_bars, tile, ring, mid, seq_len_k, q_pos, row_nan,
        BLOCK_N, DV, CAUSAL, NUM_STAGES, WG, True, num_warps,
    )  # fmt: skip
    acc = warpgroup_mma(p_op, v_smem.index(ring % NUM_STAGES), acc, is_async=True)
    mbarrier.arrive(turn_bars.index(1 - WG), count=1)
    return acc, p_op, row_nan


@gluon.jit
def _qdq_q(
    q_smem, q_in, mma_dtype: gl.constexpr, ROWS: gl.constexpr, NQ: gl.constexpr,
    Q0: gl.constexpr, QQ: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Q's QDQ in shared memory (``QQ = (dynamic, format, fast)``, format 1 fp8 or 2
    nvfp4): the raw rows of shared tiles ``Q0 .. Q0 + NQ`` (``[ROWS, 64]`` each) become
    their factored values in ``mma_dtype`` (K's dtype; the same 16-bit NVMMA tiles), as the
    prefill core's pass computes them (``prefill_kernel._qdq_features`` on its K path;
    dynamic: the row's amax over all ``NQ`` tiles, ``qdq_device.global_scale_of_amax``,
    NaN for a row with a non-finite element). ``q_in = (QS, q_gs, q_inv)``: the static
    global scale and its reciprocal (``1 / q_gs`` fp8, ``1 / (6 q_gs)`` nvfp4; ``QQ[2]``:
    the reciprocal path, 16-bit Q and a power-of-two ``q_gs``). Each thread stores what it
    loaded, so no thread overwrites another's raw values; fenced for the async proxy and
    met at a barrier of the calling warps before any MMA reads them. Returns the tiles in
    ``mma_dtype`` and the rows' global scales ``[ROWS]`` (dynamic; else ``q_gs``). fp8 Q
    with any scale, nvfp4 Q with a static one (a dynamic nvfp4 Q keeps the pass: its
    per-row scales against the 16-column blocks are not built in this layout yet)."""
    _, q_gs, q_inv = q_in
    FMT: gl.constexpr = QQ[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    gl.static_assert(q_smem.dtype.primitive_bitwidth == 16)
    gl.static_assert(FMT == 1 or not QQ[0])  # dynamic nvfp4 Q: the pass
    if QQ[0]:
        amax = gl.zeros([ROWS], gl.float32, rows)
        for c in gl.static_range(NQ):
            amax = dev.amax_update(amax, q_smem.index(Q0 + c).load(layout).to(gl.float32), 1)
        gs = dev.global_scale_of_amax(amax, FMT)
    else:
        gs = gl.full([ROWS], q_gs, gl.float32, rows)
    q_mma = q_smem._reinterpret(mma_dtype)
    for c in gl.static_range(NQ):
        x = q_smem.index(Q0 + c).load(layout).to(gl.float32)
        if QQ[2]:
            y = _qdq_features_fast(x, q_gs, q_inv, FMT, ROWS, CHUNK, True)
        elif FMT == 2:  # static: the scalar scale (per-row scales: the pass)
            y = dev.nvfp4_qdq(x, q_gs, ROWS, CHUNK, 1, True, True)
        else:
            y = _qdq_features(x, gs, FMT, ROWS, CHUNK, True)
        q_mma.index(Q0 + c).store(y.to(mma_dtype))
    fence_async_shared()
    gl.barrier()
    return q_mma, gs


@gluon.jit
def _attend(
    q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars, bad_smem, k_desc,
    v_desc, q_in, KS, q_start, seq_len_q, k_start, seq_len_k, row0, head, kv_head, k_col, v_col,
    mid, n_tiles, qk_scale, p_gs, p_inv_gs, stride_qst, stride_kst, nm, counts,
    s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
    pv_dtype: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
    NQ: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, QQ: gl.constexpr,
    K_DYNAMIC: gl.constexpr, P_FMT: gl.constexpr, NM: gl.constexpr, ISSUE_LOADS: gl.constexpr,
    WG: gl.constexpr, SCHED: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The key loop of ``ROWS`` query rows from ``row0`` (in the sequence): ``(acc, l, m,
    row_nan)``. With ``ISSUE_LOADS`` it issues the K/V loads of the tile ``NUM_STAGES``
    ahead itself; otherwise (warp specialized) it releases ring slots to the producer
    through ``empties = (empty_bars, k_empty_bars, q_empty)``: ``empty_bars[slot]`` once
    a slot's P V MMA is done, and with ``EARLY_K`` (``SCHED = (TURNS, EARLY_K)``) its K
    half on ``k_empty_bars[slot]`` as soon as the slot's ``S = Q Kᵀ`` is done (FA3's
    separate K and V pipelines: a K load then has a whole key step to land, even with two
    stages). ``counts = (ring0, turn0,
    q_phase)``: the ring index of the first key tile, the first turn and Q's barrier
    phase (all 0: a program's one query tile).

    Ping-pong (``WG`` 0 or 1: one of two consumer warpgroups, rows ``WG * ROWS`` of
    the Q tile; -1: not): the warpgroups take turns on the tensor cores through the
    mbarriers ``turn_bars`` (FA3's warp-scheduler barriers): a turn issues ``S_j`` and
    ``P_{j-1} V_{j-1}`` and hands over, so one warpgroup's softmax (and P's QDQ, N:M)
    runs under the other's MMAs; turn ``t`` of warpgroup 1 follows turn ``t`` of
    warpgroup 0 (warpgroup 0's first turn is pre-arrived by the kernel). Without
    ``TURNS`` the two consumer warpgroups run the key loop independently (FA3's
    schedule for head dims above 128: no warp-scheduler barrier), ordered only on
    masked V tiles (``_sanitize_v``)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    TURNS: gl.constexpr = SCHED[0]
    EARLY_K: gl.constexpr = SCHED[1]
    PP: gl.constexpr = WG >= 0 and TURNS  # ping-pong turns
    empty_bars, k_empty_bars, _ = empties
    ring0, turn0, q_phase = counts
    Q0: gl.constexpr = NQ * WG if WG >= 0 else 0  # the first of this warpgroup's Q tiles
    offs_m = row0 + gl.arange(0, ROWS, layout=row_s)
    q_pos = seq_len_k - seq_len_q + offs_m  # key positions of the rows (suffix alignment)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    row_nan = gl.zeros([ROWS], gl.int1, row_s)
    row_scale = gl.full([ROWS], qk_scale, gl.float32, row_s)
    if QQ[0] and QQ[1] == 0:  # dynamic Q scales from the pass
        qs = q_in[0] + (q_start + offs_m).to(gl.int64) * stride_qst + head
        row_scale = row_scale * gl.load(qs, mask=offs_m < seq_len_q, other=1.0)
    ks_base = KS + k_start.to(gl.int64) * stride_kst + kv_head
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
    # common.qdq_p's (gs, 1 / gs, 1 / (6 gs)): p_inv_gs is the one P's format uses
    p_scales = (p_gs, p_inv_gs, p_inv_gs)
    mbarrier.wait(q_bar, q_phase)
    if QQ[1] > 0:  # Q raw in shared memory: its QDQ (and dynamic scales) here
        q_mma, q_row_gs = _qdq_q(q_smem, q_in, k_desc.dtype, ROWS, NQ, Q0, QQ, num_warps)
        if QQ[0]:
            row_scale = row_scale * gl.convert_layout(q_row_gs, row_s)
    else:
        q_mma = q_smem

    if n_tiles > 0:
        if PP:
            mbarrier.wait(turn_bars.index(WG), turn0 & 1)
        s = _issue_qk(
            q_mma, k_smem, k_bars, ring0, s_layout, ROWS, BLOCK_N, NQ, NUM_STAGES, Q0
        )  # fmt: skip
        if PP:
            mbarrier.arrive(turn_bars.index(1 - WG), count=1)
        s = warpgroup_mma_wait(0, deps=(s,))
        if EARLY_K:
            mbarrier.arrive(k_empty_bars.index(ring0 % NUM_STAGES), count=1)
        p, alpha, m_i, l_i = _softmax(
            s, m_i, l_i, 0, mid, seq_len_k, q_pos, row_scale, ks_base, stride_kst,
            p_scales, nm, s_layout, ROWS, BLOCK_N, CAUSAL, K_DYNAMIC, P_FMT, NM,
            pv_dtype,
        )  # fmt: skip
        for j in range(1, n_tiles):
            prev = j - 1
            if PP:  # P and the rescale off the turn; S_j and P V in it
                p_op = gl.convert_layout(p.to(pv_dtype), p_layout)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                mbarrier.wait(turn_bars.index(WG), (turn0 + j) & 1)
                s = _issue_qk(
                    q_mma, k_smem, k_bars, ring0 + j, s_layout, ROWS, BLOCK_N, NQ, NUM_STAGES,
                    Q0,
                )  # fmt: skip
                row_nan = _sanitize_v(
                    v_smem, v_bars, bad_smem, turn_bars, prev, ring0 + prev, mid, seq_len_k,
                    q_pos, row_nan, BLOCK_N, DV, CAUSAL, NUM_STAGES, WG, True, num_warps,
                )  # fmt: skip
                acc = warpgroup_mma(
                    p_op, v_smem.index((ring0 + prev) % NUM_STAGES), acc, is_async=True
                )  # fmt: skip
                mbarrier.arrive(turn_bars.index(1 - WG), count=1)
            else:
                s = _issue_qk(
                    q_mma, k_smem, k_bars, ring0 + j, s_layout, ROWS, BLOCK_N, NQ, NUM_STAGES,
                    Q0,
                )  # fmt: skip
                acc, p_op, row_nan = _issue_pv(
                    p, alpha, acc, v_smem, v_bars, bad_smem, turn_bars, prev, ring0 + prev, mid,
                    seq_len_k, q_pos, row_nan, row_o, p_layout, pv_dtype, BLOCK_N, DV, CAUSAL,
                    NUM_STAGES, WG, num_warps,
                )  # fmt: skip
            s = warpgroup_mma_wait(1, deps=(s,))
            if EARLY_K:  # S_j is done: K_j's slot may be refilled
                mbarrier.arrive(k_empty_bars.index((ring0 + j) % NUM_STAGES), count=1)
            p, alpha, m_i, l_i = _softmax(
                s, m_i, l_i, j * BLOCK_N, mid, seq_len_k, q_pos, row_scale, ks_base,
                stride_kst, p_scales, nm, s_layout, ROWS, BLOCK_N, CAUSAL, K_DYNAMIC, P_FMT,
                NM, pv_dtype,
            )  # fmt: skip
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            if ISSUE_LOADS:
                nxt = prev + NUM_STAGES
                if nxt < n_tiles:
                    _load_kv(
                        k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, nxt, k_start, k_col,
                        v_col, BLOCK_N, NQ, NUM_STAGES,
                    )  # fmt: skip
            else:  # the producer partition may refill the slot
                mbarrier.arrive(empty_bars.index((ring0 + prev) % NUM_STAGES), count=1)
        last = n_tiles - 1
        if PP:
            acc, p_op, row_nan = _turn_pv(
                p, alpha, acc, v_smem, v_bars, bad_smem, turn_bars, turn0 + n_tiles, last,
                ring0 + last, mid, seq_len_k, q_pos, row_nan, row_o, p_layout, pv_dtype,
                BLOCK_N, DV, CAUSAL, NUM_STAGES, WG, num_warps,
            )  # fmt: skip
        else:
            acc, p_op, row_nan = _issue_pv(
                p, alpha, acc, v_smem, v_bars, bad_smem, turn_bars, last, ring0 + last, mid,
                seq_len_k, q_pos, row_nan, row_o, p_layout, pv_dtype, BLOCK_N, DV, CAUSAL,
                NUM_STAGES, WG, num_warps,
            )  # fmt: skip
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    return acc, l_i, m_i, row_nan


@gluon.jit
def _epilogue(
    acc, l_i, m_i, row_nan, Out, Lse, q_start, seq_len_q, row0, head, out_scale, stride_ot,
    stride_oh, stride_lh, s_layout: gl.constexpr, o_layout: gl.constexpr, ROWS: gl.constexpr,
    DV: gl.constexpr, RETURN_LSE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """``out = acc / l`` (a non-finite element makes the row NaN, so do flagged rows)
    and ``lse = (m + log2 l) ln 2`` of ``ROWS`` rows from ``row0``; a row with no
    visible key writes 0 and ``-inf``."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = row0 + gl.arange(0, ROWS, layout=row_s)
    empty = l_i == 0.0
    inv_l = gl.convert_layout(out_scale / gl.where(empty, 1.0, l_i), row_o)
    out = acc * gl.expand_dims(inv_l, 1)  # acc is 0 on empty rows
    poison = gl.sum(acc - acc, axis=1)  # NaN for a row with a non-finite element
    poison = gl.where(gl.convert_layout(row_nan, row_o), float("nan"), poison)
    out = out + gl.expand_dims(poison, 1)
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    out = gl.convert_layout(out.to(Out.dtype.element_ty), st_layout)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, st_layout))
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    _store_rows(Out, Lse, out, rows, cols, lse, offs_m, q_start, seq_len_q, head, stride_ot,
                stride_oh, stride_lh, RETURN_LSE)  # fmt: skip


@gluon.jit
def _store_rows(
    Out, Lse, out, rows, cols, lse, lse_rows, q_start, seq_len_q, head, stride_ot, stride_oh,
    stride_lh, RETURN_LSE: gl.constexpr,
):  # fmt: skip
    """Write ``out`` (Out's dtype) at the sequence's ``rows`` x ``cols`` and ``lse`` at
    ``lse_rows``, rows below ``seq_len_q``."""
    o_ptrs = (
        Out
        + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
        + gl.expand_dims(cols, 0)
    )
    gl.store(o_ptrs, out, mask=gl.expand_dims(rows < seq_len_q, 1))
    if RETURN_LSE:
        gl.store(Lse + head * stride_lh + q_start + lse_rows, lse, mask=lse_rows < seq_len_q)


@gluon.jit
def _poison_tile(
    Out, Lse, q_start, seq_len_q, row0, head, stride_ot, stride_oh, stride_lh,
    BLOCK_M: gl.constexpr, DV: gl.constexpr, RETURN_LSE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """NaN into the ``BLOCK_M`` output rows from ``row0`` (and their LSE): a sequence
    whose offsets left the tensors (``seq_span``'s ``bad``)."""
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, st_layout))
    nan = gl.full([BLOCK_M, DV], float("nan"), Out.dtype.element_ty, st_layout)
    lse = gl.full([BLOCK_M], float("nan"), gl.float32, gl.SliceLayout(1, st_layout))
    _store_rows(Out, Lse, nan, rows, cols, lse, rows, q_start, seq_len_q, head, stride_ot,
                stride_oh, stride_lh, RETURN_LSE)  # fmt: skip


@gluon.jit
def _consume(
    q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars, bad_smem, k_desc,
    v_desc, q_in, KS, Out, Lse, q_start, seq_len_q, k_start, seq_len_k, row0, head, kv_head,
    k_col, v_col, mid, n_tiles, qk_scale, p_gs, p_inv_gs, out_scale, stride_qst, stride_kst,
    stride_ot, stride_oh, stride_lh, nm, counts, s_layout: gl.constexpr,
    o_layout: gl.constexpr, p_layout: gl.constexpr, pv_dtype: gl.constexpr,
    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr, NQ: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, QQ: gl.constexpr,
    K_DYNAMIC: gl.constexpr, P_FMT: gl.constexpr, NM: gl.constexpr, RETURN_LSE: gl.constexpr,
    WG: gl.constexpr, SCHED: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A consumer warpgroup (ping-pong) or partition:
    ``_attend`` over its ``ROWS`` rows (from ``row0``), then their ``_epilogue``."""
    acc, l_i, m_i, row_nan = _attend(
        q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars, bad_smem,
        k_desc, v_desc, q_in, KS, q_start, seq_len_q, k_start, seq_len_k, row0, head, kv_head,
        k_col, v_col, mid, n_tiles, qk_scale, p_gs, p_inv_gs, stride_qst, stride_kst, nm,
        counts, s_layout, o_layout, p_layout, pv_dtype, ROWS, BLOCK_N, DV, NQ, NUM_STAGES,
        CAUSAL, QQ, K_DYNAMIC, P_FMT, NM, False, WG, SCHED, num_warps,
    )  # fmt: skip
    _epilogue(
        acc, l_i, m_i, row_nan, Out, Lse, q_start, seq_len_q, row0, head, out_scale, stride_ot,
        stride_oh, stride_lh, s_layout, o_layout, ROWS, DV, RETURN_LSE, num_warps,
    )  # fmt: skip


@gluon.jit
def _producer(
    q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, q_desc, k_desc, v_desc,
    q_row, q_col, k_start, k_col, v_col, n_tiles, ring0, BLOCK_N: gl.constexpr,
    NQ: gl.constexpr, NUM_STAGES: gl.constexpr, QH: gl.constexpr, EARLY_K: gl.constexpr,
):  # fmt: skip
    """The TMA partition (one warp): Q once (``QH`` row blocks of ``NQ`` chunks: one, or
    one per ping-pong warpgroup), then every K/V tile into its ring slot once the
    consumers released the slot's previous tile (``empties = (empty_bars,
    k_empty_bars)``). ``EARLY_K``: K and V are released apart (``_attend``), and K runs
    one tile ahead of V (K_0, then K_{t+1} before V_t: FA3's producer order). ``ring0``:
    the ring index of tile 0."""
    empty_bars = empties[0]
    k_empty_bars = empties[1]
    mbarrier.expect(q_bar, QH * NQ * q_desc.block_type.nbytes)
    for h in gl.static_range(QH):
        for c in gl.static_range(NQ):
            tma.async_copy_global_to_shared(
                q_desc, [q_row + h * q_desc.block_type.shape[0], q_col + c * CHUNK], q_bar,
                q_smem.index(h * NQ + c),
            )  # fmt: skip
    if EARLY_K:
        if n_tiles > 0:
            if ring0 >= NUM_STAGES:
                g0 = ring0
                mbarrier.wait(k_empty_bars.index(g0 % NUM_STAGES), ((g0 // NUM_STAGES) - 1) & 1)
            _load_k(k_desc, k_smem, k_bars, ring0 % NUM_STAGES, k_start, k_col, NQ)
        for t in range(n_tiles):
            nk = t + 1
            if nk < n_tiles:
                gk = ring0 + nk
                if gk >= NUM_STAGES:
                    mbarrier.wait(k_empty_bars.index(gk % NUM_STAGES), ((gk // NUM_STAGES) - 1) & 1)
                _load_k(
                    k_desc, k_smem, k_bars, gk % NUM_STAGES, k_start + nk * BLOCK_N, k_col, NQ
                )  # fmt: skip
            g = ring0 + t
            if g >= NUM_STAGES:
                mbarrier.wait(empty_bars.index(g % NUM_STAGES), ((g // NUM_STAGES) - 1) & 1)
            _load_v(v_desc, v_smem, v_bars, g % NUM_STAGES, k_start + t * BLOCK_N, v_col)
    else:
        for t in range(n_tiles):
            g = ring0 + t
            if g >= NUM_STAGES:
                mbarrier.wait(empty_bars.index(g % NUM_STAGES), ((g // NUM_STAGES) - 1) & 1)
            row = k_start + t * BLOCK_N
            _load_k(k_desc, k_smem, k_bars, g % NUM_STAGES, row, k_col, NQ)
            _load_v(v_desc, v_smem, v_bars, g % NUM_STAGES, row, v_col)


@gluon.jit
def _setup(
    q_desc, k_desc, v_desc, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
    NQ: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr,
    EARLY_K: gl.constexpr,
):  # fmt: skip
    """Shared memory and mbarriers of a program: ``(q_smem, k_smem, v_smem, q_bar, k_bars,
    v_bars, empties, turn_bars, bad_smem)``, ``empties = (empty_bars, k_empty_bars,
    q_empty)`` (``k_empty_bars`` only with ``EARLY_K``, else an alias; ``q_empty`` an
    alias of ``q_bar``, not used)."""
    dtype: gl.constexpr = q_desc.dtype  # Q (raw, bf16, where its QDQ runs here: Q_FMT)
    pv_dtype: gl.constexpr = v_desc.dtype  # P and V
    QH: gl.constexpr = 2 if PINGPONG else 1  # Q row blocks (descriptor: ROWS rows)
    q_smem = gl.allocate_shared_memory(dtype, [QH * NQ, ROWS, CHUNK], q_desc.layout)
    k_smem = gl.allocate_shared_memory(
        k_desc.dtype, [NUM_STAGES * NQ, BLOCK_N, CHUNK], k_desc.layout
    )
    v_smem = gl.allocate_shared_memory(pv_dtype, [NUM_STAGES, BLOCK_N, DV], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if EARLY_K:  # K's own release barriers (empty_bars then release V alone)
        k_empty_bars = gl.allocate_shared_memory(
            gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()
        )  # fmt: skip
    else:
        k_empty_bars = empty_bars  # not used
    q_empty = q_bar  # not used (a program's one query tile)
    empties = (empty_bars, k_empty_bars, q_empty)
    TURN_BARS: gl.constexpr = 2 if TURNS else NUM_STAGES
    if PINGPONG:  # the turns (without TURNS: each slot's "V checked" barrier), and
        # the first bad V key of each ring slot (WG 0 to 1)
        turn_bars = gl.allocate_shared_memory(
            gl.int64, [TURN_BARS, 1], mbarrier.MBarrierLayout()
        )  # fmt: skip
        bad_smem = gl.allocate_shared_memory(
            gl.int32, [NUM_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )  # fmt: skip
    else:  # not read without ping-pong
        turn_bars = empty_bars
        bad_smem = empty_bars
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2 if PINGPONG else 1)
        if EARLY_K:
            mbarrier.init(k_empty_bars.index(i), count=2 if PINGPONG else 1)
    if PINGPONG:
        for i in gl.static_range(TURN_BARS):
            mbarrier.init(turn_bars.index(i), count=1)
    fence_async_shared()
    return q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars, bad_smem


@gluon.jit
def _teardown(
    q_bar, k_bars, v_bars, empties, turn_bars, NUM_STAGES: gl.constexpr,
    PINGPONG: gl.constexpr, TURNS: gl.constexpr, EARLY_K: gl.constexpr,
):  # fmt: skip
    """Invalidate ``_setup``'s mbarriers."""
    empty_bars, k_empty_bars, _ = empties
    TURN_BARS: gl.constexpr = 2 if TURNS else NUM_STAGES
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
        mbarrier.invalidate(empty_bars.index(i))
        if EARLY_K:
            mbarrier.invalidate(k_empty_bars.index(i))
    if PINGPONG:
        for i in gl.static_range(TURN_BARS):
            mbarrier.invalidate(turn_bars.index(i))


@gluon.jit(do_not_specialize=["rows_q", "rows_k"])
def gluon_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    Out,
    Lse,
    QS,
    KS,
    cu_seqlens_q,
    cu_seqlens_k,
    rows_q,
    rows_k,
    qk_scale,
    p_gs,
    p_inv_gs,
    out_scale,
    q_gs,
    q_inv,
    group,
    n_sink,
    n_recent,
    stride_qh,
    stride_kh,
    stride_vh,
    stride_qst,
    stride_kst,
    stride_ot,
    stride_oh,
    stride_lh,
    DQK: gl.constexpr,
    DV: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    Q_DYNAMIC: gl.constexpr,
    Q_FMT: gl.constexpr,
    Q_FAST: gl.constexpr,
    K_DYNAMIC: gl.constexpr,
    P_FMT: gl.constexpr,
    NM_N: gl.constexpr,
    NM_M: gl.constexpr,
    NM_DENSE: gl.constexpr,
    NM_PAIRS: gl.constexpr,
    NM_NAN_RANK: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    WARP_SPEC: gl.constexpr,
    PINGPONG: gl.constexpr,
    TURNS: gl.constexpr,
    EARLY_K: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Attention of ``BLOCK_M`` queries of one head of one sequence.

    Descriptors: Q ``[T, cols]`` blocks ``[BLOCK_M, 64]``, K ``[Tk, cols]`` blocks
    ``[BLOCK_N, 64]``, V ``[Tk, cols]`` blocks ``[BLOCK_N, DV]`` (see the module doc);
    ``stride_*h`` the head strides in elements; Out ``[T, H, DV]``; Lse ``[H, T]``
    float32; ``rows_q`` / ``rows_k`` T and Tk, the bounds of the offsets (``seq_span``: a
    sequence whose offsets leave them gets NaN rows). Q and K are raw or factored QDQ
    values (from the launcher's pre-pass);
    ``QS [T, H]`` / ``KS [Tk, Hkv]`` their per-token global scales when dynamic.
    ``Q_FMT`` 1 (fp8) or 2 (nvfp4): Q arrives raw and is QDQ'd here, by each consumer in
    shared memory before its first ``Q Kᵀ`` (``_qdq_q``): its dynamic per-token global
    scales computed there (``QS`` unread), or the static ``q_gs`` with ``q_inv`` (``1 /
    q_gs`` fp8, ``1 / (6 q_gs)`` nvfp4) for ``Q_FAST`` (16-bit Q, ``q_gs`` a power of two:
    the reciprocal path); the factored values in K's dtype (fp16 for a bf16 Q: the same
    16-bit swizzled tiles). ``Q_FMT`` 0: Q as it is (raw, or factored by the pass).
    ``qk_scale`` = softmax_scale * log2(e) times the static Q and K global scales;
    ``P_FMT`` 0 (none), 1 (fp8) or 2 (nvfp4), ``p_gs`` P's global scale and
    ``p_inv_gs`` ``1 / p_gs`` (fp8) or ``1 / (6 p_gs)`` (nvfp4);
    ``out_scale`` = P's times V's global scale; ``group`` = H / Hkv. N:M sparsity
    (``NM_N > 0``): ``NM_N`` of every ``NM_M`` keys, plus the ``n_sink`` first and the
    ``n_recent`` latest keys of each row when ``NM_DENSE`` (docs/numerics.md "LSE, masks and input
    checks"). ``NM_PAIRS``: 2:4's rank by
    pair maxima and minima (``_keep_2_of_4``; the same mask). ``NM_NAN_RANK``: NaN scores
    kept by their rank alone, without the ``s != s`` guard (``GluonPrefillConfig.nm_nan_rank``).
    ``PINGPONG``
    (with ``WARP_SPEC``): two consumer warpgroups of ``num_warps`` = 4 warps, 64 rows
    each, in ping-pong (``_attend``), ``CONSUMER_REGS`` registers for the second;
    ``TURNS`` (default True): they take turns on the tensor cores, else they run
    independently. ``EARLY_K`` (with ``WARP_SPEC``): K slots released apart from V
    slots, once their ``Q Kᵀ`` is done (``_attend``, ``_producer``).
    """
    NQ: gl.constexpr = DQK // CHUNK
    ROWS: gl.constexpr = BLOCK_M // 2 if PINGPONG else BLOCK_M  # rows of a consumer
    QH: gl.constexpr = 2 if PINGPONG else 1  # Q row blocks (descriptor: ROWS rows)
    NM: gl.constexpr = (NM_N, NM_M, NM_DENSE, NM_PAIRS, NM_NAN_RANK)
    QQ: gl.constexpr = (Q_DYNAMIC, Q_FMT, Q_FAST)  # Q's scales and its QDQ here (_qdq_q)
    q_in = (QS, q_gs, q_inv)
    gl.static_assert(DQK % CHUNK == 0)
    gl.static_assert(16 * num_warps == ROWS)
    gl.static_assert(NM_N == 0 or BLOCK_N % NM_M == 0)
    gl.static_assert(WARP_SPEC or not PINGPONG)
    gl.static_assert(WARP_SPEC or not EARLY_K)
    gl.static_assert(PINGPONG or TURNS)
    SCHED: gl.constexpr = (TURNS, EARLY_K)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, DV, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pv_dtype: gl.constexpr = v_desc.dtype  # P and V

    _one_tile(
        q_desc, k_desc, v_desc, Out, Lse, q_in, KS, cu_seqlens_q, cu_seqlens_k, rows_q, rows_k,
        qk_scale, p_gs, p_inv_gs, out_scale, group, n_sink, n_recent, stride_qh, stride_kh,
        stride_vh, stride_qst, stride_kst, stride_ot, stride_oh, stride_lh, s_layout, o_layout,
        p_layout, pv_dtype, DV, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, QQ, K_DYNAMIC,
        P_FMT, NM, RETURN_LSE, WARP_SPEC, PINGPONG, TURNS, EARLY_K, SCHED, QH, NQ, ROWS,
        PRODUCER_REGS, CONSUMER_REGS, num_warps,
    )  # fmt: skip


@gluon.jit
def _one_tile(
    q_desc, k_desc, v_desc, Out, Lse, q_in, KS, cu_seqlens_q, cu_seqlens_k, rows_q, rows_k,
    qk_scale, p_gs, p_inv_gs, out_scale, group, n_sink, n_recent, stride_qh, stride_kh,
    stride_vh, stride_qst, stride_kst, stride_ot, stride_oh, stride_lh, s_layout: gl.constexpr,
    o_layout: gl.constexpr, p_layout: gl.constexpr, pv_dtype: gl.constexpr, DV: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, QQ: gl.constexpr, K_DYNAMIC: gl.constexpr,
    P_FMT: gl.constexpr, NM: gl.constexpr, RETURN_LSE: gl.constexpr, WARP_SPEC: gl.constexpr,
    PINGPONG: gl.constexpr, TURNS: gl.constexpr, EARLY_K: gl.constexpr, SCHED: gl.constexpr,
    QH: gl.constexpr, NQ: gl.constexpr, ROWS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The kernel's body: the program's one query tile (grid: query tiles x
    heads x sequences)."""
    start_m, head, seq, q_start, seq_len_q, bad_q = query_tile(cu_seqlens_q, rows_q, CAUSAL)
    if start_m * BLOCK_M < seq_len_q:
        k_start, seq_len_k, bad_k = seq_span(cu_seqlens_k, seq, rows_k)
        if bad_q | bad_k:
            _poison_tile(
                Out, Lse, q_start, seq_len_q, start_m * BLOCK_M, head, stride_ot, stride_oh,
                stride_lh, BLOCK_M, DV, RETURN_LSE, num_warps,
            )  # fmt: skip
        else:
            kv_head = head // group
            hi, mid = key_bounds(start_m, seq_len_q, seq_len_k, BLOCK_M, BLOCK_N, CAUSAL)
            n_tiles = gl.cdiv(hi, BLOCK_N)
            nm = (n_sink, n_recent, seq_len_q == 1)  # a single query is never sparsified

            q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars, bad_smem = _setup(
                q_desc, k_desc, v_desc, ROWS, BLOCK_N, DV, NQ, NUM_STAGES, PINGPONG, TURNS, EARLY_K,
            )  # fmt: skip

            q_col = head * stride_qh
            k_col = kv_head * stride_kh
            v_col = kv_head * stride_vh
            q_row = q_start + start_m * BLOCK_M
            row0 = start_m * BLOCK_M  # the tile's first row in the sequence
            if PINGPONG:
                if TURNS:  # warpgroup 0 takes the first turn
                    mbarrier.arrive(turn_bars.index(0), count=1)
                gl.warp_specialize(
                    [
                        (_consume, (
                            q_smem, k_smem, v_smem, q_bar, k_bars, v_bars,
                            empties, turn_bars, bad_smem, k_desc, v_desc, q_in, KS, Out, Lse,
                            q_start, seq_len_q, k_start, seq_len_k, row0, head, kv_head, k_col,
                            v_col, mid, n_tiles, qk_scale, p_gs, p_inv_gs, out_scale, stride_qst,
                            stride_kst, stride_ot, stride_oh, stride_lh, nm, (0, 0, 0), s_layout,
                            o_layout, p_layout, pv_dtype, ROWS, BLOCK_N, DV, NQ, NUM_STAGES, CAUSAL,
                            QQ, K_DYNAMIC, P_FMT, NM, RETURN_LSE, 0, SCHED, num_warps,
                        )),
                        (_consume, (
                            q_smem, k_smem, v_smem, q_bar, k_bars,
                            v_bars, empties, turn_bars, bad_smem, k_desc, v_desc, q_in, KS, Out,
                            Lse, q_start, seq_len_q, k_start, seq_len_k, row0 + ROWS, head,
                            kv_head, k_col, v_col, mid, n_tiles, qk_scale, p_gs, p_inv_gs,
                            out_scale, stride_qst, stride_kst, stride_ot, stride_oh, stride_lh, nm,
                            (0, 0, 0), s_layout, o_layout, p_layout, pv_dtype, ROWS, BLOCK_N,
                            DV, NQ, NUM_STAGES, CAUSAL, QQ, K_DYNAMIC, P_FMT, NM, RETURN_LSE, 1,
                            SCHED, num_warps,
                        )),
                        (_producer, (
                            q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, q_desc,
                            k_desc, v_desc, q_row, q_col, k_start, k_col, v_col, n_tiles, 0,
                            BLOCK_N, NQ, NUM_STAGES, QH, EARLY_K,
                        )),
                    ],
                    [num_warps, 1],
                    [CONSUMER_REGS, PRODUCER_REGS],
                )  # fmt: skip
            else:
                if WARP_SPEC:
                    acc, l_i, m_i, row_nan = gl.warp_specialize(
                        [
                            (_attend, (
                                q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties,
                                turn_bars, bad_smem, k_desc, v_desc, q_in, KS, q_start, seq_len_q,
                                k_start, seq_len_k, row0, head, kv_head, k_col, v_col, mid,
                                n_tiles, qk_scale, p_gs, p_inv_gs, stride_qst, stride_kst, nm,
                                (0, 0, 0), s_layout, o_layout, p_layout, pv_dtype, ROWS, BLOCK_N,
                                DV, NQ,
                                NUM_STAGES, CAUSAL, QQ, K_DYNAMIC, P_FMT, NM, False, -1,
                                SCHED, num_warps,
                            )),
                            (_producer, (
                                q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, q_desc,
                                k_desc, v_desc, q_row, q_col, k_start, k_col, v_col, n_tiles, 0,
                                BLOCK_N, NQ, NUM_STAGES, QH, EARLY_K,
                            )),
                        ],
                        [1],
                        [PRODUCER_REGS],
                    )  # fmt: skip
                else:
                    mbarrier.expect(q_bar, NQ * q_desc.block_type.nbytes)
                    for c in gl.static_range(NQ):
                        tma.async_copy_global_to_shared(
                            q_desc, [q_row, q_col + c * CHUNK], q_bar, q_smem.index(c)
                        )
                    for i in gl.static_range(NUM_STAGES):
                        if i < n_tiles:
                            _load_kv(
                                k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, k_start, k_col,
                                v_col, BLOCK_N, NQ, NUM_STAGES,
                            )  # fmt: skip
                    acc, l_i, m_i, row_nan = _attend(
                        q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empties, turn_bars,
                        bad_smem, k_desc, v_desc, q_in, KS, q_start, seq_len_q, k_start, seq_len_k,
                        row0, head, kv_head, k_col, v_col, mid, n_tiles, qk_scale, p_gs,
                        p_inv_gs, stride_qst, stride_kst, nm, (0, 0, 0), s_layout, o_layout,
                        p_layout, pv_dtype, ROWS, BLOCK_N, DV, NQ, NUM_STAGES, CAUSAL, QQ,
                        K_DYNAMIC, P_FMT, NM, True, -1, SCHED, num_warps,
                    )  # fmt: skip
                _epilogue(
                    acc, l_i, m_i, row_nan, Out, Lse, q_start, seq_len_q, row0, head, out_scale,
                    stride_ot, stride_oh, stride_lh, s_layout, o_layout, ROWS, DV, RETURN_LSE,
                    num_warps,
                )  # fmt: skip

            _teardown(
                q_bar, k_bars, v_bars, empties, turn_bars, NUM_STAGES, PINGPONG, TURNS, EARLY_K,
            )  # fmt: skip
