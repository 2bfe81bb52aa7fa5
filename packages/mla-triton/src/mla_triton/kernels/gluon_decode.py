"""Absorbed-MLA split-K decode for Hopper (sm90) in Gluon: the unquantized recipe.

Algorithm (one CTA per (head group of 64, split, request); 8 warps = 2 warpgroups)
----------------------------------------------------------------------------------
The split bounds, the base-2 online softmax with an integer running maximum, the
NaN rules and the partial outputs are those of ``decode_kernel.decode_split_kernel``
(its docstring is the contract); only the schedule differs:

- q (``[64, 512]`` and ``[64, 64]``, heads past ``H`` zero) is staged in shared
  memory once and is the A operand of every ``S`` wgmma.
- Latent tiles of ``BLOCK_N`` rows (``[BLOCK_N, 512]`` + ``[BLOCK_N, 64]``) stream
  through a ring of ``STAGES`` shared-memory buffers filled by ``cp.async`` (one
  block-table lookup per row, so any page size works), ``STAGES - 1`` tiles ahead.
- ``S = q Kᵀ`` is computed once: the two warpgroups each take half of the
  ``BLOCK_N`` tokens (wgmma ``64 x BLOCK_N/2``, K-major B = the tile, permuted);
  the row maxima cross the warpgroups through one small shared-memory reduction.
- ``P`` (16-bit) goes to shared memory; ``O += P V`` runs with the two warpgroups
  each owning 256 of the 512 output features (wgmma ``64 x 256``, MN-major B = the
  same tile: V is the first 512 features of the rows K was read from).
- Copies run ``STAGES - 1`` tiles ahead of the MMAs; per tile the CTA meets at five
  barriers (buffer reuse, tile landed, the row maximum, P written). The denominators
  are kept per element of ``S`` and summed once at the end.

Epilogue: one split writes ``out``/``lse``; several write the unnormalized float32
accumulator and the base-2 ``(m, l)`` to the workspace of ``mla_triton.decode``,
whose merge kernel (``decode_kernel.decode_merge_kernel``) combines them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla_triton import qdq_device as dev

LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
NUM_WARPS = 8
"""Warps per CTA: two warpgroups (the kernel's layouts assume it)."""
BLOCK_H = 64
"""Query heads per CTA (the wgmma M)."""
_WARPS: gl.constexpr = gl.constexpr(NUM_WARPS)
_HEADS: gl.constexpr = gl.constexpr(BLOCK_H)
# Register layout of the tile copies: 16 bytes a thread, 8 threads along a 128-byte row
# segment, 4 rows a warp; the kv_c and k_pe parts share its rows (one block-table lookup).
_LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])


