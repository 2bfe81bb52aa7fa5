"""Prefill: varlen flash attention with Q, K, P and V quantized (docs/numerics.md).

Implementations: ``triton`` (portable, ``triton.py``) and ``gluon`` (sm90, ``gluon.py``);
``choose`` picks one per call from the device, the Triton release and what the Gluon
kernel covers (16-bit inputs, head dims 192/128 and alike):

| facts | implementation |
|---|---|
| an sm90 GPU, the Gluon Triton release, inputs the Gluon kernel covers | ``gluon`` |
| anything else | ``triton`` |
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, overload

import torch

from mla_formats import AttentionQuant, NMSparsity
from mla_triton.common import device as dev
from mla_triton.common.choice import forced
from mla_triton.common.replay import REPLAY, key_of
from mla_triton.ops.prefill import gluon
from mla_triton.ops.prefill.core import (
    MAX_HEAD_DIM_QK,
    MAX_HEAD_DIM_V,
    Checked,
    PrefillFamily,
    Recipe,
    check_cu,
    check_max_seqlen,
    check_offsets,
    check_tensor,
)
from mla_triton.ops.prefill.triton import TRITON, PrefillConfig

__all__ = ["choose", "prefill"]

_UNQUANTIZED = AttentionQuant()


def choose(
    impl: str,
    config: object,
    *,
    capability: tuple[int, int] | None,
    gluon_api: str | None,
    gluon_unsupported: str | None,
) -> tuple[PrefillFamily, str | None]:
    """The family that runs a checked call, and why ``auto`` did not take Gluon (a pure
    function). ``impl``/``config``: forced by ``tuning.use`` (``"auto"``, None otherwise);
    ``capability``: q's CUDA capability (None: CPU or the interpreter); ``gluon_api``:
    why this Triton cannot run Gluon (None: it can); ``gluon_unsupported``: why the Gluon
    kernel does not cover the inputs. A forced implementation that cannot run the call
    is a ValueError naming ``impl`` (a config of the wrong type: ``config``)."""
    if impl == "triton":
        if config is not None and not isinstance(config, PrefillConfig):
            raise ValueError(f"config: impl 'triton' takes a tuning.TritonPrefill, got "
                             f"{type(config).__name__}")  # fmt: skip
        return TRITON, None
    if impl == "gluon" and config is not None and not isinstance(config, gluon.GluonPrefillConfig):
        raise ValueError(f"config: impl 'gluon' takes a tuning.GluonPrefill, got "
                         f"{type(config).__name__}")  # fmt: skip
    reason = None
    if capability != (9, 0):
        got = capability if capability is not None else "no CUDA GPU (CPU or the interpreter)"
        reason = f"the Gluon prefill needs an sm90 GPU (capability (9, 0)), got {got}"
    reason = reason or gluon_api or gluon_unsupported
    if reason is None:
        return gluon.FAMILY, None
    if impl == "gluon":
        raise ValueError(f"impl: the Gluon prefill cannot run these inputs: {reason}")
    return TRITON, reason


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen flash attention with NVFP4/FP8 QDQ of Q, K, P and V (docs/numerics.md).

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
            unwritten); a sequence whose offsets leave the tensors' rows gets NaN
            rows and no read or write leaves the tensors (docs/numerics.md "Vouched
            offsets"). Otherwise the offsets are read back and checked (start at 0,
            non-decreasing, end at the token count) and a given value smaller than
            the longest sequence raises ``ValueError``.
        max_seqlen_k: the longest key sequence: it only sizes the K/V pass's launch,
            which covers every key whatever the value, so an understated one is
            slower, never wrong. Checked as ``max_seqlen_q`` is.

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

    A call with both ``max_seqlen_q`` and ``max_seqlen_k`` reads no value on the host,
    so a repeated call (same shapes, strides, dtypes, arguments) replays the launches of
    the first ones (``common.replay``).
    """

    def call() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, quant,
                        sparsity, return_lse, out, max_seqlen_q, max_seqlen_k)  # fmt: skip

    if max_seqlen_q is None or max_seqlen_k is None:
        return call()
    inputs, key = key_of(
        ("prefill", softmax_scale, causal, id(quant), id(sparsity), return_lse, max_seqlen_q,
         max_seqlen_k, forced("prefill"), dev.interpreting()),
        q, k, v, cu_seqlens_q, cu_seqlens_k, out,
    )  # fmt: skip
    return REPLAY(key, inputs, call, keep=(quant, sparsity))


def _prefill(q: _T, k: _T, v: _T, cu_seqlens_q: _T, cu_seqlens_k: _T, softmax_scale: float,
             causal: bool, quant: AttentionQuant | None, sparsity: NMSparsity | None,
             return_lse: bool, out: _T | None, max_seqlen_q: int | None,
             max_seqlen_k: int | None) -> _T | tuple[_T, _T]:  # fmt: skip
    """``prefill``'s checks, dispatch and launches (its arguments as given)."""
    q = check_tensor(q, "q")
    device = q.device
    k = check_tensor(k, "k", device)
    v = check_tensor(v, "v", device)
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
    cu_q = check_cu(cu_seqlens_q, "cu_seqlens_q", device)
    cu_k = check_cu(cu_seqlens_k, "cu_seqlens_k", device)
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
        quant = _UNQUANTIZED
    elif not isinstance(quant, AttentionQuant):
        raise ValueError(
            f"quant: expected None or mla_formats.AttentionQuant, got {type(quant).__name__}"
        )
    if sparsity is not None and not isinstance(sparsity, NMSparsity):
        raise ValueError(
            f"sparsity: expected None or mla_formats.NMSparsity, got {type(sparsity).__name__}"
        )
    impl, config = forced("prefill")
    capability = dev.capability(q.device)
    family, _ = choose(
        impl, config, capability=capability,
        gluon_api=dev.gluon_api_missing() if capability == (9, 0) else None,
        gluon_unsupported=gluon.unsupported(q.dtype, q.shape[2], dim_v, sparsity),
    )  # fmt: skip
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
        longest_q = check_offsets(cu_q, "cu_seqlens_q", tokens, "q")
        longest_k = check_offsets(cu_k, "cu_seqlens_k", tokens_k, "k")
    max_q = longest_q if max_seqlen_q is None else max_seqlen_q
    max_k = longest_k if max_seqlen_k is None else max_seqlen_k
    max_q = check_max_seqlen(max_q, "max_seqlen_q", longest_q)
    max_k = check_max_seqlen(max_k, "max_seqlen_k", longest_k)

    lse = torch.empty(heads, tokens, dtype=torch.float32, device=device)
    c = Checked(q, k, v, cu_q, cu_k, out, lse, float(softmax_scale), causal, quant, sparsity,
                return_lse, max_q, max_k)  # fmt: skip
    config = family.check_config(config, c)
    if tokens and max_q:
        family.launch(c, Recipe.of(quant), config)
    return (out, lse) if return_lse else out
