"""Decode: one query token per request against a paged latent cache, K and V quantized on read.

Implementations: ``triton`` (split-K, any GPU and the CPU interpreter), ``gluon`` (the
Gluon split kernel, sm90) and ``gluon_ws`` (warp-specialized Gluon, sm90);
``dispatch.choose`` picks one per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_formats import AttentionQuant
from mla_triton.common import device as dev
from mla_triton.common.choice import forced
from mla_triton.common.replay import REPLAY, capacity, key_of, replayable
from mla_triton.common.splitk import check_call, run_decode, split_key
from mla_triton.ops.decode.dispatch import choose

__all__ = ["decode"]

_UNQUANTIZED = AttentionQuant()


def decode(
    q: torch.Tensor | Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    quant: AttentionQuant | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    check_values: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized absorbed-MLA decode: split-K over a paged latent cache (docs/numerics.md).

    Args:
        q: ``[B, H, D]`` with ``D = kv_lora_rank + rope`` (576 = 512 + 64), or the pair
            ``(q_nope [B, H, kv_lora_rank], q_pe [B, H, rope])``; float16 or bfloat16,
            last dim contiguous, any other strides; any ``H >= 1``.
        kv_cache: ``[num_blocks, page_size, D]`` latent cache (kv_c then k_pe), q's
            dtype and device, last dim contiguous; page and row strides are read from
            the tensor (a strided view of a larger cache works); offsets are 64-bit.
        block_table: int32/int64 ``[B, max_blocks]``; token ``t`` of request ``b`` is
            ``kv_cache[block_table[b, t // page_size], t % page_size]``. An entry a
            request uses outside ``[0, num_blocks)`` is never read through: unchecked,
            that request's rows come out NaN (docs/numerics.md "Indices outside the
            cache").
        seq_lens: int32/int64 ``[B]``; request ``b`` attends to its first
            ``seq_lens[b]`` tokens (0: out 0, lse -inf). Unchecked, a length below 0
            or beyond the block table's capacity makes the request's rows NaN.
        softmax_scale: scores are ``(q̂ · k̂) * softmax_scale``.
        kv_lora_rank: the latent width (V and output width), a power of two.
        quant: ``mla_formats.AttentionQuant`` or None. q̂ and K̂ are QDQ'd along the D
            features (q: static or dynamic per request and head; K: static or dynamic
            per token), V̂ (the first kv_lora_rank features) and P̂ along the tokens
            at absolute positions (static). K and V are quantized on read from the
            raw cache, independently.
        num_splits: split count of the sequence axis; None: ``decode_num_splits``.
        workspace: preallocated workspace (any contiguous tensor on the device) of
            at least ``decode_workspace_size(...)`` bytes; None allocates one when
            more than one split runs.
        out: preallocated output ``[B, H, kv_lora_rank]`` in q's dtype, last dim
            contiguous; every element is written.
        lse: preallocated ``[B, H]`` float32 LSE output; every element is written.
        max_seq_len: an upper bound of ``seq_lens`` (no larger than the block table's
            capacity, the default); only the split policy reads it.
        check_values: check seq_lens and the used block-table entries on the host
            (a device sync) and raise ``ValueError``. None: only when they are CPU
            tensors. bfloat16 under Triton's interpreter runs in float32 inside
            (``interpreted_bf16``).

    Returns:
        ``(out [B, H, kv_lora_rank] in q's dtype, lse [B, H] float32)``, the LSE in
        natural log: ``out = P̂ V̂ / l``, ``lse = ln(l) + m ln 2`` with ``m`` the ceil'd
        base-2 maximum score and ``l`` the sum of the unquantized ``P = 2^(t - m)``.

    Numerics: the result does not depend on the split count or on the other
    requests in the batch beyond float32 summation order and the exception of docs/numerics.md
    "Softmax, P and schedule invariance"
    (E4M3 subnormal block scales of P); with ``num_splits`` fixed, a request's
    result is bit-identical whatever the rest of the batch.

    Non-finite input (docs/numerics.md "Non-finite input"): NaN and ±inf poison
    exactly the rows that read them, never saturate: a non-finite q̂ element its
    head's row (out and LSE), a non-finite element of a seen latent row every row
    of that request (out and LSE), through QDQ blocks and dynamic scales as
    ``mla_formats`` does. Memory the block table does not reference (other pages,
    slots past a sequence's end) is never read.
    """

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return _decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, quant,
                       num_splits, workspace, out, lse, max_seq_len, check_values)  # fmt: skip

    if not replayable(check_values, seq_lens):
        return call()
    inputs, key = key_of(
        ("decode", softmax_scale, kv_lora_rank, id(quant), num_splits,
         split_key(max_seq_len, capacity(block_table, kv_cache)), check_values,
         forced("decode"), dev.interpreting()),
        q, kv_cache, block_table, seq_lens, workspace, out, lse,
    )  # fmt: skip
    return REPLAY(key, inputs, call, keep=quant)


def _decode(
    q: torch.Tensor | Sequence[torch.Tensor],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    quant: AttentionQuant | None,
    num_splits: int | None,
    workspace: torch.Tensor | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    max_seq_len: int | None,
    check_values: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = check_call(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, quant,
                   max_seq_len)  # fmt: skip
    family, cfg = choose(c, kv_cache, quant, kv_lora_rank, forced("decode"))
    recipe = quant if quant is not None else _UNQUANTIZED
    return run_decode(
        c, kv_cache, block_table, seq_lens, recipe, family, out=out, lse=lse,
        num_splits=num_splits, workspace=workspace, max_seq_len=max_seq_len,
        check_values=check_values, config=cfg, kv_lora_rank=kv_lora_rank,
    )  # fmt: skip