@gluon.jit
def _tile_rows(
    bt_row, start, hi, stride_bt_p, stride_kv_page, stride_kv_row, num_blocks,
    PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Element offsets ``[BLOCK_N]`` (int64) of the latent rows ``[start, start + BLOCK_N)``
    and which of them use a block-table entry outside ``[0, num_blocks)`` (those are
    read from page 0 instead); rows at or past ``hi`` read no table entry."""
    tok = start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, _LD))
    valid = tok < hi
    page = gl.load(bt_row + (tok // PAGE) * stride_bt_p, mask=valid, other=0).to(gl.int64)
    bad = valid & ((page < 0) | (page >= num_blocks))
    page = gl.where(bad, 0, page)
    return page * stride_kv_page + (tok % PAGE).to(gl.int64) * stride_kv_row, bad


@gluon.jit
def _issue_tile(
    kv_smem,
    kpe_smem,
    kv_ptr,
    rows,
    start,
    hi,
    D1: gl.constexpr,
    D2: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """``cp.async`` the latent rows at ``rows`` (``_tile_rows`` of ``start``; those below
    ``hi``) into ``kv_smem [BLOCK_N, D1]`` and ``kpe_smem [BLOCK_N, D2]``, one commit group.
    Rows at or past ``hi`` are zero-filled."""
    valid = (start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, _LD))) < hi
    offs_d1 = gl.arange(0, D1, gl.SliceLayout(0, _LD))
    cp.async_copy_global_to_shared(
        kv_smem, kv_ptr + rows[:, None] + offs_d1[None, :], mask=valid[:, None]
    )
    offs_d2 = gl.arange(0, D2, gl.SliceLayout(0, _LD))
    cp.async_copy_global_to_shared(
        kpe_smem, kv_ptr + rows[:, None] + D1 + offs_d2[None, :], mask=valid[:, None]
    )
    cp.commit_group()


@gluon.jit
def _advance(
    kv_ring, kpe_ring, kv_ptr, rows, t, lo, hi, bt_row, stride_bt_p, stride_kv_page,
    stride_kv_row, num_blocks, D1: gl.constexpr, D2: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Copy tile ``t`` of the split (``rows``: its row offsets) into its ring slot and
    look up the rows of tile ``t + 1``: ``_tile_rows``'s ``(rows, bad)``."""
    _issue_tile(
        kv_ring.index(t % STAGES), kpe_ring.index(t % STAGES), kv_ptr, rows,
        lo + t * BLOCK_N, hi, D1, D2, BLOCK_N,
    )  # fmt: skip
    return _tile_rows(
        bt_row, lo + (t + 1) * BLOCK_N, hi, stride_bt_p, stride_kv_page, stride_kv_row,
        num_blocks, PAGE, BLOCK_N,
    )  # fmt: skip


@gluon.jit
def _scores(q1_smem, q2_smem, kv_tile, kpe_tile, s_layout: gl.constexpr):
    """Issue ``S = q1 kvᵀ + q2 kpeᵀ`` (``[64, BLOCK_N]`` float32) as async wgmma."""
    s = gl.zeros([_HEADS, kv_tile.shape[0]], gl.float32, s_layout)
    s = warpgroup_mma(q1_smem, kv_tile.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q2_smem, kpe_tile.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_el, valid, row_scale, RAW: gl.constexpr):
    """One tile of the base-2 online softmax with an integer running maximum (exact
    rescales): ``(P, alpha, m_new, l_el)`` with the denominators kept per element.

    ``row_scale [64]``: softmax scale times log2(e) (and q's, K's global scales).
    ``RAW`` (an operand read raw): an infinite score becomes NaN, as in the Triton kernel.
    """
    # raw: the rounded product plus (s - s), NaN where s is not finite
    t = gl.fma(s, row_scale[:, None], s - s) if RAW else s * row_scale[:, None]
    t = gl.where(valid[None, :], t, float("-inf"))
    m_new = gl.maximum(m_i, gl.ceil(gl.max(t, axis=1)))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - m_new[:, None])
    return p, alpha, m_new, l_el * alpha[:, None] + p


@gluon.jit
def _qdq_tile_fp8(kv_raw, kpe_raw, kv_mma, kpe_mma, k_inv_gs):
    """K̂ = V̂ of one resident tile, in place: the factored E4M3 values of the raw rows
    times ``k_inv_gs`` (a power of two), in the MMA's 16-bit type (exact). Each thread
    rewrites the elements it read, 16384 elements at a time (registers; each piece costs
    a barrier the compiler adds, as it cannot see that no other thread's elements are
    touched); the caller fences and meets at a barrier."""
    D1: gl.constexpr = kv_raw.shape[1]
    W: gl.constexpr = min(D1, 16384 // kv_raw.shape[0])
    for c in gl.static_range(D1 // W):
        x = kv_raw.slice(c * W, W, dim=1).load(_LD).to(gl.float32)
        y = dev.e4m3_round_hw(gl.fma(x, k_inv_gs, x - x), True)
        kv_mma.slice(c * W, W, dim=1).store(y.to(kv_mma.dtype))
    x2 = kpe_raw.load(_LD).to(gl.float32)
    kpe_mma.store(dev.e4m3_round_hw(gl.fma(x2, k_inv_gs, x2 - x2), True).to(kpe_mma.dtype))


@gluon.jit
def _p_hat(p, p_inv_gs, P_FMT: gl.constexpr):
    """P̂ (factored) for the P V MMA: fp8 along the tokens (per element), or P itself."""
    if P_FMT == 1:
        p = dev.fp8_qdq_p(p, p_inv_gs, True)
    return p


@gluon.jit
def _q_rows_smem(q_ptr, b, hg, stride_b, stride_h, num_heads, D: gl.constexpr, dtype: gl.constexpr):
    """Request ``b``'s q rows of heads ``[64 hg, 64 hg + 64)``, features ``[0, D)``, in a
    shared ``[64, D]`` wgmma operand; heads past ``num_heads`` are zeros."""
    offs_h = hg * _HEADS + gl.arange(0, _HEADS, gl.SliceLayout(1, _LD))
    offs_d = gl.arange(0, D, gl.SliceLayout(0, _LD))
    rows = gl.load(
        q_ptr + b * stride_b + offs_h[:, None] * stride_h + offs_d[None, :],
        mask=(offs_h < num_heads)[:, None],
        other=0.0,
    )
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, D], dtype)
    return gl.allocate_shared_memory(dtype, [_HEADS, D], layout, rows)


