"""Hopper (sm90) prefill in Gluon: launcher of ``kernels.gluon_prefill``.

``launch`` takes the tensors ``mla_triton.prefill`` has already checked (SPEC 5) and
computes what ``prefill`` computes (fp16 / bf16), with TMA loads, wgmma and
mbarriers instead of Triton's generic pipeline. Q, K and V are QDQ'd (any format)
in passes before attention, by ``mla_triton.prefill.quantize_kv`` (Q through its K
path), into factored values (fp16 where both operands of a dot are quantized,
else the input dtype, exact either way); P is QDQ'd in the kernel between the two
MMAs (fp8 or nvfp4). What it does not cover (N:M sparsity, float32, head dims
other than multiples of 64 up to 256 for Q/K and 64 or 128 for V) raises
``ValueError`` naming the argument; ``unsupported`` gives the same reason without
raising, for a dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton.prefill import _global_scale, quantize_kv
from mla_triton.qdq_device import FORMAT_CODES

__all__ = ["GluonPrefillConfig", "Variant", "compile_sm90", "launch", "unsupported"]

LOG2E = 1.4426950408889634
_CHUNK = 64  # columns of one Q / K shared tile


@dataclass(frozen=True)
class GluonPrefillConfig:
    """Tiling of ``gluon_prefill_kernel``: ``block_m`` queries (64 or 128; 16 rows a
    warp), ``block_n`` keys (64 or 128) per tile, ``num_stages`` K/V buffers (2 to 4:
    a tile's loads are issued once the MMAs of the tile ``num_stages`` before it end);
    ``warp_specialize``: one extra producer warp issues every TMA load (24 registers,
    the compute warps get the rest) instead of the compute warps."""

    block_m: int = 128
    block_n: int = 64
    num_stages: int = 3
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"config.block_m: expected 64 or 128, got {self.block_m!r}")
        if self.block_n not in (64, 128):
            raise ValueError(f"config.block_n: expected 64 or 128, got {self.block_n!r}")
        if not isinstance(self.warp_specialize, bool):
            raise ValueError(
                f"config.warp_specialize: expected a bool, got {self.warp_specialize!r}"
            )
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 4:
            raise ValueError(f"config.num_stages: expected 2 to 4, got {self.num_stages!r}")

    @property
    def num_warps(self) -> int:
        """Warps of a program: 16 query rows each (one wgmma row block)."""
        return self.block_m // 16


def unsupported(
    q: torch.Tensor,
    v: torch.Tensor,
    quant: AttentionQuant | None,
    sparsity: NMSparsity | None,
) -> str | None:
    """Why ``launch`` cannot take these (checked) inputs, naming the argument; None if it
    can. Every recipe ``quant`` may give is covered (Q/K/V by the pass, P fp8 or nvfp4)."""
    if sparsity is not None:
        return "sparsity: the Gluon prefill has no N:M sparsity"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q: the Gluon prefill takes float16 or bfloat16, got {q.dtype}"
    dim, dim_v = q.shape[2], v.shape[2]
    if dim % _CHUNK or not _CHUNK <= dim <= 256:
        return f"q: head dim {dim} must be a multiple of 64 in [64, 256] for the Gluon prefill"
    if dim_v not in (64, 128):
        return f"v: head dim {dim_v} must be 64 or 128 for the Gluon prefill"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"q: the Gluon prefill needs a Hopper (sm90) GPU, got device {q.device}"
    return None


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` itself when a 2-d TMA view ``[T, cols]`` of it is legal (16-byte
    aligned base and token stride, non-negative head stride), else a contiguous copy."""
    size = x.element_size()
    if x.data_ptr() % 16 or (x.stride(0) * size) % 16 or x.stride(1) < 0 or x.stride(0) < 1:
        return x.contiguous()
    return x


def _descriptor(x: torch.Tensor, block: list[int]) -> object:
    """TMA descriptor of ``x [T, H, D]`` as ``[T, (H - 1) * stride_h + D]`` rows of
    stride ``stride_t`` (column ``h * stride_h + d`` is ``x[t, h, d]``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tokens, heads, dim = x.shape
    cols = (heads - 1) * x.stride(1) + dim
    return TensorDescriptor(x, [tokens, cols], [x.stride(0), 1], block, _layout(block, x.dtype))


def _layout(block: list[int], dtype: torch.dtype) -> object:
    """The shared-memory layout of a TMA block: NVMMA, the widest swizzle that fits."""
    from triton.experimental.gluon import language as gl

    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(block, gl_dtype)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    return_lse: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int | None = None,
    quant: AttentionQuant | None = None,
    sparsity: NMSparsity | None = None,
    config: GluonPrefillConfig | None = None,
) -> torch.Tensor:
    """Varlen attention on checked inputs (as ``prefill`` checks them); returns ``out``.

    ``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]`` (fp16 or bf16, unit
    stride on the head dim), ``cu_q`` / ``cu_k`` int32 ``[B + 1]`` offsets on q's
    device, ``out [T, H, Dv]`` in q's dtype, ``lse [H, T]`` float32 (written when
    ``return_lse``), ``max_seqlen_q`` the longest query sequence (sizes the grid),
    ``max_seqlen_k`` the longest key sequence (sizes the K/V pass only; any value is
    correct, ``max_seqlen_q`` by default).
    """
    reason = unsupported(q, v, quant, sparsity)
    if reason is not None:
        raise ValueError(reason)
    if config is None:
        config = GluonPrefillConfig()
    elif not isinstance(config, GluonPrefillConfig):
        raise ValueError(f"config: expected None or a GluonPrefillConfig, got {type(config)}")
    tokens, heads, dim = q.shape
    _, kv_heads, dim_v = v.shape
    batch = cu_q.numel() - 1
    if tokens == 0 or batch == 0 or max_seqlen_q == 0 or k.shape[0] == 0:
        if k.shape[0] == 0 and tokens:
            out.zero_()
            lse.fill_(float("-inf"))
        return out
    from mla_triton.kernels.gluon_prefill import gluon_prefill_kernel

    quant = quant or AttentionQuant()
    qq, kq, pq, vq = quant.q, quant.k, quant.p, quant.v
    q_fmt, k_fmt, p_fmt, v_fmt = (FORMAT_CODES[op.format.name] for op in (qq, kq, pq, vq))
    qk_dtype = torch.float16 if q_fmt and k_fmt else q.dtype
    pv_dtype = torch.float16 if p_fmt and v_fmt else q.dtype
    ones = torch.ones(1, dtype=torch.float32, device=q.device)
    q_scales = k_scales = ones
    if k_fmt or v_fmt:
        k, v, k_scales = quantize_kv(
            k, v, cu_k, quant, max_seqlen_k=max_seqlen_k or max_seqlen_q, k_dtype=qk_dtype,
            v_dtype=pv_dtype,
        )  # fmt: skip
    if q_fmt:  # Q through the pass's K path (V left alone: format none)
        q, _, q_scales = quantize_kv(
            q, q, cu_q, AttentionQuant(k=qq), max_seqlen_k=max_seqlen_q, k_dtype=qk_dtype
        )
    q_dynamic, k_dynamic = q_fmt != 0 and qq.is_dynamic, k_fmt != 0 and kq.is_dynamic
    qk_scale = softmax_scale * LOG2E * _static_gs(qq) * _static_gs(kq)
    p_gs = _global_scale(pq)

    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    bm, bn = config.block_m, config.block_n
    grid = (triton.cdiv(max_seqlen_q, bm), heads, batch)
    gluon_prefill_kernel[grid](
        _descriptor(q, [bm, _CHUNK]), _descriptor(k, [bn, _CHUNK]), _descriptor(v, [bn, dim_v]),
        out, lse, q_scales, k_scales, cu_q, cu_k, qk_scale, p_gs,
        1.0 / (6.0 * p_gs) if p_fmt == 2 else 1.0 / p_gs, p_gs * _global_scale(vq),
        heads // kv_heads, q.stride(1), k.stride(1), v.stride(1),
        q_scales.stride(0) if q_dynamic else 0, k_scales.stride(0) if k_dynamic else 0,
        out.stride(0), out.stride(1), lse.stride(0),
        **Variant(causal, return_lse, q_dynamic, k_dynamic, p_fmt).constexprs(dim, dim_v, config),
    )  # fmt: skip
    return out


def _static_gs(op: OperandQuant) -> float:
    """The global scale folded into ``qk_scale``: static ones (dynamic: per token)."""
    return 1.0 if op.is_dynamic else _global_scale(op)


@dataclass(frozen=True)
class Variant:
    """The kernel's compile-time switches besides the tiling: causal masking, LSE
    output, dynamic (per-token) Q and K global scales, and P's format code (0 none,
    1 fp8, 2 nvfp4)."""

    causal: bool
    return_lse: bool
    q_dynamic: bool = False
    k_dynamic: bool = False
    p_fmt: int = 0

    def constexprs(self, dim: int, dim_v: int, config: GluonPrefillConfig) -> dict[str, Any]:
        """The kernel's compile-time arguments (``num_warps`` too)."""
        return {
            "DQK": dim, "DV": dim_v, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
            "NUM_STAGES": config.num_stages, "CAUSAL": self.causal,
            "Q_DYNAMIC": self.q_dynamic, "K_DYNAMIC": self.k_dynamic, "P_FMT": self.p_fmt,
            "RETURN_LSE": self.return_lse, "WARP_SPEC": config.warp_specialize,
            "PRODUCER_REGS": 24, "num_warps": config.num_warps,
        }  # fmt: skip


