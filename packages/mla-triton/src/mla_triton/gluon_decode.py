"""Launcher of the Gluon sm90 decode (``kernels.gluon_decode``) and its CPU compile check.

``launch_gluon_decode`` takes the tensors ``mla_triton.decode`` has already checked
(SPEC 5) and launches the Gluon split kernel and, with several splits, the Triton
merge kernel on the same workspace layout. Only the unquantized recipe (q, K, V,
P all ``none``) and 16-bit inputs are implemented so far; ``gluon_decode_supported``
says whether a call can take this path.

``compile_variant`` compiles one kernel variant for sm_90a without a GPU (Gluon has
no interpreter): the CPU test and the benchmark's report use it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mla_formats import AttentionQuant

if TYPE_CHECKING:
    from mla_triton.decode import _Checked

__all__ = [
    "UNQUANTIZED",
    "GluonDecodeConfig",
    "GluonRecipe",
    "compile_variant",
    "gluon_decode",
    "gluon_decode_config",
    "gluon_decode_preferred",
    "gluon_decode_supported",
    "gluon_recipe",
    "launch_gluon_decode",
]

LOG2E = math.log2(math.e)
_MAX_SMEM = 232448  # bytes of shared memory one CTA may use on sm90 (227 KiB)


@dataclass(frozen=True)
class GluonDecodeConfig:
    """Tile configuration of the Gluon split kernel.

    Attributes:
        block_n: tokens per tile (32 or 64).
        stages: shared-memory ring depth (2 to 4); ``stages - 1`` tiles are in flight.
        overlap: issue ``S`` of the next tile before the softmax of this one (needs
            ``stages >= 3``: two tiles resident while copies run ahead).
    """

    block_n: int
    stages: int
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.block_n not in (32, 64):
            raise ValueError(f"config.block_n: expected 32 or 64, got {self.block_n}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"config.stages: expected 2 to 4, got {self.stages}")
        if self.overlap and self.stages < 3:
            raise ValueError(f"config.overlap: needs stages >= 3, got {self.stages}")

    @property
    def name(self) -> str:
        """A short label: ``bn64-st2``, ``bn32-st4-ov``."""
        return f"bn{self.block_n}-st{self.stages}" + ("-ov" if self.overlap else "")


VARIANTS: tuple[GluonDecodeConfig, ...] = (
    GluonDecodeConfig(block_n=64, stages=2),
    GluonDecodeConfig(block_n=32, stages=4),
    GluonDecodeConfig(block_n=32, stages=4, overlap=True),
)
"""Every configuration the launcher may pick (the CPU test compiles each)."""


def gluon_decode_config(num_heads: int) -> GluonDecodeConfig:
    """The default tile configuration (64-token tiles, double-buffered)."""
    del num_heads
    return VARIANTS[0]


@dataclass(frozen=True)
class GluonRecipe:
    """What the Gluon kernel needs of an ``AttentionQuant`` (the ones it implements).

    Attributes:
        q_scaled: q is quantized (fp8, static or dynamic): the kernel reads q̂ and its
            global scales, which ``decode``'s ``decode_q_kernel`` writes.
        kv_fp8: K and V are fp8 with one static power-of-two global scale, so K̂ = V̂
            (quantized once per tile, in place).
        p_fmt: 0 (P not quantized) or 1 (fp8).
        k_gs, v_gs, p_gs: static global scales (1.0 when not quantized).
    """

    q_scaled: bool = False
    kv_fp8: bool = False
    p_fmt: int = 0
    k_gs: float = 1.0
    v_gs: float = 1.0
    p_gs: float = 1.0

    @property
    def mma_f16(self) -> bool:
        """The MMAs run on float16 operands (q̂ and K̂ both factored), else the input dtype."""
        return self.q_scaled and self.kv_fp8


UNQUANTIZED = GluonRecipe()


def gluon_recipe(quant: AttentionQuant | None) -> GluonRecipe | str:
    """The ``GluonRecipe`` of ``quant``, or the reason the Gluon kernel does not take it.

    Implemented: q none or fp8 (static or dynamic); K and V both none, or both fp8 with
    the same static power-of-two global scale; P none or fp8.
    """
    from mla_triton.decode import _operand

    if quant is None:
        return UNQUANTIZED
    qo, ko, vo, po = (_operand(op) for op in (quant.q, quant.k, quant.v, quant.p))
    if 2 in (qo.code, ko.code, vo.code, po.code):
        return "nvfp4 is not implemented in the Gluon kernel yet"
    if (ko.code, vo.code) not in ((0, 0), (1, 1)):
        return "K and V must be both none or both fp8 in the Gluon kernel"
    if ko.code == 1 and (ko.dynamic or not ko.pow2 or ko.gs != vo.gs or vo.dynamic):
        return "fp8 K and V need one static power-of-two global scale in the Gluon kernel"
    return GluonRecipe(
        q_scaled=qo.code != 0, kv_fp8=ko.code == 1, p_fmt=po.code, k_gs=ko.gs, v_gs=vo.gs,
        p_gs=po.gs,
    )  # fmt: skip


def gluon_decode_supported(
    q_dtype: torch.dtype, quant: AttentionQuant | None, kv_lora_rank: int, rope: int
) -> str | None:
    """None when the Gluon kernel implements the call, else the reason it does not."""
    if q_dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q_dtype} (16-bit only)"
    if (kv_lora_rank, rope) != (512, 64):
        return f"kv_lora_rank {kv_lora_rank} + rope {rope} (512 + 64 only)"
    recipe = gluon_recipe(quant)
    return recipe if isinstance(recipe, str) else None


def gluon_decode_preferred(num_heads: int) -> bool:
    """Whether the Gluon kernel is the faster choice for ``num_heads`` query heads.

    Measured on an H200 (docs/gluon.md, first run, quant none): with 128 heads the Gluon
    kernel ran 1.2x to 1.4x the Triton one; with 16 it ran 0.69x (48 of its 64 wgmma
    rows are padding, and one CTA fills an SM's shared memory, where the Triton kernel
    runs 16 heads a program, several programs an SM). Up to 32 heads: the Triton kernel.
    """
    return num_heads > 32


def _kernel() -> Any:
    from mla_triton.kernels.gluon_decode import gluon_decode_split_kernel

    return gluon_decode_split_kernel


def launch_gluon_decode(
    c: _Checked,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor],
    queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    quant: AttentionQuant | None,
    num_splits: int,
    config: GluonDecodeConfig,
    launch: bool = True,
) -> dict[str, Any]:
    """Launch the Gluon split kernel, then ``decode``'s merge (``_merge_splits``).

    ``c``: ``decode``'s checked inputs; ``partials`` ``(wacc, wml)`` and ``queries``
    ``(q_nope, q_pe, q_scale)`` as ``decode._stage_q`` returns them (q̂ and its global
    scales when q is quantized: float16 when K is quantized too, else the input dtype;
    placeholders otherwise). Shapes: ``kv_cache [blocks, page, 576]``,
    ``block_table [B, pages]``, ``seq_lens [B]``, ``out [B, H, 512]``, ``lse [B, H]``.
    No allocation, no synchronization (CUDA-graph safe). Returns the kernel's keyword
    arguments: ``decode.split_kernel_args`` (those both Triton split kernels take)
    restricted to this kernel's parameters, plus its own (``k_inv_gs``, ``STAGES``,
    ``OVERLAP``, ``KV_FP8``) and ``num_warps``; ``launch=False`` only builds them.
    """
    from mla_triton.decode import DecodeConfig, _merge_splits, _operand, split_kernel_args
    from mla_triton.kernels.gluon_decode import BLOCK_H, NUM_WARPS

    recipe = gluon_recipe(quant)
    if isinstance(recipe, str):
        raise ValueError(f"quant: the Gluon decode does not take it: {recipe}")
    aq = quant if quant is not None else AttentionQuant()
    ops = tuple(_operand(op) for op in (aq.q, aq.k, aq.v, aq.p))
    tiles = DecodeConfig(block_h=BLOCK_H, block_n=config.block_n, num_warps=NUM_WARPS,
                         num_stages=config.stages)  # fmt: skip
    shared = split_kernel_args(
        c, kv_cache, block_table, seq_lens, out, lse, partials, queries,
        (ops[0], ops[1], ops[2], ops[3]), tiles, num_splits, queries[0].shape[2],
        recipe.mma_f16,
    )  # fmt: skip
    kernel = _kernel()
    args = {k: v for k, v in shared.items() if k in set(kernel.arg_names)}
    args.update(
        k_inv_gs=1.0 / recipe.k_gs, STAGES=config.stages, OVERLAP=config.overlap,
        KV_FP8=recipe.kv_fp8, num_warps=NUM_WARPS,
    )  # fmt: skip
    if launch and c.batch > 0:
        kernel[(args["HEAD_GROUPS"] * num_splits * c.batch,)](**args)
        _merge_splits(c, *partials, seq_lens, out, lse, num_splits, args["out_scale"], args["D1"])
    return args


def gluon_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    quant: AttentionQuant | None = None,
    num_splits: int | None = None,
    config: GluonDecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_triton.decode`` through the Gluon kernel (benchmarks and tests).

    ``q [B, H, 576]`` and the cache in float16/bfloat16 on an sm90 GPU; the inputs
    go through ``mla_triton.decode``'s checks first (a ValueError names a bad
    argument), q̂ is staged by ``decode``'s own q kernel, the split count is
    ``decode``'s policy for 64 heads per CTA. ``quant``: the recipes of
    ``gluon_recipe``. Returns ``(out [B, H, 512] in q's dtype, lse [B, H] float32)``.
    """
    from mla_triton.decode import (
        _check,
        _check_num_splits,
        _operand,
        _stage_q,
        decode_num_splits,
    )

    c = _check(q, kv_cache, block_table, seq_lens, softmax_scale, 512, quant, None)
    reason = gluon_decode_supported(c.q_nope.dtype, quant, 512, c.rope)
    if reason is not None:
        raise ValueError(f"quant: the Gluon decode does not take this call: {reason}")
    if q.device.type != "cuda":
        raise ValueError(f"q: the Gluon decode runs on a CUDA device, got {q.device}")
    recipe = gluon_recipe(quant)
    assert isinstance(recipe, GluonRecipe)
    cfg = config if config is not None else gluon_decode_config(c.heads)
    splits = (
        _check_num_splits(num_splits)
        if num_splits is not None
        else decode_num_splits(c.batch, c.heads, c.capacity, device=q.device, block_h=64)
    )
    out = torch.empty(c.batch, c.heads, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(c.batch, c.heads, dtype=torch.float32, device=q.device)
    qo = _operand(quant.q) if quant is not None else _operand(AttentionQuant().q)
    wacc, wml, q_nope, q_pe, q_scale = _stage_q(c, qo, recipe.mma_f16, splits, 512, None, lse)
    launch_gluon_decode(
        c, kv_cache, block_table, seq_lens, out, lse, (wacc, wml), (q_nope, q_pe, q_scale),
        quant=quant, num_splits=splits, config=cfg,
    )  # fmt: skip
    return out, lse


# ---------------------------------------------------------------------- CPU compile


_POINTERS = ("qn_ptr", "qp_ptr", "kv_ptr", "bt_ptr", "seq_lens_ptr", "out_ptr", "lse_ptr",
             "wacc_ptr", "wml_ptr")  # fmt: skip
_FLOAT_ARGS = ("score_scale", "k_inv_gs", "p_inv_gs", "out_scale")


@dataclass(frozen=True)
class CompiledVariant:
    """What ``compile_variant`` reports: PTX and TTGIR text, shared memory (bytes), warps,
    and ``ptxas -v``'s report for sm_90a (registers, spills, performance warnings)."""

    ptx: str
    ttgir: str
    shared: int
    num_warps: int
    ptxas_info: str


def compile_variant(
    config: GluonDecodeConfig,
    *,
    dtype: str = "bf16",
    num_splits: int = 1,
    page: int = 64,
    index_dtype: str = "i32",
    recipe: GluonRecipe = UNQUANTIZED,
) -> CompiledVariant:
    """Compile the Gluon split kernel for sm_90a on any machine (no GPU needed).

    ``dtype``: ``"bf16"`` or ``"fp16"`` (the cache and output; q̂ is float16 when
    ``recipe.mma_f16``); ``num_splits``, ``page``, ``recipe``: what the launch would
    pass; integer strides and sizes are marked divisible by 16 as the JIT marks a
    multiple of 16 (a 576-wide row and a 64-row page are).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_triton.kernels.decode_kernel import SPLIT_ALIGN
    from mla_triton.kernels.gluon_decode import NUM_WARPS

    fn = _kernel()
    q_dtype = "fp16" if recipe.mma_f16 else dtype
    ptr_types = {
        "qn_ptr": f"*{q_dtype}", "qp_ptr": f"*{q_dtype}", "qgs_ptr": "*fp32", "kv_ptr": f"*{dtype}",
        "bt_ptr": f"*{index_dtype}", "seq_lens_ptr": f"*{index_dtype}",
        "out_ptr": f"*{dtype}", "lse_ptr": "*fp32", "wacc_ptr": "*fp32", "wml_ptr": "*fp32",
    }  # fmt: skip
    constexprs: dict[str, Any] = {
        "D1": 512, "D2": 64, "PAGE": page, "BLOCK_N": config.block_n, "STAGES": config.stages,
        "OVERLAP": config.overlap, "Q_SCALED": recipe.q_scaled, "KV_FP8": recipe.kv_fp8,
        "P_FMT": recipe.p_fmt, "NUM_SPLITS": num_splits, "HEAD_GROUPS": 2,
        "SPLIT_ALIGN_": SPLIT_ALIGN,
    }  # fmt: skip
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    divisible = {"stride_qn_b", "stride_qn_h", "stride_qp_b", "stride_qp_h", "stride_kv_page",
                 "stride_kv_row", "stride_o_b", "stride_o_h"}  # fmt: skip
    for j, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ptr_types:
            signature[name] = ptr_types[name]
            attrs[(j,)] = [["tt.divisibility", 16]]
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in divisible:
                attrs[(j,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}
    )
    ptx = compiled.asm["ptx"]
    return CompiledVariant(
        ptx=ptx,
        ttgir=compiled.asm["ttgir"],
        shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
        ptxas_info=_ptxas_info(ptx),
    )


def _ptxas_info(ptx: str) -> str:
    """``ptxas -v --gpu-name sm_90a`` on ``ptx`` (Triton's bundled ptxas): its report."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", src, "-o", src + ".cubin"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return run.stdout + run.stderr


def max_shared_bytes() -> int:
    """Shared memory one CTA may use on sm90 (bytes)."""
    return _MAX_SMEM
