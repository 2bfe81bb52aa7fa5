"""Absorbed-MLA split-K decode for Hopper (sm90) in Gluon, warp-specialized (recipe none;
fp8 Q/K/P/V through the float16 shadow, V̂ = K̂; nvfp4 Q/K/P/V through its V̂ section, a V̂
ring beside the K̂ ring: ``gluon_decode_ws_kernel``'s last paragraphs).

The contract (split bounds, base-2 online softmax with an integer running maximum,
NaN rules, partial outputs) is ``triton_kernels.decode_split_kernel``'s, as in
``gluon_decode``; this kernel changes only the schedule, after FlashMLA's sm90 one.

Schedule (one CTA per (64 heads, split, request); three partitions of 4 warps)
------------------------------------------------------------------------------
- producer (a warpgroup): block-table lookup and ``cp.async`` of latent tile ``t``
  (``[N, 512]`` + ``[N, 64]``, ``N`` = ``BLOCK_N`` 64 or 32 tokens, rows past the split's
  end zero-filled) into ring slot ``t % STAGES`` (2 slots of 64 tokens, or 4 of 32: the
  same 144 KiB) once both math warpgroups released the slot's previous tile (``free``).
  ``CHUNKED``: each 64-feature chunk arrives on its own barrier (``landed``) by every
  copying thread's ``cp.async.mbarrier.arrive``, and the producer moves on to the next
  tile; else it waits for the tile and arrives once. One lookup per row: any page size.
  ``TMA`` (a page holds whole tiles): one lookup per tile, nine ``[N, 64]`` TMA boxes on
  an expect-tx barrier (a chunk's, ``CHUNKED``), and the producer moves on at once; the
  rows past the split's end are the page's real rows, which the tile's math warpgroup
  zeroes in V's columns after ``S_t`` (their scores are masked) and before P V.
- math warpgroup ``r`` (``r`` = 0: the default partition, 1: a worker) owns the
  tiles ``t`` with ``t % 2 == r`` and the output features ``[256 r, 256 r + 256)``.
  For its tile ``t`` it issues the other warpgroup's ``P_{t-1} V_{t-1}`` (its half of
  the features; P read from shared memory, published before tile ``t`` can start
  landing), then ``S_t = q K_tᵀ`` (``64 x N``, all N tokens, chunk by chunk as they
  land: S is computed once, by one warpgroup), runs the softmax of ``S_t`` from the
  running maximum after tile ``t - 1`` (the other warpgroup's, from shared memory),
  publishes ``P_t`` (into the slot's dead rope columns: K's last 64 features are not
  needed once ``S_t`` is done) and the new maximum (``pready``), and issues ``P_t V_t``
  from registers. So one warpgroup's softmax runs under the other's MMAs (FlashMLA's
  "seesaw"), the running maxima form one chain through the tiles in order, and every
  rescale is the exact power of two of the single-partition kernels: the accumulator and
  the per-warpgroup denominators see the same multiplications in the same order.
- Every wgmma is waited for before a loop's back edge (ptxas serializes the loop's
  wgmma otherwise, warning C7515).

Epilogue: the two warpgroups exchange their denominators (rescaled to the final
maximum) through shared memory (``done``: the producer adds the bad-page flags); each
writes its 256 features (one split: ``out`` and,
warpgroup 0, ``lse``; several: the float32 accumulator and ``(m, l)`` of the
workspace that ``common.splitk_kernels.decode_merge_kernel`` combines).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla_triton.common.kernels import split_program
from mla_triton.ops.decode.gluon_kernels import BLOCK_H as BLOCK_H  # 64 heads a CTA (wgmma M)
from mla_triton.ops.decode.gluon_kernels import LN2, normalized, p_hat, q_rows, tail_v

NUM_WARPS = 4
"""Warps of each partition (the default one is the kernel's ``num_warps``)."""
BLOCK_N = 64
"""Tokens per tile (by default; ``WsConfig.block_n``: 32 or 64)."""
STAGES = 2
"""Ring slots (by default; a 64-token tile is 72 KiB, q takes another 72 KiB;
``WsConfig.stages``: 4 slots of 32-token tiles hold as many bytes as 2 of 64)."""
_WARPS: gl.constexpr = gl.constexpr(NUM_WARPS)
_HEADS: gl.constexpr = gl.constexpr(BLOCK_H)
# copies: 16 bytes a thread, 8 threads along a 128-byte row segment, 4 rows a warp
_LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
_CH: gl.constexpr = gl.constexpr(64)  # features a chunk (128 bytes: one swizzle atom)
_NCH: gl.constexpr = gl.constexpr(512 // 64 + 1)  # chunks a tile: kv_c, then k_pe
_VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
# the open nvfp4 V block (``V_SEP``), [16, 128] pieces: a column (a block) in 16 lanes of a warp
_LD16: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [1, NUM_WARPS], [1, 0])


@gluon.jit
def _q_smem(q_ptr, b, hg, stride_b, stride_h, num_heads, D: gl.constexpr, dtype: gl.constexpr):
    """q rows of heads ``[64 hg, 64 hg + 64)`` (zeros past ``num_heads``), features
    ``[0, D)``, as a shared ``[1, 64, D]`` wgmma operand (indexed at run time)."""
    rows = q_rows(q_ptr, b, hg, stride_b, stride_h, num_heads, D, _LD)
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, D], dtype)
    smem = gl.allocate_shared_memory(dtype, [1, _HEADS, D], layout)
    smem.index(0).store(rows)
    return smem