@gluon.jit(do_not_specialize=["num_splits"])
def gluon_decode_split_kernel(
    split,
    k_inv_gs,
    p_inv_gs,
    out_scale,  # gs_p * gs_v
    num_splits,
    SHAPE: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    Q_SCALED: gl.constexpr,
    KV_FP8: gl.constexpr,
    P_FMT: gl.constexpr,
    MULTI_SPLIT: gl.constexpr,
):
    """Stage 1: one (head group, split, request).

    Shapes as ``decode_kernel.decode_split_kernel``: q ``[B, H, D1]`` + ``[B, H, D2]``,
    cache rows ``D1 + D2`` wide, out ``[B, H, D1]`` and lse ``[B, H]`` (one split) or
    workspace acc ``[B, num_splits, H, D1]`` and ``(m, l)`` ``[B, num_splits, H, 2]``.
    Recipes: ``Q_SCALED``: q is q̂ (factored, by ``decode_q_kernel``) with its global
    scales ``qgs [B, H]``; ``KV_FP8``: K̂ = V̂ (fp8, one static power-of-two global scale)
    quantized in place once the tile has landed; ``P_FMT`` 0 or 1 (fp8). ``split`` and
    ``SHAPE`` as the Triton split kernels' (``kernels.common.split_program``; ``cache =
    (kv_ptr,)``, ``BLOCK_H`` 64); ``num_splits`` a runtime argument, ``MULTI_SPLIT``
    (``num_splits > 1``) the epilogue, as theirs.
    """
    qn_ptr, qp_ptr, qgs_ptr = split[0]
    (kv_ptr,) = split[1]
    bt_ptr, seq_lens_ptr = split[2], split[3]
    out_ptr, lse_ptr = split[4]
    wacc_ptr, wml_ptr = split[5]
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h = split[6]
    stride_kv_page, stride_kv_row = split[7]
    stride_bt_b, stride_bt_p = split[8]
    stride_sl = split[9]
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h = split[10]
    num_heads, capacity, num_blocks = split[11]
    score_scale = split[12]  # softmax_scale * log2(e), times K's static global scale
    D1: gl.constexpr = SHAPE[0]
    D2: gl.constexpr = SHAPE[1]
    PAGE: gl.constexpr = SHAPE[2]
    BLOCK_N: gl.constexpr = SHAPE[4]
    HEAD_GROUPS: gl.constexpr = SHAPE[5]
    SPLIT_ALIGN_: gl.constexpr = SHAPE[6]
    gl.static_assert(SHAPE[3] == _HEADS, "BLOCK_H: 64 heads a CTA (the wgmma M)")
    dtype: gl.constexpr = kv_ptr.dtype.element_ty  # the raw cache
    mma: gl.constexpr = qn_ptr.dtype.element_ty  # q (or q̂), K̂, V̂ and P̂ in the MMAs
    # S [64, BLOCK_N]: each warpgroup half of the tokens; O [64, D1]: half the features.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D1 // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid = gl.program_id(0)
    hg = pid % HEAD_GROUPS
    n_splits = num_splits if MULTI_SPLIT else 1  # a constant with one split
    split = (pid // HEAD_GROUPS) % n_splits
    b = (pid // HEAD_GROUPS // n_splits).to(gl.int64)

    raw = gl.load(seq_lens_ptr + b * stride_sl).to(gl.int32)
    poisoned = (raw < 0) | (raw > capacity)
    seq_len = gl.minimum(gl.maximum(raw, 0), capacity)
    per = (seq_len + n_splits - 1) // n_splits
    chunk = gl.maximum((per + SPLIT_ALIGN_ - 1) // SPLIT_ALIGN_, 1) * SPLIT_ALIGN_
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq_len)
    n_tiles = gl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N

    q1_smem = _q_rows_smem(qn_ptr, b, hg, stride_qn_b, stride_qn_h, num_heads, D1, mma)
    q2_smem = _q_rows_smem(qp_ptr, b, hg, stride_qp_b, stride_qp_h, num_heads, D2, mma)
    row_scale = gl.full([_HEADS], score_scale, gl.float32, row_s)
    if Q_SCALED:
        offs_hs = hg * _HEADS + gl.arange(0, _HEADS, row_s)
        row_scale *= gl.load(qgs_ptr + b * num_heads + offs_hs, mask=offs_hs < num_heads, other=1.0)
    RAW: gl.constexpr = (not KV_FP8) or (not Q_SCALED)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], dtype)
    kpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, BLOCK_N], mma)
    kv_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], kv_layout)
    kpe_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kpe_layout)
    # the same buffers as the MMAs read them (K̂ = V̂ rewritten in place in their type)
    kv_mma = kv_ring._reinterpret(mma)
    kpe_mma = kpe_ring._reinterpret(mma)

    bt_row = bt_ptr + b * stride_bt_b
    # The block-table lookup runs one tile ahead of the copy issue (its latency hides
    # behind an iteration); n_bad: a row whose page lies outside the cache, any tile.
    rows_next, n_bad = _tile_rows(
        bt_row, lo, hi, stride_bt_p, stride_kv_page, stride_kv_row, num_blocks, PAGE, BLOCK_N
    )
    for j in gl.static_range(STAGES - 1):
        rows_next, bad = _advance(
            kv_ring, kpe_ring, kv_ptr, rows_next, j, lo, hi, bt_row, stride_bt_p,
            stride_kv_page, stride_kv_row, num_blocks, D1, D2, PAGE, BLOCK_N, STAGES,
        )  # fmt: skip
        n_bad |= bad

    m_i = gl.full([_HEADS], float("-inf"), gl.float32, row_s)
    # The denominators stay per element of S until the end: no cross-warpgroup sum per tile.
    l_el = gl.zeros([_HEADS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([_HEADS, D1], gl.float32, o_layout)
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))

    if OVERLAP:
        # The softmax of tile i + 1 runs on the ALUs while P V of tile i runs on the
        # tensor cores (P double-buffered); S of tile i + 1 is issued with it. Tiles i
        # and i + 1 stay resident, copies run STAGES - 2 tiles ahead. Every wgmma is
        # waited for before acc is rescaled and before the loop's back edge.
        p_ring = gl.allocate_shared_memory(mma, [2, _HEADS, BLOCK_N], p_layout)
        cp.wait_group(STAGES - 2)
        if KV_FP8:
            _qdq_tile_fp8(
                kv_ring.index(0), kpe_ring.index(0), kv_mma.index(0), kpe_mma.index(0), k_inv_gs
            )
        fence_async_shared()
        gl.barrier()
        s = _scores(q1_smem, q2_smem, kv_mma.index(0), kpe_mma.index(0), s_layout)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, lo + offs_n < hi, row_scale, RAW)
        p_ring.index(0).store(_p_hat(p, p_inv_gs, P_FMT).to(mma))
        for i in range(n_tiles):
            cp.wait_group(STAGES - 3)  # tile i + 1 has landed (this thread's copies) ...
            nx = (i + 1) % STAGES
            if KV_FP8:
                gl.barrier()  # every thread's copies of tile i + 1 have landed
                _qdq_tile_fp8(
                    kv_ring.index(nx),
                    kpe_ring.index(nx),
                    kv_mma.index(nx),
                    kpe_mma.index(nx),
                    k_inv_gs,
                )
            fence_async_shared()  # ... and so has P of tile i (this thread's stores)
            gl.barrier()  # ... for every thread
            s_next = _scores(q1_smem, q2_smem, kv_mma.index(nx), kpe_mma.index(nx), s_layout)
            acc = warpgroup_mma(p_ring.index(i % 2), kv_mma.index(i % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_next,))  # S of tile i + 1 done, P V in flight
            valid = (lo + (i + 1) * BLOCK_N + offs_n) < hi
            p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, valid, row_scale, RAW)
            p_ring.index((i + 1) % 2).store(_p_hat(p, p_inv_gs, P_FMT).to(mma))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            nxt = i + STAGES - 1  # into the buffer of tile i - 1: both warpgroups are past it
            rows_next, bad = _advance(
                kv_ring, kpe_ring, kv_ptr, rows_next, nxt, lo, hi, bt_row, stride_bt_p,
                stride_kv_page, stride_kv_row, num_blocks, D1, D2, PAGE, BLOCK_N, STAGES,
            )  # fmt: skip
            n_bad |= bad
    else:
        p_smem = gl.allocate_shared_memory(mma, [_HEADS, BLOCK_N], p_layout)
        for i in range(n_tiles):
            # Both warpgroups are done with tile i - 1 (its P V was waited for): free.
            gl.barrier()
            nxt = i + STAGES - 1
            rows_next, bad = _advance(
                kv_ring, kpe_ring, kv_ptr, rows_next, nxt, lo, hi, bt_row, stride_bt_p,
                stride_kv_page, stride_kv_row, num_blocks, D1, D2, PAGE, BLOCK_N, STAGES,
            )  # fmt: skip
            n_bad |= bad
            cp.wait_group(STAGES - 1)  # tile i has landed (this thread's copies) ...
            cur = i % STAGES
            if KV_FP8:
                gl.barrier()  # every thread's copies have landed
                _qdq_tile_fp8(
                    kv_ring.index(cur),
                    kpe_ring.index(cur),
                    kv_mma.index(cur),
                    kpe_mma.index(cur),
                    k_inv_gs,
                )
            fence_async_shared()
            gl.barrier()  # ... and every thread's
            kv_tile = kv_mma.index(cur)
            s = _scores(q1_smem, q2_smem, kv_tile, kpe_mma.index(cur), s_layout)
            s = warpgroup_mma_wait(0, deps=(s,))
            valid = (lo + i * BLOCK_N + offs_n) < hi
            p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, valid, row_scale, RAW)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_smem.store(_p_hat(p, p_inv_gs, P_FMT).to(mma))
            fence_async_shared()
            gl.barrier()  # both halves of P are in shared memory
            acc = warpgroup_mma(p_smem, kv_tile, acc, is_async=True)
            # Waited for here, not across the loop's back edge: ptxas serializes every
            # wgmma of the loop (warning C7515) when an async accumulator crosses it.
            acc = warpgroup_mma_wait(0, deps=(acc,))

    cp.wait_group(0)
    l_i = gl.sum(l_el, axis=1)
    l_i = gl.where(gl.max(n_bad.to(gl.int32), axis=0) > 0, float("nan"), l_i)

    # ---- epilogue -------------------------------------------------------------------
    m_o = gl.convert_layout(m_i, row_o)
    l_o = gl.convert_layout(l_i, row_o)
    offs_h = hg * _HEADS + gl.arange(0, _HEADS, row_o)
    h_mask = offs_h < num_heads
    offs_d = gl.arange(0, D1, gl.SliceLayout(0, o_layout))
    if not MULTI_SPLIT:
        l_o = gl.where(poisoned, float("nan"), l_o)
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        keep = (seq_len > 0) | poisoned
        inv_l = gl.where(keep, out_scale / l_safe, 0.0)
        o = acc * inv_l[:, None]
        row_sum = gl.sum(acc, axis=1)
        o = o + (row_sum - row_sum)[:, None]  # a non-finite row is NaN in every feature
        lse = gl.where(keep, (gl.log2(l_safe) + m_o) * LN2, float("-inf"))
        o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
        gl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)
    else:
        row = (b * n_splits + split) * num_heads + offs_h
        st_mask = h_mask & (lo < seq_len)
        gl.store(wacc_ptr + row[:, None] * D1 + offs_d[None, :], acc, mask=st_mask[:, None])
        gl.store(wml_ptr + row * 2, m_o, mask=st_mask)
        gl.store(wml_ptr + row * 2 + 1, l_o, mask=st_mask)
