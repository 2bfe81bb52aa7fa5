"""Input checks shared by the oracles (docs/numerics.md "Input checks").

Every check raises ``ValueError`` whose message starts with the argument's name
and says what was expected. The oracles accept any strides and any page size;
the kernels may be stricter.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla_formats import AttentionQuant, NMSparsity

__all__ = [
    "FLOAT_DTYPES",
    "DecodeShapes",
    "PrefillShapes",
    "check_decode",
    "check_prefill",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
COMPUTE_DTYPES = (torch.float32, torch.float64)
HEAD_DIM_MULTIPLE = 16


def _tensor(x: object, name: str, rank: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-d tensor, got shape {tuple(x.shape)}")
    return x


def _float_tensor(x: object, name: str, rank: int) -> torch.Tensor:
    t = _tensor(x, name, rank)
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a floating dtype {FLOAT_DTYPES}, got {t.dtype}")
    return t


def _index_tensor(x: object, name: str, rank: int) -> torch.Tensor:
    t = _tensor(x, name, rank)
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {t.dtype}")
    return t


def _same(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(
            f"{name}: expected device {ref.device} (that of {ref_name}), got {t.device}"
        )


def _same_dtype(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: expected dtype {ref.dtype} (that of {ref_name}), got {t.dtype}")


def _head_dim(size: int, name: str) -> None:
    if size <= 0 or size % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"{name}: head dim {size} must be a positive multiple of {HEAD_DIM_MULTIPLE}"
        )


def _common(
    softmax_scale: object,
    quant: object,
    compute_dtype: object,
    out_dtype: object,
    debug: object,
) -> float:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a float, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    if quant is not None and not isinstance(quant, AttentionQuant):
        raise ValueError(
            f"quant: expected None or mla_formats.AttentionQuant, got {type(quant).__name__}"
        )
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype!r}"
        )
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected None or one of {FLOAT_DTYPES}, got {out_dtype!r}")
    if debug is not None and not isinstance(debug, dict):
        raise ValueError(f"debug: expected None or a dict, got {type(debug).__name__}")
    return scale


def _cu_seqlens(
    cu: object, name: str, tokens: torch.Tensor, tokens_name: str, q: torch.Tensor
) -> list[int]:
    """Host copy of checked offsets; ``tokens`` is the packed tensor they index."""
    t = _index_tensor(cu, name, 1)
    _same(t, q, name, "q")
    total = tokens.shape[0]
    if t.numel() < 1:  # [0] is a batch of zero sequences
        raise ValueError(f"{name}: expected batch + 1 >= 1 entries, got {t.numel()}")
    values = [int(x) for x in t.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]}")
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values}")
    if values[-1] != total:
        raise ValueError(
            f"{name}: last entry {values[-1]} must equal the number of tokens {total} "
            f"(dim 0 of {tokens_name})"
        )
    return values


@dataclass(frozen=True)
class PrefillShapes:
    """Sizes of a checked prefill call."""

    softmax_scale: float
    cu_q: list[int]
    cu_k: list[int]
    heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_v: int


def check_prefill(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    *,
    softmax_scale: object,
    causal: object,
    quant: object,
    sparsity: object,
    return_lse: object,
    compute_dtype: object,
    out_dtype: object,
    debug: object,
) -> PrefillShapes:
    """Check prefill's arguments (docs/numerics.md "Input checks"); return their sizes."""
    qt = _float_tensor(q, "q", 3)
    kt = _float_tensor(k, "k", 3)
    vt = _float_tensor(v, "v", 3)
    for t, name in ((kt, "k"), (vt, "v")):
        _same(t, qt, name, "q")
        _same_dtype(t, qt, name, "q")
    heads, head_dim_qk = qt.shape[1], qt.shape[2]
    kv_heads = kt.shape[1]
    _head_dim(head_dim_qk, "q")
    if kt.shape[2] != head_dim_qk:
        raise ValueError(f"k: expected head dim {head_dim_qk} (that of q), got {kt.shape[2]}")
    _head_dim(vt.shape[2], "v")
    if tuple(vt.shape[:2]) != tuple(kt.shape[:2]):
        raise ValueError(
            f"v: expected tokens and heads {tuple(kt.shape[:2])} (those of k), "
            f"got {tuple(vt.shape[:2])}"
        )
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"k: the number of KV heads ({kv_heads}) must divide the number of query heads "
            f"({heads}), both positive"
        )
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qt, "q", qt)
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", kt, "k", qt)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_k: expected {len(cu_q)} entries (the batch of cu_seqlens_q), "
            f"got {len(cu_k)}"
        )
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {return_lse!r}")
    if sparsity is not None and not isinstance(sparsity, NMSparsity):
        raise ValueError(
            f"sparsity: expected None or mla_formats.NMSparsity, got {type(sparsity).__name__}"
        )
    scale = _common(softmax_scale, quant, compute_dtype, out_dtype, debug)
    return PrefillShapes(
        softmax_scale=scale,
        cu_q=cu_q,
        cu_k=cu_k,
        heads=heads,
        kv_heads=kv_heads,
        head_dim_qk=head_dim_qk,
        head_dim_v=vt.shape[2],
    )


