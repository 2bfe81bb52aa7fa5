"""Decode on read, the Triton split-K implementation (``triton_kernels.decode_split_kernel``).

K and V are quantized on read from the raw latent cache, once per tile for every head of
a program; runs on any GPU Triton supports and on the CPU through Triton's interpreter.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton.common.splitk import DecodeConfig, Operands, SplitFamily, block_h_for, scales
from mla_triton.ops.decode.triton_kernels import decode_split_kernel

__all__ = ["ON_READ", "OnRead", "default_config"]


def default_config(num_heads: int, quant: AttentionQuant | None = None) -> DecodeConfig:
    """The tiles for ``num_heads`` query heads and a recipe.

    64 heads a program over 8 warps where there are that many heads; on-read K/V QDQ holds a
    float32 copy of the tile in registers, so quantized recipes take smaller tiles
    (docs/design/decode.md).
    """
    block_h = block_h_for(num_heads)
    ops = () if quant is None else (quant.k, quant.v)
    nvfp4_kv = any(op.format.name == "nvfp4" for op in ops)
    quantized_kv = any(not op.is_identity for op in ops)
    if block_h == 64:
        block_n = 32 if nvfp4_kv else 64
        return DecodeConfig(block_h=64, block_n=block_n, num_warps=8, num_stages=2)
    if quantized_kv:
        return DecodeConfig(block_h=block_h, block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=3)


class OnRead(SplitFamily):
    """``decode``: K and V quantized on read from the raw cache (``decode_split_kernel``)."""

    kernel = decode_split_kernel

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        return default_config(num_heads, recipe)

    def v_shares_k(self, ops: Operands) -> bool:
        _, ko, vo, _ = ops
        return ko.code == 1 and vo.code == 1 and ko.pow2 and ko.gs == vo.gs

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        ko = ops[1]
        return {
            "k_scales": scales(ko.gs),
            "K_EXACT": not ko.pow2,
            "KV_SHARED": self.v_shares_k(ops),
        }


ON_READ = OnRead()
