"""Prefill, the Gluon implementation for sm90 (``gluon_kernels``: TMA loads, wgmma, mbarriers).

Q, K and V are QDQ'd (any format) by the pass ``core.quantize_kv`` (Q through its K path)
into factored values (fp16 where both operands of a dot are quantized, else the input
dtype, exact either way); with ``GluonPrefillConfig.q_in_kernel`` Q is QDQ'd in the kernel
instead where ``q_qdq_in_kernel`` says (fp8 any scale, nvfp4 a static one); P is QDQ'd in
the kernel between the two MMAs (fp8 or nvfp4), after the optional N:M selection. What the
kernel does not cover (N:M groups wider than 64 keys, float32, head dims other than
multiples of 64 up to 256 for Q/K and 64 or 128 for V): ``unsupported`` says why, for the
dispatch. The numbers are those of the Triton kernel (docs/numerics.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_formats import AttentionQuant, NMSparsity
from mla_triton.common.memo import by_identity
from mla_triton.ops.prefill.core import (
    Checked,
    PrefillFamily,
    Recipe,
    cdiv,
    fast_qdq_exact,
    quantize_kv,
    unit_scale,
)
from mla_triton.ops.prefill.gluon_kernels import gluon_prefill_kernel

__all__ = [
    "AUTO_CONFIGS",
    "FAMILY",
    "GluonPrefillConfig",
    "Variant",
    "auto_config",
    "compile_sm90",
    "q_qdq_in_kernel",
    "unsupported",
]

_CHUNK = 64  # columns of one Q / K shared tile


@dataclass(frozen=True)
class GluonPrefillConfig:
    """Tiling of ``gluon_prefill_kernel``: ``block_m`` queries (64 or 128; 16 rows a
    warp), ``block_n`` keys (64 or 128) per tile, ``num_stages`` K/V buffers (2 to 4:
    a tile's loads are issued once the MMAs of the tile ``num_stages`` before it end);
    ``warp_specialize``: one extra producer warp issues every TMA load (24 registers,
    the compute warps get the rest) instead of the compute warps; ``pingpong`` (with
    ``warp_specialize`` and ``block_m`` 128): the 128 rows go to two consumer
    warpgroups of 64 rows that take turns on the tensor cores (FA3's ping-pong: one's
    softmax, P QDQ and N:M under the other's MMAs); ``turns=False`` (with ``pingpong``):
    the two warpgroups run independently, without the turn barriers (FA3's schedule
    for head dims above 128, where it drops its warp-scheduler barrier);
    ``early_k`` (with ``warp_specialize``): a K slot is released to the producer as soon
    as its ``Q Kᵀ`` MMA is done and the producer loads K one tile ahead of V (FA3's
    separate K and V pipelines), instead of one release per slot after its ``P V``: with
    two stages the next K load then has a whole key step to land instead of none;
    ``nm_pairs``: 2:4 sparsity's rank of a group of four keys by its two pairs'
    maxima and minima (the second largest is ``max(min(max a b, max c d), max(min a b,
    min c d))``: a pair is one thread's two adjacent accumulator columns), about 3 integer
    instructions a key pair fewer than the general rank's two rounds of group maxima; the
    same kept keys (other N:M and no sparsity: no effect); ``nm_nan_rank``: N:M keeps a NaN
    score by its rank alone, without the ``s != s`` guard (a compare and a predicate op a
    score): a NaN score here is the kernel's own NaN constant (the NaN rule's ``-inf``) or
    a result of the GPU's arithmetic, a positive NaN whose sort key is above every other,
    so at most the third and fourth NaN of a group are dropped, and the row stays NaN
    (GPU tests: bit for bit against the guard; no effect without N:M); ``q_in_kernel``:
    a quantized Q is QDQ'd in the kernel, by each consumer in shared memory before its first
    ``Q Kᵀ`` (its dynamic per-token scales too), instead of by a pass over Q before the
    launch (one kernel and Q's round trip through memory fewer; the same factored values:
    GPU tests bit for bit against the pass; no effect for an unquantized Q, nor for nvfp4
    Q with a dynamic amax, which keeps the pass)."""

    block_m: int = 128
    block_n: int = 64
    num_stages: int = 3
    warp_specialize: bool = False
    pingpong: bool = False
    turns: bool = True
    early_k: bool = False
    nm_pairs: bool = False
    nm_nan_rank: bool = False
    q_in_kernel: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"config.block_m: expected 64 or 128, got {self.block_m!r}")
        if self.block_n not in (64, 128):
            raise ValueError(f"config.block_n: expected 64 or 128, got {self.block_n!r}")
        names = (
            "warp_specialize", "pingpong", "turns", "early_k", "nm_pairs", "nm_nan_rank",
            "q_in_kernel",
        )  # fmt: skip
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name}: expected a bool, got {getattr(self, name)!r}")
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 4:
            raise ValueError(f"config.num_stages: expected 2 to 4, got {self.num_stages!r}")
        if self.pingpong and not (self.warp_specialize and self.block_m == 128):
            raise ValueError("config.pingpong: needs warp_specialize=True and block_m=128")
        if not (self.turns or self.pingpong):
            raise ValueError("config.turns: False needs pingpong=True")
        if self.early_k and not self.warp_specialize:
            raise ValueError("config.early_k: needs warp_specialize=True")

    @property
    def num_warps(self) -> int:
        """Warps of a program's (first) consumer: 16 query rows each (one wgmma row
        block); ping-pong: one warpgroup of the two."""
        return self.block_m // (32 if self.pingpong else 16)

    @property
    def q_rows(self) -> int:
        """Rows of Q's TMA block: the tile, or one warpgroup's half of it (ping-pong)."""
        return self.block_m // (2 if self.pingpong else 1)

    @property
    def total_warps(self) -> int:
        """Warps of a program as compiled: the consumers, and the producer warp padded
        to a warpgroup when warp specialized."""
        return self.num_warps * (1 + self.pingpong) + 4 * self.warp_specialize


# The tiling ``prefill`` runs the Gluon kernel with (no config given), by P's format: the
# fastest measured on an H200 against FA3 in one process (docs/design/prefill.md): P none
# and fp8 ping-pong 128 x 128 x 2, K released after Q K^T, Q's QDQ in the kernel; nvfp4 two
# consumer warpgroups without turns at 128 x 64 x 3 (Q's QDQ in the pass: faster there);
# N:M sparsity warp-specialized 128 x 128 x 2.
_PINGPONG = GluonPrefillConfig(
    128, 128, 2, warp_specialize=True, pingpong=True, early_k=True, q_in_kernel=True
)
_NO_TURNS = GluonPrefillConfig(128, 64, 3, warp_specialize=True, pingpong=True, turns=False)
_WS_NM = GluonPrefillConfig(
    128, 128, 2, warp_specialize=True, early_k=True, nm_pairs=True, nm_nan_rank=True,
    q_in_kernel=True
)  # fmt: skip
AUTO_CONFIGS: dict[str, GluonPrefillConfig] = {
    "none": _PINGPONG,
    "fp8": _PINGPONG,
    "nvfp4": _NO_TURNS,
}
AUTO_CONFIGS |= {f"{name}+nm": _WS_NM for name in tuple(AUTO_CONFIGS)}
_P_FORMATS = ("none", "fp8", "nvfp4")  # by format code
CONSUMER_REGS = 240
"""Registers a thread of ping-pong's second consumer warpgroup asks for (FA3's 240:
two of them and the 24 of the producer warp fill the register file)."""


def auto_config(recipe: Recipe, sparse: bool = False) -> GluonPrefillConfig:
    """``AUTO_CONFIGS``' tiling for ``recipe``'s P format (``sparse``: with N:M)."""
    return AUTO_CONFIGS[_P_FORMATS[recipe.p_fmt] + ("+nm" if sparse else "")]


def q_qdq_in_kernel(config: GluonPrefillConfig, recipe: Recipe) -> bool:
    """Whether the kernel QDQs Q itself: ``config.q_in_kernel`` and a Q format it covers
    (fp8 with any scale, nvfp4 with a static one); otherwise the launcher's pass does."""
    return config.q_in_kernel and (
        recipe.q_fmt == 1 or (recipe.q_fmt == 2 and not recipe.q_dynamic)
    )