@dataclass(frozen=True)
class DecodeShapes:
    """Sizes of a checked decode call; ``q`` is the full ``[B, H, D]`` query."""

    softmax_scale: float
    q: torch.Tensor
    seq_lens: list[int]
    block_table: list[list[int]]
    page_size: int


def _decode_query(q: object, kv_lora_rank: int) -> torch.Tensor:
    if isinstance(q, torch.Tensor):
        return _float_tensor(q, "q", 3)
    if not isinstance(q, Sequence) or len(q) != 2:
        raise ValueError(
            "q: expected a [B, H, D] tensor or the pair (q_nope [B, H, kv_lora_rank], "
            f"q_pe [B, H, rope]), got {type(q).__name__}"
        )
    q_nope = _float_tensor(q[0], "q[0] (q_nope)", 3)
    q_pe = _float_tensor(q[1], "q[1] (q_pe)", 3)
    _same(q_pe, q_nope, "q[1] (q_pe)", "q_nope")
    _same_dtype(q_pe, q_nope, "q[1] (q_pe)", "q_nope")
    if q_nope.shape[2] != kv_lora_rank:
        raise ValueError(
            f"q[0] (q_nope): expected last dim kv_lora_rank = {kv_lora_rank}, got {q_nope.shape[2]}"
        )
    if tuple(q_pe.shape[:2]) != tuple(q_nope.shape[:2]):
        raise ValueError(
            f"q[1] (q_pe): expected batch and heads {tuple(q_nope.shape[:2])} (those of "
            f"q_nope), got {tuple(q_pe.shape[:2])}"
        )
    return torch.cat([q_nope, q_pe], dim=-1)


def check_decode(
    q: object,
    kv_cache: object,
    block_table: object,
    seq_lens: object,
    *,
    softmax_scale: object,
    kv_lora_rank: object,
    quant: object,
    compute_dtype: object,
    out_dtype: object,
    debug: object,
) -> DecodeShapes:
    """Check decode's arguments (docs/numerics.md "Input checks").

    Returns the full query and host-side indices.
    """
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        raise ValueError(f"kv_lora_rank: expected an int, got {kv_lora_rank!r}")
    if kv_lora_rank <= 0 or kv_lora_rank % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"kv_lora_rank: expected a positive multiple of {HEAD_DIM_MULTIPLE}, got {kv_lora_rank}"
        )
    qt = _decode_query(q, kv_lora_rank)
    cache = _float_tensor(kv_cache, "kv_cache", 3)
    _same(cache, qt, "kv_cache", "q")
    _same_dtype(cache, qt, "kv_cache", "q")
    num_blocks, page_size, dim = cache.shape
    if dim <= kv_lora_rank or dim % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"kv_cache: last dim {dim} must be kv_lora_rank ({kv_lora_rank}) plus a positive "
            f"rope width, a multiple of {HEAD_DIM_MULTIPLE} (576 = 512 + 64 for DeepSeek)"
        )
    if page_size <= 0:
        raise ValueError(f"kv_cache: page size (dim 1) must be positive, got {page_size}")
    if qt.shape[2] != dim:
        raise ValueError(f"q: expected head dim {dim} (that of kv_cache), got {qt.shape[2]}")
    if qt.shape[1] == 0:
        raise ValueError("q: expected at least one head")
    batch = qt.shape[0]

    table = _index_tensor(block_table, "block_table", 2)
    _same(table, qt, "block_table", "q")
    if table.shape[0] != batch:
        raise ValueError(
            f"block_table: expected {batch} rows (the batch of q), got {table.shape[0]}"
        )
    lens_t = _index_tensor(seq_lens, "seq_lens", 1)
    _same(lens_t, qt, "seq_lens", "q")
    if lens_t.shape[0] != batch:
        raise ValueError(
            f"seq_lens: expected {batch} entries (the batch of q), got {lens_t.shape[0]}"
        )
    lens = [int(x) for x in lens_t.tolist()]
    capacity = table.shape[1] * page_size
    for b, length in enumerate(lens):
        if length < 0:
            raise ValueError(f"seq_lens: entry {b} is negative ({length})")
        if length > capacity:
            raise ValueError(
                f"seq_lens: entry {b} is {length}, beyond the block table's capacity "
                f"{table.shape[1]} pages x {page_size} = {capacity}"
            )
    rows: list[list[int]] = [[int(x) for x in row] for row in table.tolist()]
    for b, length in enumerate(lens):
        used = rows[b][: -(-length // page_size)]
        bad = [page for page in used if not 0 <= page < num_blocks]
        if bad:
            raise ValueError(
                f"block_table: row {b} uses page {bad[0]}, outside the cache's "
                f"{num_blocks} blocks [0, {num_blocks})"
            )
    scale = _common(softmax_scale, quant, compute_dtype, out_dtype, debug)
    return DecodeShapes(
        softmax_scale=scale, q=qt, seq_lens=lens, block_table=rows, page_size=page_size
    )
