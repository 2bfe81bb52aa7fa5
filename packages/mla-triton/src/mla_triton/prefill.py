"""``prefill``: varlen quantized MLA prefill attention (SPEC 3 to 6), launch wrapper.

Checks its inputs (SPEC 5), resolves the quantization recipe into kernel
constants, quantizes fresh K and V once (``kv_qdq_kernel``) where the attention
kernel would otherwise repeat that per query tile, and launches
``prefill_fwd_kernel``. The numbers it computes are those of docs/numerics.md.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import torch
import triton

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton.kernels.prefill_kernel import kv_qdq_kernel, prefill_fwd_kernel
from mla_triton.qdq_device import FORMAT_CODES

__all__ = [
    "GLUON_NM_AUTO",
    "IMPLS",
    "Checked",
    "Choice",
    "PrefillConfig",
    "PrefillFamily",
    "Recipe",
    "default_config",
    "prefill",
    "quantize_kv",
    "select_impl",
]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM_QK = 576
MAX_HEAD_DIM_V = 512
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DOT_F32, _DOT_F16, _DOT_BF16 = 0, 1, 2
_WARPS = (1, 2, 4, 8, 16)
IMPLS = ("auto", "triton", "gluon")
"""``prefill``'s ``impl`` values: ``auto`` (Gluon where ``select_impl`` takes it, else
Triton), ``triton`` (the portable kernel), ``gluon`` (the sm90 kernel, or ValueError)."""
GLUON_NM_AUTO = True
"""Whether ``impl="auto"`` takes the Gluon kernel for N:M ``sparsity`` on sm90 (on since
its GPU tests passed on an H200, ``benchmarks/results/gpu-suites-flips``; off: the
Triton kernel; ``impl="gluon"`` or a ``GluonPrefillConfig`` runs it either way)."""
_LOG = logging.getLogger("mla_triton")
_LOGGED: set[str] = set()  # fallback reasons logged once


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
            if not _is_int(value) or value < 16 or value & (value - 1):
                raise ValueError(f"config.{name}: expected a power of two >= 16, got {value!r}")
        if not _is_int(self.num_warps) or self.num_warps not in _WARPS:
            raise ValueError(f"config.num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not _is_int(self.num_stages) or not 1 <= self.num_stages <= 4:
            raise ValueError(f"config.num_stages: expected 1 to 4, got {self.num_stages!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _bf16_in_float32(dtype: torch.dtype) -> bool:
    """Whether bf16 inputs run the kernels in float32: under Triton's interpreter, whose
    bf16 arithmetic and bf16 dots are wrong (on a GPU bf16 runs as bf16)."""
    return dtype == torch.bfloat16 and _interpreting()


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
    there, 15% slower without P QDQ: docs/benchmarks-prefill.md). Large head dims
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


def _split_head_dim(dim: int) -> tuple[int, int]:
    """``(D1, D2)``: the largest power of two <= dim, and the rest padded to a power of two."""
    d1 = 1 << (dim.bit_length() - 1)
    rest = dim - d1
    return d1, (triton.next_power_of_2(rest) if rest else 0)


def _global_scale(op: OperandQuant) -> float:
    """A static operand's global scale, rounded to float32 as ``mla_formats`` computes it."""
    if op.is_identity or op.is_dynamic:
        return 1.0
    amax = torch.tensor(op.static_amax(), dtype=torch.float32)
    return float(amax / op.format.unit_amax)


