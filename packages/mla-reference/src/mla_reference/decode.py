"""Eager oracle of quantized absorbed-MLA decode over a paged latent cache.

The definitions: docs/numerics.md "Operands and axes" to "LSE, masks and input checks".

One request at a time: gather its latent rows token by token through the block
table, QDQ them as K (along the features) and as V (the first ``kv_lora_rank``
features, along the tokens), form every score, softmax with the power-of-two
reference point, QDQ P, multiply by V̂ and divide by the unquantized denominator.
Non-finite operands poison by row (docs/numerics.md "Non-finite input").
"""

from __future__ import annotations

from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_reference._softmax import (
    normalize,
    poison_v,
    quantize_operand,
    resolve_quant,
    softmax_rows,
    split_non_finite,
)
from mla_reference._validate import check_decode

__all__ = ["decode", "gather_latent"]


def gather_latent(
    kv_cache: torch.Tensor, pages: list[int], seq_len: int, page_size: int
) -> torch.Tensor:
    """A request's latent rows ``[seq_len, D]``: token ``t`` is
    ``kv_cache[pages[t // page_size], t % page_size]`` (any strides)."""
    t = torch.arange(seq_len, device=kv_cache.device)
    table = torch.tensor(pages, dtype=torch.long, device=kv_cache.device)
    return kv_cache[table[t // page_size], t % page_size]


def decode(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    quant: AttentionQuant | None = None,
    compute_dtype: torch.dtype = torch.float64,
    out_dtype: torch.dtype | None = None,
    debug: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized absorbed MLA decode: the decode oracle.

    Args:
        q: ``[B, H, D]`` with ``D = kv_lora_rank + rope`` (DeepSeek: 576 = 512 + 64),
            or the pair ``(q_nope [B, H, kv_lora_rank], q_pe [B, H, rope])``, which is
            concatenated first.
        kv_cache: ``[num_blocks, page_size, D]`` latent cache (kv_c then k_pe), same
            dtype and device as q; any strides, any positive page size.
        block_table: int32/int64 ``[B, max_blocks]``; token ``t`` of request ``b`` is
            ``kv_cache[block_table[b, t // page_size], t % page_size]``.
        seq_lens: int32/int64 ``[B]``; request ``b`` attends to its first
            ``seq_lens[b]`` tokens, all visible; 0 gives out 0 and lse -inf.
        softmax_scale: positive factor of the dot products, ``s = (q̂ · k̂) * scale``.
        kv_lora_rank: width of the latent part, the V width and output width.
        quant: ``mla_formats.AttentionQuant`` or None (no quantization at all). q and
            the latent rows as K are QDQ'd along the D features (q's amax dynamic
            per request and head by default, K's static or dynamic per token); V
            (the first kv_lora_rank features) and P along the tokens, blocks at
            token positions 0, 16, 32, ... of the request, the tail block
            zero-padded. The cache itself is read raw, K and V independently.
        compute_dtype: float64 (default) or float32, for the dots and the softmax.
        out_dtype: dtype of ``out``; q's dtype by default. The LSE has dtype
            ``promote(out_dtype, float32)``.
        debug: when a dict, it is filled in compute_dtype with ``"q"`` q̂ ``[B, H, D]``
            and lists with one entry per request: ``"k"`` k̂ ``[L, D]``, ``"v"`` V̂
            ``[L, kv_lora_rank]``, ``"p"`` P̂ ``[H, L]``, ``"m"`` the base-2 reference
            point ``[H]`` (integers, -inf when L = 0), ``"l"`` the denominator ``[H]``;
            ``p``, ``m`` and ``l`` are NaN in a row poisoned by q̂ or k̂.

    Per row (one request, one head), with ``t_j = s_j log2(e)``: ``m = ceil(max t)``,
    ``P_j = 2^(t_j - m)``, ``l = sum P``, ``out = QDQ(P) · V̂ / l``, ``lse = ln(l) + m ln 2``.

    Non-finite input (NaN or ±inf in an operand after QDQ; for ``none`` the raw
    value): a row whose q̂, or the k̂ of one of its request's ``seq_lens[b]``
    tokens, holds one has out and LSE all NaN; a row that reads a v̂ holding one has
    out all NaN and its LSE unchanged. Cache rows past ``seq_lens[b]`` are never
    read. A request with ``seq_lens[b] = 0`` gives out 0 and LSE -inf even with a
    NaN query.

    Returns:
        ``(out [B, H, kv_lora_rank], lse [B, H])``, the LSE in natural log.
    """
    shapes = check_decode(
        q,
        kv_cache,
        block_table,
        seq_lens,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        quant=quant,
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        debug=debug,
    )
    recipe = resolve_quant(quant)
    q_full = shapes.q
    batch, heads, _ = q_full.shape
    q_hat = quantize_operand(q_full, recipe.q, axis=-1, compute_dtype=compute_dtype)
    q_use, q_bad = split_non_finite(q_hat, dim=-1)  # [B, H, D], [B, H]
    out = torch.zeros(batch, heads, kv_lora_rank, dtype=compute_dtype, device=q_full.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=compute_dtype, device=q_full.device)
    lists: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "p": [], "m": [], "l": []}

    for b, length in enumerate(shapes.seq_lens):
        latent = gather_latent(kv_cache, shapes.block_table[b], length, shapes.page_size)
        k_hat = quantize_operand(latent, recipe.k, axis=-1, compute_dtype=compute_dtype)
        v_hat = quantize_operand(
            latent[:, :kv_lora_rank], recipe.v, axis=0, compute_dtype=compute_dtype, pad=True
        )
        k_use, k_bad = split_non_finite(k_hat, dim=-1)  # [L, D], [L]
        v_use, v_bad = split_non_finite(v_hat, dim=-1)  # every head sees all L tokens
        s = (q_use[b] @ k_use.T) * shapes.softmax_scale  # [H, L]
        keep = torch.ones(1, length, dtype=torch.bool, device=s.device)
        sm = softmax_rows(s, keep, recipe.p, poisoned=q_bad[b] | k_bad.any())
        out_b, lse[b] = normalize(sm.p @ v_use, sm)
        out[b] = poison_v(out_b, v_bad.any().expand(heads))
        if debug is not None:
            for name, value in (("k", k_hat), ("v", v_hat), ("p", sm.p), ("m", sm.m), ("l", sm.l)):
                lists[name].append(value)

    if debug is not None:
        debug.update(q=q_hat, **lists)
    result_dtype = out_dtype or q_full.dtype
    return out.to(result_dtype), lse.to(torch.promote_types(result_dtype, torch.float32))
