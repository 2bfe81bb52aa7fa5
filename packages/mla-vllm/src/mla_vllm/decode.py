"""The decode step of one layer (``MLAQuantImpl.forward_mqa``), in named steps.

Shapes (N local heads, L = kv_lora_rank, R = rope dim, R requests of
``query_len`` tokens each, B = R * query_len decode rows):

1. ``expand_rows``: vLLM's per-request block table ``[R, pages]`` and sequence
   lengths ``[R]`` become one row per query token (``[B, pages]``, ``[B]``);
2. ``size_splits``: the split-KV count and its scratch for B rows;
3. ``record_query_amax``: while calibrating, the running max |q|;
4. ``run_decode``: the shadow kernel (K̂/V̂ read from the write-once shadow) or
   the on-read kernel (K/V quantized from the raw latent at every step);
5. ``observe_error``: on sampled calls, the error against unquantized decode.

``forward_decode`` runs them in order. The query is ``q [B, N, L + R]`` or the
pair ``(q_nope [B, N, L], q_pe [B, N, R])``; the raw cache is ``[blocks, page,
L + R]``; the result is ``(out [B, N, L], lse [B, N] float32)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton import decode, decode_shadow
from mla_vllm.shadow import LayerShadow
from mla_vllm.state import LayerState
from mla_vllm.workspace import decode_scratch

__all__ = [
    "DecodeRows",
    "Query",
    "Splits",
    "expand_rows",
    "forward_decode",
    "observe_error",
    "record_query_amax",
    "run_decode",
    "size_splits",
]

Query = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""``q [B, N, L + R]`` or ``(q_nope [B, N, L], q_pe [B, N, R])``."""


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step: one row per query token.

    ``query`` has B rows of N heads; row ``i`` reads the pages ``block_table[i]``
    (``[B, pages]`` int32) and sees the keys ``< seq_lens[i]`` (``[B]`` int32).
    """

    query: Query
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def first(self) -> torch.Tensor:
        """The query tensor (the first one of a pair): ``[B, N, ...]``."""
        return self.query if isinstance(self.query, torch.Tensor) else self.query[0]

    @property
    def rows(self) -> int:
        return int(self.first.shape[0])

    @property
    def heads(self) -> int:
        return int(self.first.shape[1])

    def head(self, n: int) -> DecodeRows:
        """The first ``n`` rows."""
        q = self.query
        query = q[:n] if isinstance(q, torch.Tensor) else (q[0][:n], q[1][:n])
        return DecodeRows(query, self.block_table[:n], self.seq_lens[:n])


def expand_rows(
    query: Query, block_table: torch.Tensor, seq_lens: torch.Tensor, *, causal: bool
) -> DecodeRows:
    """One row per query token from vLLM's per-request decode metadata.

    ``block_table [R, pages]`` and ``seq_lens [R]`` are per request; ``query`` has
    ``B = R * query_len`` rows, a request's tokens consecutive (speculative decoding
    gives ``query_len > 1``). Each token's row repeats its request's pages; with
    ``causal``, token ``t`` of ``query_len`` sees ``seq_len - (query_len - 1 - t)``
    keys (clamped at 0), else all ``seq_len``. Raises ``ValueError`` (``q``) when B
    is not a multiple of R.
    """
    first = query if isinstance(query, torch.Tensor) else query[0]
    rows = int(first.shape[0])
    num_reqs = int(seq_lens.shape[0])
    query_len, rest = divmod(rows, num_reqs) if num_reqs else (1, 0)
    if rest:
        raise ValueError(f"q: {rows} decode rows do not split evenly over {num_reqs} requests")
    if query_len > 1:
        block_table = block_table.repeat_interleave(query_len, dim=0)
        if causal:
            shift = torch.arange(1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
            seq_lens = (seq_lens.unsqueeze(1) + shift).flatten().clamp(min=0)
        else:
            seq_lens = seq_lens.repeat_interleave(query_len)
    return DecodeRows(query, block_table, seq_lens)


@dataclass(frozen=True)
class Splits:
    """How one decode launch splits the keys, and its scratch.

    ``max_seq_len`` bounds every row's sequence length (at most the block table's
    capacity, at least 1); ``workspace`` is a uint8 buffer or None.
    """

    num_splits: int
    max_seq_len: int
    workspace: torch.Tensor | None


def size_splits(
    rows: DecodeRows, cache: torch.Tensor, max_seq_len: int, kv_lora_rank: int
) -> Splits:
    """The split count and workspace of ``rows`` on ``cache [blocks, page, L + R]``.

    ``max_seq_len`` is vLLM's batch maximum, clamped to ``pages * page`` (what a
    block table row can address).
    """
    capacity = int(rows.block_table.shape[1]) * int(cache.shape[1])
    bound = max(1, min(int(max_seq_len), capacity))
    splits, workspace = decode_scratch(
        rows.rows, rows.heads, bound, kv_lora_rank, rows.first.device
    )
    return Splits(splits, bound, workspace)


def record_query_amax(state: LayerState, query: Query) -> None:
    """While calibrating: the running max |q| over ``q`` (or both halves of the pair)."""
    if state.calibrating:
        parts = (query,) if isinstance(query, torch.Tensor) else query
        state.record_amax("decode", "q", *parts)


def run_decode(
    rows: DecodeRows,
    cache: torch.Tensor,
    shadow: tuple[LayerShadow, torch.Tensor] | None,
    quant: AttentionQuant | None,
    splits: Splits,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, N, L], lse [B, N] float32)`` of ``rows`` through one kernel.

    With ``shadow`` (the layer's ``LayerShadow`` and the cache's uint8 shadow bytes
    ``[blocks, page, S]``), K̂ and V̂ are read from the shadow and q is quantized
    with the shadow's recipe; without, K and V are quantized from the raw
    ``cache [blocks, page, L + R]`` on read with ``quant`` (None: unquantized).
    """
    if shadow is not None:
        layer, shadow_bytes = shadow
        return decode_shadow(
            rows.query,
            cache,
            shadow_bytes,
            rows.block_table,
            rows.seq_lens,
            softmax_scale=softmax_scale,
            quant=layer.quant,
            storage=layer.storage,
            kv_lora_rank=kv_lora_rank,
            num_splits=splits.num_splits,
            workspace=splits.workspace,
            max_seq_len=splits.max_seq_len,
            check_values=False,
        )
    return decode(
        rows.query,
        cache,
        rows.block_table,
        rows.seq_lens,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        quant=quant,
        num_splits=splits.num_splits,
        workspace=splits.workspace,
        max_seq_len=splits.max_seq_len,
        check_values=False,
    )


