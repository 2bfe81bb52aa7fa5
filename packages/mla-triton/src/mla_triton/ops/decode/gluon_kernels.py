"""Absorbed-MLA split-K decode for Hopper (sm90) in Gluon: on read and over the shadow.

Algorithm (one CTA per (head group of 64, split, request); 8 warps = 2 warpgroups)
----------------------------------------------------------------------------------
The split bounds, the base-2 online softmax with an integer running maximum, the
NaN rules and the partial outputs are those of ``triton_kernels.decode_split_kernel``
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
- Quantized operands, once a tile has landed and before the MMAs' fence: fp8 K = V
  rewritten in place (``KV_FP8``); or V̂ in tiles of their own (32-token tiles, two
  stages: a K and a V̂ ring): copied from a shadow's V̂ section (``V_SEP``; nvfp4's open
  16-token block quantized here from the raw rows, ``V_TAIL``; dynamic K's per-token
  scales on S's columns, ``K_DYN``), or quantized on read from the raw tile with K̂ then
  rewritten in place (``V_OWN``; 2: whole 16-element blocks a thread). P̂ between the
  MMAs (fp8, nvfp4 16-token blocks).

Epilogue: one split writes ``out``/``lse``; several write the unnormalized float32
accumulator and the base-2 ``(m, l)`` to the workspace of ``mla_triton.decode``,
whose merge kernel (``common.splitk_kernels.decode_merge_kernel``) combines them.
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

from mla_triton.common import kernels as common
from mla_triton.common import qdq as dev

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
_ROWS: gl.constexpr = gl.SliceLayout(1, _LD)
# The open nvfp4 V block, 128 columns at a time: [16, 128] over the CTA, 8 elements a thread.
_LD16: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, NUM_WARPS // 4], [1, 0])
# V̂ on read, [32, 64] pieces: a 16-token block's column lies in 16 lanes of one warp.
_LDV: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [2, NUM_WARPS // 2], [1, 0])
# On read with whole blocks a thread (``V_OWN == 2``): V̂'s [32, 256] pieces, a thread
# holding 16 tokens (one block) of 2 columns; K̂'s [32, 128] pieces, a thread holding 16
# features (one block) of a row. The block maxima need no shuffles and the block-scale
# arithmetic runs once a block instead of once an element (V) or half-block (K).
_LDVB: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [2, NUM_WARPS // 2], [1, 0])
_LDKB: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])


@gluon.jit
def _tile_rows(
    bt_row, start, hi, stride_bt_p, num_blocks, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    layout: gl.constexpr = _ROWS,
):  # fmt: skip
    """``(page, slot)`` ``[BLOCK_N]`` (int64) of the tokens ``[start, start + BLOCK_N)`` and
    which of them use a block-table entry outside ``[0, num_blocks)`` (those read page 0
    instead); tokens at or past ``hi`` read no table entry."""
    tok = start + gl.arange(0, BLOCK_N, layout)
    valid = tok < hi
    page = gl.load(bt_row + (tok // PAGE) * stride_bt_p, mask=valid, other=0).to(gl.int64)
    bad = valid & ((page < 0) | (page >= num_blocks))
    page = gl.where(bad, 0, page)
    return (page, (tok % PAGE).to(gl.int64)), bad


@gluon.jit
def _copy_rows(smem, ptr, rows, strides, col0, valid):
    """``cp.async`` ``smem [BLOCK_N, W]`` from the rows ``rows = (page, slot)`` of ``ptr``
    (page and row ``strides``, multiples of 8 elements: 16-byte rows), columns ``col0 ..
    col0 + W``; rows not ``valid`` are zero-filled."""
    offs = gl.arange(0, smem.shape[1], gl.SliceLayout(0, _LD))
    base = gl.multiple_of(rows[0] * strides[0] + rows[1] * strides[1], 8)
    cp.async_copy_global_to_shared(
        smem, ptr + base[:, None] + col0 + offs[None, :], mask=valid[:, None]
    )


@gluon.jit
def _advance(
    rings, ptrs, strides, rows, t, lo, hi, v_hi, bt_row, stride_bt_p, num_blocks,
    PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_SEP: gl.constexpr,
):  # fmt: skip
    """Copy tile ``t`` of the split (``rows``: its ``(page, slot)``) into its ring slot, one
    commit group: K (``[BLOCK_N, D1]`` + ``[BLOCK_N, D2]`` of ``ptrs[0]``'s rows, zeros at
    or past ``hi``) and with ``V_SEP`` V̂ (``[BLOCK_N, D1]`` of ``ptrs[1]``'s rows, zeros
    at or past ``v_hi``); then look up the rows of tile ``t + 1``: ``_tile_rows``'s
    ``(rows, bad)``."""
    D1: gl.constexpr = rings[0].shape[2]
    tok = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, _LD))
    k_strides = (strides[0], strides[1])
    _copy_rows(rings[0].index(t % STAGES), ptrs[0], rows, k_strides, 0, tok < hi)
    _copy_rows(rings[1].index(t % STAGES), ptrs[0], rows, k_strides, D1, tok < hi)
    if V_SEP:
        v_strides = (strides[2], strides[3])
        _copy_rows(rings[2].index(t % STAGES), ptrs[1], rows, v_strides, 0, tok < v_hi)
    cp.commit_group()
    return _tile_rows(bt_row, lo + (t + 1) * BLOCK_N, hi, stride_bt_p, num_blocks, PAGE, BLOCK_N)


@gluon.jit
def _scores(q1_smem, q2_smem, kv_tile, kpe_tile, s_layout: gl.constexpr):
    """Issue ``S = q1 kvᵀ + q2 kpeᵀ`` (``[64, BLOCK_N]`` float32) as async wgmma."""
    s = gl.zeros([_HEADS, kv_tile.shape[0]], gl.float32, s_layout)
    s = warpgroup_mma(q1_smem, kv_tile.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q2_smem, kpe_tile.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_step(
    s, m_i, l_el, valid, row_scale, col_scale, RAW: gl.constexpr, K_DYN: gl.constexpr
):
    """One tile of the base-2 online softmax with an integer running maximum (exact
    rescales): ``(P, alpha, m_new, l_el)`` with the denominators kept per element.

    ``row_scale [64]``: softmax scale times log2(e) (and q's, K's static global scales);
    ``col_scale [BLOCK_N]`` with ``K_DYN``: each token's dynamic K global scale.
    ``RAW`` (K read raw, or q not quantized): an infinite score becomes NaN, as in the
    Triton kernels.
    """
    # raw: the rounded product plus (s - s), NaN where s is not finite
    t = gl.fma(s, row_scale[:, None], s - s) if RAW else s * row_scale[:, None]
    if K_DYN:
        t = t * col_scale[None, :]
    t = gl.where(valid[None, :], t, float("-inf"))
    m_new = gl.maximum(m_i, gl.ceil(gl.max(t, axis=1)))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - m_new[:, None])
    return p, alpha, m_new, l_el * alpha[:, None] + p


@gluon.jit
def _col_scales(ks_ptr, strides, bt_row, start, hi, stride_bt_p, num_blocks, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Dynamic K: the float32 global scale of each token of the tile at ``start``
    (``[BLOCK_N]``, 1 at or past ``hi``), from the shadow's K-scale section."""
    (page, slot), _ = _tile_rows(bt_row, start, hi, stride_bt_p, num_blocks, PAGE, BLOCK_N, layout)
    valid = start + gl.arange(0, BLOCK_N, layout) < hi
    return gl.load(ks_ptr + page * strides[6] + slot * strides[7], mask=valid, other=1.0)