def unsupported(
    dtype: torch.dtype, dim: int, dim_v: int, sparsity: NMSparsity | None
) -> str | None:
    """Why the Gluon kernel does not cover inputs of ``dtype`` with head dims ``dim``
    (Q, K) and ``dim_v`` (V) and ``sparsity``, naming the argument; None if it does.
    Every recipe is covered (Q/K/V by the pass, P none, fp8 or nvfp4), and N:M
    sparsity with groups of up to 64 keys (whole groups in a key tile)."""
    if sparsity is not None and sparsity.m > _CHUNK:
        return f"sparsity: m = {sparsity.m} exceeds the Gluon prefill's 64-key tiles"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"q: the Gluon prefill takes float16 or bfloat16, got {dtype}"
    if dim % _CHUNK or not _CHUNK <= dim <= 256:
        return f"q: head dim {dim} must be a multiple of 64 in [64, 256] for the Gluon prefill"
    if dim_v not in (64, 128):
        return f"v: head dim {dim_v} must be 64 or 128 for the Gluon prefill"
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
    stride ``stride_t`` (column ``h * stride_h + d`` is ``x[t, h, d]``); ``x`` as
    ``_tma_ready`` leaves it and ``T > 0``.

    Triton validates a descriptor when it is made: the base's 16-byte alignment
    (``_tma_ready`` ensures it), positive sizes, and what depends only on the row
    stride, width, block and dtype. So the first descriptor of each of those is made
    and validated; later ones are copies of it with their own base and token count."""
    tokens, heads, dim = x.shape
    cols = (heads - 1) * x.stride(1) + dim
    proto = _proto_descriptor(cols, x.stride(0), tuple(block), x.dtype)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(proto.__dict__)
    desc.base, desc.shape = x, [tokens, cols]
    return desc


@functools.lru_cache(maxsize=256)
def _proto_descriptor(cols: int, stride: int, block: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A validated descriptor of ``[1, cols]`` rows of ``stride`` elements of ``dtype``
    (on an empty placeholder, address 0, never launched): ``_descriptor``'s template."""
    base = torch.empty(0, dtype=dtype)
    return TensorDescriptor(base, [1, cols], [stride, 1], list(block), _layout(list(block), dtype))


