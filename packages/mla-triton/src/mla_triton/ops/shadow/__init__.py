"""Write-once quantized K/V shadow cache beside the raw latent cache (docs/design/shadow.md).

On-read decode (``mla_triton.decode``) quantizes every latent tile as K and as V
at every decode step, once per head group. With static K and V scales (or a
dynamic per-token K scale) a token's K̂ never changes once it is written, and the
V̂ of a complete 16-token block never changes once the block is full. This module
quantizes them once, at cache-write time, into a *shadow* cache that a decode
variant reads instead; both paths compute the same function (bitwise-equal
quantized operands; outputs equal up to float32 summation order).

Engine-agnostic API, plain tensors:

- ``shadow_layout(quant, storage=...)``: what a token's shadow row holds and its
  bytes (``ShadowLayout.token_bytes``); ``ShadowLayout.shape(num_blocks,
  page_size)`` and ``allocate_shadow`` give the uint8 tensor ``[num_blocks,
  page_size, token_bytes]``, addressed by the same ``(block, slot)`` as the raw
  cache: a block id names both, so prefix caching, swapping and preemption move
  the shadow with its raw block.
- ``update_cache(kv_c, k_pe, kv_cache, slot_mapping, shadow, quant=...)``: the
  inputs of vLLM's ``concat_and_cache_mla``; writes the raw rows exactly as it
  does and the shadow beside them.
- ``decode_shadow(q, kv_cache, shadow, block_table, seq_lens, ...)``: ``decode``
  reading K̂ and V̂ from the shadow.

Tail block: the nvfp4 V̂ of a 16-token block is written when its last slot is
written; a sequence's open tail block (1 to 15 tokens) has none, and decode
quantizes it on read from the raw rows, zeros past the sequence's end. The
shadow's contents thus never depend on a sequence length; decode needs nothing
but the raw cache, the shadow, the block table and ``seq_lens``. Requires pages
of a multiple of 16 slots holding consecutive positions (slot ``i`` of a
sequence's ``j``-th page is position ``j * page_size + i``), as paged engines do,
written in position order (docs/numerics.md "The shadow's write order").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any

import torch

from mla_formats import AttentionQuant, OperandQuant
from mla_triton.common import device as dev
from mla_triton.common.choice import forced
from mla_triton.common.replay import REPLAY, capacity, key_of, replayable
from mla_triton.common.splitk import (
    DecodeConfig,
    Operands,
    SplitFamily,
    block_h_for,
    check_call,
    operand,
    run_decode,
    split_key,
    tensor_arg,
)
from mla_triton.ops.decode import gluon_ws as ws
from mla_triton.ops.decode.dispatch import TABLE, Route, choose
from mla_triton.ops.decode.gluon import (
    SEPARATE_V_CONFIG,
    GluonDecodeConfig,
    GluonFacts,
    GluonRecipe,
    Unsupported,
    _GluonFamily,
    gluon_recipe,
    gluon_taken,
)
from mla_triton.ops.shadow.kernels import (
    shadow_decode_split_kernel,
    shadow_update_kernel,
    shadow_v_block_kernel,
)

__all__ = [
    "STORAGES",
    "ShadowLayout",
    "allocate_shadow",
    "decode_shadow",
    "gluon_shadow_recipe",
    "gluon_shadow_taken",
    "shadow_decode_config",
    "shadow_layout",
    "update_cache",
]

STORAGES: tuple[str, ...] = ("fp16", "packed")
_ALIGN = 16  # bytes: sections and token rows are 16-byte aligned
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_UPDATE_BLOCK_T = 16  # tokens per program of the update kernel


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _section_bytes(fmt: str, width: int, storage: str) -> int:
    if fmt == "none":
        return 0
    if storage == "fp16":
        return 2 * width
    if fmt == "fp8":
        return width
    return width // 2 + width // 16  # nvfp4: E2M1 codes, two per byte, and E4M3 block scales


@dataclass(frozen=True)
class ShadowLayout:
    """What one token's shadow row holds, at which byte offsets (all 16-byte aligned).

    Sections (absent ones have 0 bytes):

    - K̂ (``k_offset``, ``k_bytes``): the token's ``kv_lora_rank + rope_dim``
      factored K values; ``fp16`` storage: float16, latent then rope; ``packed``:
      nvfp4 as ``[latent codes (kv_lora_rank / 2 bytes, element 2i in the low
      nibble), latent block scales (kv_lora_rank / 16 E4M3 bytes), rope codes, rope
      scales]``, fp8 as E4M3 bytes.
    - K scale (``k_scale_offset``, 4 bytes): the float32 global scale of a dynamic K.
    - V̂ (``v_offset``, ``v_bytes``): ``kv_lora_rank`` factored V values; fp8: the
      token's own (E4M3 bytes when packed); nvfp4: written when the token's
      16-token block is complete (packed: the token's codes, then 1/16 of its
      block's scales: row ``r`` of a block holds those of features
      ``r * kv_lora_rank / 16`` onwards). Absent when V shares K̂ (``v_shared``:
      fp8 K and V with one static scale: V̂ is K̂'s first ``kv_lora_rank`` values).

    Factored values are the QDQ'd values divided by their global scale (docs/numerics.md "Formats
    and scales"),
    exact in float16 and bfloat16; global scales stay out of the shadow, so the
    layout records the K and V recipes (``k_quant``, ``v_quant``, amax included)
    it was made for: two layouts are equal only when their shadows hold the same
    values.
    """

    storage: str
    k_format: str
    k_dynamic: bool
    v_format: str
    v_shared: bool
    kv_lora_rank: int
    rope_dim: int
    k_offset: int
    k_bytes: int
    k_scale_offset: int
    k_scale_bytes: int
    v_offset: int
    v_bytes: int
    payload_bytes: int
    """Bytes of the sections without padding."""
    token_bytes: int
    """Bytes per token (the shadow's last dim): the sections, each 16-byte aligned."""
    k_quant: OperandQuant
    """The K recipe the shadow's K̂ is written with."""
    v_quant: OperandQuant
    """The V recipe the shadow's V̂ is written with."""

    def shape(self, num_blocks: int, page_size: int) -> tuple[int, int, int]:
        """The shadow tensor's shape ``(num_blocks, page_size, token_bytes)`` (uint8)."""
        return (num_blocks, page_size, self.token_bytes)

    def nbytes(self, num_blocks: int, page_size: int) -> int:
        """Bytes of a shadow for ``num_blocks`` pages of ``page_size`` tokens."""
        return num_blocks * page_size * self.token_bytes

    def views(
        self, shadow: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Typed views ``(k_hat, k_scale, v_hat)`` of a shadow (None: absent section).

        ``fp16``: k_hat ``[N, P, kv_lora_rank + rope_dim]`` float16, v_hat ``[N, P,
        kv_lora_rank]`` float16; ``packed``: uint8 byte ranges; k_scale ``[N, P, 1]``
        float32.
        """
        k = v = s = None
        wide = torch.float16 if self.storage == "fp16" else torch.uint8
        if self.k_bytes:
            k = shadow[..., self.k_offset : self.k_offset + self.k_bytes].view(wide)
        if self.k_scale_bytes:
            s = shadow[..., self.k_scale_offset : self.k_scale_offset + 4].view(torch.float32)
        if self.v_bytes:
            v = shadow[..., self.v_offset : self.v_offset + self.v_bytes].view(wide)
        return k, s, v


def _check_storage(storage: object) -> str:
    if storage not in STORAGES:
        raise ValueError(f"storage: expected one of {STORAGES}, got {storage!r}")
    assert isinstance(storage, str)
    return storage


def _check_quant(quant: object) -> AttentionQuant:
    if not isinstance(quant, AttentionQuant):
        raise ValueError(f"quant: expected mla_formats.AttentionQuant, got {type(quant).__name__}")
    return quant


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _v_shared(k: OperandQuant, v: OperandQuant) -> bool:
    return (
        k.format.name == "fp8"
        and v.format.name == "fp8"
        and not k.is_dynamic
        and k.global_scale() == v.global_scale()
    )


@lru_cache(maxsize=256)
def _make_layout(
    k: OperandQuant, v: OperandQuant, kv_lora_rank: int, rope_dim: int, storage: str
) -> ShadowLayout:
    shared = _v_shared(k, v)
    k_bytes = _section_bytes(k.format.name, kv_lora_rank, storage) + _section_bytes(
        k.format.name, rope_dim, storage
    )
    s_bytes = 4 if k.is_dynamic else 0
    v_bytes = 0 if shared else _section_bytes(v.format.name, kv_lora_rank, storage)
    k_off = 0
    v_off = _align(k_bytes)
    s_off = v_off + _align(v_bytes)
    total = _align(s_off + s_bytes)
    return ShadowLayout(
        storage=storage,
        k_format=k.format.name,
        k_dynamic=k.is_dynamic,
        v_format=v.format.name,
        v_shared=shared,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        k_offset=k_off,
        k_bytes=k_bytes,
        k_scale_offset=s_off,
        k_scale_bytes=s_bytes,
        v_offset=v_off,
        v_bytes=v_bytes,
        payload_bytes=k_bytes + s_bytes + v_bytes,
        token_bytes=total,
        k_quant=k,
        v_quant=v,
    )


def shadow_layout(
    quant: AttentionQuant,
    *,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    storage: str = "fp16",
) -> ShadowLayout:
    """The shadow layout for a recipe's K and V (q and p do not enter the shadow).

    Bytes per token (DeepSeek, 512 + 64; ``token_bytes``, 16-byte aligned):

    ======================  ========  ========
    K / V                   fp16      packed
    ======================  ========  ========
    nvfp4 / nvfp4           2176      624 (612 payload)
    fp8 / fp8 (one scale)   1152      576
    nvfp4 / fp8             2176      848
    dynamic K               +16       +16 (4 payload)
    ======================  ========  ========

    The raw bf16 latent is 1152 bytes per token.
    """
    q = _check_quant(quant)
    _positive_int(kv_lora_rank, "kv_lora_rank", 16)
    _positive_int(rope_dim, "rope_dim", 16)
    for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value}")
    return _make_layout(q.k, q.v, kv_lora_rank, rope_dim, _check_storage(storage))


# fmt: off
def allocate_shadow(
    num_blocks: int, page_size: int, quant: AttentionQuant, *, kv_lora_rank: int = 512,
    rope_dim: int = 64, storage: str = "fp16", device: torch.device | str | None = None,
) -> torch.Tensor:
    # fmt: on
    """A zeroed uint8 shadow ``[num_blocks, page_size, token_bytes]`` for ``quant``.

    An engine with its own allocator instead allocates ``shadow_layout(...).shape(...)``
    bytes (or a wider per-token row holding the raw latent too: any uint8 view with
    a contiguous last dim and 16-byte aligned strides works).
    """
    _positive_int(num_blocks, "num_blocks", 0)
    _positive_int(page_size, "page_size")
    try:
        where = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: not a torch device: {device!r} ({exc})") from None
    if where is not None and where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r}, but CUDA is not available on this machine")
    if page_size % 16:
        raise ValueError(f"page_size: expected a multiple of 16, got {page_size}")
    lay = shadow_layout(quant, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, storage=storage)
    shadow = torch.zeros(lay.shape(num_blocks, page_size), dtype=torch.uint8, device=device)
    _stamp(shadow, lay, "quant")
    return shadow


_STAMP = "_mla_shadow_layout"


def _stamps(shadow: torch.Tensor) -> dict[int, ShadowLayout]:
    """The layouts written into the memory ``shadow`` views, by start address: a dict
    on the tensor that owns the memory, so every view of one allocation that starts at the
    same address (``shadow.view(...)``, ``shadow[:n]``) shares its stamp, while views of
    one buffer at other addresses (an engine's per-layer shadows) keep their own."""
    owner = shadow
    while owner._base is not None:
        owner = owner._base
    stamps: dict[int, ShadowLayout] | None = getattr(owner, _STAMP, None)
    if stamps is None:
        stamps = {}
        setattr(owner, _STAMP, stamps)
    return stamps


def _stamp(shadow: torch.Tensor, lay: ShadowLayout, argument: str) -> None:
    """Record which layout (recipe) the shadow's contents follow (``_stamps``): no device
    sync. Called once every check of a writing call has passed."""
    _check_stamp(shadow, lay, argument)
    _stamps(shadow)[shadow.data_ptr()] = lay


def _check_stamp(shadow: torch.Tensor, lay: ShadowLayout, argument: str) -> None:
    """Refuse a tensor stamped with another layout, naming ``argument`` (the recipe)."""
    held = _stamps(shadow).get(shadow.data_ptr())
    if held is None or held is lay:  # the layouts are cached: the usual case, no comparison
        return
    if held != lay and (held.kv_lora_rank, held.rope_dim) != (
        lay.kv_lora_rank, lay.rope_dim,
    ):  # fmt: skip
        raise ValueError(
            f"shadow: allocated for kv_lora_rank {held.kv_lora_rank} and rope_dim "
            f"{held.rope_dim}; this call has kv_lora_rank {lay.kv_lora_rank} and rope_dim "
            f"{lay.rope_dim} (allocate the shadow with the model's widths)"
        )
    if held != lay:
        raise ValueError(
            f"{argument}: this shadow holds K̂/V̂ written for k={held.k_quant}, "
            f"v={held.v_quant}, storage {held.storage!r}; got k={lay.k_quant}, "
            f"v={lay.v_quant}, storage {lay.storage!r} (the shadow must be read with "
            "the recipe it was written with)"
        )


# ---------------------------------------------------------------------------- checks


def _check_shadow(
    shadow: object, kv_cache: torch.Tensor, lay: ShadowLayout
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    t = tensor_arg(shadow, "shadow", 3)
    want = lay.shape(kv_cache.shape[0], kv_cache.shape[1])
    if t.dtype != torch.uint8 or tuple(t.shape) != want:
        raise ValueError(
            f"shadow: expected uint8 {want} (shadow_layout(...).shape for the cache's "
            f"blocks and page size; {lay.token_bytes} bytes per token for this recipe and "
            f"storage {lay.storage!r}), got {t.dtype} {tuple(t.shape)}"
        )
    if t.device != kv_cache.device:
        raise ValueError(f"shadow: expected device {kv_cache.device}, got {t.device}")
    if lay.token_bytes:
        if t.stride(2) != 1 or t.stride(0) % _ALIGN or t.stride(1) % _ALIGN:
            raise ValueError(
                f"shadow: expected a contiguous last dim and 16-byte aligned page and row "
                f"strides, got strides {tuple(t.stride())}"
            )
        if t.data_ptr() % _ALIGN:
            raise ValueError("shadow: expected a 16-byte aligned data pointer")
    _check_stamp(t, lay, "quant")
    k, s, v = lay.views(t)
    return t, k, s, v


def _check_cache(kv_cache: object, width: int) -> torch.Tensor:
    cache = tensor_arg(kv_cache, "kv_cache", 3)
    if cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache: expected float16 or bfloat16, got {cache.dtype}")
    if cache.shape[2] != width:
        raise ValueError(
            f"kv_cache: expected last dim {width} (kv_lora_rank + rope_dim), got {cache.shape[2]}"
        )
    if cache.shape[2] > 1 and cache.stride(2) != 1:
        raise ValueError(
            "kv_cache: the last dim must be contiguous (stride 1), got strides "
            f"{tuple(cache.stride())}"
        )
    if cache.shape[1] <= 0 or cache.shape[1] % 16:
        raise ValueError(
            f"kv_cache: page size (dim 1) must be a positive multiple of 16 (16-token V "
            f"blocks lie in one page), got {cache.shape[1]}"
        )
    return cache


_Views = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""A shadow's typed sections ``(k_hat, k_scale, v_hat)`` (``ShadowLayout.views``)."""


def _section_args(
    views: _Views, cache: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The split kernel's cache pointers ``(kv_ptr, kh_ptr, ks_ptr, vh_ptr)`` and their
    (page, row) strides, in that order (an absent section: the raw cache, never read,
    and zero strides)."""
    ptrs = [cache]
    strides = [cache.stride(0), cache.stride(1)]
    for view in views:
        ptrs.append(cache if view is None else view)
        strides += [0, 0] if view is None else [view.stride(0), view.stride(1)]
    return tuple(ptrs), tuple(strides)


# ---------------------------------------------------------------------------- update


def update_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    shadow: torch.Tensor,
    *,
    quant: AttentionQuant,
    storage: str = "fp16",
    check_values: bool | None = None,
) -> None:
    """Write new tokens into the raw latent cache and its quantized shadow.

    Args:
        kv_c: ``[T, kv_lora_rank]`` float16/bfloat16/float32, last dim contiguous
            (any row stride): the compressed latent of each new token.
        k_pe: ``[T, rope_dim]``, the same (squeeze vLLM's ``[T, 1, rope]`` first).
        kv_cache: the raw cache ``[num_blocks, page_size, kv_lora_rank + rope_dim]``
            float16/bfloat16, last dim contiguous, ``page_size`` a multiple of 16.
            Row ``slot`` gets ``kv_c ++ k_pe`` cast to its dtype, exactly as vLLM's
            ``concat_and_cache_mla`` (``kv_cache_dtype="auto"``) writes it.
        slot_mapping: int32/int64 ``[T']`` with ``T' <= T`` (tokens past ``T'`` are
            padding and ignored): token ``t`` goes to page ``slot // page_size``,
            slot ``slot % page_size``; ``-1`` skips the token, and so does (on the
            device, unchecked) any slot outside the cache. A slot may appear once per
            call: duplicates are refused when values are checked; unchecked, which
            of the tokens lands (raw row and shadow alike) is undefined.
        shadow: uint8 ``shadow_layout(quant, storage=storage).shape(num_blocks,
            page_size)``, same device (a strided view works, see ``allocate_shadow``).
            The shadow is stamped with the layout (recipe) written (through any view
            starting at its address); a later call or ``decode_shadow`` with another
            recipe on it raises ``ValueError`` (docs/numerics.md).
        quant: the recipe; only ``quant.k`` and ``quant.v`` are used, and they must
            be the ones decode passes.
        storage: ``"fp16"`` (16-bit factored values) or ``"packed"`` (4/8-bit codes).
        check_values: check slot_mapping on the host (a device sync) against the
            cache's capacity, for duplicates and for the write order below. None: only
            when it is a CPU tensor.

    Writes, per token, the raw row, K̂ (and its dynamic scale) and fp8 V̂; then, in
    a second launch, the nvfp4 V̂ of every 16-token block whose last slot
    (``slot % 16 == 15``) this call writes, from the block's 16 raw rows. Two
    launches, no host sync, no allocation: CUDA-graph capturable.

    Write order (docs/numerics.md "The shadow's write order"): tokens reach a page in
    position order, as an engine's append-only pages do, so a block's last slot is
    written after, or with, its other 15; a slot rewritten (a speculative rollback, a
    page given to another request) is followed by its block's later slots before
    decode counts the block as complete. Checked, one call's entries of
    ``slot_mapping`` that write one page (``-1`` aside, in their order in
    ``slot_mapping``) must be consecutive slots, increasing; the first entry that is not
    raises ``ValueError`` naming ``slot_mapping``, the entry, its slot and position,
    before anything is written. What earlier calls wrote is not checked: the shadow
    keeps no record of it.

    Non-finite input is written as is; its K̂ and V̂ are NaN (with the token's nvfp4
    block, or its row for a dynamic K scale), never saturated (docs/numerics.md).
    """

    def call() -> None:
        _update_cache(kv_c, k_pe, kv_cache, slot_mapping, shadow, quant, storage, check_values)

    if not replayable(check_values, slot_mapping) or not isinstance(shadow, torch.Tensor):
        return call()
    # the stamp check and stamping are host work a replay skips: only a shadow stamped
    # already (``held``, in the key) is replayed, so that the full call stamps every shadow
    held = _stamps(shadow).get(shadow.data_ptr())
    if held is None:
        return call()
    inputs, key = key_of(
        ("update_cache", id(quant), storage, check_values, dev.interpreting(), id(held)),
        kv_c, k_pe, kv_cache, slot_mapping, shadow,
    )  # fmt: skip
    REPLAY(key, inputs, call, keep=(quant, held))
    return None


def _update_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    shadow: torch.Tensor, quant: AttentionQuant, storage: str, check_values: bool | None,
) -> None:
    q = _check_quant(quant)
    st = _check_storage(storage)
    x1 = tensor_arg(kv_c, "kv_c", 2)
    x2 = tensor_arg(k_pe, "k_pe", 2)
    for name, x in (("kv_c", x1), ("k_pe", x2)):
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {x.dtype}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous, got strides {x.stride()}")
    d1, d2 = x1.shape[1], x2.shape[1]
    if d1 < 16 or d1 & (d1 - 1):
        raise ValueError(f"kv_c: last dim (kv_lora_rank) must be a power of two >= 16, got {d1}")
    if d2 < 16 or d2 & (d2 - 1):
        raise ValueError(f"k_pe: last dim (rope_dim) must be a power of two >= 16, got {d2}")
    if x2.shape[0] != x1.shape[0]:
        raise ValueError(f"k_pe: expected {x1.shape[0]} rows (those of kv_c), got {x2.shape[0]}")
    cache = _check_cache(kv_cache, d1 + d2)
    for name, x in (("kv_c", x1), ("k_pe", x2)):
        if x.device != cache.device:
            raise ValueError(f"{name}: expected device {cache.device}, got {x.device}")
    slots = tensor_arg(slot_mapping, "slot_mapping", 1)
    if slots.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping: expected int32 or int64, got {slots.dtype}")
    if slots.device != cache.device:
        raise ValueError(f"slot_mapping: expected device {cache.device}, got {slots.device}")
    if slots.shape[0] > x1.shape[0]:
        raise ValueError(f"slot_mapping: {slots.shape[0]} entries for {x1.shape[0]} tokens of kv_c")
    lay = shadow_layout(q, kv_lora_rank=d1, rope_dim=d2, storage=st)
    written, kh, ks, vh = _check_shadow(shadow, cache, lay)
    n = slots.shape[0]
    page_size = cache.shape[1]
    if check_values or (check_values is None and slots.device.type == "cpu"):
        s = slots.to("cpu", torch.int64)
        cap = cache.shape[0] * page_size
        bad = (s < -1) | (s >= cap)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"slot_mapping: entry {i} is {int(s[i])}, outside [-1, {cap}) (the cache's "
                f"{cache.shape[0]} blocks x {page_size} slots)"
            )
        used = s[s >= 0].sort().values
        repeated = used[1:][used[1:] == used[:-1]]
        if repeated.numel():
            twice = int(repeated[0])
            raise ValueError(
                f"slot_mapping: slot {twice} appears more than once (one call writes each "
                "slot at most once)"
            )
        _check_order(s, page_size)
    _stamp(written, lay, "quant")
    if n == 0:
        return
    if dev.interpreted_bf16(cache.dtype):  # the interpreter's bf16 casts are wrong: float32 copy
        wide = cache.float()
        r1, r2 = (x.to(cache.dtype).float() for x in (x1, x2))  # the values the cache holds
        _write_cache(r1, r2, wide, slots, kh, ks, vh, q, lay, n)
        cache.copy_(wide)  # every value came from a bf16 rounding: exact
        return
    _write_cache(x1, x2, cache, slots, kh, ks, vh, q, lay, n)


def _check_order(slots: torch.Tensor, page_size: int) -> None:
    """Refuse a call whose tokens do not reach a page in position order (host, int64 CPU
    ``slots`` within the cache, no duplicates): the entries writing one page, in their
    order in ``slot_mapping`` (``-1`` aside), must be consecutive slots, increasing. The
    first entry that is not names itself, its slot and page position, and the entry before
    it on that page."""
    entry = (slots >= 0).nonzero()[:, 0]
    written = slots[entry]
    pages, order = (written // page_size).sort(stable=True)  # each page's entries in call order
    at, entry = written[order], entry[order]
    broken = (pages[1:] == pages[:-1]) & (at[1:] != at[:-1] + 1)
    if not bool(broken.any()):
        return
    k = int(entry[1:][broken].argmin())  # the first broken entry in call order
    k = int(broken.nonzero()[k, 0]) + 1
    slot, prev = int(at[k]), int(at[k - 1])
    raise ValueError(
        f"slot_mapping: entry {int(entry[k])} writes slot {slot} (position {slot % page_size} "
        f"of page {slot // page_size}) after entry {int(entry[k - 1])} wrote slot {prev} "
        f"(position {prev % page_size}); tokens reach a page in position order: the entries "
        "of one call that write a page are consecutive slots, increasing"
    )


def _write_cache(
    x1: torch.Tensor,
    x2: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kh: torch.Tensor | None,
    ks: torch.Tensor | None,
    vh: torch.Tensor | None,
    q: AttentionQuant,
    lay: ShadowLayout,
    n: int,
) -> None:
    """``update_cache``'s two launches on checked inputs (``n`` tokens)."""
    d1, d2 = x1.shape[1], x2.shape[1]
    page_size = cache.shape[1]
    st = lay.storage
    ko, vo = operand(q.k), operand(q.v)
    hw = dev.hw_fp8(cache.device)
    v_token = vo.code == 1 and not lay.v_shared
    ptrs, strides = _section_args((kh, ks, vh), cache)
    shadow_update_kernel[(-(-n // _UPDATE_BLOCK_T),)](
        kvc_ptr=x1,
        kpe_ptr=x2,
        slot_ptr=slots,
        cache=ptrs,
        num_tokens=n,
        stride_kvc_t=x1.stride(0),
        stride_kpe_t=x2.stride(0),
        stride_slot=slots.stride(0),
        cache_strides=strides,
        capacity=cache.shape[0] * page_size,
        k_gs=ko.gs,
        v_gs=vo.gs,
        D1=d1,
        D2=d2,
        PAGE=page_size,
        BLOCK_T=_UPDATE_BLOCK_T,
        K_FMT=ko.code,
        K_DYN=ko.dynamic,
        K_EXACT=not ko.pow2,
        V_TOKEN=v_token,
        V_EXACT=not vo.pow2,
        STORE=STORAGES.index(st),
        HW_FP8=hw,
        num_warps=4,
    )
    if vo.code == 2:
        assert vh is not None
        shadow_v_block_kernel[(n,)](
            slots,
            cache,
            vh,
            slots.stride(0),
            cache.stride(0),
            cache.stride(1),
            vh.stride(0),
            vh.stride(1),
            cache.shape[0] * page_size,
            vo.gs,
            D1=d1,
            PAGE=page_size,
            V_EXACT=not vo.pow2,
            STORE=STORAGES.index(st),
            HW_FP8=hw,
            num_warps=4,
        )


# ---------------------------------------------------------------------------- decode


def shadow_decode_config(
    num_heads: int, quant: AttentionQuant | None = None, storage: str = "fp16"
) -> DecodeConfig:
    """Default tiles of ``decode_shadow``: quant none's where the shared memory allows.

    The loop reads 16-bit K̂ (and V̂) like on-read decode reads the raw cache, with
    no float32 copy of a tile: K and V unquantized, or fp8 V sharing K̂, take quant
    none's tiles (``decode_config``: 64-token tiles; 2 stages for 64 heads a
    program, 3 for fewer). K and V read from different rows (a V̂ section, or
    only one of them quantized) double the bytes a tile stages in shared memory
    (64 heads: q 72 KiB + 136 KiB a 64-token stage, more than the 227 KiB of a
    Hopper SM for 2 stages), so they take 32-token tiles, 2 stages. The packed
    storage decodes codes to float32 in registers: 32-token tiles, 2 stages.
    """
    block_h = block_h_for(num_heads)
    read = quant is not None and not (quant.k.is_identity and quant.v.is_identity)
    # K and V from different rows (K̂ and V̂, or one of them raw): two tiles a stage
    two_tiles = read and quant is not None and not _v_shared(quant.k, quant.v)
    if two_tiles or (read and storage == "packed"):
        block_n, stages = 32, 2
    else:
        block_n, stages = 64, (2 if block_h == 64 else 3)
    warps = 8 if block_h == 64 else 4
    return DecodeConfig(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)


def _tail_loop(block_h: int, v_tail: bool) -> bool:
    """How the split kernel runs the tile holding a sequence's end (``TAIL_LOOP``).

    True: a pipelined loop of 0 or 1 tiles (its loads staged through shared memory
    like the main loop's); False: one tile after the loop, not pipelined (its loads
    go through registers). Compiled for sm_90 (ptxas register and spill counts),
    the peeled tile frees the main loop of spills with 64 heads a program
    (wgmma), and the loop form does with fewer heads (mma.sync) unless the tail
    quantizes nvfp4 V on read. Both give the same bits.
    """
    return block_h < 64 and not v_tail


# fmt: off
def decode_shadow(
    q: torch.Tensor | Sequence[torch.Tensor], kv_cache: torch.Tensor, shadow: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, *, softmax_scale: float,
    quant: AttentionQuant, storage: str = "fp16", kv_lora_rank: int = 512,
    num_splits: int | None = None, workspace: torch.Tensor | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    max_seq_len: int | None = None, check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # fmt: on
    """``mla_triton.decode`` reading K̂ and V̂ from a shadow written by ``update_cache``.

    Arguments and results as ``decode`` (q, kv_cache, block_table, seq_lens,
    softmax_scale, kv_lora_rank, num_splits, workspace — sized by
    ``decode_workspace_size`` —, out, lse, max_seq_len, check_values),
    plus ``shadow`` and ``storage`` as passed to ``update_cache``, and ``quant``
    (required), whose k and v must be those the shadow was written with. The
    page size must be a multiple of 16.

    q̂ and P̂ are quantized in the kernel as in ``decode``; K̂ comes from the
    shadow (raw K when k is ``none``); V̂ of complete 16-token blocks from the
    shadow (raw V when v is ``none``; K̂ when fp8 K and V share a scale), and
    the sequence's open nvfp4 V block is quantized on read from the raw rows
    with zeros past ``seq_lens``. With the same split count and tile
    configuration as ``decode``, the result is bit-identical to it; with
    different ones, equal up to float32 summation order (docs/numerics.md "Softmax, P and schedule
    invariance").

    Implementations (``dispatch.choose`` with ``gluon_shadow_taken``): on an sm90 GPU the
    rows of ``dispatch.TABLE`` for ``decode_shadow`` (the warp-specialized Gluon kernel for
    the shadows it reads at any head count, the Gluon split kernel above 32 heads for a
    dynamic nvfp4 K with fp8 V); the Triton kernel otherwise. ``mla_triton.tuning.use``
    forces one.
    """
    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return _decode_shadow(q, kv_cache, shadow, block_table, seq_lens, softmax_scale, quant,
                              storage, kv_lora_rank, num_splits, workspace, out, lse, max_seq_len,
                              check_values)  # fmt: skip

    if not replayable(check_values, seq_lens) or not isinstance(shadow, torch.Tensor):
        return call()
    held = _stamps(shadow).get(shadow.data_ptr())  # the recipe check reads the stamp
    inputs, key = key_of(
        ("decode_shadow", softmax_scale, id(quant), storage, kv_lora_rank, num_splits,
         split_key(max_seq_len, capacity(block_table, kv_cache)), check_values,
         forced("decode"), dev.interpreting(), id(held)),
        q, kv_cache, shadow, block_table, seq_lens, workspace, out, lse,
    )  # fmt: skip
    return REPLAY(key, inputs, call, keep=(quant, held))


def _decode_shadow(
    q: torch.Tensor | Sequence[torch.Tensor], kv_cache: torch.Tensor, shadow: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
    quant: AttentionQuant, storage: str, kv_lora_rank: int, num_splits: int | None,
    workspace: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None,
    max_seq_len: int | None, check_values: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl, config = forced("decode")
    qq = _check_quant(quant)
    st = _check_storage(storage)
    c = check_call(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, qq, max_seq_len)
    cache = _check_cache(kv_cache, kv_lora_rank + c.rope)
    lay = shadow_layout(qq, kv_lora_rank=kv_lora_rank, rope_dim=c.rope, storage=st)
    _, kh, ks, vh = _check_shadow(shadow, cache, lay)
    rec = gluon_shadow_recipe(qq, lay, c.q_nope.dtype)
    tiles, gluon = _gluon_tiles(rec, lay, cache, (kh, ks, vh), config)
    k_src = kh if lay.storage == "packed" and kh is not None else tiles  # packed: its bytes
    sections = _v_sections(k_src, cache, (kh, ks, vh)) if vh is not None else None
    ws_route = ws.ws_shadow_route(rec, tiles, sections)
    rule = partial(gluon_shadow_taken, layout=lay)
    triton = _ShadowFamily(lay, (kh, ks, vh))
    route = Route("decode_shadow", triton, gluon, ws_route, rule, ("shadow", lay))
    family, cfg = choose(c, tiles, qq, kv_lora_rank, (impl, config), route)
    return run_decode(
        c, cache, block_table, seq_lens, qq, family, out=out, lse=lse, num_splits=num_splits,
        workspace=workspace, max_seq_len=max_seq_len, check_values=check_values, config=cfg,
        kv_lora_rank=kv_lora_rank,
    )  # fmt: skip


AUTO_GLUON_SHADOWS = frozenset(
    kind for row in TABLE if row.op == "decode_shadow" for kind in row.recipes or ()
)
"""The Gluon shadow variants (recipes without global scales) ``"auto"`` runs through a Gluon
kernel: those of ``dispatch.TABLE``'s rows."""


@lru_cache(maxsize=256)
def gluon_shadow_recipe(
    quant: AttentionQuant | None, layout: ShadowLayout, dtype: torch.dtype
) -> GluonRecipe | str:
    """The ``GluonRecipe`` of a shadow read with ``quant`` by q of ``dtype``, or why the
    Gluon kernel does not take it (a pure function).

    Taken: q and P none, fp8 or nvfp4 (``gluon_recipe(nvfp4_qp=True)``); K and V both
    none (the raw rows, as ``decode``); else ``fp16`` storage with K's tiles the
    shadow's K̂ (raw rows for K none) and, for V: fp8 with K's static scale, V̂ = K̂'s
    first 512 features (any scale: the kernel applies K's to the scores and ``gs_p
    gs_v`` to the output, as the Triton shadow kernel); any other quantized V, the V̂
    section in tiles of their own (``v_sep``: 32-token tiles), nvfp4's open block
    quantized from the raw rows, a dynamic K's per-token scales from the shadow. A
    float16 K̂ needs q̂ quantized or q float16 (q bfloat16 would need K̂ cast in the
    tile). ``packed`` storage: nvfp4 K and V of static scales, V's a power of two (``packed``:
    the warp-specialized kernel's producer decodes it). Refused: other packed shadows, dynamic
    V, K quantized with V not.
    """
    qq = quant if quant is not None else AttentionQuant()
    base = gluon_recipe(AttentionQuant(q=qq.q, p=qq.p))
    if isinstance(base, str):
        return base
    if qq.k.is_identity and qq.v.is_identity:
        return base
    ko, vo = operand(qq.k), operand(qq.v)
    packed_nvfp4 = (ko.code, vo.code) == (2, 2) and not (ko.dynamic or vo.dynamic) and vo.pow2
    if layout.storage != "fp16" and not packed_nvfp4:
        return (f"shadow storage {layout.storage!r}: the Gluon kernel reads nvfp4 K and V of "
                "static scales (V's a power of two) only")  # fmt: skip
    if ko.code and not base.q_scaled and dtype != torch.float16:
        return f"q {dtype} not quantized with a quantized K: K̂ is float16 (no cast in the tile)"
    if layout.storage != "fp16":
        return replace(
            base, shadow_f16=True, k_fmt=2, k_gs=ko.gs, v_gs=vo.gs, v_sep=True, v_f16=True,
            v_tail=True, v_fmt=2, packed=True,
        )  # fmt: skip
    if layout.v_shared:
        return replace(base, shadow_f16=True, k_fmt=ko.code, k_gs=ko.gs, v_gs=ko.gs, v_fmt=1)
    if vo.code == 0:
        return (
            "K quantized with V not (raw V tiles beside K̂) is not implemented in the Gluon kernel"
        )
    if vo.dynamic:
        return "a dynamic V scale is not implemented in the Gluon kernel"
    return replace(
        base, shadow_f16=ko.code != 0, k_fmt=ko.code, k_gs=ko.gs, v_gs=vo.gs, v_sep=True,
        v_f16=True, v_tail=vo.code == 2, v_exact=not vo.pow2, k_dyn=ko.dynamic, v_fmt=vo.code,
    )  # fmt: skip


def gluon_shadow_taken(f: GluonFacts, *, layout: ShadowLayout) -> GluonRecipe | Unsupported:
    """``gluon_taken`` for ``decode_shadow`` (``f`` of the K tiles the Gluon kernel reads;
    page and row strides multiples of 8 elements, the 16-byte rows of every shadow) with
    the shadow's recipe rule (``gluon_shadow_recipe``). A pure function of its arguments."""

    def recipe(quant: AttentionQuant | None) -> GluonRecipe | str:
        return gluon_shadow_recipe(quant, layout, f.dtype)

    return gluon_taken(f, recipe=recipe, stride_align=8)


def _gluon_tiles(
    rec: GluonRecipe | str,
    lay: ShadowLayout,
    cache: torch.Tensor,
    views: _Views,
    config: object,
) -> tuple[torch.Tensor, Any]:
    """What ``decode_shadow``'s Gluon kernel reads (``rec``: ``gluon_shadow_recipe``'s
    answer for the call): the K tiles (the facts' tensor) and the factory of its split
    family from a ``GluonDecodeConfig``.

    K̂ = V̂ (fp8, one scale) or K and V none: one ring of tiles, the shadow's K̂ or the
    raw rows. A V̂ section (``GluonRecipe.v_sep``): ``(K tiles, V̂, raw rows, K
    scales)``, ``SEPARATE_V_CONFIG`` (another ``GluonDecodeConfig``: a ValueError naming
    ``config``)."""
    kh = views[0]
    if not isinstance(rec, GluonRecipe) or not rec.v_sep:
        # K̂ (= V̂) of a float16 shadow, else the raw rows
        tiles = kh if kh is not None and lay.v_shared and lay.storage == "fp16" else cache
        return tiles, partial(_GluonShadowFamily, cache=((tiles,), _strides(tiles)))
    if isinstance(config, GluonDecodeConfig) and config != SEPARATE_V_CONFIG:
        raise ValueError(
            f"config: a shadow with a V̂ section runs the Gluon kernel as "
            f"{SEPARATE_V_CONFIG.name} only (two tiles a stage), got {config.name}"
        )
    if rec.packed:  # the facts are the raw rows'; only the warp-specialized kernel reads it

        def refuse(cfg: GluonDecodeConfig) -> _GluonShadowFamily:
            raise ValueError(
                f"config: a packed shadow runs the warp-specialized Gluon kernel only "
                f"(gluon_ws.NVFP4_PACKED_CONFIG), not {cfg.name}"
            )

        return cache, refuse
    tiles = kh if kh is not None else cache
    sections = _v_sections(tiles, cache, views)

    def family(cfg: GluonDecodeConfig) -> _GluonShadowFamily:
        del cfg  # the default, or SEPARATE_V_CONFIG (checked above)
        return _GluonShadowFamily(SEPARATE_V_CONFIG, cache=sections, v_sep=True)

    return tiles, family


def _v_sections(
    tiles: torch.Tensor, cache: torch.Tensor, views: _Views
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """A V̂ section's cache pointers ``(K tiles, V̂, raw rows, K scales)`` (the raw cache
    where there are no K scales) and their (page, row) strides, as the kernels read them."""
    _, ks, vh = views
    assert vh is not None  # v_sep: the recipe has a V̂ section
    ptrs = (tiles, vh, cache, ks if ks is not None else cache)
    return ptrs, tuple(x for t in ptrs for x in _strides(t))


def _strides(t: torch.Tensor) -> tuple[int, int]:
    return (t.stride(0), t.stride(1))


class _ShadowFamily(SplitFamily):
    """``decode_shadow``: K̂ and V̂ read from the shadow (``shadow_decode_split_kernel``)."""

    kernel = shadow_decode_split_kernel

    def __init__(self, lay: ShadowLayout, views: _Views) -> None:
        self.lay = lay
        self.views = views

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        return shadow_decode_config(num_heads, recipe, self.lay.storage)

    def v_shares_k(self, ops: Operands) -> bool:
        return ops[2].code != 0 and self.lay.v_shared

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        vo = ops[2]
        v_src = 0 if vo.code == 0 else (2 if self.lay.v_shared else 1)
        return {
            "V_SRC": v_src,
            "V_TAIL": vo.code == 2,
            "TAIL_LOOP": _tail_loop(cfg.block_h, vo.code == 2),
            "STORE": STORAGES.index(self.lay.storage),
        }

    def cache_args(self, cache: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        return _section_args(self.views, cache)


class _GluonShadowFamily(_GluonFamily):
    """``decode_shadow`` under ``tuning.use("gluon")``: the Gluon kernel on a shadow's tiles, read
    as they
    are (no QDQ in the kernel: ``KV_FP8`` False). ``cache``: the kernel's cache pointers
    and their (page, row) strides: ``((tiles,), ...)`` (a float16 K̂ ``[N, P, 576]``, V̂ its
    first 512 features; or the raw cache for K and V none), or with ``v_sep`` ``(K tiles,
    V̂, raw rows, K scales)`` (``V_SEP``; ``V_TAIL`` for nvfp4 V)."""

    def __init__(
        self,
        config: GluonDecodeConfig,
        *,
        cache: tuple[tuple[torch.Tensor, ...], tuple[int, ...]],
        v_sep: bool = False,
    ) -> None:
        super().__init__(config)
        self.cache = cache
        self.v_sep = v_sep

    def v_shares_k(self, ops: Operands) -> bool:
        return ops[1].code != 0 and not self.v_sep  # the tiles hold K̂ = V̂

    def v_own(self, recipe: AttentionQuant | None) -> bool:
        return False  # the shadow holds V̂: nothing is quantized on read but nvfp4's open block

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        return super().extra_args(cache, cfg, ops) | {
            "KV_FP8": False, "V_SEP": self.v_sep, "V_TAIL": self.v_sep and ops[2].code == 2,
            "V_OWN": False, "OVERLAP": self.config.overlap,
        }  # fmt: skip

    def cache_args(self, cache: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        return self.cache