@gluon.jit
def _nvfp4_v_block(x, v_scales, V_EXACT: gl.constexpr):
    """Factored nvfp4 V̂ of one 16-token block ``x [16, D1]`` (float32, zeros past the
    sequence's end): blocks of 16 along the tokens, i.e. each column is a block.
    ``common.qdq_latent``'s arithmetic (``qdq_device.nvfp4_qdq_fast`` with ``snap_ties``
    for a power-of-two ``gs``, ``nvfp4_qdq`` with the exact division otherwise), so
    equal to ``mla_formats`` bit for bit; a non-finite element makes its block NaN."""
    gs, _, inv_6gs = v_scales
    a = gl.abs(x)
    bmax = dev.nan_max(a, 0)[None, :]
    if V_EXACT:
        sb = dev.nvfp4_block_scale(bmax, gs)
        mag = dev.e2m1_scaled(a, sb * gs, True) * sb
    else:
        sb, inv = dev._nvfp4_fast_blocks(a, bmax, gs, inv_6gs, True, True)
        mag = dev.e2m1_round_nonneg(dev.snap_ties(a * inv)) * sb
    return gl.where(x < 0, -mag, mag)


@gluon.jit
def tail_v(vh_tile, raw_ptr, strides, bt_row, start, hi, stride_bt_p, num_blocks, v_scales,
            PAGE: gl.constexpr, V_EXACT: gl.constexpr, layout: gl.constexpr = _LD16):  # fmt: skip
    """nvfp4 V: the sequence's open 16-token block (``ob = 16 (hi // 16) < hi``, in this
    tile) has no V̂ in the shadow (the copy left its rows zero): quantize it from the raw
    rows (``ptrs[2]``), zeros past ``hi``, into its 16 rows of ``vh_tile`` (``layout``:
    of a ``[16, 128]`` piece over the calling warps). The caller fences and meets at a
    barrier before the P V MMA."""
    D1: gl.constexpr = vh_tile.shape[1]
    BLOCK_N: gl.constexpr = vh_tile.shape[0]
    ob = (hi // 16) * 16
    # one page holds the block (PAGE is a multiple of 16); a page outside the cache was
    # flagged with the tile's rows and reads page 0
    page = gl.load(bt_row + (ob // PAGE) * stride_bt_p).to(gl.int64)
    page = gl.where((page < 0) | (page >= num_blocks), 0, page)
    offs_o = gl.arange(0, 16, gl.SliceLayout(1, layout))
    rows = page * strides[4] + ((ob % PAGE) + offs_o).to(gl.int64) * strides[5]
    W: gl.constexpr = 128  # columns a piece (each column is a block: pieces are independent)
    offs_d = gl.arange(0, W, gl.SliceLayout(0, layout))
    for c in gl.static_range(D1 // W):
        x = gl.load(raw_ptr + rows[:, None] + c * W + offs_d[None, :],
                    mask=(ob + offs_o < hi)[:, None], other=0.0)  # fmt: skip
        y = _nvfp4_v_block(x.to(gl.float32), v_scales, V_EXACT).to(vh_tile.dtype)
        for k in gl.static_range(BLOCK_N // 16):  # the open block's place in the tile
            if start + 16 * k == ob:
                vh_tile.slice(16 * k, 16, dim=0).slice(c * W, W, dim=1).store(y)


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
def _qdq_tile_kv(kv_raw, kpe_raw, kv_mma, kpe_mma, vh_tile, k_scales, v_scales,
                 K_FMT: gl.constexpr, K_EXACT: gl.constexpr, V_FMT: gl.constexpr,
                 V_EXACT: gl.constexpr, BLOCKS: gl.constexpr = False):  # fmt: skip
    """On read with V̂ of its own (``V_OWN``): V̂ of the resident raw tile along the tokens
    (16-token blocks from the tile's start, a multiple of 16; rows past the sequence's
    end are the copy's zeros) into ``vh_tile``, then K̂ along the features in place (its
    16-bit MMA type), both by ``common.qdq_latent`` (the Triton kernel's arithmetic:
    bitwise ``mla_formats``). ``*_scales = (gs, 1 / gs, 1 / (6 gs))``, static. 64 columns
    a piece; ``BLOCKS`` (``V_OWN == 2``): whole blocks a thread, V̂ in [32, 256] pieces and
    K̂ in [32, 128] (``_LDVB``, ``_LDKB``; the same arithmetic, so the same bits). The
    caller fences and meets at a barrier."""
    BN: gl.constexpr = kv_raw.shape[0]
    D1: gl.constexpr = kv_raw.shape[1]
    W: gl.constexpr = 64
    WV: gl.constexpr = 256 if BLOCKS else W
    WK: gl.constexpr = 128 if BLOCKS else W
    lv: gl.constexpr = _LDVB if BLOCKS else _LDV
    lk: gl.constexpr = _LDKB if BLOCKS else _LD
    for c in gl.static_range(D1 // WV):
        x = kv_raw.slice(c * WV, WV, dim=1).load(lv).to(gl.float32)
        y = common.qdq_latent(x, v_scales, V_FMT, V_EXACT, True, BN, WV, common.AXIS_TOKENS)
        vh_tile.slice(c * WV, WV, dim=1).store(y.to(vh_tile.dtype))
    if K_FMT != 0:
        gl.barrier()  # every thread has read the raw rows V̂ needs before K̂ overwrites them
        _qdq_k(kv_raw, kpe_raw, kv_mma, kpe_mma, k_scales, K_FMT, K_EXACT, WK, lk)


@gluon.jit
def _qdq_k(kv_raw, kpe_raw, k_out, kpe_mma, k_scales, K_FMT: gl.constexpr, K_EXACT: gl.constexpr,
           WK: gl.constexpr, lk: gl.constexpr):  # fmt: skip
    """K̂ of the resident raw tile along the features (``common.qdq_latent``), ``WK``
    columns a piece read in layout ``lk``: the latent part into ``k_out`` (in place), the
    rope part in place. The caller fences and meets at a barrier before the S MMA."""
    BN: gl.constexpr = kv_raw.shape[0]
    D1: gl.constexpr = kv_raw.shape[1]
    for c in gl.static_range(D1 // WK):
        x = kv_raw.slice(c * WK, WK, dim=1).load(lk).to(gl.float32)
        y = common.qdq_latent(x, k_scales, K_FMT, K_EXACT, True, BN, WK, common.AXIS_FEATURES)
        k_out.slice(c * WK, WK, dim=1).store(y.to(k_out.dtype))
    x2 = kpe_raw.load(_LD).to(gl.float32)
    D2: gl.constexpr = kpe_raw.shape[1]
    y2 = common.qdq_latent(x2, k_scales, K_FMT, K_EXACT, True, BN, D2, common.AXIS_FEATURES)
    kpe_mma.store(y2.to(kpe_mma.dtype))


@gluon.jit
def p_hat(p, p_scales, P_FMT: gl.constexpr):
    """P̂ (factored) for the P V MMA, ``common.qdq_p`` on S's layout: fp8 per element,
    nvfp4 in blocks of 16 tokens at multiples of 16 (within a warpgroup's half of the
    tile), or P itself. ``p_scales = (gs, 1 / gs, 1 / (6 gs))``."""
    return common.qdq_p(p, p_scales, P_FMT, True, p.shape[0], p.shape[1])


@gluon.jit
def q_rows(q_ptr, b, hg, stride_b, stride_h, num_heads, D: gl.constexpr, ld: gl.constexpr):
    """Request ``b``'s q rows of heads ``[64 hg, 64 hg + 64)``, features ``[0, D)``, loaded
    in layout ``ld``; heads past ``num_heads`` are zeros."""
    offs_h = hg * _HEADS + gl.arange(0, _HEADS, gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, D, gl.SliceLayout(0, ld))
    return gl.load(
        q_ptr + b * stride_b + offs_h[:, None] * stride_h + offs_d[None, :],
        mask=(offs_h < num_heads)[:, None],
        other=0.0,
    )


@gluon.jit
def normalized(acc, l_o, poisoned, seq_len, out_scale):
    """One split's output rows ``acc * out_scale / l`` (``l_o`` in ``acc``'s row layout, NaN
    for a poisoned request; 0 for an empty request), the rows kept (not empty, or
    poisoned) and ``l`` with its zeros made 1: ``(o, keep, l_safe)``."""
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    keep = (seq_len > 0) | poisoned
    inv_l = gl.where(keep, out_scale / l_safe, 0.0)
    return acc * inv_l[:, None], keep, l_safe


@gluon.jit
def _q_rows_smem(q_ptr, b, hg, stride_b, stride_h, num_heads, D: gl.constexpr, dtype: gl.constexpr):
    """``q_rows`` in a shared ``[64, D]`` wgmma operand."""
    rows = q_rows(q_ptr, b, hg, stride_b, stride_h, num_heads, D, _LD)
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, D], dtype)
    return gl.allocate_shared_memory(dtype, [_HEADS, D], layout, rows)


@gluon.jit(do_not_specialize=["num_splits", "num_blocks"])
def gluon_decode_split_kernel(
    split,
    k_inv_gs,
    k_scales,  # (gs_k, 1 / gs_k, 1 / (6 gs_k)): K quantized on read with V_OWN
    v_scales,  # (gs_v, 1 / gs_v, 1 / (6 gs_v)): the open nvfp4 V block (V_TAIL)
    p_scales,  # (gs_p, 1 / gs_p, 1 / (6 gs_p))
    out_scale,  # gs_p * gs_v
    num_splits,
    num_blocks,
    SHAPE: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    Q_SCALED: gl.constexpr,
    K_FMT: gl.constexpr,
    KV_FP8: gl.constexpr,
    V_SEP: gl.constexpr,
    V_TAIL: gl.constexpr,
    V_EXACT: gl.constexpr,
    V_OWN: gl.constexpr,
    K_EXACT: gl.constexpr,
    V_FMT: gl.constexpr,
    K_DYN: gl.constexpr,
    P_FMT: gl.constexpr,
    MULTI_SPLIT: gl.constexpr,
):
    """Stage 1: one (head group, split, request).

    Shapes as ``triton_kernels.decode_split_kernel``: q ``[B, H, D1]`` + ``[B, H, D2]``,
    cache rows ``D1 + D2`` wide, out ``[B, H, D1]`` and lse ``[B, H]`` (one split) or
    workspace acc ``[B, num_splits, H, D1]`` and ``(m, l)`` ``[B, num_splits, H, 2]``.
    Recipes: ``Q_SCALED``: q is q̂ (factored, by ``decode_q_kernel``) with its global
    scales ``qgs [B, H]``; ``K_FMT``: K's format (0: the tiles are raw, so an infinite
    score becomes NaN); ``KV_FP8``: K̂ = V̂ (fp8, one static power-of-two global scale)
    quantized in place once the tile has landed; ``P_FMT`` 0, 1 (fp8) or 2 (nvfp4). ``split`` and
    ``SHAPE`` as the Triton split kernels' (``common.kernels.split_program``; ``cache =
    (kv_ptr,)``, ``BLOCK_H`` 64); ``num_splits`` a runtime argument, ``MULTI_SPLIT``
    (``num_splits > 1``) the epilogue, as theirs.

    ``V_SEP`` (``decode_shadow`` with a V̂ section, or K and V from different rows):
    ``cache = (k_ptr, v_ptr, raw_ptr, ks_ptr)`` with four (page, row) stride pairs: the
    K tiles (a float16 shadow's K̂ ``[.., 576]`` or the raw rows), the V tiles (its V̂
    ``[.., 512]``, or the raw rows), the raw cache and the dynamic K scales (``K_DYN``:
    float32, one a token, multiplied into S's columns). ``V_TAIL`` (nvfp4 V): the
    sequence's open 16-token block has no V̂ yet and is quantized here from the raw rows
    (``tail_v``; ``V_EXACT``: ``gs_v`` not a power of two).

    ``V_OWN`` (``decode`` on read, V quantized and not sharing K̂: nvfp4, K and V of
    different recipes): once a raw tile has landed, V̂ (``V_FMT``, ``v_scales``) goes to
    a ring of its own and K̂ (``K_FMT``, ``k_scales``, ``K_EXACT``) replaces the tile in
    place (``_qdq_tile_kv``), 32-token tiles as ``V_SEP``. ``V_OWN`` 2: whole blocks a
    thread; 3: K̂'s latent part into the V̂ ring first, S issued, V̂ in place over the raw
    tile while S runs, P V on it; 4: as 3 with K̂ of tile i + 1 under the P V MMA of tile i
    (3 and 4: K and q quantized, q̂ and K̂ float16).
    """
    qn_ptr, qp_ptr, qgs_ptr = split[0]
    ptrs = split[1]  # (kv_ptr,), or with V_SEP (k_ptr, v_ptr, raw_ptr, ks_ptr)
    k_ptr = ptrs[0]
    bt_ptr, seq_lens_ptr = split[2], split[3]
    out_ptr, lse_ptr = split[4]
    wacc_ptr, wml_ptr = split[5]
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h = split[6]
    strides = split[7]  # (page, row) of each cache pointer
    stride_bt_b, stride_bt_p = split[8]
    stride_sl = split[9]
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h = split[10]
    num_heads, capacity = split[11]
    score_scale = split[12]  # softmax_scale * log2(e), times K's static global scale
    D1: gl.constexpr = SHAPE[0]
    D2: gl.constexpr = SHAPE[1]
    PAGE: gl.constexpr = SHAPE[2]
    BLOCK_N: gl.constexpr = SHAPE[4]
    HEAD_GROUPS: gl.constexpr = SHAPE[5]
    SPLIT_ALIGN_: gl.constexpr = SHAPE[6]
    gl.static_assert(SHAPE[3] == _HEADS, "BLOCK_H: 64 heads a CTA (the wgmma M)")
    gl.static_assert(not (V_SEP and (OVERLAP or KV_FP8)), "V_SEP: the plain loop, no QDQ")
    gl.static_assert(not (V_OWN and (OVERLAP or KV_FP8 or V_SEP)), "V_OWN: the plain loop")
    gl.static_assert(V_OWN == 0 or V_OWN == 1 or V_OWN == 2, "V_OWN: 0, 1 or 2")
    gl.static_assert((not V_TAIL and not K_DYN) or V_SEP, "V_TAIL, K_DYN: shadow sections")
    gl.static_assert(PAGE % 16 == 0 or not V_TAIL, "PAGE: a multiple of 16 (V blocks)")
    dtype: gl.constexpr = k_ptr.dtype.element_ty  # the K tiles as stored
    mma: gl.constexpr = qn_ptr.dtype.element_ty  # q (or q̂) and K in the S MMA
    # S [64, BLOCK_N]: each warpgroup half of the tokens; O [64, D1]: half the features.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D1 // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

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
    # nvfp4 V: V̂ rows exist below the open block's start (hi is the sequence's end or a
    # multiple of SPLIT_ALIGN, so every block below it is complete or the open one)
    v_hi = (hi // 16) * 16 if V_TAIL else hi

    q1_smem = _q_rows_smem(qn_ptr, b, hg, stride_qn_b, stride_qn_h, num_heads, D1, mma)
    q2_smem = _q_rows_smem(qp_ptr, b, hg, stride_qp_b, stride_qp_h, num_heads, D2, mma)
    row_scale = gl.full([_HEADS], score_scale, gl.float32, row_s)
    if Q_SCALED:
        offs_hs = hg * _HEADS + gl.arange(0, _HEADS, row_s)
        row_scale *= gl.load(qgs_ptr + b * num_heads + offs_hs, mask=offs_hs < num_heads, other=1.0)
    RAW: gl.constexpr = (K_FMT == 0) or (not Q_SCALED)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], dtype)
    kpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
    kv_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], kv_layout)
    kpe_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kpe_layout)
    # the same buffers as the MMAs read them (K̂ = V̂ rewritten in place in their type)
    kv_mma = kv_ring._reinterpret(mma)
    kpe_mma = kpe_ring._reinterpret(mma)
    # V̂ tiles of their own with V_SEP (the P V MMA's B, in their stored type; so is P),
    # else V is the first D1 features of the K tile
    pv: gl.constexpr = ptrs[1].dtype.element_ty if V_SEP else (gl.float16 if V_OWN else mma)
    if V_SEP or V_OWN:
        vh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], pv)
        vh_ring = gl.allocate_shared_memory(pv, [STAGES, BLOCK_N, D1], vh_layout)
    else:
        vh_ring = kv_mma
    rings = (kv_ring, kpe_ring, vh_ring)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, BLOCK_N], pv)

    bt_row = bt_ptr + b * stride_bt_b
    # The block-table lookup runs one tile ahead of the copy issue (its latency hides
    # behind an iteration); n_bad: a row whose page lies outside the cache, any tile.
    rows_next, n_bad = _tile_rows(bt_row, lo, hi, stride_bt_p, num_blocks, PAGE, BLOCK_N)
    for j in gl.static_range(STAGES - 1):
        rows_next, bad = _advance(
            rings, ptrs, strides, rows_next, j, lo, hi, v_hi, bt_row, stride_bt_p,
            num_blocks, PAGE, BLOCK_N, STAGES, V_SEP,
        )  # fmt: skip
        n_bad |= bad

    m_i = gl.full([_HEADS], float("-inf"), gl.float32, row_s)
    # The denominators stay per element of S until the end: no cross-warpgroup sum per tile.
    l_el = gl.zeros([_HEADS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([_HEADS, D1], gl.float32, o_layout)
    offs_n = gl.arange(0, BLOCK_N, col_s)
    col_scale = gl.full([BLOCK_N], 1.0, gl.float32, col_s)

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
        p, alpha, m_i, l_el = _softmax_step(
            s, m_i, l_el, lo + offs_n < hi, row_scale, col_scale, RAW, False
        )
        p_ring.index(0).store(p_hat(p, p_scales, P_FMT).to(mma))
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
            p, alpha, m_i, l_el = _softmax_step(
                s, m_i, l_el, valid, row_scale, col_scale, RAW, False
            )
            p_ring.index((i + 1) % 2).store(p_hat(p, p_scales, P_FMT).to(mma))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            nxt = i + STAGES - 1  # into the buffer of tile i - 1: both warpgroups are past it
            rows_next, bad = _advance(
                rings, ptrs, strides, rows_next, nxt, lo, hi, v_hi, bt_row, stride_bt_p,
                num_blocks, PAGE, BLOCK_N, STAGES, V_SEP,
            )  # fmt: skip
            n_bad |= bad
    else:
        p_smem = gl.allocate_shared_memory(pv, [_HEADS, BLOCK_N], p_layout)
        for i in range(n_tiles):
            # Both warpgroups are done with tile i - 1 (its P V was waited for): free.
            gl.barrier()
            nxt = i + STAGES - 1
            rows_next, bad = _advance(
                rings, ptrs, strides, rows_next, nxt, lo, hi, v_hi, bt_row, stride_bt_p,
                num_blocks, PAGE, BLOCK_N, STAGES, V_SEP,
            )  # fmt: skip
            n_bad |= bad
            start = lo + i * BLOCK_N
            if K_DYN:  # issued before the wait: its latency hides behind the copies
                col_scale = _col_scales(
                    ptrs[3], strides, bt_row, start, hi, stride_bt_p, num_blocks, PAGE,
                    BLOCK_N, col_s,
                )  # fmt: skip
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
            if V_OWN:
                gl.barrier()  # every thread's copies have landed
                _qdq_tile_kv(
                    kv_ring.index(cur), kpe_ring.index(cur), kv_mma.index(cur),
                    kpe_mma.index(cur), vh_ring.index(cur), k_scales, v_scales, K_FMT,
                    K_EXACT, V_FMT, V_EXACT, V_OWN == 2,
                )  # fmt: skip
            if V_TAIL:  # noqa: SIM102 (a constexpr branch, then the tile holding the block)
                if (v_hi < hi) & (start <= v_hi) & (v_hi < start + BLOCK_N):
                    gl.barrier()  # every thread's copies (the open block's zero rows) landed
                    tail_v(
                        vh_ring.index(cur), ptrs[2], strides, bt_row, start, hi,
                        stride_bt_p, num_blocks, v_scales, PAGE, V_EXACT,
                    )  # fmt: skip
            fence_async_shared()
            gl.barrier()  # ... and every thread's
            s = _scores(q1_smem, q2_smem, kv_mma.index(cur), kpe_mma.index(cur), s_layout)
            s = warpgroup_mma_wait(0, deps=(s,))
            valid = (start + offs_n) < hi
            p, alpha, m_i, l_el = _softmax_step(
                s, m_i, l_el, valid, row_scale, col_scale, RAW, K_DYN
            )
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_smem.store(p_hat(p, p_scales, P_FMT).to(pv))
            fence_async_shared()
            gl.barrier()  # both halves of P are in shared memory
            acc = warpgroup_mma(p_smem, vh_ring.index(cur), acc, is_async=True)
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
        o, keep, l_safe = normalized(acc, l_o, poisoned, seq_len, out_scale)
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