def _layout(block: list[int], dtype: torch.dtype) -> object:
    """The shared-memory layout of a TMA block: NVMMA, the widest swizzle that fits."""
    return _block_layout(tuple(block), dtype)


@functools.lru_cache(maxsize=64)
def _block_layout(block: tuple[int, ...], dtype: torch.dtype) -> object:
    """``_layout``, cached (a pure function of the block and dtype, built for every
    descriptor of every call otherwise)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


@by_identity
def _q_as_k(quant: AttentionQuant) -> AttentionQuant:
    """A recipe whose K is ``quant``'s Q (Q's pass through ``quantize_kv``'s K path)."""
    return AttentionQuant(k=quant.q)


class _Gluon(PrefillFamily):
    """``gluon_prefill_kernel`` after the Q and K/V passes (``quantize_kv``)."""

    name = "gluon"

    def check_config(self, config: object, c: Checked) -> GluonPrefillConfig:
        if config is None:
            config = auto_config(Recipe.of(c.quant), c.sparsity is not None)
        elif not isinstance(config, GluonPrefillConfig):
            raise ValueError(
                f"config: expected None or a GluonPrefillConfig, got {type(config).__name__}"
            )
        return self.check_key_tile(config, c)

    def launch(self, c: Checked, recipe: Recipe, config: GluonPrefillConfig) -> None:
        q, k, v, r = c.q, c.k, c.v, recipe
        if k.shape[0] == 0:  # no keys (no TMA view of an empty tensor): every row empty
            c.out.zero_()
            c.lse.fill_(float("-inf"))
            return
        heads, kv_heads, dim_v = q.shape[1], k.shape[1], v.shape[2]
        qk_dtype, pv_dtype = r.dot_dtypes(q.dtype)
        q_scales = k_scales = unit_scale(q.device)
        if r.k_fmt or r.v_fmt:
            k, v, k_scales = quantize_kv(
                k, v, c.cu_k, c.quant, max_seqlen_k=c.max_seqlen_k, k_dtype=qk_dtype,
                v_dtype=pv_dtype,
            )  # fmt: skip
        q_gs, q_inv, q_fast = r.q_gs, 1.0, False  # Q's QDQ in the kernel (q_in_kernel)
        in_kernel = q_qdq_in_kernel(config, r)
        if in_kernel:
            q_inv = 1.0 / (6.0 * q_gs) if r.q_fmt == 2 else 1.0 / q_gs
            q_fast = not r.q_dynamic and fast_qdq_exact(q, q_gs)
        elif r.q_fmt:  # Q through the pass's K path (V left alone: format none)
            q, _, q_scales = quantize_kv(
                q, q, c.cu_q, _q_as_k(c.quant), max_seqlen_k=c.max_seqlen_q,
                k_dtype=qk_dtype,
            )  # fmt: skip
        q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
        bm, bn = config.block_m, config.block_n
        variant = Variant(c.causal, c.return_lse, r.q_dynamic, r.k_dynamic, r.p_fmt,
                          *Variant.nm_of(c.sparsity), q_fmt=r.q_fmt if in_kernel else 0,
                          q_fast=q_fast)  # fmt: skip
        n_sink, n_recent = (
            (c.sparsity.dense_sink_tokens, c.sparsity.dense_recent_tokens) if c.sparsity
            else (0, 0)
        )  # fmt: skip
        grid = (cdiv(c.max_seqlen_q, bm), heads, c.cu_q.numel() - 1)
        gluon_prefill_kernel[grid](
            _descriptor(q, [config.q_rows, _CHUNK]), _descriptor(k, [bn, _CHUNK]),
            _descriptor(v, [bn, dim_v]), c.out, c.lse, q_scales, k_scales, c.cu_q, c.cu_k,
            q.shape[0], k.shape[0],
            r.qk_scale(c.softmax_scale), r.p_gs, r.p_inv_gs, r.out_scale, q_gs, q_inv,
            heads // kv_heads,
            n_sink, n_recent, q.stride(1), k.stride(1), v.stride(1),
            q_scales.stride(0) if r.q_dynamic else 0,
            k_scales.stride(0) if r.k_dynamic else 0, c.out.stride(0), c.out.stride(1),
            c.lse.stride(0), **variant.constexprs(q.shape[2], dim_v, config),
        )  # fmt: skip