def compile_sm90(
    dtype: torch.dtype,
    dim: int,
    dim_v: int,
    config: GluonPrefillConfig,
    variant: Variant,
    pv_dtype: torch.dtype | None = None,
) -> object:
    """Compile the kernel for sm_90a without a GPU (as ``launch`` would specialize it;
    ``dtype`` that of Q, K and out, ``pv_dtype`` that of V and P, ``dtype`` by default);
    returns Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared`` bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_triton.kernels.gluon_prefill import gluon_prefill_kernel

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}

    def desc(block: list[int], of: torch.dtype) -> str:
        return f"tensordesc<{names[of]}[{','.join(map(str, block))}],{_layout(block, of)!r}>"

    bm, bn, pv = config.block_m, config.block_n, pv_dtype or dtype
    signature = {
        "q_desc": desc([bm, _CHUNK], dtype), "k_desc": desc([bn, _CHUNK], dtype),
        "v_desc": desc([bn, dim_v], pv), "Out": f"*{names[dtype]}", "Lse": "*fp32",
        "QS": "*fp32", "KS": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
        "qk_scale": "fp32", "p_gs": "fp32", "p_inv_gs": "fp32", "out_scale": "fp32",
        "group": "i32",
        "stride_qh": "i32", "stride_kh": "i32", "stride_vh": "i32", "stride_qst": "i32",
        "stride_kst": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_lh": "i32",
    }  # fmt: skip
    constexprs = variant.constexprs(dim, dim_v, config)
    signature |= dict.fromkeys(constexprs, "constexpr")
    source = GluonASTSource(gluon_prefill_kernel, signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps}
    )
