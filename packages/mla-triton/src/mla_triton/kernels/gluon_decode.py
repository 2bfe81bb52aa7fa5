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
def _scores(q1_smem, q2_smem, kv_tile, kpe_tile, s_layout: gl.constexpr):
    """Issue ``S = q1 kvᵀ + q2 kpeᵀ`` (``[64, BLOCK_N]`` float32) as async wgmma."""
    s = gl.zeros([_HEADS, kv_tile.shape[0]], gl.float32, s_layout)
    s = warpgroup_mma(q1_smem, kv_tile.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q2_smem, kpe_tile.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_el, valid, score_scale):
    """One tile of the base-2 online softmax with an integer running maximum (exact
    rescales): ``(P, alpha, m_new, l_el)`` with the denominators kept per element."""
    t = gl.fma(s, score_scale, s - s)  # the rounded product, NaN if s is not finite
    t = gl.where(valid[None, :], t, float("-inf"))
    m_new = gl.maximum(m_i, gl.ceil(gl.max(t, axis=1)))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - m_new[:, None])
    return p, alpha, m_new, l_el * alpha[:, None] + p


@gluon.jit
def _stage_q(
    qn_ptr,
    qp_ptr,
    b,
    hg,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    num_heads,
    dtype: gl.constexpr,
    D1: gl.constexpr,
    D2: gl.constexpr,
):
    """q of heads ``[64 hg, 64 hg + 64)`` into shared memory (``[64, D1]``, ``[64, D2]``);
    heads past ``num_heads`` are zeros."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [_WARPS, 1], [1, 0])
    ld_pe: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0])
    offs_h = hg * _HEADS + gl.arange(0, _HEADS, gl.SliceLayout(1, ld))
    offs_d1 = gl.arange(0, D1, gl.SliceLayout(0, ld))
    q1 = gl.load(
        qn_ptr + b * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_d1[None, :],
        mask=(offs_h < num_heads)[:, None],
        other=0.0,
    )
    offs_hp = hg * _HEADS + gl.arange(0, _HEADS, gl.SliceLayout(1, ld_pe))
    offs_d2 = gl.arange(0, D2, gl.SliceLayout(0, ld_pe))
    q2 = gl.load(
        qp_ptr + b * stride_qp_b + offs_hp[:, None] * stride_qp_h + offs_d2[None, :],
        mask=(offs_hp < num_heads)[:, None],
        other=0.0,
    )
    q1_smem = gl.allocate_shared_memory(
        dtype, [_HEADS, D1], gl.NVMMASharedLayout.get_default_for([_HEADS, D1], dtype), q1
    )
    q2_smem = gl.allocate_shared_memory(
        dtype, [_HEADS, D2], gl.NVMMASharedLayout.get_default_for([_HEADS, D2], dtype), q2
    )
    return q1_smem, q2_smem


@gluon.jit
def gluon_decode_split_kernel(
    qn_ptr,
    qp_ptr,
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
    score_scale,  # softmax_scale * log2(e)
    D1: gl.constexpr,
    D2: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    HEAD_GROUPS: gl.constexpr,
    SPLIT_ALIGN_: gl.constexpr,
):
    """Stage 1 of the unquantized recipe: one (head group, split, request).

    Shapes as ``decode_kernel.decode_split_kernel``: q ``[B, H, D1]`` + ``[B, H, D2]``,
    cache rows ``D1 + D2`` wide, out ``[B, H, D1]`` and lse ``[B, H]`` (one split) or
    workspace acc ``[B, NUM_SPLITS, H, D1]`` and ``(m, l)`` ``[B, NUM_SPLITS, H, 2]``.
    """
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
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
    split = (pid // HEAD_GROUPS) % NUM_SPLITS
    b = (pid // HEAD_GROUPS // NUM_SPLITS).to(gl.int64)

    raw = gl.load(seq_lens_ptr + b * stride_sl).to(gl.int32)
    poisoned = (raw < 0) | (raw > capacity)
    seq_len = gl.minimum(gl.maximum(raw, 0), capacity)
    per = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = gl.maximum((per + SPLIT_ALIGN_ - 1) // SPLIT_ALIGN_, 1) * SPLIT_ALIGN_
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq_len)
    n_tiles = gl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N

    q1_smem, q2_smem = _stage_q(
        qn_ptr, qp_ptr, b, hg, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, num_heads,
        dtype, D1, D2,
    )  # fmt: skip
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], dtype)
    kpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, BLOCK_N], dtype)
    kv_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], kv_layout)
    kpe_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kpe_layout)

    bt_row = bt_ptr + b * stride_bt_b
    n_bad = gl.zeros([BLOCK_N], gl.int1, gl.SliceLayout(1, _LD))  # a page outside the cache
    for j in gl.static_range(STAGES - 1):
        rows, bad = _tile_rows(
            bt_row, lo + j * BLOCK_N, hi, stride_bt_p, stride_kv_page, stride_kv_row,
            num_blocks, PAGE, BLOCK_N,
        )  # fmt: skip
        n_bad |= bad
        _issue_tile(
            kv_ring.index(j), kpe_ring.index(j), kv_ptr, rows, lo + j * BLOCK_N, hi, D1, D2,
            BLOCK_N,
        )  # fmt: skip
    # The block-table lookup runs one tile ahead of the copy issue (its latency hides
    # behind an iteration).
    rows_next, bad = _tile_rows(
        bt_row, lo + (STAGES - 1) * BLOCK_N, hi, stride_bt_p, stride_kv_page, stride_kv_row,
        num_blocks, PAGE, BLOCK_N,
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
        p_ring = gl.allocate_shared_memory(dtype, [2, _HEADS, BLOCK_N], p_layout)
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        gl.barrier()
        s = _scores(q1_smem, q2_smem, kv_ring.index(0), kpe_ring.index(0), s_layout)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, lo + offs_n < hi, score_scale)
        p_ring.index(0).store(p.to(dtype))
        for i in range(n_tiles):
            cp.wait_group(STAGES - 3)  # tile i + 1 has landed (this thread's copies) ...
            fence_async_shared()  # ... and so has P of tile i (this thread's stores)
            gl.barrier()  # ... for every thread
            nx = (i + 1) % STAGES
            s_next = _scores(q1_smem, q2_smem, kv_ring.index(nx), kpe_ring.index(nx), s_layout)
            acc = warpgroup_mma(p_ring.index(i % 2), kv_ring.index(i % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_next,))  # S of tile i + 1 done, P V in flight
            valid = (lo + (i + 1) * BLOCK_N + offs_n) < hi
            p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, valid, score_scale)
            p_ring.index((i + 1) % 2).store(p.to(dtype))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            nxt = i + STAGES - 1  # into the buffer of tile i - 1: both warpgroups are past it
            _issue_tile(
                kv_ring.index(nxt % STAGES), kpe_ring.index(nxt % STAGES), kv_ptr, rows_next,
                lo + nxt * BLOCK_N, hi, D1, D2, BLOCK_N,
            )  # fmt: skip
            rows_next, bad = _tile_rows(
                bt_row, lo + (nxt + 1) * BLOCK_N, hi, stride_bt_p, stride_kv_page,
                stride_kv_row, num_blocks, PAGE, BLOCK_N,
            )  # fmt: skip
            n_bad |= bad
    else:
        p_smem = gl.allocate_shared_memory(dtype, [_HEADS, BLOCK_N], p_layout)
        for i in range(n_tiles):
            # Both warpgroups are done with tile i - 1 (its P V was waited for): free.
            gl.barrier()
            nxt = i + STAGES - 1
            _issue_tile(
                kv_ring.index(nxt % STAGES), kpe_ring.index(nxt % STAGES), kv_ptr, rows_next,
                lo + nxt * BLOCK_N, hi, D1, D2, BLOCK_N,
            )  # fmt: skip
            rows_next, bad = _tile_rows(
                bt_row, lo + (nxt + 1) * BLOCK_N, hi, stride_bt_p, stride_kv_page,
                stride_kv_row, num_blocks, PAGE, BLOCK_N,
            )  # fmt: skip
            n_bad |= bad
            cp.wait_group(STAGES - 1)  # tile i has landed (this thread's copies) ...
            fence_async_shared()
            gl.barrier()  # ... and every thread's
            kv_tile = kv_ring.index(i % STAGES)
            s = _scores(q1_smem, q2_smem, kv_tile, kpe_ring.index(i % STAGES), s_layout)
            s = warpgroup_mma_wait(0, deps=(s,))
            valid = (lo + i * BLOCK_N + offs_n) < hi
            p, alpha, m_i, l_el = _softmax_step(s, m_i, l_el, valid, score_scale)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_smem.store(p.to(dtype))
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
    if NUM_SPLITS == 1:
        l_o = gl.where(poisoned, float("nan"), l_o)
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        keep = (seq_len > 0) | poisoned
        inv_l = gl.where(keep, 1.0 / l_safe, 0.0)
        o = acc * inv_l[:, None]
        row_sum = gl.sum(acc, axis=1)
        o = o + (row_sum - row_sum)[:, None]  # a non-finite row is NaN in every feature
        lse = gl.where(keep, (gl.log2(l_safe) + m_o) * LN2, float("-inf"))
        o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
        gl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)
    else:
        row = (b * NUM_SPLITS + split) * num_heads + offs_h
        st_mask = h_mask & (lo < seq_len)
        gl.store(wacc_ptr + row[:, None] * D1 + offs_d[None, :], acc, mask=st_mask[:, None])
        gl.store(wml_ptr + row * 2, m_o, mask=st_mask)
        gl.store(wml_ptr + row * 2 + 1, l_o, mask=st_mask)