FAMILY = _Gluon()


@dataclass(frozen=True)
class Variant:
    """The kernel's compile-time switches besides the tiling: causal masking, LSE
    output, dynamic (per-token) Q and K global scales, P's format code (0 none, 1 fp8,
    2 nvfp4), and N:M sparsity (``nm_n`` of every ``nm_m`` keys, 0 for none;
    ``nm_dense``: dense sink or recent keys); Q's format code ``q_fmt`` and ``q_fast``
    (16-bit Q, a static power-of-two global scale: the reciprocal path), read only for a
    tiling with ``q_in_kernel``."""

    causal: bool
    return_lse: bool
    q_dynamic: bool = False
    k_dynamic: bool = False
    p_fmt: int = 0
    nm_n: int = 0
    nm_m: int = 1
    nm_dense: bool = False
    q_fmt: int = 0
    q_fast: bool = False

    @staticmethod
    def nm_of(sparsity: NMSparsity | None) -> tuple[int, int, bool]:
        """``(nm_n, nm_m, nm_dense)`` of ``sparsity`` (``(0, 1, False)`` for None)."""
        if sparsity is None:
            return 0, 1, False
        dense = sparsity.dense_sink_tokens + sparsity.dense_recent_tokens > 0
        return sparsity.n, sparsity.m, dense

    def constexprs(self, dim: int, dim_v: int, config: GluonPrefillConfig) -> dict[str, Any]:
        """The kernel's compile-time arguments (``num_warps`` too)."""
        return {
            "DQK": dim, "DV": dim_v, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
            "NUM_STAGES": config.num_stages, "CAUSAL": self.causal,
            "Q_DYNAMIC": self.q_dynamic, "K_DYNAMIC": self.k_dynamic, "P_FMT": self.p_fmt,
            "Q_FMT": self.q_fmt if config.q_in_kernel else 0,
            "Q_FAST": self.q_fast and config.q_in_kernel,
            "NM_N": self.nm_n, "NM_M": self.nm_m, "NM_DENSE": self.nm_dense,
            "NM_PAIRS": config.nm_pairs, "NM_NAN_RANK": config.nm_nan_rank,
            "RETURN_LSE": self.return_lse, "WARP_SPEC": config.warp_specialize,
            "PINGPONG": config.pingpong, "TURNS": config.turns, "EARLY_K": config.early_k,
            "PRODUCER_REGS": 24,
            "CONSUMER_REGS": CONSUMER_REGS, "num_warps": config.num_warps,
        }  # fmt: skip


def compile_sm90(
    dtype: torch.dtype,
    dim: int,
    dim_v: int,
    config: GluonPrefillConfig,
    variant: Variant,
    pv_dtype: torch.dtype | None = None,
    k_dtype: torch.dtype | None = None,
) -> object:
    """Compile the kernel for sm_90a without a GPU (as ``launch`` would specialize it;
    ``dtype`` that of Q and out, ``k_dtype`` that of K, ``pv_dtype`` that of V and P, both
    ``dtype`` by default);
    returns Triton's ``CompiledKernel`` (``.asm["ptx"]``, ``.metadata.shared`` bytes)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}

    def desc(block: list[int], of: torch.dtype) -> str:
        return f"tensordesc<{names[of]}[{','.join(map(str, block))}],{_layout(block, of)!r}>"

    bn, pv = config.block_n, pv_dtype or dtype
    signature = {
        "q_desc": desc([config.q_rows, _CHUNK], dtype),
        "k_desc": desc([bn, _CHUNK], k_dtype or dtype),
        "v_desc": desc([bn, dim_v], pv), "Out": f"*{names[dtype]}", "Lse": "*fp32",
        "QS": "*fp32", "KS": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
        "rows_q": "i32", "rows_k": "i32", "qk_scale": "fp32", "p_gs": "fp32",
        "p_inv_gs": "fp32", "out_scale": "fp32",
        "q_gs": "fp32", "q_inv": "fp32",
        "group": "i32", "n_sink": "i32", "n_recent": "i32",
        "stride_qh": "i32", "stride_kh": "i32", "stride_vh": "i32", "stride_qst": "i32",
        "stride_kst": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_lh": "i32",
    }  # fmt: skip
    constexprs = variant.constexprs(dim, dim_v, config)
    signature |= dict.fromkeys(constexprs, "constexpr")
    source = GluonASTSource(gluon_prefill_kernel, signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps}
    )
