"""What every prefill implementation shares: argument checks, the recipe as kernels take it,
the K/V pass (``quantize_kv``) and the family interface.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton.common import device as dev
from mla_triton.common.memo import by_identity
from mla_triton.common.qdq import FORMAT_CODES
from mla_triton.ops.prefill.triton_kernels import kv_qdq_kernel

__all__ = [
    "MAX_HEAD_DIM_QK",
    "MAX_HEAD_DIM_V",
    "Checked",
    "PrefillFamily",
    "Recipe",
    "cdiv",
    "check_cu",
    "check_max_seqlen",
    "check_offsets",
    "check_tensor",
    "fast_qdq_exact",
    "global_scale",
    "is_int",
    "next_power_of_2",
    "quantize_kv",
    "split_head_dim",
    "unit_scale",
]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM_QK = 576
MAX_HEAD_DIM_V = 512
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` on host integers (``ceil(a / b)``), without its constexpr wrapper."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on a positive host integer, without its constexpr wrapper."""
    return 1 << (n - 1).bit_length()


def split_head_dim(dim: int) -> tuple[int, int]:
    """``(D1, D2)``: the largest power of two <= dim, and the rest padded to a power of two."""
    d1 = 1 << (dim.bit_length() - 1)
    rest = dim - d1
    return d1, (next_power_of_2(rest) if rest else 0)


@functools.lru_cache(maxsize=256)
def global_scale(op: OperandQuant) -> float:
    """A static operand's global scale, rounded to float32 as ``mla_formats`` computes it
    (cached: a pure function of a frozen ``OperandQuant``)."""
    if op.is_identity or op.is_dynamic:
        return 1.0
    amax = torch.tensor(op.static_amax(), dtype=torch.float32)
    return float(amax / op.format.unit_amax)


def fast_qdq_exact(x: torch.Tensor, gs: float) -> bool:
    """The reciprocal QDQ path is bit-exact for 16-bit inputs and a power-of-two scale."""
    return x.dtype in (torch.float16, torch.bfloat16) and math.frexp(gs)[0] == 0.5


def check_tensor(x: object, name: str, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name}: expected a 3-d [tokens, heads, head_dim] tensor, got shape "
                         f"{tuple(x.shape)}")  # fmt: skip
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if device is None:
        if x.device.type != "cuda" and not (x.device.type == "cpu" and dev.interpreting()):
            raise ValueError(
                f"{name}: expected a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), "
                f"got device {x.device}"
            )
    elif x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    if x.numel() and x.stride(2) != 1:
        raise ValueError(f"{name}: expected a unit stride on the head dim, got strides "
                         f"{tuple(x.stride())}")  # fmt: skip
    return x


def unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 ``[1]`` tensor holding 1 on ``device``: the placeholder of the per-token
    scales a kernel reads only when they are dynamic (never written). One per device,
    made once (outside CUDA-graph capture: a tensor made during a capture is filled only
    when the graph replays, so it is made afresh there)."""
    key = (device.type, device.index)
    unit = _UNIT_SCALES.get(key)
    if unit is None:
        unit = torch.ones(1, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _UNIT_SCALES[key] = unit
    return unit


_UNIT_SCALES: dict[tuple[str, int | None], torch.Tensor] = {}


def check_cu(x: object, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.numel() < 1:
        raise ValueError(f"{name}: expected a 1-d [batch + 1] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    if x.dtype == torch.int32 and x.is_contiguous():
        return x  # what the conversion would return, without its two calls
    return x.to(torch.int32).contiguous()


def check_offsets(cu: torch.Tensor, name: str, tokens: int, tokens_name: str) -> int:
    """Check the offsets' values on the host; return the longest sequence."""
    values: list[int] = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]}")
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if min(lengths, default=0) < 0:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values}")
    if values[-1] != tokens:
        raise ValueError(f"{name}: last entry {values[-1]} must equal the number of tokens "
                         f"{tokens} (dim 0 of {tokens_name})")  # fmt: skip
    return max(lengths, default=0)