def observe_error(
    state: LayerState,
    rows: DecodeRows,
    cache: torch.Tensor,
    out: torch.Tensor,
    splits: Splits,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
) -> None:
    """On a sampled call, the error of ``out [B, N, L]`` against unquantized decode.

    Compares the first ``observe.max_rows`` rows with the on-read kernel run
    without quantization on the raw ``cache``; records into ``state``'s decode
    statistics.
    """
    if not state.should_observe("decode"):
        return
    n = min(rows.rows, state.observe.max_rows)
    head = rows.head(n)
    reference, _ = decode(
        head.query,
        cache,
        head.block_table,
        head.seq_lens,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        num_splits=splits.num_splits,
        max_seq_len=splits.max_seq_len,
        check_values=False,
    )
    state.record_stats("decode", out[:n], reference)


def forward_decode(
    state: LayerState,
    query: Query,
    cache: torch.Tensor,
    shadow: tuple[LayerShadow, torch.Tensor] | None,
    decode_metadata: Any,
    *,
    causal: bool,
    max_seq_len: int,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of one layer: ``(out [B, N, L], lse [B, N] float32)``.

    ``decode_metadata`` is vLLM's MLA decode metadata (its ``block_table [R,
    pages]`` and ``seq_lens [R]``); ``cache`` the raw ``[blocks, page, L + R]``
    view; ``shadow`` as in ``run_decode``. Runs the steps of this module in order.
    """
    rows = expand_rows(query, decode_metadata.block_table, decode_metadata.seq_lens, causal=causal)
    splits = size_splits(rows, cache, max_seq_len, kv_lora_rank)
    record_query_amax(state, query)
    recipe = state.recipe.decode
    quant = None if recipe.is_identity else recipe
    out, lse = run_decode(
        rows, cache, shadow, quant, splits, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank
    )
    if quant is not None:
        observe_error(
            state, rows, cache, out, splits, softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank
        )
    return out, lse