@gluon.jit
def _producer(
    kv_ring, kpe_ring, landed, free, done, bad_smem, kv_ptr, bt_row, lo, hi, n_tiles,
    stride_bt_p, stride_kv_page, stride_kv_row, num_blocks, D1: gl.constexpr,
    D2: gl.constexpr, PAGE: gl.constexpr, CHUNKED: gl.constexpr, vsec=0,
    V_SEP: gl.constexpr = False,
):  # fmt: skip
    """Copy every tile of the split into its slot (``cp.async``, zero rows past ``hi``)
    once the slot is free. ``CHUNKED``: each 64-feature chunk arrives on its own barrier
    (``landed``, the copying threads' ``cp.async.mbarrier.arrive``) and the next tile is
    issued at once; else the tile is waited for and arrives on the slot's first barrier.
    At the end ``bad_smem [BLOCK_N]`` says, per row slot, whether a row used a
    block-table entry outside ``[0, num_blocks)`` (read from page 0 instead); then
    ``done``. ``V_SEP``: ``vsec = (vh_ring, v_ptr, stride_v_page, stride_v_row, v_hi)``,
    the tile's V̂ rows (the shadow's V̂ section, zeros at or past ``v_hi``) into the V̂
    slot in the same commit group, before the rope chunk (whose barrier covers it)."""
    ST: gl.constexpr = kv_ring.shape[0]
    N: gl.constexpr = kv_ring.shape[1]
    row_l: gl.constexpr = gl.SliceLayout(1, _LD)
    offs_c = gl.arange(0, _CH, gl.SliceLayout(0, _LD))
    offs_d2 = gl.arange(0, D2, gl.SliceLayout(0, _LD))
    n_bad = gl.zeros([N], gl.int32, row_l)
    for t in range(n_tiles):
        s = t % ST
        tok = lo + t * N + gl.arange(0, N, row_l)
        valid = tok < hi
        # the block-table lookup is issued before the wait: its latency hides under it
        page = gl.load(bt_row + (tok // PAGE) * stride_bt_p, mask=valid, other=0).to(gl.int64)
        if t >= ST:
            mbarrier.wait(free.index(s), ((t // ST) - 1) & 1)
        bad = valid & ((page < 0) | (page >= num_blocks))
        n_bad = n_bad | bad.to(gl.int32)
        page = gl.where(bad, 0, page)
        src = kv_ptr + (page * stride_kv_page + (tok % PAGE).to(gl.int64) * stride_kv_row)
        for c in gl.static_range(D1 // _CH):
            cp.async_copy_global_to_shared(
                kv_ring.index(s).slice(c * _CH, _CH, dim=1),
                src[:, None] + c * _CH + offs_c[None, :], mask=valid[:, None],
            )  # fmt: skip
            if CHUNKED:
                cp.mbarrier_arrive(landed.index(s * _NCH + c), increment_count=False)
        if V_SEP:
            vh_ring, v_ptr, stride_v_page, stride_v_row, v_hi = vsec
            v_src = v_ptr + (page * stride_v_page + (tok % PAGE).to(gl.int64) * stride_v_row)
            for c in gl.static_range(D1 // _CH):
                cp.async_copy_global_to_shared(
                    vh_ring.index(s).slice(c * _CH, _CH, dim=1),
                    v_src[:, None] + c * _CH + offs_c[None, :], mask=(tok < v_hi)[:, None],
                )  # fmt: skip
        cp.async_copy_global_to_shared(
            kpe_ring.index(s), src[:, None] + D1 + offs_d2[None, :], mask=valid[:, None]
        )
        if CHUNKED:
            cp.mbarrier_arrive(landed.index(s * _NCH + D1 // _CH), increment_count=False)
        cp.commit_group()
        if not CHUNKED:
            cp.wait_group(0)
            fence_async_shared()
            gl.barrier()  # every producer thread's copies have landed
            mbarrier.arrive(landed.index(s * _NCH))
    cp.wait_group(0)
    bad_smem.store(n_bad)
    gl.barrier()
    mbarrier.arrive(done)


# the packed nvfp4 shadow (``PACKED``): 32-bit words of eight E2M1 codes (element ``8 w + k``
# in bits ``4k..4k+3`` of word ``w``) and E4M3 block scales


@gluon.jit
def _e2m1_f16(nib):
    """E2M1 codes (int32 nibbles) as their float16 values (exact): magnitude ``m``
    0 and 1 are 0 and 0.5, ``m >= 2`` is ``2**(m // 2 - 1) * (1 + (m % 2) / 2)``."""
    m = nib & 7
    bits = gl.where(m < 2, m * 0x3800, (m << 9) + 0x3800) | ((nib & 8) << 12)
    return bits.to(gl.uint16).to(gl.float16, bitcast=True)


# the packed producer: a tile is four units of 16 rows (K̂'s rows
# 0-15 and 16-31, then V̂'s: a 16-row V̂ unit is one V block, its 512 scales in its own rows),
# each unit's packed bytes copied by ``cp.async`` into one of ``_PKB`` staging buffers two
# units ahead of its decode; the code words, a word a thread, whose eight float16 values it
# stores as one 16-byte piece of the tile
_PKU: gl.constexpr = gl.constexpr(16)  # rows a unit
_PKB: gl.constexpr = gl.constexpr(3)  # staging buffers: two units in flight, one decoded
_PK: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [2, 2, 8, 1], [NUM_WARPS, 1, 1, 1],
                                      [3, 2, 1, 0])  # fmt: skip
_PK_ROPE: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [4, 1, 8, 1], [NUM_WARPS, 1, 1, 1],
                                           [3, 2, 1, 0])  # fmt: skip
# the copies' [16, W] words, a row every 8 threads (one row index a thread: ptxas spills
# thread-index values the worker's entry computes for its partition): 32, 8 and 4 bytes a
# thread (the rope's scales, 16 bytes a row: 4 of the 8 threads)
_CP64: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
_CP16: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [NUM_WARPS, 1], [1, 0])
_CP8: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [NUM_WARPS, 1], [1, 0])
_CP4: gl.constexpr = _CP8
_FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a buffer's layout


@gluon.jit
def _pk_arange(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(0, n)`` along ``dim`` of a 4-D tensor of ``layout`` (size 1 along the others)."""
    if dim == 0:
        x = gl.arange(0, n, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return x[:, None, None, None]
    elif dim == 1:  # noqa: RET505  (static branches)
        x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return x[None, :, None, None]
    elif dim == 2:
        x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        return x[None, None, :, None]
    else:
        x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return x[None, None, None, :]


@gluon.jit
def _pk_values(words, scales, layout: gl.constexpr):
    """The ``[R, 8 A B]`` float16 factored values (exact) of code words ``[R, A, B]``
    (``SliceLayout(3, layout)``; word ``B a + b`` of a row) times their E4M3 block scales
    (uint8, broadcast to ``[R, A, B, 8]``)."""
    R: gl.constexpr = words.shape[0]
    A: gl.constexpr = words.shape[1]
    B: gl.constexpr = words.shape[2]
    nib = (words[:, :, :, None] >> (_pk_arange(8, 3, layout) * 4)) & 15
    scale = scales.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    return gl.reshape(_e2m1_f16(nib) * scale, [R, A * B * 8])


@gluon.jit
def _pku_base(ptr, entry, start, hi, num_blocks, stride_page, stride_row, PAGE: gl.constexpr):
    """The unit of tokens ``[start, start + 16)`` (one page: pages hold whole 16-token
    blocks): its first row (``ptr`` uint8, a section of the shadow) and whether its
    block-table ``entry`` is outside ``[0, num_blocks)`` (then page 0 is read; an entry
    from ``hi`` on is not looked up, and not bad)."""
    bad = (start < hi) & ((entry < 0) | (entry >= num_blocks))
    page = gl.where(bad, 0, entry).to(gl.int64)
    return ptr + (page * stride_page + (start % PAGE).to(gl.int64) * stride_row), bad


@gluon.jit
def _pku_copy(dst, base, start, bound, stride_row, B0: gl.constexpr, layout: gl.constexpr):
    """``cp.async`` of bytes ``[B0, B0 + 4 W)`` of the unit's rows (``base``: its first row)
    into the staging words ``dst [16, W]`` (int32), rows at or past ``bound`` zero."""
    R: gl.constexpr = dst.shape[0]
    W: gl.constexpr = dst.shape[1]
    r = gl.arange(0, R, gl.SliceLayout(1, layout))
    w = gl.arange(0, W, gl.SliceLayout(0, layout))
    rows = (base + B0 + r.to(gl.int64) * stride_row).to(gl.pointer_type(gl.int32))
    cp.async_copy_global_to_shared(dst, rows[:, None] + w[None, :],
                                   mask=((start + r) < bound)[:, None])  # fmt: skip


@gluon.jit
def _pku_issue(stage, j, ptr, entry, start, bound, geo, PAGE: gl.constexpr, V: gl.constexpr):
    """Copy unit ``j``'s packed bytes into staging buffer ``j % _PKB`` (one commit group;
    ``geo = (hi, num_blocks, stride_page, stride_row)``):
    K̂ (``V`` False; ``ptr`` its section): the 256 code bytes, then 64 (latent block scales
    and the rope's codes) and 16 (the rope's scales and padding); V̂: the 256 code bytes and
    the row's 32 of the block's scales. Rows at or past ``bound`` zero. Returns the page
    guard's flag (``_pku_base``)."""
    codes, ext, rope_sc = stage
    hi, num_blocks, stride_page, stride_row = geo
    b = j % _PKB
    base, bad = _pku_base(ptr, entry, start, hi, num_blocks, stride_page, stride_row, PAGE)
    _pku_copy(codes.index(b), base, start, bound, stride_row, 0, _CP64)
    if V:  # the block's scales, row by row: the first 128 words of ``ext``
        _pku_copy(ext.index(b).reshape([2 * _PKU, 8]).slice(0, _PKU), base, start, bound,
                  stride_row, 256, _CP8)  # fmt: skip
    else:
        _pku_copy(ext.index(b), base, start, bound, stride_row, 256, _CP16)
        _pku_copy(rope_sc.index(b), base, start, bound, stride_row, 320, _CP4)
    cp.commit_group()
    return bad


@gluon.jit
def _pku_k(kv, kpe, stage, j):
    """Decode staged K̂ unit ``j`` into ``kv [16, 512]`` and ``kpe [16, 64]`` (rows of the
    slot): 128 latent features at a time, each word's block scale (one a 16 features: a
    word pair) a byte of the row's scale words."""
    codes, ext, rope_sc = stage
    b = j % _PKB
    words = codes.index(b).reshape([_PKU, 8, 8])
    extra = ext.index(b)
    shift = (_pk_arange(8, 2, _PK) // 2) * 8
    for c in gl.static_range(4):
        w = words.slice(2 * c, 2, dim=1).load(gl.SliceLayout(3, _PK))
        sw = extra.slice(2 * c, 2, dim=1).load(gl.SliceLayout(2, gl.SliceLayout(3, _PK)))
        sc = ((sw[:, :, None, None] >> shift) & 255).to(gl.uint8)
        kv.slice(128 * c, 128, dim=1).store(_pk_values(w, sc, _PK))
    rw = extra.slice(8, 8, dim=1).load(gl.SliceLayout(1, gl.SliceLayout(3, _PK_ROPE)))
    rs = rope_sc.index(b).slice(0, 1, dim=1).load(gl.SliceLayout(2, gl.SliceLayout(3, _PK_ROPE)))
    sc = (rs[:, :, None, None] >> ((_pk_arange(8, 2, _PK_ROPE) // 2) * 8)) & 255
    kpe.store(_pk_values(rw[:, None, :], sc.to(gl.uint8), _PK_ROPE))


@gluon.jit
def _pku_v(vh, stage, j):
    """Decode staged V̂ unit ``j`` (one 16-token V block) into ``vh [16, 512]``: feature
    ``f``'s scale is byte ``f`` of the block's 512 (its rows' 32 bytes in row order), so
    the 128 scales of a chunk are 32 staged words every row of the unit reads (two
    words a code word)."""
    codes, ext, _rope_sc = stage
    b = j % _PKB
    words = codes.index(b).reshape([_PKU, 8, 8])
    # chunk c's 128 scales: staged words [32 c, 32 c + 32) as (1, a, b, word of 8)
    scales = ext.index(b).reshape([8, 2, 8, 2])
    k = _pk_arange(8, 3, _PK)
    for c in gl.static_range(4):
        w = words.slice(2 * c, 2, dim=1).load(gl.SliceLayout(3, _PK))
        lo = scales.slice(c, 1, dim=0).slice(0, 1, dim=3).load(_PK)
        hi = scales.slice(c, 1, dim=0).slice(1, 1, dim=3).load(_PK)
        sc = (gl.where(k < 4, lo, hi) >> ((k % 4) * 8)) & 255
        vh.slice(128 * c, 128, dim=1).store(_pk_values(w, sc.to(gl.uint8), _PK))


@gluon.jit
def _producer_packed(
    kv_ring, kpe_ring, vh_ring, landed, free, done, bad_smem, stage, k_ptr, v_ptr, bt_row, lo,
    hi, v_hi, n_tiles, stride_bt_p, stride_page, stride_row, num_blocks, PAGE: gl.constexpr,
):  # fmt: skip
    """``_producer`` for the packed nvfp4 shadow (``PACKED``; ``k_ptr``, ``v_ptr``: its K̂
    and V̂ sections, uint8, one (page, row) stride pair in bytes), decoding its codes and
    block scales (``_pk_values``: exact, the ``fp16`` storage's values) into the slots'
    float16 K̂ and V̂ tiles, with the global loads in flight ahead of the decode: a tile is
    four units of 16 rows (its K̂ halves, then its V̂ halves), ``stage = (codes, ext,
    rope_sc)`` ``_PKB`` staging buffers (int32 ``[_PKB, 16, 64]``, ``[_PKB, 16, 16]``,
    ``[_PKB, 16, 4]``). Unit ``j``'s bytes (codes and scales: one copy group, one round trip)
    are issued while unit ``j - 2`` is decoded, the block-table entries of tile ``t + 1``
    at the start of tile ``t`` (used two units later); each unit is decoded from shared
    memory once its group has landed (``wait_group(1)`` and the producer's barrier, which
    also frees the buffer the next copy overwrites). The values, the slots, the zero rows
    (K̂ at or past ``hi``; V̂ at or past ``v_hi``, the open block's, which the tile's math
    warpgroup quantizes from the raw rows: the copies zero-fill them), K̂ on the slot's
    first barrier, V̂ on its second; at the end ``bad_smem`` and ``done``, as
    ``_producer``."""
    ST: gl.constexpr = kv_ring.shape[0]
    N: gl.constexpr = kv_ring.shape[1]
    D1: gl.constexpr = kv_ring.shape[2]
    D2: gl.constexpr = kpe_ring.shape[2]
    gl.static_assert((D1 == 512) & (D2 == 64), "PACKED: the staging holds 512 + 64 features")
    gl.static_assert(N == 2 * _PKU, "PACKED: 32-token tiles, two units a section")
    gl.static_assert(PAGE % _PKU == 0, "PACKED: a unit's rows in one page")
    n_bad = lo - lo  # an int32 0
    geo = (hi, num_blocks, stride_page, stride_row)
    e0 = gl.load(bt_row + (lo // PAGE) * stride_bt_p, mask=lo < hi, other=0)
    e1 = gl.load(bt_row + ((lo + _PKU) // PAGE) * stride_bt_p, mask=lo + _PKU < hi, other=0)
    n_bad |= _pku_issue(stage, 0, k_ptr, e0, lo, hi, geo, PAGE, False).to(gl.int32)
    n_bad |= _pku_issue(stage, 1, k_ptr, e1, lo + _PKU, hi, geo, PAGE, False).to(gl.int32)
    for t in range(n_tiles):
        s = t % ST
        j = 4 * t
        start = lo + t * N
        nx = start + N  # tile t + 1: its entries, used by its K̂ copies (steps 2 and 3)
        f0 = gl.load(bt_row + (nx // PAGE) * stride_bt_p, mask=nx < hi, other=0)
        f1 = gl.load(bt_row + ((nx + _PKU) // PAGE) * stride_bt_p, mask=nx + _PKU < hi,
                     other=0)  # fmt: skip
        kv = kv_ring.index(s)
        kpe = kpe_ring.index(s)
        vh = vh_ring.index(s)
        # K̂ rows 0-15 (V̂ rows 0-15 issued first: its loads in flight under the slot wait)
        cp.wait_group(1)
        gl.barrier()
        _pku_issue(stage, j + 2, v_ptr, e0, start, v_hi, geo, PAGE, True)
        if t >= ST:
            mbarrier.wait(free.index(s), ((t // ST) - 1) & 1)
        _pku_k(kv.slice(0, _PKU, dim=0), kpe.slice(0, _PKU, dim=0), stage, j)
        # K̂ rows 16-31, then K̂ lands
        cp.wait_group(1)
        gl.barrier()
        _pku_issue(stage, j + 3, v_ptr, e1, start + _PKU, v_hi, geo, PAGE, True)
        _pku_k(kv.slice(_PKU, _PKU, dim=0), kpe.slice(_PKU, _PKU, dim=0), stage, j + 1)
        fence_async_shared()
        gl.barrier()
        mbarrier.arrive(landed.index(s * _NCH))
        # V̂ rows 0-15 (tile t + 1's K̂ rows 0-15 issued)
        cp.wait_group(1)
        gl.barrier()
        n_bad |= _pku_issue(stage, j + 4, k_ptr, f0, nx, hi, geo, PAGE, False).to(gl.int32)
        _pku_v(vh.slice(0, _PKU, dim=0), stage, j + 2)
        # V̂ rows 16-31, then V̂ lands
        cp.wait_group(1)
        gl.barrier()
        n_bad |= _pku_issue(stage, j + 5, k_ptr, f1, nx + _PKU, hi, geo, PAGE, False).to(gl.int32)
        _pku_v(vh.slice(_PKU, _PKU, dim=0), stage, j + 3)
        fence_async_shared()
        gl.barrier()
        mbarrier.arrive(landed.index(s * _NCH + 1))
        e0 = f0
        e1 = f1
    cp.wait_group(0)
    bad_smem.store(gl.full([N], n_bad, gl.int32, gl.SliceLayout(1, _LD)))
    gl.barrier()
    mbarrier.arrive(done)


@gluon.jit
def _producer_tma(
    kv_ring, kpe_ring, landed, free, done, bad_smem, kv_desc, bt_row, lo, n_tiles, stride_bt_p,
    num_blocks, D1: gl.constexpr, PAGE: gl.constexpr, CHUNKED: gl.constexpr, vsec=0,
    V_SEP: gl.constexpr = False,
):  # fmt: skip
    """TMA variant of ``_producer`` (a page holds whole tiles: one block-table entry a
    tile): tile ``t`` is nine ``[BLOCK_N, 64]`` boxes of ``kv_desc`` (the cache as its
    ``[num_blocks * PAGE, 576]`` rows, so no box leaves it) at row ``page * PAGE + (start
    % PAGE)``, on the slot's first barrier (one expect-tx for the tile) or, ``CHUNKED``,
    each box on its chunk's barrier. Rows past ``hi`` are the page's real rows: the math
    warpgroup that owns the tile zeroes them (``_zero_tail``) before V is read. A page
    outside ``[0, num_blocks)`` is read as page 0 and flagged in ``bad_smem`` (every row
    slot: the flag is the tile's); then ``done``. ``V_SEP`` (not ``CHUNKED``): ``vsec =
    (vh_ring, v_desc)``, the tile's V̂ rows (eight boxes of the V̂ section's descriptor,
    ``[num_blocks * PAGE, 512]``, the same row) into the V̂ slot on the slot's second
    barrier (an expect-tx of their own, issued after K̂'s: S needs only K̂)."""
    ST: gl.constexpr = kv_ring.shape[0]
    N: gl.constexpr = kv_ring.shape[1]
    BOX: gl.constexpr = kv_desc.block_type.nbytes
    n_bad = lo - lo  # an int32 0
    for t in range(n_tiles):
        s = t % ST
        start = lo + t * N  # < hi <= capacity * PAGE: the table holds the tile's entry
        page = gl.load(bt_row + (start // PAGE) * stride_bt_p)  # the table's own type
        if t >= ST:
            mbarrier.wait(free.index(s), ((t // ST) - 1) & 1)
        bad = (page < 0) | (page >= num_blocks)
        n_bad = n_bad | bad.to(gl.int32)
        # int32 from here: the host checked num_blocks * PAGE < 2**31 (TMA coordinates)
        row = gl.where(bad, 0, page).to(gl.int32) * PAGE + start % PAGE
        if CHUNKED:
            for c in gl.static_range(D1 // _CH + 1):
                bar = landed.index(s * _NCH + c)
                mbarrier.expect(bar, BOX)
                if c < D1 // _CH:
                    dst = kv_ring.index(s).slice(c * _CH, _CH, dim=1)
                else:
                    dst = kpe_ring.index(s)
                tma.async_copy_global_to_shared(kv_desc, [row, c * _CH], bar, dst)
        else:
            bar = landed.index(s * _NCH)
            mbarrier.expect(bar, (D1 // _CH + 1) * BOX)
            for c in gl.static_range(D1 // _CH):
                tma.async_copy_global_to_shared(
                    kv_desc, [row, c * _CH], bar, kv_ring.index(s).slice(c * _CH, _CH, dim=1)
                )
            tma.async_copy_global_to_shared(kv_desc, [row, D1], bar, kpe_ring.index(s))
            if V_SEP:
                vh_ring, v_desc = vsec
                v_bar = landed.index(s * _NCH + 1)
                mbarrier.expect(v_bar, (D1 // _CH) * v_desc.block_type.nbytes)
                for c in gl.static_range(D1 // _CH):
                    tma.async_copy_global_to_shared(
                        v_desc, [row, c * _CH], v_bar, vh_ring.index(s).slice(c * _CH, _CH, dim=1)
                    )
    bad_smem.store(gl.full([N], n_bad, gl.int32, gl.SliceLayout(1, _LD)))
    gl.barrier()
    mbarrier.arrive(done)


@gluon.jit
def _zero_tail(kv_tile, n_valid):
    """Zero rows ``[n_valid, BLOCK_N)`` of a TMA-loaded tile's 512 V features (``kv_tile
    [BLOCK_N, 512]`` shared; their P is 0, but 0 times a non-finite row past the split's
    end would be NaN), one 64-feature chunk at a time."""
    N: gl.constexpr = kv_tile.shape[0]
    keep = (gl.arange(0, N, gl.SliceLayout(1, _LD)) < n_valid)[:, None]
    for c in gl.static_range(kv_tile.shape[1] // _CH):
        chunk = kv_tile.slice(c * _CH, _CH, dim=1)
        x = chunk.load(_LD)
        chunk.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _softmax(s, m_prev, valid, row_scale, RAW: gl.constexpr):
    """One tile of the base-2 online softmax with an integer running maximum, from the
    maximum after the previous tile: ``(P, alpha, m_new)``. ``RAW`` (q or K not
    quantized): an infinite score is NaN (the raw operands' rule of the Triton kernel);
    else the plain product (q̂ and K̂ bound every score), as ``gluon_decode``'s."""
    if RAW:  # noqa: SIM108  (static branches) the rounded product, NaN where s is not finite
        t = gl.fma(s, row_scale[:, None], s - s)
    else:
        t = s * row_scale[:, None]
    t = gl.where(valid[None, :], t, float("-inf"))
    m_new = gl.maximum(m_prev, gl.ceil(gl.max(t, axis=1)))
    return gl.exp2(t - m_new[:, None]), gl.exp2(m_prev - m_new), m_new


@gluon.jit
def _slot(t, ST: gl.constexpr, ROLE: gl.constexpr):
    """The ring slot of tile ``t`` (of warpgroup ``ROLE``'s parity): ``ROLE`` itself, a
    constant, with two slots; else ``t % ST``."""
    if ST == 2:
        return ROLE
    else:  # noqa: RET505  (a static branch: one return each)
        return t % ST


@gluon.jit
def _rescale(acc, alpha, row_o: gl.constexpr):
    """``acc * alpha`` by rows (``alpha [64]``: powers of two, at most 1)."""
    return acc * gl.convert_layout(alpha, row_o)[:, None]


@gluon.jit
def _pv_other(
    acc, l_i, m_i, kv_ring, kpe_ring, m_smem, pready, t, ROLE: gl.constexpr,
    row_s: gl.constexpr, row_o: gl.constexpr, p_sl: gl.constexpr,
):  # fmt: skip
    """Wait for the other warpgroup's P of tile ``t`` and its maximum, rescale, issue
    ``acc += P_t V_t`` (this warpgroup's features of ``kv_ring``'s slot: the latent
    tiles, or the V̂ ring with ``V_SEP``; async): ``(acc, l, m)``."""
    N: gl.constexpr = kv_ring.shape[1]
    s = _slot(t, kv_ring.shape[0], 1 - ROLE)  # the other warpgroup's tile
    mbarrier.wait(pready.index(1 - ROLE), (t // 2) & 1)
    fence_async_shared()
    m_new = m_smem.slice((1 - ROLE) * _HEADS, _HEADS).load(row_s)
    alpha = gl.exp2(m_i - m_new)
    acc = _rescale(acc, alpha, row_o)
    p_tile = kpe_ring.index(s)._reinterpret(kpe_ring.dtype, [_HEADS, N], p_sl)
    v_half = kv_ring.index(s).slice(ROLE * (acc.shape[1]), acc.shape[1], dim=1)
    acc = warpgroup_mma(p_tile, v_half, acc, is_async=True)
    return acc, l_i * alpha, m_new


@gluon.jit
def _opaque(x):
    """``x`` (an int32 scalar) through an identity the compiler cannot see through."""
    return gl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _release_other(acc, free, t, ST: gl.constexpr, ROLE: gl.constexpr):
    """Wait for ``P_{t-1} V_{t-1}`` (the group before S's first; S stays in flight) and
    release tile ``t - 1``'s slot: tile ``t + ST - 1`` can start landing under ``S_t``."""
    acc = warpgroup_mma_wait(1, deps=(acc,))
    gl.barrier()
    mbarrier.arrive(free.index(_slot(t - 1, ST, 1 - ROLE)))
    return acc


@gluon.jit
def _own_tile(
    acc, l_i, m_i, q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, landed, pready, free, t, lo,
    hi, row_scale, quant, ROLE: gl.constexpr, HAS_PREV: gl.constexpr, CHUNKED: gl.constexpr,
    TMA: gl.constexpr, EARLY_S: gl.constexpr, QUANT: gl.constexpr,
):  # fmt: skip
    """This warpgroup's tile ``t``: the other warpgroup's ``P_{t-1} V_{t-1}``
    (``HAS_PREV``; its P is published before tile ``t`` can start landing; that slot is
    released once it is done, under ``S_t``), ``S_t`` (``CHUNKED``: each 64-feature chunk
    as soon as it has landed), the softmax, (``TMA``: the tail rows zeroed,
    ``_zero_tail``) ``P_t`` and the maximum published, ``P_t V_t`` from registers, the
    slot released. ``EARLY_S``: ``S_t`` is issued first, as soon as tile ``t`` has
    landed, so it runs under the other warpgroup's softmax of ``t - 1``; then ``P_{t-1}
    V_{t-1}``, which runs under this softmax (the other slot released after it). The
    same operations on ``acc`` and ``l`` in the same order. ``QUANT = (RAW, P_FMT, _,
    V_PAGE, PACKED)`` (``_softmax``'s rule; P̂ fp8 or nvfp4 for both P V, ``gluon_kernels.p_hat``
    with ``quant[1]``, the denominators summing the unquantized P; ``V_PAGE`` nonzero
    (``V_SEP``: the page size): P V reads the V̂ ring ``quant[2]``, into whose slot the
    sequence's open 16-token V block is quantized from the raw rows first, where
    ``_zero_tail`` stands, by ``gluon_kernels.tail_v`` with ``quant[3]``; with ``TMA``
    the V̂ tile's barrier is waited for there and its rows past the open block zeroed).
    Returns ``(acc, l, m)``."""
    HALF: gl.constexpr = acc.shape[1]
    ST: gl.constexpr = kv_ring.shape[0]
    N: gl.constexpr = kv_ring.shape[1]
    D1: gl.constexpr = kv_ring.shape[2]
    dtype: gl.constexpr = kv_ring.dtype
    o_layout: gl.constexpr = acc.type.layout
    s_layout: gl.constexpr = row_scale.type.layout.parent
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, N], dtype)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if QUANT[3] != 0:  # noqa: SIM108  (static) V_SEP: V̂ tiles of their own
        v_ring = quant[2]
    else:
        v_ring = kv_ring
    s = _slot(t, ST, ROLE)
    phase = (t // ST) & 1
    if HAS_PREV and not EARLY_S:
        acc, l_i, m_i = _pv_other(
            acc, l_i, m_i, v_ring, kpe_ring, m_smem, pready, t - 1, ROLE, row_s, row_o, p_sl,
        )  # fmt: skip
    # The slot as a value the compiler cannot fold: with a constant one, it hoists the
    # 72 wgmma descriptors of S out of the loop and spills them.
    slot = _opaque(t) % ST
    zero = _opaque(t) - t  # q's descriptors too (q1_smem, q2_smem: [1, 64, D])
    kv_tile = kv_ring.index(slot)
    sc = gl.zeros([_HEADS, N], gl.float32, s_layout)
    if CHUNKED:
        for c in gl.static_range(D1 // _CH):
            mbarrier.wait(landed.index(s * _NCH + c), phase)
            fence_async_shared()
            sc = warpgroup_mma(q1_smem.index(zero).slice(c * _CH, _CH, dim=1),
                               kv_tile.slice(c * _CH, _CH, dim=1).permute((1, 0)), sc,
                               use_acc=c > 0, is_async=True)  # fmt: skip
            if HAS_PREV and c == 0 and not EARLY_S:
                acc = _release_other(acc, free, t, ST, ROLE)
        mbarrier.wait(landed.index(s * _NCH + D1 // _CH), phase)
        fence_async_shared()
    else:
        mbarrier.wait(landed.index(s * _NCH), phase)
        fence_async_shared()
        sc = warpgroup_mma(q1_smem.index(zero), kv_tile.permute((1, 0)), sc, use_acc=False,
                           is_async=True)  # fmt: skip
        if HAS_PREV and not EARLY_S:
            acc = _release_other(acc, free, t, ST, ROLE)
    sc = warpgroup_mma(q2_smem.index(zero), kpe_ring.index(slot).permute((1, 0)), sc,
                       is_async=True)  # fmt: skip
    if HAS_PREV and EARLY_S:  # P_{t-1} V_{t-1} behind S_t; S_t waited for, it stays in flight
        acc, l_i, m_i = _pv_other(
            acc, l_i, m_i, v_ring, kpe_ring, m_smem, pready, t - 1, ROLE, row_s, row_o, p_sl,
        )  # fmt: skip
        sc = warpgroup_mma_wait(1, deps=(sc,))
    else:
        sc = warpgroup_mma_wait(0, deps=(sc,))
    offs_n = gl.arange(0, N, gl.SliceLayout(0, s_layout))
    p, alpha, m_i = _softmax(sc, m_i, (lo + t * N + offs_n) < hi, row_scale, QUANT[0])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if QUANT[1] != 0:  # noqa: SIM108  (static) P̂ feeds both P V, P the denominators
        p16 = p_hat(p, quant[1], QUANT[1]).to(dtype)
    else:
        p16 = p.to(dtype)
    if (TMA or QUANT[4]) and QUANT[3] != 0:  # V_SEP: the V̂ tile (its own barrier)
        mbarrier.wait(landed.index(s * _NCH + 1), phase)
        if TMA:  # rows past its blocks (PACKED: zeros already)
            v_end = (hi + 15) // 16 * 16 - lo - t * N  # the open block (if any): tail_v's
            if v_end < N:
                _zero_tail(v_ring.index(s), v_end)
        else:
            fence_async_shared()
    elif TMA:  # noqa: SIM102  (static: the tail tile's rows past the split are real rows)
        if lo + t * N + N > hi:
            _zero_tail(kv_ring.index(s), hi - lo - t * N)
    if QUANT[3] != 0:  # V_SEP: the sequence's open nvfp4 V block, if in this tile
        raw_ptr, strides, bt_row, stride_bt_p, num_blocks, v_scales = quant[3]
        v_hi = (hi // 16) * 16
        start = lo + t * N
        if (v_hi < hi) & (start <= v_hi) & (v_hi < start + N):
            tail_v(v_ring.index(s), raw_ptr, strides, bt_row, start, hi, stride_bt_p,
                    num_blocks, v_scales, QUANT[3], False, _LD16)  # fmt: skip
    # publish P_t (into the slot's rope columns, read by S_t only) and the maximum
    kpe_ring.index(s)._reinterpret(dtype, [_HEADS, N], p_sl).store(p16)
    m_smem.slice(ROLE * _HEADS, _HEADS).store(m_i)
    fence_async_shared()
    gl.barrier()
    mbarrier.arrive(pready.index(ROLE))
    if HAS_PREV and EARLY_S:  # P_{t-1} V_{t-1} done: release tile t - 1's slot
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.barrier()
        mbarrier.arrive(free.index(_slot(t - 1, ST, 1 - ROLE)))
    acc = _rescale(acc, alpha, row_o)
    v_half = v_ring.index(s).slice(ROLE * HALF, HALF, dim=1)
    acc = warpgroup_mma(gl.convert_layout(p16, p_op), v_half, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    gl.barrier()
    mbarrier.arrive(free.index(s))
    return acc, l_i, m_i


@gluon.jit
def _math(
    q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, l_smem, bad_smem, landed, pready, free, done,
    lo, hi, n_tiles, score_scale, quant, b, hg, num_heads, ROLE: gl.constexpr,
    D1: gl.constexpr, CHUNKED: gl.constexpr, TMA: gl.constexpr, EARLY_S: gl.constexpr,
    QUANT: gl.constexpr,
):  # fmt: skip
    """Math warpgroup ``ROLE``: its tiles' S and softmax, P V of every tile on its 256
    features (``quant``, ``QUANT``: ``_math_part``'s; ``Q_SCALED``: each row's q̂ global
    scale times ``score_scale``, as ``gluon_decode``'s). Returns ``(acc [64, 256], m [64],
    l [64], nonfinite [64], any bad row)``, ``l`` the sum of both warpgroups' denominators
    at the final maximum ``m``, ``nonfinite`` 0 or NaN (a row with a non-finite feature in
    either half)."""
    HALF: gl.constexpr = D1 // 2
    ST: gl.constexpr = kv_ring.shape[0]
    N: gl.constexpr = kv_ring.shape[1]
    dtype: gl.constexpr = kv_ring.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, N], dtype)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o_: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_scale = gl.full([_HEADS], score_scale, gl.float32, row_s)
    if QUANT[2]:  # Q_SCALED: q̂'s global scales qgs [B, H]
        offs_hs = hg * _HEADS + gl.arange(0, _HEADS, row_s)
        row_scale *= gl.load(quant[0] + b * num_heads + offs_hs, mask=offs_hs < num_heads,
                             other=1.0)  # fmt: skip
    m_i = gl.full([_HEADS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([_HEADS], gl.float32, row_s)
    acc = gl.zeros([_HEADS, HALF], gl.float32, o_layout)

    n_own = gl.maximum(n_tiles - ROLE + 1, 0) // 2
    first = 0
    if ROLE == 0:  # tile 0 has no predecessor: peeled
        if n_own > 0:
            acc, l_i, m_i = _own_tile(
                acc, l_i, m_i, q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, landed, pready, free,
                0, lo, hi, row_scale, quant, ROLE, False, CHUNKED, TMA, EARLY_S, QUANT,
            )  # fmt: skip
        first = 1
    for k in range(first, n_own):
        acc, l_i, m_i = _own_tile(
            acc, l_i, m_i, q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, landed, pready, free,
            2 * k + ROLE, lo, hi, row_scale, quant, ROLE, True, CHUNKED, TMA, EARLY_S, QUANT,
        )  # fmt: skip
    if QUANT[3] != 0:  # noqa: SIM108  (static) V_SEP: V̂ tiles of their own
        v_ring = quant[2]
    else:
        v_ring = kv_ring
    last = n_tiles - 1
    if (last >= 0) & (last % 2 != ROLE):  # the other warpgroup's last tile
        acc, l_i, m_i = _pv_other(
            acc, l_i, m_i, v_ring, kpe_ring, m_smem, pready, last, ROLE, row_s, row_o_, p_sl,
        )  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.barrier()
        mbarrier.arrive(free.index(_slot(last, ST, 1 - ROLE)))

    # both warpgroups' denominators at the final maximum (which both hold now), their
    # rows' non-finite flags (0, or NaN where a feature of the half is not finite) and
    # the producer's bad-row flags
    l_smem.slice(ROLE * _HEADS, _HEADS).store(l_i)
    row_sum = gl.sum(acc, axis=1)
    l_smem.slice((2 + ROLE) * _HEADS, _HEADS).store(row_sum - row_sum)
    gl.barrier()
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    l_i = l_smem.slice(0, _HEADS).load(row_s) + l_smem.slice(_HEADS, _HEADS).load(row_s)
    nonfinite = l_smem.slice(2 * _HEADS, _HEADS).load(row_o_) + l_smem.slice(
        3 * _HEADS, _HEADS
    ).load(row_o_)
    bad = gl.max(bad_smem.load(gl.SliceLayout(1, _LD)), axis=0) > 0
    return acc, m_i, l_i, nonfinite, bad


@gluon.jit
def _epilogue(
    acc, m_i, l_i, nonfinite, bad, out_ptr, lse_ptr, wacc_ptr, wml_ptr, b, hg, split,
    n_splits, lo, seq_len, poisoned, num_heads, stride_o_b, stride_o_h, stride_lse_b,
    stride_lse_h, out_scale, ROLE: gl.constexpr, D1: gl.constexpr, MULTI_SPLIT: gl.constexpr,
):  # fmt: skip
    """Write this warpgroup's 256 features (and, warpgroup 0, the LSE or ``(m, l)``)."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    HALF: gl.constexpr = D1 // 2
    l_i = gl.where(bad, float("nan"), l_i)
    m_o = gl.convert_layout(m_i, row_o)
    l_o = gl.convert_layout(l_i, row_o)
    offs_h = hg * _HEADS + gl.arange(0, _HEADS, row_o)
    h_mask = offs_h < num_heads
    offs_d = ROLE * HALF + gl.arange(0, HALF, gl.SliceLayout(0, o_layout))
    if not MULTI_SPLIT:
        l_o = gl.where(poisoned, float("nan"), l_o)
        o, keep, l_safe = normalized(acc, l_o, poisoned, seq_len, out_scale)
        o = o + nonfinite[:, None]  # a non-finite row is NaN in every feature (both halves)
        o_ptrs = out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
        if ROLE == 0:
            lse = gl.where(keep, (gl.log2(l_safe) + m_o) * LN2, float("-inf"))
            gl.store(lse_ptr + b * stride_lse_b + offs_h * stride_lse_h, lse, mask=h_mask)
    else:
        row = (b * n_splits + split) * num_heads + offs_h
        st_mask = h_mask & (lo < seq_len)
        gl.store(wacc_ptr + row[:, None] * D1 + offs_d[None, :], acc, mask=st_mask[:, None])
        if ROLE == 0:
            gl.store(wml_ptr + row * 2, m_o, mask=st_mask)
            gl.store(wml_ptr + row * 2 + 1, l_o, mask=st_mask)


@gluon.jit
def _math_part(
    args, ROLE: gl.constexpr, D1: gl.constexpr, MULTI_SPLIT: gl.constexpr,
    CHUNKED: gl.constexpr, TMA: gl.constexpr, EARLY_S: gl.constexpr, QUANT: gl.constexpr,
):  # fmt: skip
    """A math warpgroup: ``_math`` then ``_epilogue`` for its features (``args``: the
    kernel's shared buffers, barriers, bounds and output pointers, in this order, then
    ``quant``: 0 for recipe none, else ``(qgs_ptr, p_scales)``, with ``V_SEP`` then the
    V̂ ring and ``(raw_ptr, strides, bt_row, stride_bt_p, num_blocks, v_scales)`` of the
    open V block; ``QUANT = (RAW, P_FMT, Q_SCALED, V_PAGE, PACKED)``)."""
    (q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, l_smem, bad_smem, landed, pready, free, done,
     lo, hi, n_tiles, score_scale, out_ptr, lse_ptr, wacc_ptr, wml_ptr, b, hg, split,
     n_splits, seq_len, poisoned, num_heads, stride_o_b, stride_o_h, stride_lse_b,
     stride_lse_h, out_scale, quant) = args  # fmt: skip
    acc, m_i, l_i, nonfinite, bad = _math(
        q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, l_smem, bad_smem, landed, pready, free,
        done, lo, hi, n_tiles, score_scale, quant, b, hg, num_heads, ROLE, D1, CHUNKED, TMA,
        EARLY_S, QUANT,
    )  # fmt: skip
    _epilogue(
        acc, m_i, l_i, nonfinite, bad, out_ptr, lse_ptr, wacc_ptr, wml_ptr, b, hg, split,
        n_splits, lo, seq_len, poisoned, num_heads, stride_o_b, stride_o_h, stride_lse_b,
        stride_lse_h, out_scale, ROLE, D1, MULTI_SPLIT,
    )  # fmt: skip


@gluon.jit(do_not_specialize=["num_splits", "num_blocks"])
def gluon_decode_ws_kernel(
    split,
    out_scale,
    kv_desc,
    p_hat_scales,
    v_tail_scales,
    num_splits,
    num_blocks,
    SHAPE: gl.constexpr,
    MULTI_SPLIT: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    MATH_REGS: gl.constexpr,
    CHUNKED: gl.constexpr,
    STAGES: gl.constexpr,
    TMA: gl.constexpr,
    EARLY_S: gl.constexpr,
    Q_SCALED: gl.constexpr,
    K_FMT: gl.constexpr,
    P_FMT: gl.constexpr,
    V_SEP: gl.constexpr,
    PACKED: gl.constexpr,
):
    """Stage 1, warp-specialized: one (head group, split, request); recipe none, or fp8
    Q/K/P/V through the float16 shadow (V̂ = K̂).

    Arguments as ``gluon_kernels.gluon_decode_split_kernel``'s (``split``: the split
    kernels' tuple, ``common.kernels.split_program``; ``SHAPE`` with ``BLOCK_H`` 64 and
    ``BLOCK_N`` 32 or 64); ``PRODUCER_REGS`` / ``MATH_REGS``: the registers a thread of the
    producer / the worker math warpgroup asks for (``setmaxnreg``); ``CHUNKED``: S starts
    on each 64-feature chunk of a tile as it lands (one barrier a chunk), else on the
    whole tile; ``STAGES``: ring slots (even: a slot's tiles belong to one warpgroup);
    ``TMA``: tiles arrive by TMA through ``kv_desc`` (the cache's rows ``[num_blocks *
    PAGE, 576]`` in ``[BLOCK_N, 64]`` boxes; ``PAGE`` a multiple of ``BLOCK_N``), else by
    ``cp.async`` (``kv_desc`` None); ``EARLY_S``: a warpgroup issues ``S_t`` before it waits
    for the other's ``P_{t-1}`` (``_own_tile``).

    The shadow (``decode_shadow``): the cache is the shadow's float16 K̂ ``[.., 576]``
    (V̂ its first 512 features), q its float16 q̂ (``Q_SCALED``: global scales ``qgs``
    ``[B, H]``); ``K_FMT`` 1 (with ``Q_SCALED``: the plain score product, as
    ``gluon_decode``'s, else the raw rule); ``P_FMT`` 1: P̂ fp8 between the MMAs
    (``p_hat_scales = (gs_p, 1 / gs_p, 1 / (6 gs_p))``; None with ``P_FMT`` 0);
    ``out_scale = gs_p gs_v``. Recipe none: ``Q_SCALED`` False, ``K_FMT`` and ``P_FMT``
    0, the same code as before these arguments.

    ``V_SEP`` (nvfp4 V through the shadow; pages multiples of 16):
    ``split[1] = (k_ptr, v_ptr, raw_ptr, ks_ptr)`` with four (page, row) stride pairs, as
    ``gluon_decode``'s ``V_SEP``: the producer copies each tile's V̂ rows (the section,
    zeros from the sequence's open 16-token block on) into a V̂ ring of its own (``[STAGES,
    BLOCK_N, 512]``, float16; ``BLOCK_N`` 32 and two slots fit: 212992 bytes with q̂),
    the tile's owner quantizes the open block from the raw rows into its slot after
    ``S_t`` (``v_tail_scales = (gs_v, 1 / gs_v, 1 / (6 gs_v))``, a power of two), and both
    P V read the V̂ slot; ``P_FMT`` 2: P̂ nvfp4 in 16-token blocks. With ``TMA`` (whole
    tiles): ``kv_desc = (K̂ descriptor, V̂ descriptor)``, the V̂ tile on the slot's second
    barrier, its rows past the open block zeroed by the owner (``_zero_tail``) before
    ``tail_v``. None and False elsewhere (no code). ``PACKED`` (with ``V_SEP``, not
    ``TMA``): the shadow is the packed nvfp4 one (``split[1]``'s K̂ and V̂ pointers uint8, one
    stride pair for both, in bytes); the producer decodes its E2M1 codes and E4M3 block
    scales into the same float16 K̂ and V̂ tiles (``_producer_packed``, which keeps the
    next 16-row units' packed bytes in flight: ``cp.async`` into three staging buffers,
    16128 bytes of shared memory beside the rings), so the math warpgroups run unchanged
    and the outputs are the ``fp16`` storage's bit for bit.
    """
    qn_ptr, qp_ptr, qgs_ptr = split[0]
    if V_SEP:  # (K̂ tiles, V̂ section, raw rows, K scales) and their (page, row) strides
        kv_ptr, v_ptr, raw_ptr, _ks_ptr = split[1]
        stride_kv_page, stride_kv_row, stride_v_page, stride_v_row = split[7][:4]
    else:
        (kv_ptr,) = split[1]
        stride_kv_page, stride_kv_row = split[7]
    bt_ptr = split[2]
    out_ptr, lse_ptr = split[4]
    wacc_ptr, wml_ptr = split[5]
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h = split[6]
    stride_bt_b, stride_bt_p = split[8]
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h = split[10]
    num_heads, _capacity = split[11]
    score_scale = split[12]  # softmax_scale * log2(e)
    D1: gl.constexpr = SHAPE[0]
    D2: gl.constexpr = SHAPE[1]
    PAGE: gl.constexpr = SHAPE[2]
    N: gl.constexpr = SHAPE[4]
    gl.static_assert(SHAPE[3] == _HEADS, "BLOCK_H: 64 heads a CTA (the wgmma M)")
    gl.static_assert((N == 32) | (N == 64), "BLOCK_N: 32- or 64-token tiles")
    gl.static_assert(STAGES % 2 == 0, "STAGES: even (a slot's tiles are one warpgroup's)")
    gl.static_assert((not TMA) or (PAGE % N == 0), "TMA: a page holds whole tiles")
    gl.static_assert((P_FMT >= 0) and (P_FMT <= 2), "P_FMT: P none, fp8 or nvfp4")
    gl.static_assert((not V_SEP) or ((not (TMA and CHUNKED)) and (PAGE % 16 == 0)),
                     "V_SEP: whole-tile loads, pages of whole 16-token V blocks")  # fmt: skip
    gl.static_assert((not PACKED) or (V_SEP and not TMA and not CHUNKED),
                     "PACKED: a V̂ section decoded by the producer, whole tiles")  # fmt: skip
    # the tiles' type (PACKED: the decoded float16)
    dtype: gl.constexpr = gl.float16 if PACKED else kv_ptr.dtype.element_ty

    n_splits = num_splits if MULTI_SPLIT else 1  # a constant with one split
    hg, split_i, b, seq_len, poisoned, lo, hi = split_program(split, SHAPE, n_splits)
    n_tiles = gl.maximum(hi - lo + N - 1, 0) // N

    q1_smem = _q_smem(qn_ptr, b, hg, stride_qn_b, stride_qn_h, num_heads, D1, dtype)
    q2_smem = _q_smem(qp_ptr, b, hg, stride_qp_b, stride_qp_h, num_heads, D2, dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D1], dtype)
    kpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D2], dtype)
    kv_ring = gl.allocate_shared_memory(dtype, [STAGES, N, D1], kv_layout)
    kpe_ring = gl.allocate_shared_memory(dtype, [STAGES, N, D2], kpe_layout)
    if V_SEP:  # the V̂ ring (float16, as the K̂ tiles)
        gl.static_assert(PACKED or (v_ptr.dtype.element_ty == dtype),
                         "V_SEP: V̂ in the K̂ tiles' type")  # fmt: skip
        vh_ring = gl.allocate_shared_memory(dtype, [STAGES, N, D1], kv_layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [2 * _HEADS], _VEC)  # a warpgroup's last
    l_smem = gl.allocate_shared_memory(gl.float32, [4 * _HEADS], _VEC)
    bad_smem = gl.allocate_shared_memory(
        gl.int32, [N], _VEC, gl.zeros([N], gl.int32, gl.SliceLayout(1, _LD))
    )
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    landed = gl.allocate_shared_memory(gl.int64, [STAGES * _NCH, 1], bar_layout)
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # a warpgroup's P
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    for i in gl.static_range(STAGES):
        if i < 2:
            mbarrier.init(pready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # both math warpgroups
    for i in gl.static_range(STAGES * _NCH):  # chunked cp.async: every producer thread
        mbarrier.init(landed.index(i), count=_WARPS * 32 if CHUNKED and not TMA else 1)
    mbarrier.init(done, count=3)  # the three partitions
    fence_async_shared()
    gl.barrier()

    RAW: gl.constexpr = (K_FMT == 0) or (not Q_SCALED)
    QUANT: gl.constexpr = gl.constexpr((RAW, P_FMT, Q_SCALED, PAGE if V_SEP else 0,
                                        PACKED))  # fmt: skip
    if V_SEP:  # the V̂ ring, and what the open V block is quantized from
        tail = (raw_ptr, split[7], bt_ptr + b * stride_bt_b, stride_bt_p, num_blocks,
                v_tail_scales)  # fmt: skip
        quant = (qgs_ptr, p_hat_scales, vh_ring, tail)
        vsec = (vh_ring, v_ptr, stride_v_page, stride_v_row, (hi // 16) * 16)
    elif Q_SCALED or (P_FMT != 0):
        quant = (qgs_ptr, p_hat_scales)  # type: ignore[assignment]
        vsec = 0  # type: ignore[assignment]
    else:
        quant = 0  # type: ignore[assignment]  # a constexpr: nothing reaches the partitions
        vsec = 0  # type: ignore[assignment]
    math_args = (
        q1_smem, q2_smem, kv_ring, kpe_ring, m_smem, l_smem, bad_smem, landed, pready, free,
        done, lo, hi, n_tiles, score_scale, out_ptr, lse_ptr, wacc_ptr, wml_ptr, b, hg, split_i,
        n_splits, seq_len, poisoned, num_heads, stride_o_b, stride_o_h, stride_lse_b,
        stride_lse_h, out_scale, quant,
    )  # fmt: skip
    if TMA:
        if V_SEP:  # (K̂ tiles, V̂ section): a descriptor each, the same rows
            k_desc, v_desc = kv_desc
            vsec_tma = (vh_ring, v_desc)
        else:
            k_desc = kv_desc
            vsec_tma = 0  # type: ignore[assignment]
        gl.warp_specialize(
            [
                (_math_part, (math_args, 0, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_math_part, (math_args, 1, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_producer_tma, (
                    kv_ring, kpe_ring, landed, free, done, bad_smem, k_desc,
                    bt_ptr + b * stride_bt_b, lo, n_tiles, stride_bt_p, num_blocks, D1, PAGE,
                    CHUNKED, vsec_tma, V_SEP,
                )),
            ],
            [_WARPS, _WARPS],
            [MATH_REGS, PRODUCER_REGS],
        )  # fmt: skip
    elif PACKED:  # staging: two units of packed bytes in flight, one decoded
        stage = (
            gl.allocate_shared_memory(gl.int32, [_PKB, _PKU, 64], _FLAT),
            gl.allocate_shared_memory(gl.int32, [_PKB, _PKU, 16], _FLAT),
            gl.allocate_shared_memory(gl.int32, [_PKB, _PKU, 4], _FLAT),
        )
        gl.warp_specialize(
            [
                (_math_part, (math_args, 0, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_math_part, (math_args, 1, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_producer_packed, (
                    kv_ring, kpe_ring, vh_ring, landed, free, done, bad_smem, stage, kv_ptr,
                    v_ptr, bt_ptr + b * stride_bt_b, lo, hi, (hi // 16) * 16, n_tiles,
                    stride_bt_p, stride_kv_page, stride_kv_row, num_blocks, PAGE,
                )),
            ],
            [_WARPS, _WARPS],
            [MATH_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_math_part, (math_args, 0, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_math_part, (math_args, 1, D1, MULTI_SPLIT, CHUNKED, TMA, EARLY_S, QUANT)),
                (_producer, (
                    kv_ring, kpe_ring, landed, free, done, bad_smem, kv_ptr,
                    bt_ptr + b * stride_bt_b, lo, hi, n_tiles, stride_bt_p, stride_kv_page,
                    stride_kv_row, num_blocks, D1, D2, PAGE, CHUNKED, vsec, V_SEP,
                )),
            ],
            [_WARPS, _WARPS],
            [MATH_REGS, PRODUCER_REGS],
        )  # fmt: skip