def _hw_fp8(device: torch.device) -> bool:
    """Whether kernels may use the fp8 conversion instruction (sm89+, not the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _fast_qdq_exact(x: torch.Tensor, gs: float) -> bool:
    """The reciprocal QDQ path is bit-exact for 16-bit inputs and a power-of-two scale."""
    return x.dtype in (torch.float16, torch.bfloat16) and math.frexp(gs)[0] == 0.5


def _check_tensor(x: object, name: str, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name}: expected a 3-d [tokens, heads, head_dim] tensor, got shape "
                         f"{tuple(x.shape)}")  # fmt: skip
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if device is None:
        if x.device.type != "cuda" and not (x.device.type == "cpu" and _interpreting()):
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


def _check_cu(x: object, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.numel() < 1:
        raise ValueError(f"{name}: expected a 1-d [batch + 1] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32 or int64 tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    return x.to(torch.int32).contiguous()


def _check_offsets(cu: torch.Tensor, name: str, tokens: int, tokens_name: str) -> int:
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


def _check_max_seqlen(value: object, name: str, longest: int | None) -> int:
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
    k_scales = torch.ones(1, dtype=torch.float32, device=device)
    if k_fmt:
        k_hat = torch.empty(tokens_k, kv_heads, dim, dtype=k_dtype or k.dtype, device=device)
        if k_dynamic:
            k_scales = torch.empty(tokens_k, kv_heads, dtype=torch.float32, device=device)
    if v_fmt:
        v_hat = torch.empty(tokens_k, kv_heads, dim_v, dtype=v_dtype or v.dtype, device=device)
    batch = cu_seqlens_k.numel() - 1
    if not (k_fmt or v_fmt) or tokens_k == 0 or batch == 0:
        return k_hat, v_hat, k_scales
    d1, d2 = _split_head_dim(dim)
    block_t = 32 if max(dim, dim_v) <= 256 else 16
    k_gs, v_gs = _global_scale(quant.k), _global_scale(quant.v)
    k_fast = k_fmt != 0 and not k_dynamic and _fast_qdq_exact(k, k_gs)
    v_fast = v_fmt != 0 and _fast_qdq_exact(v, v_gs)
    kv_qdq_kernel[(triton.cdiv(max(max_seqlen_k, 1), block_t), kv_heads, batch)](
        k, v, k_hat, v_hat, k_scales, cu_seqlens_k, k_gs, v_gs,
        1.0 / (6.0 * k_gs) if k_fmt == 2 else 1.0 / k_gs,
        1.0 / (6.0 * v_gs) if v_fmt == 2 else 1.0 / v_gs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_hat.stride(0), k_hat.stride(1), v_hat.stride(0), v_hat.stride(1),
        k_scales.stride(0) if k_dynamic else 0,
        D1=d1, D2=d2, D2_VALID=dim - d1, DV=dim_v, DVP=triton.next_power_of_2(dim_v),
        BLOCK_T=block_t, K_FMT=k_fmt, K_DYNAMIC=k_dynamic, V_FMT=v_fmt,
        K_FAST=k_fast, V_FAST=v_fast, HW_FP8=_hw_fp8(device),
        num_warps=4 if max(dim, dim_v) <= 256 else 8,
    )  # fmt: skip
    return k_hat, v_hat, k_scales


if TYPE_CHECKING:
    from typing_extensions import Required, TypedDict, Unpack

    class _Options(TypedDict, total=False):
        """``prefill``'s keyword arguments but ``return_lse`` (for its overloads)."""

        softmax_scale: Required[float]
        causal: bool
        quant: AttentionQuant | None
        sparsity: NMSparsity | None
        out: torch.Tensor | None
        max_seqlen_q: int | None
        max_seqlen_k: int | None
        config: PrefillConfig | Any | None
        impl: str


_T = torch.Tensor


# fmt: off
@overload
def prefill(q: _T, k: _T, v: _T, cu_seqlens_q: _T, cu_seqlens_k: _T, *,
            return_lse: Literal[False] = ..., **options: Unpack[_Options]) -> _T: ...
@overload
def prefill(q: _T, k: _T, v: _T, cu_seqlens_q: _T, cu_seqlens_k: _T, *,
            return_lse: Literal[True], **options: Unpack[_Options]) -> tuple[_T, _T]: ...
@overload
def prefill(q: _T, k: _T, v: _T, cu_seqlens_q: _T, cu_seqlens_k: _T, *,
            return_lse: bool, **options: Unpack[_Options]) -> _T | tuple[_T, _T]: ...
