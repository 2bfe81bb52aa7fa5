"""Write-once quantized K/V shadow cache: the Triton kernels (docs/numerics.md "Formats and
scales").

The shadow holds, beside the raw latent cache and addressed by the same
``(page, slot)``, the *factored* quantized operands of every written token (the
QDQ'd value divided by its global scale, exact in 16 bits, docs/numerics.md "Formats and scales"):

- K̂ ``[D1 + D2]`` along the features, static or dynamic amax (then the token's
  float32 global scale beside it). Fixed once the token is written.
- V̂ ``[D1]`` along the tokens, static amax. fp8 V has no blocks: fixed once the
  token is written. nvfp4 V is blocked over 16 consecutive absolute positions,
  which (pages holding consecutive positions, page size a multiple of 16) are 16
  consecutive slots of one page: the block of slot ``s`` is ``s // 16``. Its
  V̂ is written once, when the block's last slot (``s % 16 == 15``) is written,
  from the raw cache (which then holds all 16 tokens). The open tail block of a
  sequence (fewer than 16 tokens) has no V̂ in the shadow: decode quantizes it
  on read from the raw cache, with zeros past the sequence's end, exactly as the
  on-read decode does. So the shadow never depends on a sequence length.

Kernels:

- ``shadow_update_kernel``: one program per new token: the raw row (as
  ``concat_and_cache_mla`` writes it), K̂ (and its scale), fp8 V̂.
- ``shadow_v_block_kernel``: one program per new token; the token that closes a
  16-token block re-reads the block's 16 raw rows and writes their nvfp4 V̂. A
  second launch, so the raw rows of the same step are visible.
- ``shadow_decode_split_kernel``: ``decode_split_kernel`` with K̂ and V̂ read from
  the shadow instead of quantized on read. Its loop runs the complete tiles only
  (no masks, no QDQ of K or V); the tile holding the sequence's end runs after
  it, reads K̂ and the complete blocks' V̂ from the shadow and quantizes only the
  open nvfp4 V block (16 raw rows) on read. Stage 0 (q̂) and stage 2 (merge) are
  ``ops.decode.triton_kernels``'s; prologue, scores, softmax step and epilogue ``common``'s.

Storage (``STORE``): 0, the 16-bit form: factored values as float16 (exact; a
cast to bfloat16 is exact too). 1, packed: nvfp4 as E2M1 codes (two per byte,
low nibble first) plus E4M3 block-scale bytes, fp8 as E4M3 bytes; decoded with
integer and float32 arithmetic (no fp8 casts: the interpreter rounds them wrongly).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_triton.common import qdq as dev
from mla_triton.common.kernels import (
    AXIS_FEATURES,
    AXIS_TOKENS,
    finish_split,
    fp8_latent,
    qdq_latent,
    qdq_p,
    scores,
    softmax_step,
    split_program,
    split_start,
    tile_pages,
)

# ---------------------------------------------------------------- packed codes


@triton.jit
def e4m3_encode(y):
    """The E4M3FN byte (int32 0..255) of a float32 ``y`` already on the E4M3 grid."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)  # subnormals: multiples of 2^-9 below 2^-6
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(y != y, 0x7F, code)  # NaN (E4M3FN has one NaN code, 0x7F, and its negative)
    return tl.where(y < 0, code | 0x80, code)


@triton.jit
def e4m3_decode(code):
    """float32 value of an E4M3FN byte (int32 0..255); integer and float32 arithmetic.

    ``0x7F`` and ``0xFF`` are NaN."""
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    a = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    a = tl.where((code & 0x7F) == 0x7F, float("nan"), a)
    return tl.where((code & 0x80) != 0, -a, a)


@triton.jit
def e2m1_encode(y):
    """The E2M1 nibble (int32 0..15, sign in bit 3) of a float32 ``y`` on the E2M1 grid."""
    a = tl.abs(y)
    big = 4 + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32) + (a >= 6.0).to(tl.int32)
    code = tl.where(a >= 2.0, big, (a * 2.0).to(tl.int32))
    return tl.where(y < 0, code | 8, code)


