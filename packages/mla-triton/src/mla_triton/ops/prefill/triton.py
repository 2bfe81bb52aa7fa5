"""Prefill, the portable Triton implementation (``triton_kernels.prefill_fwd_kernel``).

Every recipe, N:M sparsity, float32 inputs and head dims up to 576/512; any GPU Triton
supports and the CPU through Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_formats import AttentionQuant
from mla_triton.common import device as dev
from mla_triton.ops.prefill.core import (
    Checked,
    PrefillFamily,
    Recipe,
    cdiv,
    is_int,
    next_power_of_2,
    quantize_kv,
    split_head_dim,
    unit_scale,
)
from mla_triton.ops.prefill.triton_kernels import prefill_fwd_kernel

__all__ = ["TRITON", "PrefillConfig", "TritonPrefill", "default_config"]

_DOT_F32, _DOT_F16, _DOT_BF16 = 0, 1, 2
_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class PrefillConfig:
    """Tiling of ``prefill_fwd_kernel``.

    ``block_m`` queries and ``block_n`` keys per tile (powers of two, at least 16;
    ``block_n`` a multiple of the N:M group), ``num_warps`` (1, 2, 4, 8 or 16) and
    ``num_stages`` (1 to 4: the software-pipeline depth of the key loop; the tests
    and the benchmarks cover 1 to 3) as Triton takes them (ignored by the
    interpreter).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 16 or value & (value - 1):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {value!r}")
        if not is_int(self.num_warps) or self.num_warps not in _WARPS:
            raise ValueError(f"config.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not is_int(self.num_stages) or not 1 <= self.num_stages <= 4:
            raise ValueError(f"config.num_stages: expected 1 to 4, got {self.num_stages!r}")


def default_config(
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: AttentionQuant | None = None,
) -> PrefillConfig:
    """The tiling ``prefill`` uses unless given one (measured on an H200, bf16 192/128).

    192/128: 128 x 64 tiles over 8 warps, 3 stages; with NVFP4 P, 64 x 64 tiles
    over 4 warps and 2 stages instead, which fit two programs per SM, so that one
    program's softmax and P QDQ overlap the other's tensor-core work (3-5% faster
    there, 15% slower without P QDQ: docs/design/prefill.md). Large head dims
    (up to 576/512) and float32 inputs (IEEE dots on CUDA cores) take small query
    tiles so that the accumulators fit in registers.
    """
    if device.type != "cuda":  # the interpreter: fewer, larger tiles run faster
        return PrefillConfig(block_m=32, block_n=32)
    if dtype == torch.float32:
        return PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if head_dim_qk <= 256 and head_dim_v <= 128:
        if quant is not None and quant.p.format.name == "nvfp4":
            return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if head_dim_qk <= 256 and head_dim_v <= 256:
        return PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    return PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


class TritonPrefill(PrefillFamily):
    """``prefill_fwd_kernel``: every recipe, N:M sparsity, float32, head dims to 576/512."""

    name = "triton"

    def check_config(self, config: object, c: Checked) -> PrefillConfig:
        if config is None:
            config = default_config(c.q.shape[2], c.v.shape[2], c.q.dtype, c.q.device, c.quant)
        elif not isinstance(config, PrefillConfig):
            raise ValueError(
                f"config: expected None or a PrefillConfig, got {type(config).__name__}"
            )
        return self.check_key_tile(config, c)

    def launch(self, c: Checked, recipe: Recipe, config: PrefillConfig) -> None:
        if not dev.interpreted_bf16(c.q.dtype):
            _launch(c, c.q, c.k, c.v, c.out, recipe, config)
            return
        out32 = torch.empty(c.out.shape, dtype=torch.float32, device=c.out.device)
        _launch(c, c.q.float(), c.k.float(), c.v.float(), out32, recipe, config)
        c.out.copy_(out32)


TRITON = TritonPrefill()


def _launch(
    c: Checked,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    recipe: Recipe,
    config: PrefillConfig,
) -> None:
    """``prefill_fwd_kernel`` (after the K/V pass) on ``c``, with ``q``, ``k``, ``v`` and
    ``out`` those of ``c`` or their float32 copies (``device.interpreted_bf16``)."""
    _, heads, dim = q.shape
    kv_heads, dim_v = v.shape[1:]
    device = q.device
    batch = c.cu_q.numel() - 1
    r = recipe
    # Dot operand types: fp16 when both operands are quantized (their factored
    # values are exact in fp16; P's fp8 codes convert to fp16 in one step), else
    # the inputs' 16-bit type, or float32 IEEE dots for float32 inputs.
    plain = {torch.float16: _DOT_F16, torch.bfloat16: _DOT_BF16}.get(q.dtype, _DOT_F32)
    qk_dot = _DOT_F16 if r.q_fmt and r.k_fmt else plain
    pv_dot = _DOT_F16 if r.p_fmt and r.v_fmt else plain
    k_dtype, v_dtype = r.dot_dtypes(k.dtype)
    d1, d2 = split_head_dim(dim)
    dvp = next_power_of_2(dim_v)
    group = heads // kv_heads
    m_tiles = cdiv(c.max_seqlen_q, config.block_m)

    # K and V: quantized once (see the kernel module's docstring)
    kv_quant = r.k_fmt != 0 or r.v_fmt != 0
    fused = kv_quant and m_tiles == 1 and group == 1
    k_in, v_in, k_scales = k, v, unit_scale(device)
    if kv_quant and not fused:
        k_in, v_in, k_scales = quantize_kv(
            k, v, c.cu_k, c.quant, max_seqlen_k=c.max_seqlen_k, k_dtype=k_dtype, v_dtype=v_dtype
        )

    sparsity = c.sparsity
    nm_n, nm_m = (sparsity.n, sparsity.m) if sparsity is not None else (0, 1)
    n_sink = sparsity.dense_sink_tokens if sparsity is not None else 0
    n_recent = sparsity.dense_recent_tokens if sparsity is not None else 0
    prefill_fwd_kernel[(m_tiles, heads, batch)](
        q, k_in, v_in, k_scales, out, c.lse, c.cu_q, c.cu_k, q.shape[0], k.shape[0],
        r.qk_scale(c.softmax_scale), r.q_gs, r.k_gs, r.v_gs, r.p_gs, r.p_inv_gs, r.out_scale,
        n_sink, n_recent, group,
        q.stride(0), q.stride(1), k_in.stride(0), k_in.stride(1),
        v_in.stride(0), v_in.stride(1), k_scales.stride(0) if r.k_dynamic else 0,
        out.stride(0), out.stride(1), c.lse.stride(0),
        D1=d1, D2=d2, D2_VALID=dim - d1, DV=dim_v, DVP=dvp,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, CAUSAL=c.causal,
        Q_FMT=r.q_fmt, Q_DYNAMIC=r.q_dynamic, K_FMT=r.k_fmt, K_DYNAMIC=r.k_dynamic,
        V_FMT=r.v_fmt, KV_FUSED=fused, P_FMT=r.p_fmt,
        NM_N=nm_n, NM_M=nm_m, NM_DENSE=n_sink + n_recent > 0,
        QK_DOT=qk_dot, PV_DOT=pv_dot, RETURN_LSE=c.return_lse, HW_FP8=dev.hw_fp8(device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