# fmt: on


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    quant: AttentionQuant | None = None,
    sparsity: NMSparsity | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: PrefillConfig | Any | None = None,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen flash attention with NVFP4/FP8 QDQ of Q, K, P and V (SPEC 3 to 6).

    Args:
        q: ``[T, H, Dqk]`` queries of all sequences, packed (DeepSeek: Dqk = 192).
        k: ``[Tk, Hkv, Dqk]`` keys, packed; ``Hkv`` divides ``H``, query head ``h``
            reads KV head ``h // (H // Hkv)``.
        v: ``[Tk, Hkv, Dv]`` values (DeepSeek: Dv = 128). Head dims are multiples of
            16, Dqk <= 576 and Dv <= 512. q, k, v share dtype (float16, bfloat16 or
            float32) and device; any strides with a unit stride on the head dim.
            Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), whose
            bf16 arithmetic is wrong, bfloat16 inputs are computed in float32 and
            the output is rounded to bfloat16 (on a GPU they run in bf16).
        cu_seqlens_q: int32 (or int64) ``[B + 1]`` offsets of each sequence in q;
            ``B = 0`` (``[0]``, no tokens) gives empty outputs.
        cu_seqlens_k: int32 (or int64) ``[B + 1]`` offsets of each sequence in k and v.
        softmax_scale: positive factor of the dot products, ``s = (q̂ · k̂) * scale``.
        causal: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sits at
            key position ``Lk - Lq + i`` (suffix alignment) and sees keys up to it;
            otherwise every query sees all ``Lk`` keys (vLLM's context chunks).
        quant: ``mla_formats.AttentionQuant`` or None (no quantization). Q and K are
            QDQ'd along the head dim (amax dynamic per token and head, or static); P
            and V along the key axis, blocks at key positions 0, 16, ... of each
            sequence, with static amax (``AttentionQuant`` requires P's to be at
            least 1).
        sparsity: ``mla_formats.NMSparsity`` or None: N:M score sparsity over groups
            of M keys at absolute key positions, with dense sink and recent windows;
            a sequence with a single query is not sparsified.
        return_lse: also return the natural-log LSE ``[H, T]`` (float32).
        out: optional ``[T, H, Dv]`` buffer of q's dtype to write into (any strides
            with a unit stride on the head dim, e.g. a slice of a larger tensor).
        max_seqlen_q: the longest query sequence (as flash-attn's varlen API takes
            it). Given with ``max_seqlen_k``, no host sync happens and the offsets'
            values are not checked: the caller vouches for the offsets and for
            ``max_seqlen_q`` (an understated value leaves the rows past it
            unwritten). Otherwise the offsets are read back and checked (start at 0,
            non-decreasing, end at the token count) and a given value smaller than
            the longest sequence raises ``ValueError``.
        max_seqlen_k: the longest key sequence: it only sizes the K/V pass's launch,
            which covers every key whatever the value, so an understated one is
            slower, never wrong. Checked as ``max_seqlen_q`` is.
        config: tiling override: a ``PrefillConfig`` (the Triton kernel) or a
            ``mla_triton.gluon_prefill.GluonPrefillConfig`` (the Gluon kernel; with
            ``impl="auto"`` it asks for Gluon); None: ``default_config`` or
            ``gluon_prefill.auto_config``.
        impl: ``"auto"`` (default), ``"triton"`` or ``"gluon"``. ``auto`` runs the
            Gluon kernel (``mla_triton.gluon_prefill``) on an sm90 GPU (capability
            (9, 0)) when the installed Triton has the Gluon API it needs and the
            inputs are ones it covers (float16 / bfloat16, Dqk a multiple of 64 up to
            256, Dv 64 or 128, no ``PrefillConfig``; ``sparsity`` only while
            ``GLUON_NM_AUTO`` is on, or with ``impl="gluon"``), else the Triton
            kernel (``select_impl``; a fallback on sm90 for a reason other than the
            inputs is logged once on the ``mla_triton`` logger). ``gluon`` where the
            Gluon kernel cannot run raises ``ValueError`` naming ``impl`` with the
            reason. Both compute the same numbers (docs/numerics.md).

    Returns:
        ``out [T, H, Dv]`` in q's dtype, or ``(out, lse)`` with ``lse [H, T]`` float32.
        A row without a visible key gets ``out = 0`` and ``lse = -inf``.

    K and V are quantized once, in a pass before attention (``quantize_kv``), or
    inside the attention kernel when each of their tiles is read by one program
    only (a single query tile per sequence, no GQA sharing); the numbers are the
    same.

    Non-finite input is not checked; it follows the NaN rule of docs/numerics.md,
    as ``mla_reference.prefill`` does. QDQ turns NaN and ±inf into NaN and poisons
    the value's nvfp4 block and, with a dynamic amax, its row. An output row is
    NaN exactly when it reads a non-finite operand element after QDQ (for format
    none the raw value): its q̂, or the k̂ or v̂ of a key it sees (causal
    visibility, or every key when not causal; a key that N:M drops is still seen).
    Its LSE is NaN too when that element is in q̂ or k̂, and unchanged for v̂.
    Other rows are unaffected.
    """
    q = _check_tensor(q, "q")
    device = q.device
    k = _check_tensor(k, "k", device)
    v = _check_tensor(v, "v", device)
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (that of q), got {t.dtype}")
    tokens, heads, dim = q.shape
    tokens_k, kv_heads, dim_v = v.shape
    if dim % 16 or not 16 <= dim <= MAX_HEAD_DIM_QK:
        raise ValueError(f"q: head dim {dim} must be a multiple of 16 in [16, {MAX_HEAD_DIM_QK}]")
    if tuple(k.shape) != (tokens_k, kv_heads, dim):
        raise ValueError(f"k: expected shape {(tokens_k, kv_heads, dim)} (tokens and heads of v, "
                         f"head dim of q), got {tuple(k.shape)}")  # fmt: skip
    if dim_v % 16 or not 16 <= dim_v <= MAX_HEAD_DIM_V:
        raise ValueError(f"v: head dim {dim_v} must be a multiple of 16 in [16, {MAX_HEAD_DIM_V}]")
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k: the number of KV heads ({kv_heads}) must divide the number of "
                         f"query heads ({heads}), both positive")  # fmt: skip
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", device)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_k: expected {cu_q.numel()} entries (those of "
                         f"cu_seqlens_q), got {cu_k.numel()}")  # fmt: skip
    batch = cu_q.numel() - 1
    for name, n, what in (("cu_seqlens_q", tokens, "q"), ("cu_seqlens_k", tokens_k, "k")):
        if batch == 0 and n:
            raise ValueError(f"{name}: [0] (no sequences) but {what} has {n} tokens")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a float, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {return_lse!r}")
    if quant is None:
        quant = AttentionQuant()
    elif not isinstance(quant, AttentionQuant):
        raise ValueError(
            f"quant: expected None or mla_formats.AttentionQuant, got {type(quant).__name__}"
        )
    if sparsity is not None and not isinstance(sparsity, NMSparsity):
        raise ValueError(
            f"sparsity: expected None or mla_formats.NMSparsity, got {type(sparsity).__name__}"
        )
    family, config = _family(impl, config, q, dim_v, sparsity)
    if out is None:
        out = torch.empty(tokens, heads, dim_v, dtype=q.dtype, device=device)
    else:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: expected None or a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (tokens, heads, dim_v) or out.dtype != q.dtype:
            raise ValueError(f"out: expected shape {(tokens, heads, dim_v)} and dtype {q.dtype}, "
                             f"got {tuple(out.shape)} {out.dtype}")  # fmt: skip
        if out.device != device:
            raise ValueError(f"out: expected device {device} (that of q), got {out.device}")
        if out.numel() and out.stride(2) != 1:
            raise ValueError(f"out: expected a unit stride on the head dim, got strides "
                             f"{tuple(out.stride())}")  # fmt: skip
    longest_q = longest_k = None
    if max_seqlen_q is None or max_seqlen_k is None:
        longest_q = _check_offsets(cu_q, "cu_seqlens_q", tokens, "q")
        longest_k = _check_offsets(cu_k, "cu_seqlens_k", tokens_k, "k")
    max_q = longest_q if max_seqlen_q is None else max_seqlen_q
    max_k = longest_k if max_seqlen_k is None else max_seqlen_k
    max_q = _check_max_seqlen(max_q, "max_seqlen_q", longest_q)
    max_k = _check_max_seqlen(max_k, "max_seqlen_k", longest_k)

    lse = torch.empty(heads, tokens, dtype=torch.float32, device=device)
    c = Checked(q, k, v, cu_q, cu_k, out, lse, float(softmax_scale), causal, quant, sparsity,
                return_lse, max_q, max_k)  # fmt: skip
    config = family.check_config(config, c)
    if tokens and max_q:
        family.launch(c, Recipe.of(quant), config)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class Checked:
    """``prefill``'s arguments after its checks (SPEC 5): ``q [T, H, Dqk]``, ``k [Tk, Hkv,
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
        q, k, p, v = (FORMAT_CODES[op.format.name] for op in (quant.q, quant.k, quant.p, quant.v))
        gs = [_global_scale(op) for op in (quant.q, quant.k, quant.p, quant.v)]
        return cls(q, k, p, v, q != 0 and quant.q.is_dynamic, k != 0 and quant.k.is_dynamic,
                   gs[0], gs[1], gs[2], gs[3])  # fmt: skip

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
    (``mla_triton.gluon_prefill.FAMILY``, taken where ``select_impl`` says)."""

    name: str

    def check_config(self, config: object, c: Checked) -> Any:
        """``config`` checked for ``c`` (None: the family's default); ValueError names it."""
        raise NotImplementedError

    def launch(self, c: Checked, recipe: Recipe, config: Any) -> None:
        """Write ``c.out`` (and ``c.lse`` with ``c.return_lse``) for a non-empty batch."""
        raise NotImplementedError


class _Triton(PrefillFamily):
    """``prefill_fwd_kernel``: every recipe, N:M sparsity, float32, head dims to 576/512."""

    name = "triton"

    def check_config(self, config: object, c: Checked) -> PrefillConfig:
        if config is None:
            config = default_config(c.q.shape[2], c.v.shape[2], c.q.dtype, c.q.device, c.quant)
        elif not isinstance(config, PrefillConfig):
            raise ValueError(
                f"config: expected None or a PrefillConfig, got {type(config).__name__}"
            )
        if c.sparsity is not None and config.block_n % c.sparsity.m:
            raise ValueError(f"sparsity: m = {c.sparsity.m} must divide the key tile "
                             f"config.block_n = {config.block_n}")  # fmt: skip
        return config

    def launch(self, c: Checked, recipe: Recipe, config: PrefillConfig) -> None:
        if not _bf16_in_float32(c.q.dtype):
            _launch(c, c.q, c.k, c.v, c.out, recipe, config)
            return
        out32 = torch.empty(c.out.shape, dtype=torch.float32, device=c.out.device)
        _launch(c, c.q.float(), c.k.float(), c.v.float(), out32, recipe, config)
        c.out.copy_(out32)


_TRITON = _Triton()


class Choice(NamedTuple):
    """``select_impl``'s answer: the family to run, why ``auto`` did not take Gluon
    (None when it did, or when Triton was asked for), and whether that reason is
    unexpected on an sm90 GPU (logged once)."""

    impl: str
    reason: str | None = None
    unexpected: bool = False


def select_impl(
    impl: object,
    *,
    capability: tuple[int, int] | None,
    gluon_api: str | None,
    gluon_unsupported: str | None,
    config_impl: str | None,
    nm_gated: bool = False,
) -> Choice:
    """Which prefill family runs (a pure function of what ``prefill`` finds).

    ``capability``: q's CUDA device capability (None: CPU or Triton's interpreter);
    ``gluon_api``: why the installed Triton lacks the Gluon API the kernel needs
    (None: it has it); ``gluon_unsupported``: why the Gluon kernel does not cover the
    inputs (recipe, dtype, head dims, sparsity; None: it does); ``config_impl``: the
    family of a given config (``"triton"`` for a ``PrefillConfig``, ``"gluon"`` for a
    ``GluonPrefillConfig``, None without one). Raises ValueError naming ``impl`` for an
    unknown value or ``"gluon"`` where it cannot run, naming ``config`` for a config of
    the other family. ``nm_gated``: the inputs have N:M sparsity and
    ``GLUON_NM_AUTO`` is off, so ``auto`` without a config keeps Triton (not logged).
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl: expected 'auto', 'triton' or 'gluon', got {impl!r}")
    if config_impl is not None and impl != "auto" and config_impl != impl:
        raise ValueError(f"config: a {config_impl} tiling, but impl={impl!r}")
    if impl == "triton" or config_impl == "triton":
        return Choice("triton", "config: a PrefillConfig (the Triton tiling)" if impl == "auto"
                      else None)  # fmt: skip
    reason = None
    if capability != (9, 0):
        got = capability if capability is not None else "no CUDA GPU (CPU or the interpreter)"
        reason = f"q: the Gluon prefill needs an sm90 GPU (capability (9, 0)), got {got}"
    unexpected = False
    for found, is_api in ((gluon_api, True), (gluon_unsupported, False)):
        if reason is None and found is not None:
            reason, unexpected = found, is_api
    if reason is None and nm_gated and impl == "auto" and config_impl is None:
        reason = "sparsity: N:M on the Gluon prefill is off in auto (prefill.GLUON_NM_AUTO)"
    if reason is None:
        return Choice("gluon")
    if impl == "gluon" or config_impl == "gluon":
        what = "impl" if impl == "gluon" else "config"
        raise ValueError(f"{what}: the Gluon prefill cannot run these inputs: {reason}")
    return Choice("triton", reason, unexpected)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA capability; None on a CPU or under Triton's interpreter."""
    if device.type != "cuda" or _interpreting():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def _family(
    impl: object, config: object, q: torch.Tensor, dim_v: int, sparsity: NMSparsity | None
) -> tuple[PrefillFamily, object]:
    """The family ``select_impl`` picks for checked inputs; logs an unexpected fallback."""
    from mla_triton import gluon_prefill

    if config is None or isinstance(config, PrefillConfig):
        config_impl = None if config is None else "triton"
    elif isinstance(config, gluon_prefill.GluonPrefillConfig):
        config_impl = "gluon"
    else:
        raise ValueError(f"config: expected None, a PrefillConfig or a GluonPrefillConfig, "
                         f"got {type(config).__name__}")  # fmt: skip
    capability = _capability(q.device)
    on_sm90 = capability == (9, 0) and impl != "triton" and config_impl != "triton"
    choice = select_impl(
        impl, capability=capability,
        gluon_api=gluon_prefill.api_missing() if on_sm90 else None,
        gluon_unsupported=gluon_prefill.unsupported(q.dtype, q.shape[2], dim_v, sparsity),
        config_impl=config_impl, nm_gated=sparsity is not None and not GLUON_NM_AUTO,
    )  # fmt: skip
    if choice.unexpected and choice.reason not in _LOGGED:
        _LOGGED.add(str(choice.reason))
        _LOG.warning("mla_triton.prefill: the Gluon sm90 kernel is not used: %s", choice.reason)
    return (gluon_prefill.FAMILY if choice.impl == "gluon" else _TRITON), config


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
    ``out`` those of ``c`` or their float32 copies (``_bf16_in_float32``)."""
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
    d1, d2 = _split_head_dim(dim)
    dvp = triton.next_power_of_2(dim_v)
    group = heads // kv_heads
    m_tiles = triton.cdiv(c.max_seqlen_q, config.block_m)

    # K and V: quantized once (see the kernel module's docstring)
    kv_quant = r.k_fmt != 0 or r.v_fmt != 0
    fused = kv_quant and m_tiles == 1 and group == 1
    k_in, v_in, k_scales = k, v, torch.ones(1, dtype=torch.float32, device=device)
    if kv_quant and not fused:
        k_in, v_in, k_scales = quantize_kv(
            k, v, c.cu_k, c.quant, max_seqlen_k=c.max_seqlen_k, k_dtype=k_dtype, v_dtype=v_dtype
        )

    sparsity = c.sparsity
    nm_n, nm_m = (sparsity.n, sparsity.m) if sparsity is not None else (0, 1)
    n_sink = sparsity.dense_sink_tokens if sparsity is not None else 0
    n_recent = sparsity.dense_recent_tokens if sparsity is not None else 0
    prefill_fwd_kernel[(m_tiles, heads, batch)](
        q, k_in, v_in, k_scales, out, c.lse, c.cu_q, c.cu_k,
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
        QK_DOT=qk_dot, PV_DOT=pv_dot, RETURN_LSE=c.return_lse, HW_FP8=_hw_fp8(device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