@triton.jit
def e2m1_decode(code):
    """float32 value of an E2M1 nibble (int32 0..15)."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    normal = (((e + 126) << 23).to(tl.float32, bitcast=True)) * (1.0 + 0.5 * m)
    a = tl.where(e == 0, 0.5 * m, normal)
    return tl.where((code & 8) != 0, -a, a)


@triton.jit
def _nvfp4_codes(
    x, gs, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr, EXACT: tl.constexpr
):
    """NVFP4 of float32 ``[ROWS, COLS]`` in blocks of 16 along ``AXIS`` (1: features, 0:
    tokens): (E2M1 values ``[ROWS, COLS]``, E4M3 block scales, the block axis reduced).

    The same rounding as ``qdq_device.nvfp4_qdq`` (the product of the two is its
    factored value); a zero block scale gives zero codes.
    """
    xb = dev.blocks(x, ROWS, COLS, AXIS)
    sb = dev.nvfp4_block_scale(dev.nan_max(tl.abs(xb), AXIS + 1), gs)
    mag = dev.e2m1_scaled(tl.abs(xb), tl.expand_dims(sb * gs, AXIS + 1), EXACT)
    mag = tl.where(tl.expand_dims(sb, AXIS + 1) == 0.0, 0.0, mag)
    return tl.reshape(tl.where(xb < 0, -mag, mag), (ROWS, COLS)), sb


@triton.jit
def _pack_nibbles(v, ROWS: tl.constexpr, COLS: tl.constexpr):
    """E2M1 values ``[ROWS, COLS]`` to bytes ``[ROWS, COLS // 2]`` (element 2i low nibble)."""
    lo, hi = tl.split(tl.reshape(e2m1_encode(v), (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _unpack_nibbles(b, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Bytes ``[ROWS, COLS // 2]`` to E2M1 values ``[ROWS, COLS]`` (float32)."""
    bi = b.to(tl.int32)
    return tl.reshape(tl.join(e2m1_decode(bi & 0xF), e2m1_decode(bi >> 4)), (ROWS, COLS))


# ---------------------------------------------------------------- cache update


@triton.jit
def _store_k(
    kh_ptr,
    rows,
    x,
    gs,
    ok,
    FMT: tl.constexpr,
    EXACT: tl.constexpr,
    HW_FP8: tl.constexpr,
    STORE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """K̂ (or fp8 V̂) of ``COLS`` features of ``ROWS`` tokens ``x [ROWS, COLS]`` into
    shadow ``rows``, per token along the features.

    ``gs``: a scalar or ``[ROWS, 1]``; ``ok [ROWS]``: the tokens to write. 16-bit:
    ``COLS`` float16 at element offset ``rows``. Packed (bytes): nvfp4 codes
    ``COLS // 2`` bytes then ``COLS // 16`` scale bytes; fp8 ``COLS`` bytes.
    """
    offs = tl.arange(0, COLS)[None, :]
    ptrs = kh_ptr + rows[:, None]
    if STORE == 0:  # compare-form nvfp4 (exact for any input; written once per token)
        if FMT == 1:
            y = fp8_latent(x, gs, 1.0 / gs, EXACT, HW_FP8)
        else:
            y = dev.nvfp4_qdq(x, gs, ROWS, COLS, AXIS_FEATURES, EXACT)
        tl.store(ptrs + offs, y.to(tl.float16), mask=ok[:, None] & (offs >= 0))
    elif FMT == 1:
        y = dev.e4m3_round(tl.math.div_rn(x, gs) if EXACT else x * (1.0 / gs))
        tl.store(ptrs + offs, e4m3_encode(y).to(tl.uint8), mask=ok[:, None] & (offs >= 0))
    else:
        codes, sb = _nvfp4_codes(x, gs, ROWS, COLS, AXIS_FEATURES, EXACT)
        half = tl.arange(0, COLS // 2)[None, :]
        tl.store(ptrs + half, _pack_nibbles(codes, ROWS, COLS), mask=ok[:, None] & (half >= 0))
        nb = tl.arange(0, COLS // 16)[None, :]
        sbytes = e4m3_encode(sb).to(tl.uint8)
        tl.store(ptrs + COLS // 2 + nb, sbytes, mask=ok[:, None] & (nb >= 0))


@triton.jit
def shadow_update_kernel(
    kvc_ptr,
    kpe_ptr,
    slot_ptr,
    cache,
    num_tokens,
    stride_kvc_t,
    stride_kpe_t,
    stride_slot,
    cache_strides,
    capacity,
    k_gs,
    v_gs,
    D1: tl.constexpr,
    D2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYN: tl.constexpr,
    K_EXACT: tl.constexpr,
    V_TOKEN: tl.constexpr,
    V_EXACT: tl.constexpr,
    STORE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """``BLOCK_T`` new tokens: raw rows, K̂ (and dynamic scales), fp8 V̂ (``V_TOKEN``).

    A token with ``slot`` outside ``[0, capacity)`` (or past ``num_tokens``) writes
    nothing. The raw row is ``kv_c ++ k_pe`` cast to the cache's dtype; K̂ and V̂ are computed from
    those cast values, as the on-read decode computes them from the cache. Shadow
    rows: K̂ at ``page * stride_kh_page + slot * stride_kh_row`` (16-bit: D1 + D2
    float16; packed: see ``_store_k``, the rope part after the latent part), the K
    scale float32, fp8 V̂ D1 values. ``cache = (kv_ptr, kh_ptr, ks_ptr, vh_ptr)`` and
    ``cache_strides``, their (page, row) strides, as the split kernel's (``split_program``).
    """
    tl.static_assert(PAGE % 16 == 0, "PAGE: a multiple of 16 (16-token V blocks in one page)")
    kv_ptr, kh_ptr, ks_ptr, vh_ptr = cache
    stride_kv_page, stride_kv_row, stride_kh_page, stride_kh_row = cache_strides[0:4]
    stride_ks_page, stride_ks_row, stride_vh_page, stride_vh_row = cache_strides[4:8]
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < capacity)
    s = tl.where(ok, slot, 0)
    page = s // PAGE
    off = s % PAGE
    offs_d1 = tl.arange(0, D1)[None, :]
    offs_d2 = tl.arange(0, D2)[None, :]
    m1 = ok[:, None] & (offs_d1 >= 0)
    m2 = ok[:, None] & (offs_d2 >= 0)
    in_dtype = kv_ptr.dtype.element_ty
    x1 = tl.load(kvc_ptr + t[:, None] * stride_kvc_t + offs_d1, mask=m1, other=0.0)
    x2 = tl.load(kpe_ptr + t[:, None] * stride_kpe_t + offs_d2, mask=m2, other=0.0)
    x1 = x1.to(in_dtype)
    x2 = x2.to(in_dtype)
    raw = kv_ptr + (page * stride_kv_page + off * stride_kv_row)[:, None]
    tl.store(raw + offs_d1, x1, mask=m1)
    tl.store(raw + D1 + offs_d2, x2, mask=m2)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)

    if K_FMT != 0:
        if K_DYN:  # amax over each token's D1 + D2 features, divided as the reference does
            gs_row = dev.dynamic_global_scale(x1f, x2f, K_FMT, 1)
            tl.store(ks_ptr + page * stride_ks_page + off * stride_ks_row, gs_row, mask=ok)
            gs = gs_row[:, None]
        else:
            gs = k_gs
        krow = page * stride_kh_page + off * stride_kh_row
        # the rope part follows the latent part (packed nvfp4: codes, then scales)
        rope = D1 // 2 + D1 // 16 if STORE == 1 and K_FMT == 2 else D1
        _store_k(kh_ptr, krow, x1f, gs, ok, K_FMT, K_EXACT, HW_FP8, STORE, BLOCK_T, D1)
        _store_k(kh_ptr, krow + rope, x2f, gs, ok, K_FMT, K_EXACT, HW_FP8, STORE, BLOCK_T, D2)

    if V_TOKEN:  # fp8 V: per element (as K̂ is), fixed once written
        vrow = page * stride_vh_page + off * stride_vh_row
        _store_k(vh_ptr, vrow, x1f, v_gs, ok, 1, V_EXACT, HW_FP8, STORE, BLOCK_T, D1)


@triton.jit
def shadow_v_block_kernel(
    slot_ptr,
    kv_ptr,
    vh_ptr,
    stride_slot,
    stride_kv_page,
    stride_kv_row,
    stride_vh_page,
    stride_vh_row,
    capacity,
    v_gs,
    D1: tl.constexpr,
    PAGE: tl.constexpr,
    V_EXACT: tl.constexpr,
    STORE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """nvfp4 V̂ of the 16-token block that new token ``t`` closes (``slot % 16 == 15``).

    Reads the block's 16 raw rows (slots ``slot - 15 .. slot`` of the page, written
    by this step's ``shadow_update_kernel`` or earlier steps) and writes their V̂:
    16-bit, ``D1`` float16 per row; packed, ``D1 // 2`` code bytes per row and the
    block's ``D1`` scale bytes spread over its rows, ``D1 // 16`` per row (row ``r``
    of the block holds the scales of features ``r * D1 // 16 ..``).
    """
    tl.static_assert(PAGE % 16 == 0, "PAGE: a multiple of 16 (16-token V blocks in one page)")
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    if (slot < 0) | (slot >= capacity) | (slot % 16 != 15):
        return
    closes = slot >= 0
    s = slot
    page = s // PAGE
    first = s % PAGE - 15
    r = tl.arange(0, 16).to(tl.int64)
    offs_d1 = tl.arange(0, D1)
    mask = closes & (r[:, None] >= 0) & (offs_d1[None, :] >= 0)
    rows = page * stride_kv_page + (first + r) * stride_kv_row
    x = tl.load(kv_ptr + rows[:, None] + offs_d1[None, :], mask=mask, other=0.0).to(tl.float32)
    vrows = page * stride_vh_page + (first + r) * stride_vh_row
    if STORE == 0:
        y = dev.nvfp4_qdq(x, v_gs, 16, D1, AXIS_TOKENS, V_EXACT)  # the compare form
        tl.store(vh_ptr + vrows[:, None] + offs_d1[None, :], y.to(tl.float16), mask=mask)
    else:
        codes, sb = _nvfp4_codes(x, v_gs, 16, D1, AXIS_TOKENS, V_EXACT)  # sb [1, D1]
        half = tl.arange(0, D1 // 2)
        hmask = closes & (r[:, None] >= 0) & (half[None, :] >= 0)
        tl.store(vh_ptr + vrows[:, None] + half[None, :], _pack_nibbles(codes, 16, D1), mask=hmask)
        sbytes = tl.reshape(e4m3_encode(sb), (16, D1 // 16)).to(tl.uint8)
        nb = tl.arange(0, D1 // 16)
        smask = closes & (r[:, None] >= 0) & (nb[None, :] >= 0)
        tl.store(vh_ptr + vrows[:, None] + D1 // 2 + nb[None, :], sbytes, mask=smask)


# ---------------------------------------------------------------- decode


@triton.jit
def _load_rows(ptrs, valid, other, FULL: tl.constexpr):
    """``ptrs [N, C]``; ``FULL``: every row exists, no mask; else rows ``valid [N]``, ``other``."""
    if FULL:  # noqa: SIM108 (a constexpr branch: the masked load is not traced)
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=valid[:, None], other=other)
    return x


@triton.jit
def _load_elements(ptr, row, valid, STORE: tl.constexpr, COLS: tl.constexpr, FULL: tl.constexpr):
    """``COLS`` factored values per shadow row, one stored element each: float16 as
    stored (16-bit storage), or E4M3 bytes decoded to float32 (packed fp8)."""
    offs = tl.arange(0, COLS)
    if STORE == 0:
        y = _load_rows(ptr + row[:, None] + offs[None, :], valid, 0.0, FULL)
    else:
        b = _load_rows(ptr + row[:, None] + offs[None, :], valid, 0, FULL)
        y = e4m3_decode(b.to(tl.int32))
    return y


@triton.jit
def _load_packed_nvfp4(
    ptr, row, valid, COLS: tl.constexpr, BLOCK_N: tl.constexpr, FULL: tl.constexpr
):
    """A packed nvfp4 section of shadow rows: (E2M1 values ``[BLOCK_N, COLS]``, float32
    scales ``[BLOCK_N, COLS // 16]`` decoded from the ``COLS // 16`` E4M3 bytes after the
    ``COLS // 2`` code bytes). K̂ rows hold their own block scales; V̂ rows 1/16 of
    their block's."""
    half = tl.arange(0, COLS // 2)
    b = _load_rows(ptr + row[:, None] + half[None, :], valid, 0, FULL)
    nb = tl.arange(0, COLS // 16)
    sc = _load_rows(ptr + row[:, None] + COLS // 2 + nb[None, :], valid, 0, FULL)
    sb = e4m3_decode(sc.to(tl.int32))
    return _unpack_nibbles(b, BLOCK_N, COLS), sb


@triton.jit
def _load_hat(
    ptr,
    row,
    valid,
    FMT: tl.constexpr,
    STORE: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FULL: tl.constexpr,
    AXIS: tl.constexpr,
):
    """Factored K̂ (``AXIS_FEATURES``) or V̂ (``AXIS_TOKENS``: a tile starting at a
    multiple of 16, complete blocks) ``[BLOCK_N, COLS]`` from shadow rows: float32, or
    float16 as stored (16-bit storage)."""
    if STORE == 1 and FMT == 2:  # packed nvfp4: codes, then block scales
        codes, sb = _load_packed_nvfp4(ptr, row, valid, COLS, BLOCK_N, FULL)
        if AXIS == AXIS_FEATURES:  # each K̂ row holds its own blocks' scales
            codes = tl.reshape(codes, (BLOCK_N, COLS // 16, 16))
            y = tl.reshape(codes * tl.expand_dims(sb, 2), (BLOCK_N, COLS))
        else:  # each V̂ row holds 1/16 of its block's scales
            sb = tl.reshape(sb, (BLOCK_N // 16, 1, COLS))
            codes = tl.reshape(codes, (BLOCK_N // 16, 16, COLS))
            y = tl.reshape(codes * sb, (BLOCK_N, COLS))
    else:
        y = _load_elements(ptr, row, valid, STORE, COLS, FULL)
    return y


@triton.jit
def _tail_v(
    vh_ptr,
    kv_ptr,
    bt_row,
    page,
    slot,
    start,
    hi,
    strides,
    num_blocks,
    v_scales,
    D1: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_FMT: tl.constexpr,
    V_EXACT: tl.constexpr,
    STORE: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Factored nvfp4 V̂ ``[BLOCK_N, D1]`` float32 of the tile holding the sequence's end.

    ``hi`` is the sequence's length and ``start <= hi < start + BLOCK_N``. Complete
    16-token blocks (positions below ``ob = 16 * (hi // 16)``) come from the shadow;
    the open block (positions ``ob .. ob + 15``, raw rows below ``hi``, zeros past
    it) is quantized here from the raw cache: a float32 tile of 16 rows, not
    ``BLOCK_N``. Rows of blocks past ``hi`` are zeros. Equal to the on-read
    decode's V̂ of the tile (QDQ along the tokens is blockwise, blocks at absolute
    positions). ``strides``: as ``_shadow_tile``'s.
    """
    stride_kv_page, stride_kv_row, _, _, _, _, stride_vh_page, stride_vh_row, stride_bt_p = strides
    offs_n = tl.arange(0, BLOCK_N)
    ob = (hi // 16) * 16
    vrow = page * stride_vh_page + slot * stride_vh_row
    done = _load_hat(
        vh_ptr, vrow, (start + offs_n) < ob, V_FMT, STORE, D1, BLOCK_N, False, AXIS_TOKENS
    )
    # the open block: 16 slots of one page (the page size is a multiple of 16)
    offs_o = tl.arange(0, 16)
    offs_d1 = tl.arange(0, D1)
    if PAGE % BLOCK_N == 0:  # the tile, hence its open block, lies in one page
        opage = page
    else:  # (hi - 1: the table may end at hi when no block is open)
        opage = tl.load(bt_row + (tl.minimum(ob, hi - 1) // PAGE) * stride_bt_p).to(tl.int64)
        # an id outside the cache was flagged by tile_pages (a token of this tile has it)
        opage = tl.where((opage < 0) | (opage >= num_blocks), 0, opage)
    orow = opage * stride_kv_page + ((ob % PAGE) + offs_o).to(tl.int64) * stride_kv_row
    omask = (ob + offs_o) < hi
    raw = tl.load(kv_ptr + orow[:, None] + offs_d1[None, :], mask=omask[:, None], other=0.0)
    vo = qdq_latent(raw.to(tl.float32), v_scales, V_FMT, V_EXACT, HW_FP8, 16, D1, AXIS_TOKENS)
    # put the open block in its place among the tile's BLOCK_N // 16 blocks
    first = start + 16 * tl.arange(0, BLOCK_N // 16)
    sel = tl.expand_dims(tl.expand_dims(first == ob, 1), 2)  # [BLOCK_N // 16, 1, 1]
    v3 = tl.reshape(done.to(tl.float32), (BLOCK_N // 16, 16, D1))
    v3 = tl.where(sel, tl.expand_dims(vo, 0), v3)
    return tl.reshape(v3, (BLOCK_N, D1))


@triton.jit
def _shadow_tile(
    q1,
    q2,
    row_scale,
    m_i,
    l_i,
    acc,
    ptrs,
    strides,
    bt_row,
    start,
    hi,
    num_blocks,
    v_scales,
    p_scales,
    SHAPE: tl.constexpr,
    RECIPE: tl.constexpr,
    FULL: tl.constexpr,
    V_ON_READ: tl.constexpr,
):
    """One tile of ``BLOCK_N`` tokens from ``start`` (a multiple of ``BLOCK_N``).

    ``ptrs = (kv_ptr, kh_ptr, ks_ptr, vh_ptr)``; ``strides``: their (page, row)
    strides in that order, then the block table's ``stride_bt_p``; ``SHAPE = (D1, D2,
    PAGE, BLOCK_H, BLOCK_N)``; ``RECIPE = (Q_SCALED, K_FMT, K_DYN, V_FMT, V_SRC,
    V_EXACT, P_FMT, PV_F16, STORE, HW_FP8)``, the kernel's constexprs.

    K̂ from the shadow (raw K for ``K_FMT == 0``); V from the raw cache (``V_SRC``
    0), the shadow's V section (1) or the first D1 features of K̂ (2: fp8 K and V
    with one scale). ``FULL``: every token of the tile is below ``hi`` (no masks,
    no -inf scores: the main loop). Otherwise the tile holds the sequence's end
    (``hi`` is its length): masked loads, and with ``V_ON_READ`` (nvfp4 V) the
    open block's V̂ is quantized on read (``_tail_v``). Returns ``(m_i, l_i, acc)``
    (``l_i`` NaN for a page outside the cache: see ``tile_pages``).
    """
    D1: tl.constexpr = SHAPE[0]
    D2: tl.constexpr = SHAPE[1]
    PAGE: tl.constexpr = SHAPE[2]
    BLOCK_H: tl.constexpr = SHAPE[3]
    BLOCK_N: tl.constexpr = SHAPE[4]
    Q_SCALED: tl.constexpr = RECIPE[0]
    K_FMT: tl.constexpr = RECIPE[1]
    K_DYN: tl.constexpr = RECIPE[2]
    V_FMT: tl.constexpr = RECIPE[3]
    V_SRC: tl.constexpr = RECIPE[4]
    V_EXACT: tl.constexpr = RECIPE[5]
    P_FMT: tl.constexpr = RECIPE[6]
    PV_F16: tl.constexpr = RECIPE[7]
    STORE: tl.constexpr = RECIPE[8]
    HW_FP8: tl.constexpr = RECIPE[9]
    kv_ptr, kh_ptr, ks_ptr, vh_ptr = ptrs
    stride_kv_page, stride_kv_row, stride_kh_page, stride_kh_row = strides[0:4]
    stride_ks_page, stride_ks_row, stride_vh_page, stride_vh_row, stride_bt_p = strides[4:9]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, D2)
    tok = start + offs_n
    valid = tok < hi
    page, slot, l_i = tile_pages(
        bt_row, start, tok, valid, stride_bt_p, num_blocks, l_i, PAGE, BLOCK_N, FULL
    )
    rows = page * stride_kv_page + slot * stride_kv_row
    qk_dtype = q1.dtype
    in_dtype = kv_ptr.dtype.element_ty
    pv_dtype = tl.float16 if PV_F16 else in_dtype
    if K_FMT == 0:
        k1 = _load_rows(kv_ptr + rows[:, None] + offs_d1[None, :], valid, 0.0, FULL)
        k2 = _load_rows(kv_ptr + rows[:, None] + D1 + offs_d2[None, :], valid, 0.0, FULL)
    else:
        krow = page * stride_kh_page + slot * stride_kh_row
        k1 = _load_hat(kh_ptr, krow, valid, K_FMT, STORE, D1, BLOCK_N, FULL, AXIS_FEATURES)
        k1 = k1.to(qk_dtype)
        # the rope part follows the latent part (packed nvfp4: codes, then scales)
        rope = D1 // 2 + D1 // 16 if STORE == 1 and K_FMT == 2 else D1
        k2 = _load_hat(kh_ptr, krow + rope, valid, K_FMT, STORE, D2, BLOCK_N, FULL, AXIS_FEATURES)
        k2 = k2.to(qk_dtype)
    RAW: tl.constexpr = K_FMT == 0 or not Q_SCALED  # an infinite score becomes NaN
    t = scores(q1, q2, k1, k2, row_scale, row_scale, valid, RAW, False, False)
    if K_DYN:  # each token's K global scale, beside its K̂
        ks_ptrs = ks_ptr + page * stride_ks_page + slot * stride_ks_row
        if FULL:  # noqa: SIM108 (a constexpr branch: the masked load is not traced)
            col_scale = tl.load(ks_ptrs)
        else:
            col_scale = tl.load(ks_ptrs, mask=valid, other=1.0)
        t = t * col_scale[None, :]
    if not FULL:
        t = tl.where(valid[None, :], t, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(m_i, l_i, t, row_scale, False, False)
    p = qdq_p(p, p_scales, P_FMT, HW_FP8, BLOCK_H, BLOCK_N)

    if V_SRC == 2:
        v = k1
    elif V_SRC == 0:
        v = _load_rows(kv_ptr + rows[:, None] + offs_d1[None, :], valid, 0.0, FULL)
    elif V_ON_READ:
        v = _tail_v(
            vh_ptr, kv_ptr, bt_row, page, slot, start, hi, strides, num_blocks, v_scales, D1,
            PAGE, BLOCK_N, V_FMT, V_EXACT, STORE, HW_FP8,
        ).to(pv_dtype)  # fmt: skip
    else:
        vrow = page * stride_vh_page + slot * stride_vh_row
        v = _load_hat(vh_ptr, vrow, valid, V_FMT, STORE, D1, BLOCK_N, FULL, AXIS_TOKENS)
        v = v.to(pv_dtype)
    acc = tl.dot(p.to(pv_dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


# fmt: off
@triton.jit(do_not_specialize=["num_splits", "num_blocks"])
def shadow_decode_split_kernel(
    split, v_scales, p_scales, out_scale, num_splits, num_blocks,  # out_scale: gs_p * gs_v
    MULTI_SPLIT: tl.constexpr,
    SHAPE: tl.constexpr,
    STORE: tl.constexpr,
    V_SRC: tl.constexpr,
    V_TAIL: tl.constexpr,
    TAIL_LOOP: tl.constexpr,
    Q_SCALED: tl.constexpr,
    K_FMT: tl.constexpr,
    K_DYN: tl.constexpr,
    V_FMT: tl.constexpr,
    V_EXACT: tl.constexpr,
    P_FMT: tl.constexpr,
    PV_F16: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    # fmt: on
    """Stage 1 over the shadow: one (head group, split, request), as ``decode_split_kernel``
    (``split`` with ``cache = (kv_ptr, kh_ptr, ks_ptr, vh_ptr)`` and their (page, row)
    strides; ``num_splits`` and ``num_blocks`` runtime arguments, not specialized).

    The split's tiles that end at or before the sequence's end run in the main
    loop (``_shadow_tile`` with ``FULL``: shadow reads only, no masks). The tile
    holding the end (at most one per request, since split bounds are multiples
    of ``SPLIT_ALIGN_``, itself a multiple of ``BLOCK_N``) runs after it, masked,
    and with ``V_TAIL`` (nvfp4 V) quantizes its open V block on read from the raw
    rows, zeros past the end. ``TAIL_LOOP``: that tile as a (pipelined) loop of
    0 or 1 iterations, else as one tile under an ``if`` (the wrapper picks the
    form that compiles with fewer spills; the bits are the same). Same tiles,
    same per-tile arithmetic and running maxima as on-read decode: bit-identical.
    """
    PAGE: tl.constexpr = SHAPE[2]
    BLOCK_N: tl.constexpr = SHAPE[4]
    tl.static_assert(PAGE % 16 == 0, "PAGE: a multiple of 16 (16-token V blocks in one page)")
    splits = num_splits if MULTI_SPLIT else 1  # a constant with one split
    prog = split_program(split, SHAPE, splits)
    seq_len, lo, hi = prog[3], prog[5], prog[6]
    full_hi = tl.maximum(tl.minimum(hi, (seq_len // BLOCK_N) * BLOCK_N), lo)
    heads, _, bt_row, q1, q2, row_scale, m_i, l_i, acc = split_start(split, prog, Q_SCALED, SHAPE)
    ptrs = split[1]  # (kv_ptr, kh_ptr, ks_ptr, vh_ptr)
    strides = split[7] + (split[8][1],)  # their (page, row) strides, then stride_bt_p
    RECIPE: tl.constexpr = (
        Q_SCALED, K_FMT, K_DYN, V_FMT, V_SRC, V_EXACT, P_FMT, PV_F16, STORE, HW_FP8
    )  # fmt: skip

    for start in range(lo, full_hi, BLOCK_N):  # complete tiles: shadow only, no masks
        m_i, l_i, acc = _shadow_tile(
            q1, q2, row_scale, m_i, l_i, acc, ptrs, strides, bt_row, start, hi, num_blocks,
            v_scales, p_scales, SHAPE, RECIPE, True, False,
        )  # fmt: skip
    if TAIL_LOOP:  # the tile holding the sequence's end: a loop of 0 or 1 tiles
        for tail in range(full_hi, hi, BLOCK_N):
            m_i, l_i, acc = _shadow_tile(
                q1, q2, row_scale, m_i, l_i, acc, ptrs, strides, bt_row, tail, hi, num_blocks,
                v_scales, p_scales, SHAPE, RECIPE, False, V_TAIL,
            )  # fmt: skip
    elif full_hi < hi:  # the tile holding the sequence's end, peeled off the loop
        m_i, l_i, acc = _shadow_tile(
            q1, q2, row_scale, m_i, l_i, acc, ptrs, strides, bt_row, full_hi, hi, num_blocks,
            v_scales, p_scales, SHAPE, RECIPE, False, V_TAIL,
        )  # fmt: skip

    finish_split(acc, m_i, l_i, prog, heads, split, out_scale, splits, SHAPE, MULTI_SPLIT)