def check_max_seqlen(value: object, name: str, longest: int | None) -> int:
    """A given ``max_seqlen_*``; ``longest`` the checked offsets' longest sequence, if read."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected None or a non-negative int, got {value!r}")
    if longest is not None and value < longest:
        raise ValueError(f"{name}: {value} is less than the longest sequence, {longest}")
    return value


def quantize_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    quant: AttentionQuant,
    *,
    max_seqlen_k: int,
    k_dtype: torch.dtype | None = None,
    v_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prefill``'s K/V pass: QDQ fresh K and V once, before attention (no checks).

    ``k [Tk, Hkv, Dqk]`` and ``v [Tk, Hkv, Dv]`` as ``prefill`` takes them, int32
    offsets on their device. ``max_seqlen_k`` only sizes the launch: every key is
    quantized whatever its value (the longest sequence is the fastest choice).
    Returns ``(k_hat, v_hat, k_scales)``: the factored values of the quantized
    operands (the inputs themselves where ``quant`` leaves one unquantized) in
    ``k_dtype`` / ``v_dtype`` (exact in fp16, bf16 and fp32; the inputs' dtypes by
    default), and K's per-token global scales ``[Tk, Hkv]`` float32 when K's amax
    is dynamic (else a 1-element placeholder). Exposed for benchmarks and engines
    that want the pass on its own.
    """
    tokens_k, kv_heads, dim = k.shape
    dim_v = v.shape[2]
    device = k.device
    k_fmt, v_fmt = FORMAT_CODES[quant.k.format.name], FORMAT_CODES[quant.v.format.name]
    k_dynamic = k_fmt != 0 and quant.k.is_dynamic
    k_hat, v_hat = k, v
    k_scales = unit_scale(device)
    if k_fmt:
        k_hat = torch.empty(tokens_k, kv_heads, dim, dtype=k_dtype or k.dtype, device=device)
        if k_dynamic:
            k_scales = torch.empty(tokens_k, kv_heads, dtype=torch.float32, device=device)
    if v_fmt:
        v_hat = torch.empty(tokens_k, kv_heads, dim_v, dtype=v_dtype or v.dtype, device=device)
    batch = cu_seqlens_k.numel() - 1
    if not (k_fmt or v_fmt) or tokens_k == 0 or batch == 0:
        return k_hat, v_hat, k_scales
    d1, d2 = split_head_dim(dim)
    block_t = 32 if max(dim, dim_v) <= 256 else 16
    k_gs, v_gs = global_scale(quant.k), global_scale(quant.v)
    k_fast = k_fmt != 0 and not k_dynamic and fast_qdq_exact(k, k_gs)
    v_fast = v_fmt != 0 and fast_qdq_exact(v, v_gs)
    kv_qdq_kernel[(cdiv(max(max_seqlen_k, 1), block_t), kv_heads, batch)](
        k, v, k_hat, v_hat, k_scales, cu_seqlens_k, tokens_k, k_gs, v_gs,
        1.0 / (6.0 * k_gs) if k_fmt == 2 else 1.0 / k_gs,
        1.0 / (6.0 * v_gs) if v_fmt == 2 else 1.0 / v_gs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_hat.stride(0), k_hat.stride(1), v_hat.stride(0), v_hat.stride(1),
        k_scales.stride(0) if k_dynamic else 0,
        D1=d1, D2=d2, D2_VALID=dim - d1, DV=dim_v, DVP=next_power_of_2(dim_v),
        BLOCK_T=block_t, K_FMT=k_fmt, K_DYNAMIC=k_dynamic, V_FMT=v_fmt,
        K_FAST=k_fast, V_FAST=v_fast, HW_FP8=dev.hw_fp8(device),
        num_warps=4 if max(dim, dim_v) <= 256 else 8,
    )  # fmt: skip
    return k_hat, v_hat, k_scales


class _KeyTiled(Protocol):
    @property
    def block_n(self) -> int: ...


_Tiling = TypeVar("_Tiling", bound=_KeyTiled)


