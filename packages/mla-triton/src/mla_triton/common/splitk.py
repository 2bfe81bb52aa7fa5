"""The split-K decode core that every decode implementation shares.

Argument checks (docs/numerics.md "LSE, masks and input checks"), the split policy, the workspace,
q̂ (stage 0, ``splitk_kernels.decode_q_kernel``), the keyword arguments every split
kernel takes and the merge (stage 2, ``splitk_kernels.decode_merge_kernel``). An
implementation is a ``SplitFamily``: its split kernel, default tiles and own arguments.
Nothing here synchronizes with the device or allocates a data-dependent size, so a call
can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mla_formats import AttentionQuant, OperandQuant
from mla_triton.common import device as dev
from mla_triton.common.kernels import SPLIT_ALIGN
from mla_triton.common.memo import by_identity
from mla_triton.common.qdq import FORMAT_CODES
from mla_triton.common.splitk_kernels import decode_merge_kernel, decode_q_kernel

__all__ = [
    "Checked",
    "DecodeConfig",
    "Operand",
    "Operands",
    "SplitFamily",
    "block_h_for",
    "check_call",
    "decode_num_splits",
    "decode_workspace_size",
    "operand",
    "operands",
    "power_of_two",
    "run_decode",
    "scales",
    "sm_count",
    "tensor_arg",
    "unit_last_stride",
]

LOG2E = math.log2(math.e)
_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merge traffic than it gains
_CPU_SMS = 132  # SM count the split policy assumes off-GPU (the interpreter), for determinism
_MERGE_BLOCK_H = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Tile configuration of the split kernel.

    Attributes:
        block_h: query heads per program (16, 32 or 64).
        block_n: tokens per tile (16, 32 or 64; divides ``SPLIT_ALIGN``).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the tile loads (the page lookup takes
            one stage), 1 to 4. Deeper pipelines are refused: seen on an H200 with
            Triton 3.6, 5 stages with K quantized from registers and V read raw gave
            wrong outputs; the defaults use 2 or 3 (docs/benchmarks.md).

    On-read nvfp4 always rounds by multiply and magic-number addition
    (``qdq_device.nvfp4_qdq_fast``, bit-exact for power-of-two global scales; the exact
    division otherwise); the compare form measured 10% slower (docs/benchmarks.md).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_h not in (16, 32, 64):
            raise ValueError(f"config.block_h: expected 16, 32 or 64, got {self.block_h}")
        if self.block_n not in (16, 32, 64):
            raise ValueError(f"config.block_n: expected 16, 32 or 64, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"config.num_warps: expected a power of two <= 16, got {self.num_warps}"
            )
        if not 1 <= self.num_stages <= 4:
            raise ValueError(f"config.num_stages: expected 1 to 4, got {self.num_stages}")


def block_h_for(num_heads: int) -> int:
    """Heads per program: all of them up to 64 (at least 16, the smallest dot)."""
    if num_heads > 32:
        return 64
    return 32 if num_heads > 16 else 16


def sm_count(device: torch.device | None) -> int:
    if device is not None and device.type == "cuda":
        return dev.multiprocessors(device)
    return _CPU_SMS


def decode_num_splits(
    batch: int,
    num_heads: int,
    max_seq_len: int,
    *,
    device: torch.device | None = None,
    block_h: int | None = None,
) -> int:
    """The split count the default policy uses: a function of the shapes only.

    Programs without splits number ``batch * ceil(num_heads / block_h)``. The
    policy takes the fewest splits (1 to 64) whose programs fill the GPU's SMs
    (``device``'s count; 132 off-GPU) to at least 90% of whole waves, a single
    wave included (docs/design/decode.md), with every split at least
    256 tokens of ``max_seq_len`` long. No data is read: CUDA graphs captured for
    a batch size and ``max_seq_len`` replay the same split.
    """
    if batch <= 0 or max_seq_len <= 0:
        return 1
    bh = block_h if block_h is not None else block_h_for(num_heads)
    return _split_policy(batch * -(-num_heads // bh), max_seq_len, sm_count(device))


def split_key(max_seq_len: object, capacity: int) -> Hashable:
    """What the checks and the split policy read of ``max_seq_len`` (for
    ``common.replay``'s keys): a valid bound only as its ``_MIN_SPLIT_TOKENS`` count and
    whether it is positive, anything else as given (the checks refuse it)."""
    if type(max_seq_len) is int and 0 <= max_seq_len <= capacity:
        return ("bound", max_seq_len // _MIN_SPLIT_TOKENS, max_seq_len > 0)
    return ("given", type(max_seq_len), max_seq_len if isinstance(max_seq_len, Hashable) else 0)


@functools.lru_cache(maxsize=1024)
def _split_policy(programs: int, max_seq_len: int, sms: int) -> int:
    """``decode_num_splits`` for ``programs`` programs without splits on ``sms`` SMs."""
    cap = max(1, min(_MAX_SPLITS, max_seq_len // _MIN_SPLIT_TOKENS))
    for splits in range(1, cap + 1):
        total = programs * splits
        waves = -(-total // sms)
        if total >= 0.9 * waves * sms:
            return splits
    return cap


_ALIGN = 256  # bytes: every workspace section starts 256-byte aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the workspace sections (see ``decode_workspace_size``)."""

    acc: int  # float32 [B, splits, H, kv_lora_rank]
    ml: int  # float32 [B, splits, H, 2]: base-2 maximum and denominator
    q_scale: int  # float32 [B, H]: q's global scales
    q_hat: int  # 16-bit [B, H, kv_lora_rank + rope]: factored q̂
    total: int


@functools.lru_cache(maxsize=1024)
def _layout(
    batch: int,
    heads: int,
    splits: int,
    kv_lora_rank: int,
    rope: int,
    with_q: bool,
    q_bytes: int = 2,
) -> _Layout:
    acc = ml = 0 if splits <= 1 else batch * splits * heads
    acc_b, ml_b = _aligned(acc * kv_lora_rank * 4), _aligned(ml * 2 * 4)
    qs_b = _aligned(batch * heads * 4) if with_q else 0
    qh_b = _aligned(batch * heads * (kv_lora_rank + rope) * q_bytes) if with_q else 0
    return _Layout(0, acc_b, acc_b + ml_b, acc_b + ml_b + qs_b, acc_b + ml_b + qs_b + qh_b)


def decode_workspace_size(
    max_batch: int,
    num_heads: int,
    max_seq_len: int,
    *,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    num_splits: int | None = None,
    device: torch.device | None = None,
) -> int:
    """Bytes of workspace ``decode`` needs for any batch up to ``max_batch``.

    Sections (each 256-byte aligned): with several splits, the float32 unnormalized
    accumulators ``[B, splits, H, kv_lora_rank]`` and each split's base-2 maximum
    and denominator ``[B, splits, H, 2]``; when q is quantized, its global scales
    ``[B, H]`` float32 and the factored q̂ ``[B, H, kv_lora_rank + rope_dim]`` in 16
    bits (the size always counts these). With ``num_splits=None`` (the default
    policy) the size is the maximum over batch sizes 1 to ``max_batch`` for
    ``device``'s SM count.
    """
    for name, value in (
        ("max_batch", max_batch),
        ("num_heads", num_heads),
        ("max_seq_len", max_seq_len),
        ("kv_lora_rank", kv_lora_rank),
        ("rope_dim", rope_dim),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    if num_splits is not None:
        _check_num_splits(num_splits)
        return _layout(max_batch, num_heads, num_splits, kv_lora_rank, rope_dim, True).total
    return max(
        (
            _layout(
                b,
                num_heads,
                decode_num_splits(b, num_heads, max_seq_len, device=device),
                kv_lora_rank,
                rope_dim,
                True,
            ).total
            for b in range(1, max_batch + 1)
        ),
        default=0,
    )


# ---------------------------------------------------------------------------- checks


def _check_num_splits(num_splits: object) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise ValueError(f"num_splits: expected None or an int, got {num_splits!r}")
    if not 1 <= num_splits <= _MAX_SPLITS:  # the most the split policy ever picks
        raise ValueError(f"num_splits: expected 1 to {_MAX_SPLITS}, got {num_splits}")
    return num_splits


def tensor_arg(x: object, name: str, rank: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-d tensor, got shape {tuple(x.shape)}")
    return x


def unit_last_stride(x: torch.Tensor, name: str) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}"
        )


def power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _split_query(
    q: torch.Tensor | Sequence[torch.Tensor], kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(q, torch.Tensor):
        qt = tensor_arg(q, "q", 3)
        if qt.shape[2] <= kv_lora_rank:
            raise ValueError(
                f"q: last dim {qt.shape[2]} must be kv_lora_rank ({kv_lora_rank}) plus a "
                "positive rope width (576 = 512 + 64 for DeepSeek)"
            )
        return qt[..., :kv_lora_rank], qt[..., kv_lora_rank:]
    if not isinstance(q, Sequence) or len(q) != 2:
        raise ValueError(
            "q: expected a [B, H, D] tensor or the pair (q_nope [B, H, kv_lora_rank], "
            f"q_pe [B, H, rope]), got {type(q).__name__}"
        )
    q_nope = tensor_arg(q[0], "q[0] (q_nope)", 3)
    q_pe = tensor_arg(q[1], "q[1] (q_pe)", 3)
    if q_nope.shape[2] != kv_lora_rank:
        raise ValueError(
            f"q[0] (q_nope): expected last dim kv_lora_rank = {kv_lora_rank}, got {q_nope.shape[2]}"
        )
    if tuple(q_pe.shape[:2]) != tuple(q_nope.shape[:2]):
        raise ValueError(
            f"q[1] (q_pe): expected batch and heads {tuple(q_nope.shape[:2])} (those of "
            f"q_nope), got {tuple(q_pe.shape[:2])}"
        )
    if q_pe.dtype != q_nope.dtype or q_pe.device != q_nope.device:
        raise ValueError(
            f"q[1] (q_pe): expected dtype {q_nope.dtype} on {q_nope.device} (those of "
            f"q_nope), got {q_pe.dtype} on {q_pe.device}"
        )
    return q_nope, q_pe


@dataclass(frozen=True)
class Checked:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    batch: int
    heads: int
    rope: int
    page_size: int
    capacity: int
    scale: float


def _indextensor_arg(
    t: object, name: str, ndim: int, batch: int, unit: str, device: torch.device
) -> torch.Tensor:
    """An int32/int64 per-request tensor (block table, sequence lengths) on q's device."""
    x = tensor_arg(t, name, ndim)
    if x.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}: expected int32 or int64, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if x.shape[0] != batch:
        raise ValueError(f"{name}: expected {batch} {unit} (the batch of q), got {x.shape[0]}")
    return x


def check_call(
    q: torch.Tensor | Sequence[torch.Tensor],
    kv_cache: object,
    block_table: object,
    seq_lens: object,
    softmax_scale: object,
    kv_lora_rank: object,
    quant: object,
    max_seq_len: object,
) -> Checked:
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        raise ValueError(f"kv_lora_rank: expected an int, got {kv_lora_rank!r}")
    if kv_lora_rank < 16 or not power_of_two(kv_lora_rank):
        raise ValueError(
            f"kv_lora_rank: expected a power of two >= 16 (512 for DeepSeek), got {kv_lora_rank}"
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a float, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    if quant is not None and not isinstance(quant, AttentionQuant):
        raise ValueError(
            f"quant: expected None or mla_formats.AttentionQuant, got {type(quant).__name__}"
        )

    q_nope, q_pe = _split_query(q, kv_lora_rank)
    if q_nope.dtype not in _DTYPES:
        raise ValueError(f"q: expected dtype float16 or bfloat16, got {q_nope.dtype}")
    unit_last_stride(q_nope, "q")
    unit_last_stride(q_pe, "q")
    batch, heads = q_nope.shape[0], q_nope.shape[1]
    if heads == 0:
        raise ValueError("q: expected at least one head")
    rope = q_pe.shape[2]
    if rope < 16 or not power_of_two(rope):
        raise ValueError(
            f"q: the rope width (last dim minus kv_lora_rank) must be a power of two >= 16 "
            f"(64 for DeepSeek), got {rope}"
        )

    cache = tensor_arg(kv_cache, "kv_cache", 3)
    if cache.dtype != q_nope.dtype:
        raise ValueError(f"kv_cache: expected dtype {q_nope.dtype} (that of q), got {cache.dtype}")
    if cache.device != q_nope.device:
        raise ValueError(
            f"kv_cache: expected device {q_nope.device} (that of q), got {cache.device}"
        )
    if cache.shape[2] != kv_lora_rank + rope:
        raise ValueError(
            f"kv_cache: expected last dim {kv_lora_rank + rope} (kv_lora_rank + rope, as q), "
            f"got {cache.shape[2]}"
        )
    unit_last_stride(cache, "kv_cache")
    page_size = cache.shape[1]
    if page_size <= 0:
        raise ValueError(f"kv_cache: page size (dim 1) must be positive, got {page_size}")

    table = _indextensor_arg(block_table, "block_table", 2, batch, "rows", q_nope.device)
    _indextensor_arg(seq_lens, "seq_lens", 1, batch, "entries", q_nope.device)
    capacity = table.shape[1] * page_size
    if max_seq_len is not None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
            raise ValueError(
                f"max_seq_len: expected None or a non-negative int, got {max_seq_len!r}"
            )
        if max_seq_len > capacity:
            raise ValueError(
                f"max_seq_len: {max_seq_len} is beyond the block table's capacity "
                f"{table.shape[1]} pages x {page_size} = {capacity}"
            )
    return Checked(q_nope, q_pe, batch, heads, rope, page_size, capacity, scale)


def check_values_on_host(
    c: Checked, kv_cache: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Data checks (a host sync on GPU): seq_lens within capacity, used pages in range."""
    lens = seq_lens.to("cpu", torch.int64)
    if c.batch == 0:
        return
    if bool((lens < 0).any()) or bool((lens > c.capacity).any()):
        bad = int(((lens < 0) | (lens > c.capacity)).nonzero()[0, 0])
        raise ValueError(
            f"seq_lens: entry {bad} is {int(lens[bad])}, outside [0, {c.capacity}] (the block "
            f"table's capacity {table.shape[1]} pages x {c.page_size})"
        )
    pages = table.to("cpu", torch.int64)
    used = (
        torch.arange(table.shape[1])[None, :] < ((lens + c.page_size - 1) // c.page_size)[:, None]
    )
    bad_mask = used & ((pages < 0) | (pages >= kv_cache.shape[0]))
    if bool(bad_mask.any()):
        b, j = (int(x) for x in bad_mask.nonzero()[0])
        raise ValueError(
            f"block_table: row {b} uses page {int(pages[b, j])}, outside the cache's "
            f"{kv_cache.shape[0]} blocks"
        )


def _check_out(
    out: object, batch: int, heads: int, width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    t = tensor_arg(out, "out", 3)
    if tuple(t.shape) != (batch, heads, width) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"out: expected {(batch, heads, width)} {dtype} on {device}, got "
            f"{tuple(t.shape)} {t.dtype} on {t.device}"
        )
    unit_last_stride(t, "out")
    return t


def _check_lse(lse: object, batch: int, heads: int, device: torch.device) -> torch.Tensor:
    t = tensor_arg(lse, "lse", 2)
    if tuple(t.shape) != (batch, heads) or t.dtype != torch.float32 or t.device != device:
        raise ValueError(
            f"lse: expected {(batch, heads)} torch.float32 on {device}, got "
            f"{tuple(t.shape)} {t.dtype} on {t.device}"
        )
    return t


def _workspace_view(workspace: object, nbytes: int, device: torch.device) -> torch.Tensor:
    """``workspace`` (any contiguous tensor of at least ``nbytes``) as uint8 bytes: itself
    when it is a 1-d uint8 tensor, else a view of its first ``nbytes``."""
    if not isinstance(workspace, torch.Tensor):
        raise ValueError(
            f"workspace: expected None or a torch.Tensor, got {type(workspace).__name__}"
        )
    if workspace.device != device:
        raise ValueError(f"workspace: expected device {device}, got {workspace.device}")
    if not workspace.is_contiguous():
        raise ValueError("workspace: expected a contiguous tensor")
    have = workspace.numel() * workspace.element_size()
    if have < nbytes:
        raise ValueError(f"workspace: needs {nbytes} bytes (decode_workspace_size), got {have}")
    if workspace.data_ptr() % 16:
        raise ValueError("workspace: expected a 16-byte aligned data pointer")
    if workspace.dtype == torch.uint8 and workspace.dim() == 1:
        return workspace  # its bytes already: the sections are carved from the first nbytes
    return workspace.reshape(-1).view(torch.uint8)[:nbytes]


# ---------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class Operand:
    code: int  # qdq_device.FORMAT_CODES
    dynamic: bool
    gs: float  # static global scale (1.0 when dynamic or none)
    pow2: bool  # a static global scale that is a power of two: reciprocals are exact


Operands = tuple[Operand, Operand, Operand, Operand]
"""q, k, v and p of a recipe, as the kernels take them."""


@functools.lru_cache(maxsize=256)
def operand(op: OperandQuant) -> Operand:
    """What the kernels take of one operand's recipe (cached: a pure function of a frozen
    ``OperandQuant``, called for each operand of every call)."""
    if op.is_identity:
        return Operand(0, False, 1.0, True)
    if op.is_dynamic:
        return Operand(FORMAT_CODES[op.format.name], True, 1.0, False)
    # float32 division, as mla_formats computes the global scale
    gs = float(
        torch.tensor(op.static_amax(), dtype=torch.float32)
        / torch.tensor(op.format.unit_amax, dtype=torch.float32)
    )
    return Operand(FORMAT_CODES[op.format.name], False, gs, math.frexp(gs)[0] == 0.5)


@by_identity
def operands(recipe: AttentionQuant) -> Operands:
    """``operand`` of q, k, v and p of ``recipe`` (remembered per recipe object)."""
    return (operand(recipe.q), operand(recipe.k), operand(recipe.v), operand(recipe.p))


# ---------------------------------------------------------------------------- decode


def _stage_q(
    c: Checked,
    qo: Operand,
    qk_f16: bool,
    splits: int,
    kv_lora_rank: int,
    workspace: torch.Tensor | None,
    lse_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Carve the workspace and QDQ q into it when q is quantized (both decode paths).

    Returns ``(wacc, wml, q_nope, q_pe, q_scale)``: the split partials' buffers (``lse_t``
    as a placeholder with one split), the queries the split kernel reads and their
    per-row global scales (``lse_t`` as a placeholder when q is not quantized).
    """
    device = c.q_nope.device
    dtype = c.q_nope.dtype
    q_dtype = torch.float16 if qk_f16 else dtype
    q_bytes = q_dtype.itemsize
    wl = _layout(c.batch, c.heads, splits, kv_lora_rank, c.rope, qo.code != 0, q_bytes)
    if wl.total == 0:  # one split, q not quantized: no workspace
        return lse_t, lse_t, c.q_nope, c.q_pe, lse_t
    if workspace is None:
        ws = torch.empty(wl.total, dtype=torch.uint8, device=device)
    else:
        ws = _workspace_view(workspace, wl.total, device)
    wacc = ws[wl.acc : wl.ml].view(torch.float32) if splits > 1 else lse_t
    wml = ws[wl.ml : wl.q_scale].view(torch.float32) if splits > 1 else lse_t
    q_nope, q_pe, q_scale = c.q_nope, c.q_pe, lse_t
    if qo.code != 0:
        width = kv_lora_rank + c.rope
        q_scale = ws[wl.q_scale : wl.q_hat].view(torch.float32)
        q_end = wl.q_hat + c.batch * c.heads * width * q_bytes
        q_hat = ws[wl.q_hat : q_end].view(q_dtype).view(c.batch, c.heads, width)
        decode_q_kernel[(c.heads, c.batch)](
            c.q_nope,
            c.q_pe,
            q_hat,
            q_scale,
            c.q_nope.stride(0),
            c.q_nope.stride(1),
            c.q_pe.stride(0),
            c.q_pe.stride(1),
            c.heads,
            qo.gs,
            D1=kv_lora_rank,
            D2=c.rope,
            Q_FMT=qo.code,
            Q_DYN=qo.dynamic,
            num_warps=4,
        )
        q_nope, q_pe = q_hat[..., :kv_lora_rank], q_hat[..., kv_lora_rank:]
    return wacc, wml, q_nope, q_pe, q_scale


def _prepare_outputs(
    c: Checked,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    out: object,
    lse: object,
    num_splits: object,
    config: object,
    check_values: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks both decode paths make before choosing tiles, and their outputs.

    Validates ``num_splits`` and ``config``, checks a given ``out``/``lse`` (else
    allocates them), and runs the data checks (``check_values``; None: only for
    CPU tensors). Returns ``(out [B, H, kv_lora_rank], lse [B, H])``.
    """
    device = c.q_nope.device
    if num_splits is not None:
        _check_num_splits(num_splits)
    if config is not None and not isinstance(config, DecodeConfig):
        raise ValueError(f"config: expected None or DecodeConfig, got {type(config).__name__}")
    out_t = (
        torch.empty(c.batch, c.heads, kv_lora_rank, dtype=c.q_nope.dtype, device=device)
        if out is None
        else _check_out(out, c.batch, c.heads, kv_lora_rank, c.q_nope.dtype, device)
    )
    lse_t = (
        torch.empty(c.batch, c.heads, dtype=torch.float32, device=device)
        if lse is None
        else _check_lse(lse, c.batch, c.heads, device)
    )
    if check_values or (check_values is None and seq_lens.device.type == "cpu"):
        check_values_on_host(c, kv_cache, block_table, seq_lens)
    return out_t, lse_t


def _splits_for(
    c: Checked, cfg: DecodeConfig, num_splits: int | None, max_seq_len: int | None
) -> int:
    """``num_splits`` if given, else ``decode_num_splits`` for the batch and tiles."""
    if num_splits is not None:
        return num_splits
    bound = c.capacity if max_seq_len is None else max_seq_len
    return decode_num_splits(c.batch, c.heads, bound, device=c.q_nope.device, block_h=cfg.block_h)


def _merge_splits(
    c: Checked,
    wacc: torch.Tensor,
    wml: torch.Tensor,
    seq_lens: torch.Tensor,
    out_t: torch.Tensor,
    lse_t: torch.Tensor,
    splits: int,
    out_scale: float,
    kv_lora_rank: int,
) -> None:
    """Stage 2 of both decode paths: merge the ``splits`` partials into out and lse."""
    if splits == 1:
        return
    decode_merge_kernel[(-(-c.heads // _MERGE_BLOCK_H), c.batch)](
        (wacc, wml),
        seq_lens,
        (out_t, lse_t),
        seq_lens.stride(0),
        out_t.stride()[:2] + lse_t.stride(),
        c.heads,
        c.capacity,
        out_scale,
        splits,
        D1=kv_lora_rank,
        BLOCK_H=_MERGE_BLOCK_H,
        SPLIT_ALIGN_=SPLIT_ALIGN,
        num_warps=4,
    )


class SplitFamily:
    """What a split-kernel family adds to the decode core (``run_decode``): its kernel,
    default tiles, whether V̂ is K̂'s first features, and its own kernel arguments.

    On-read decode (``ops.decode.triton.OnRead``) and the shadow cache (``ops.shadow``)
    are the two families; q̂ (stage 0), the split policy, the workspace, the shared
    kernel arguments (``split_kernel_args``) and the merge (stage 2) are common.
    """

    kernel: Any
    """The ``@triton.jit`` split kernel, launched by keyword."""

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        """The tiles when the caller gives none."""
        raise NotImplementedError

    def v_shares_k(self, ops: Operands) -> bool:
        """Whether V̂ is K̂'s first ``kv_lora_rank`` features (fp8 K and V, one scale)."""
        raise NotImplementedError

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        """The kernel's arguments beyond ``split_kernel_args``, by name."""
        raise NotImplementedError

    def cache_args(
        self, cache: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None:
        """The cache pointers of ``split_program``'s ``split`` and their (page, row)
        strides; None: the raw cache alone."""
        return None


def run_decode(
    c: Checked,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    recipe: AttentionQuant,
    family: SplitFamily,
    *,
    out: object,
    lse: object,
    num_splits: object,
    workspace: torch.Tensor | None,
    max_seq_len: int | None,
    check_values: bool | None,
    config: object,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode core, after a family's own checks: outputs, tiles, launches.

    Checks ``num_splits``, ``config``, ``out`` and ``lse`` (``_prepare_outputs``), then,
    for a non-empty batch, launches q̂, ``family``'s split kernel and the merge
    (``run_launches``: float32 copies for bfloat16 under the interpreter). Returns
    ``(out [B, H, kv_lora_rank], lse [B, H])``.
    """
    out_t, lse_t = _prepare_outputs(
        c, kv_cache, block_table, seq_lens, kv_lora_rank, out, lse, num_splits, config,
        check_values,
    )  # fmt: skip
    if c.batch == 0:
        return out_t, lse_t
    assert num_splits is None or isinstance(num_splits, int)  # checked above
    assert config is None or isinstance(config, DecodeConfig)
    ops = operands(recipe)
    cfg = config if config is not None else family.default_config(c.heads, recipe)
    splits = _splits_for(c, cfg, num_splits, max_seq_len)

    def launch(cc: Checked, cache: torch.Tensor, ws: torch.Tensor | None, o: torch.Tensor) -> None:
        _launch_splits(cc, cache, block_table, seq_lens, ops, cfg, splits, family, ws, o, lse_t,
                       kv_lora_rank)  # fmt: skip

    run_launches(c, kv_cache, workspace, out_t, launch)
    return out_t, lse_t


def _launch_splits(
    c: Checked,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    ops: Operands,
    cfg: DecodeConfig,
    splits: int,
    family: SplitFamily,
    workspace: torch.Tensor | None,
    out_t: torch.Tensor,
    lse_t: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    """The launches on checked inputs: q̂ (stage 0), the family's split kernel, the merge."""
    qo, ko, vo, po = ops
    qk_f16 = qo.code != 0 and ko.code != 0
    pv_f16 = qk_f16 if family.v_shares_k(ops) else vo.code != 0
    wacc, wml, q_nope, q_pe, q_scale = _stage_q(
        c, qo, qk_f16, splits, kv_lora_rank, workspace, lse_t
    )
    args = split_kernel_args(
        c, kv_cache, block_table, seq_lens, out_t, lse_t, (wacc, wml), (q_nope, q_pe, q_scale),
        ops, cfg, splits, kv_lora_rank, pv_f16, family.cache_args(kv_cache),
    )  # fmt: skip
    grid = (-(-c.heads // cfg.block_h) * splits * c.batch,)
    family.kernel[grid](**args, **family.extra_args(kv_cache, cfg, ops))
    _merge_splits(c, wacc, wml, seq_lens, out_t, lse_t, splits, po.gs * vo.gs, kv_lora_rank)


Launch = Callable[[Checked, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def run_launches(
    c: Checked,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor | None,
    out_t: torch.Tensor,
    launch: Launch,
) -> None:
    """``launch(c, kv_cache, workspace, out)``, or, for bfloat16 under Triton's
    interpreter (``interpreted_bf16``), the same on float32 copies of q and the cache
    with a workspace of its own, the output rounded to bfloat16 once."""
    if not dev.interpreted_bf16(c.q_nope.dtype):
        launch(c, kv_cache, workspace, out_t)
        return
    o32 = torch.empty(out_t.shape, dtype=torch.float32)
    launch(replace(c, q_nope=c.q_nope.float(), q_pe=c.q_pe.float()), kv_cache.float(), None, o32)
    out_t.copy_(o32)


def split_kernel_args(
    c: Checked,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out_t: torch.Tensor,
    lse_t: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor],
    queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    operands: Operands,
    cfg: DecodeConfig,
    splits: int,
    kv_lora_rank: int,
    pv_f16: bool,
    cache: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """The keyword arguments the split kernels share, by name.

    ``split``: ``common.kernels.split_program``'s tuple; ``partials``: the workspace's
    ``(acc, ml)``; ``queries``: ``(q_nope, q_pe, q_scale)`` as ``_stage_q`` returns them;
    ``operands``: q, k, v, p; ``cache``: the family's cache pointers and their (page,
    row) strides (``SplitFamily.cache_args``; None: the raw cache alone).
    ``num_blocks`` (the cache's page count) is its own argument, which the kernels
    do not specialize, so that caches of every size share the compiled variants (vLLM
    profiles on a minimal cache, then serves on the real one).
    """
    q_nope, q_pe, q_scale = queries
    qo, ko, vo, po = operands
    ptrs, strides = cache if cache is not None else ((kv_cache,), tuple(kv_cache.stride()[:2]))
    split = (
        (q_nope, q_pe, q_scale), ptrs, block_table, seq_lens, (out_t, lse_t), partials,
        q_nope.stride()[:2] + q_pe.stride()[:2], strides, block_table.stride(),
        seq_lens.stride(0), out_t.stride()[:2] + lse_t.stride(),
        (c.heads, c.capacity),
        c.scale * LOG2E * (1.0 if ko.dynamic else ko.gs),
    )  # fmt: skip
    shape = (kv_lora_rank, c.rope, c.page_size, cfg.block_h, cfg.block_n,
             -(-c.heads // cfg.block_h), SPLIT_ALIGN)  # fmt: skip
    return {
        "split": split,
        "v_scales": scales(vo.gs),
        "p_scales": scales(po.gs),
        "out_scale": po.gs * vo.gs,
        "SHAPE": shape,
        "num_splits": splits,
        "num_blocks": kv_cache.shape[0],
        "MULTI_SPLIT": splits > 1,
        "Q_SCALED": qo.code != 0,
        "K_FMT": ko.code,
        "K_DYN": ko.dynamic,
        "V_FMT": vo.code,
        "V_EXACT": not vo.pow2,
        "P_FMT": po.code,
        "PV_F16": pv_f16,
        "HW_FP8": dev.hw_fp8(c.q_nope.device),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def scales(gs: float) -> tuple[float, float, float]:
    """A static scale triple as the kernels take it: ``(gs, 1 / gs, 1 / (6 gs))``."""
    return (gs, 1.0 / gs, 1.0 / (6.0 * gs))