@dataclass(frozen=True)
class Checked:
    """``prefill``'s arguments after its checks (docs/numerics.md "LSE, masks and input checks"):
    ``q [T, H, Dqk]``, ``k [Tk, Hkv,
    Dqk]``, ``v [Tk, Hkv, Dv]``, int32 offsets ``cu_q`` / ``cu_k [B + 1]``, the outputs
    ``out [T, H, Dv]`` and ``lse [H, T]`` float32, ``quant`` never None, and the longest
    query / key sequence (``max_seqlen_*``, read or vouched for)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    softmax_scale: float
    causal: bool
    quant: AttentionQuant
    sparsity: NMSparsity | None
    return_lse: bool
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class Recipe:
    """A recipe as the kernels take it: format codes (0 none, 1 fp8, 2 nvfp4), dynamic
    (per-token) Q and K amax, static global scales (1.0 where dynamic or none)."""

    q_fmt: int
    k_fmt: int
    p_fmt: int
    v_fmt: int
    q_dynamic: bool
    k_dynamic: bool
    q_gs: float
    k_gs: float
    p_gs: float
    v_gs: float

    @classmethod
    def of(cls, quant: AttentionQuant) -> Recipe:
        """The recipe of ``quant`` (remembered per recipe object: a pure function of it)."""
        return _recipe_of(quant)

    def qk_scale(self, softmax_scale: float) -> float:
        """The scores' factor: softmax_scale * log2(e) times the static Q and K scales."""
        return softmax_scale * LOG2E * self.q_gs * self.k_gs

    @property
    def p_inv_gs(self) -> float:
        """``1 / p_gs`` (fp8) or ``1 / (6 p_gs)`` (nvfp4): P's QDQ divisor's reciprocal."""
        return 1.0 / (6.0 * self.p_gs) if self.p_fmt == 2 else 1.0 / self.p_gs

    @property
    def out_scale(self) -> float:
        """P's times V's global scale, applied once to the output."""
        return self.p_gs * self.v_gs

    def dot_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """Operand dtypes of ``Q Kᵀ`` and ``P V``: float16 when both operands are
        quantized (their factored values are exact in fp16), else ``dtype``."""
        qk = torch.float16 if self.q_fmt and self.k_fmt else dtype
        return qk, torch.float16 if self.p_fmt and self.v_fmt else dtype


class PrefillFamily:
    """What a prefill kernel family adds to the core (``prefill``'s checks, the outputs,
    the recipe, the Q/K/V pass ``quantize_kv``): its config check and default tiling,
    and its launch. The Triton kernel (``_TRITON``, here) and the Gluon one
    (``mla_triton.ops.prefill.gluon.FAMILY``, taken where ``choose`` says)."""

    name: str

    def check_config(self, config: object, c: Checked) -> Any:
        """``config`` checked for ``c`` (None: the family's default); ValueError names it."""
        raise NotImplementedError

    @staticmethod
    def check_key_tile(config: _Tiling, c: Checked) -> _Tiling:
        """``config`` if its key tile ``block_n`` holds whole N:M groups, else a ValueError."""
        if c.sparsity is not None and config.block_n % c.sparsity.m:
            raise ValueError(f"sparsity: m = {c.sparsity.m} must divide the key tile "
                             f"config.block_n = {config.block_n}")  # fmt: skip
        return config

    def launch(self, c: Checked, recipe: Recipe, config: Any) -> None:
        """Write ``c.out`` (and ``c.lse`` with ``c.return_lse``) for a non-empty batch."""
        raise NotImplementedError


@by_identity
def _recipe_of(quant: AttentionQuant) -> Recipe:
    q, k, p, v = (FORMAT_CODES[op.format.name] for op in (quant.q, quant.k, quant.p, quant.v))
    gs = [global_scale(op) for op in (quant.q, quant.k, quant.p, quant.v)]
    return Recipe(q, k, p, v, q != 0 and quant.q.is_dynamic, k != 0 and quant.k.is_dynamic,
                  gs[0], gs[1], gs[2], gs[3])  # fmt: skip
