"""Decode, the Gluon split implementation for sm90 (``gluon_kernels``): dispatch facts, family,
CPU compile.

The dispatch (``dispatch.choose``) can run this kernel where ``gluon_taken`` gives a
recipe (an sm90 GPU, the Triton release of ``common.device.GLUON_TRITON``, a recipe of
``gluon_recipe``, 16-bit inputs of widths 512 + 64, 16-byte aligned cache rows) and runs
it where ``dispatch.TABLE`` says so, through the split-K core
(``common.splitk.run_decode``) with ``gluon_family``: only the split kernel differs from
the Triton path.
``compile_variant`` compiles one kernel variant for sm_90a without a GPU (Gluon has no
interpreter): the CPU tests use it.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource

from mla_formats import AttentionQuant
from mla_triton.common import device as dev
from mla_triton.common.kernels import SPLIT_ALIGN
from mla_triton.common.memo import by_identity
from mla_triton.common.splitk import DecodeConfig, Operands, operand
from mla_triton.ops.decode import gluon_kernels as kernels
from mla_triton.ops.decode.triton import OnRead

__all__ = [
    "ON_READ_BLOCKS_CONFIG",
    "ON_READ_NVFP4_KINDS",
    "SEPARATE_V_CONFIG",
    "UNQUANTIZED",
    "GluonDecodeConfig",
    "GluonFacts",
    "GluonRecipe",
    "Rule",
    "Unsupported",
    "compile_split_sm90",
    "compile_variant",
    "gluon_facts",
    "gluon_family",
    "gluon_recipe",
    "gluon_taken",
    "recipe_kind",
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
        on_read: the on-read QDQ schedule of a V̂-of-its-own recipe (nvfp4 on read; the
            kernel's ``V_OWN``), the same bits either way: 1 the tile's layouts; 2 whole
            16-element blocks a thread (no shuffles, the block scales once a block:
            ``ON_READ_BLOCKS_CONFIG``, the bn32-st2 tiling only).
    """

    block_n: int
    stages: int
    overlap: bool = False
    on_read: int = 1

    def __post_init__(self) -> None:
        if self.block_n not in (32, 64):
            raise ValueError(f"config.block_n: expected 32 or 64, got {self.block_n}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"config.stages: expected 2 to 4, got {self.stages}")
        if self.overlap and self.stages < 3:
            raise ValueError(f"config.overlap: needs stages >= 3, got {self.stages}")
        if self.on_read not in (1, 2) or isinstance(self.on_read, bool):
            raise ValueError(f"config.on_read: expected 1 or 2, got {self.on_read!r}")
        if self.on_read > 1 and (self.block_n, self.stages, self.overlap) != (32, 2, False):
            raise ValueError("config.on_read: above 1, the bn32-st2 tiling only (V̂ tiles of "
                             "their own)")  # fmt: skip

    @property
    def v_own(self) -> int | bool:
        """The kernel's ``V_OWN`` for a V̂-of-its-own recipe: True for ``on_read`` 1 (the
        key of today's schedule), else the level."""
        return True if self.on_read == 1 else self.on_read

    @property
    def name(self) -> str:
        """A short label: ``bn64-st2``, ``bn32-st4-ov``."""
        schedule = ("", "-vb")[self.on_read - 1]
        return f"bn{self.block_n}-st{self.stages}" + ("-ov" if self.overlap else "") + schedule


VARIANTS: tuple[GluonDecodeConfig, ...] = (
    GluonDecodeConfig(block_n=64, stages=2),
    GluonDecodeConfig(block_n=32, stages=4),
    GluonDecodeConfig(block_n=32, stages=4, overlap=True),
)
"""Every configuration the launcher may pick (the CPU test compiles each)."""

SEPARATE_V_CONFIG = GluonDecodeConfig(block_n=32, stages=2)
"""The one tiling of ``decode_shadow`` with V̂ tiles of their own (``GluonRecipe.v_sep``):
per stage a K̂ tile (36 KiB) and a V̂ tile (32 KiB) beside q (72 KiB); 64-token tiles or a
third stage exceed the 227 KiB of a CTA."""

ON_READ_BLOCKS_CONFIG = GluonDecodeConfig(block_n=32, stages=2, on_read=2)
"""``SEPARATE_V_CONFIG`` with the on-read QDQ in whole-block layouts (``V_OWN == 2``):
for a V-of-its-own recipe (nvfp4 on read); ``dispatch.TABLE`` runs nvfp4 Q, K, P and V
on read with it."""


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
        shadow_f16: the K tiles are a float16 shadow's K̂ (``decode_shadow``; V̂ = K̂
            for fp8 K and V of one static scale), read as they are (no QDQ in the kernel).
        k_fmt: K's format code (0 none: the tiles are raw, an infinite score is NaN).
        v_sep: V̂ tiles of their own (``decode_shadow``: a float16 V̂ section, or raw V
            beside a K̂): a second shared-memory ring, ``SEPARATE_V_CONFIG`` only.
        v_f16: the V tiles are a float16 V̂ section (else raw rows).
        v_tail: nvfp4 V: the open 16-token block is quantized from the raw rows.
        v_exact: V's static global scale is not a power of two (the exact division).
        k_dyn: dynamic K: each token's global scale, from the shadow, scales S's columns.
        v_own: on read, V quantized into a ring of its own (V̂ not K̂: nvfp4, K and V of
            different recipes), K̂ in place: ``SEPARATE_V_CONFIG`` only.
        q_fmt, v_fmt: q's and V's format codes; k_exact: K's static scale is not a power
            of two.
        packed: the shadow is the packed nvfp4 one (E2M1 codes and E4M3 block scales,
            624 bytes a token), which only the warp-specialized kernel reads (its producer
            decodes it into the float16 tiles).
    """

    q_scaled: bool = False
    kv_fp8: bool = False
    p_fmt: int = 0
    k_gs: float = 1.0
    v_gs: float = 1.0
    p_gs: float = 1.0
    shadow_f16: bool = False
    k_fmt: int = 0
    v_sep: bool = False
    v_f16: bool = False
    v_tail: bool = False
    v_exact: bool = False
    k_dyn: bool = False
    v_own: bool = False
    q_fmt: int = 0
    v_fmt: int = 0
    k_exact: bool = False
    packed: bool = False

    @property
    def separate_v(self) -> bool:
        """V̂ tiles of their own (the shadow's V̂ section, or V quantized on read):
        ``SEPARATE_V_CONFIG``."""
        return self.v_sep or self.v_own

    @property
    def mma_f16(self) -> bool:
        """The MMAs run on float16 operands (q̂ and K̂ both factored), else the input dtype."""
        return self.q_scaled and (
            self.kv_fp8 or self.shadow_f16 or (self.v_own and self.k_fmt != 0)
        )


UNQUANTIZED = GluonRecipe()

ON_READ_NVFP4_KINDS = frozenset(
    GluonRecipe(q_scaled=True, p_fmt=2, k_fmt=2, v_own=True, q_fmt=2, v_fmt=2, k_exact=k,
                v_exact=v)
    for k, v in itertools.product((False, True), repeat=2)
)  # fmt: skip
"""The kinds (``recipe_kind``) of nvfp4 Q, K, P and V on read: static K and V scales, a
power of two or not."""


def recipe_kind(taken: GluonRecipe) -> GluonRecipe:
    """``taken`` without its global scales: the kernel variant it compiles to, what the
    rows of ``dispatch.TABLE`` name."""
    return replace(taken, k_gs=1.0, v_gs=1.0, p_gs=1.0)


@by_identity
def gluon_recipe(quant: AttentionQuant | None) -> GluonRecipe | str:
    """The ``GluonRecipe`` of ``quant``, or the reason the Gluon kernel does not take it
    (remembered per recipe object: every call of a Gluon family asks).

    Implemented on read: q none, fp8 or nvfp4 (static or dynamic); K and V both none, or
    both fp8 with the same static power-of-two global scale (V̂ = K̂, in place); or, with
    ``GluonRecipe.v_own``, V fp8 or nvfp4 quantized into its own ring beside K none, fp8
    or nvfp4 in place (static scales, any value); P none, fp8 or nvfp4.
    """
    if quant is None:
        return UNQUANTIZED
    qo, ko, vo, po = (operand(op) for op in (quant.q, quant.k, quant.v, quant.p))
    base = GluonRecipe(
        q_scaled=qo.code != 0, q_fmt=qo.code, p_fmt=po.code, k_gs=ko.gs, v_gs=vo.gs,
        p_gs=po.gs, k_fmt=ko.code, v_fmt=vo.code, k_exact=not ko.pow2, v_exact=not vo.pow2,
    )  # fmt: skip
    if (ko.code, vo.code) == (0, 0):
        return base
    shared = (ko.code, vo.code) == (1, 1) and ko.pow2 and ko.gs == vo.gs
    if shared and not ko.dynamic and not vo.dynamic:
        return replace(base, kv_fp8=True)
    if ko.dynamic or vo.dynamic:
        return "a dynamic K or V scale on read is not implemented in the Gluon kernel"
    if vo.code == 0:
        return "K quantized with V not (raw V beside K̂ in place) is not implemented in Gluon"
    return replace(base, v_own=True)


# ---------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class GluonFacts:
    """What the dispatch decision reads of a call and its platform (no tensors).

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: the CUDA device's compute capability, None off CUDA.
        interpreting: Triton's interpreter is on (``TRITON_INTERPRET``).
        api_missing: ``gluon_api_missing()``.
        dtype: q's dtype.
        quant: the recipe.
        heads, kv_lora_rank, rope: q's heads and widths.
        kv_strides: the cache's page and row strides (elements).
        kv_aligned: the cache's data pointer is 16-byte aligned.
    """

    device_type: str
    capability: tuple[int, int] | None
    interpreting: bool
    api_missing: str | None
    dtype: torch.dtype
    quant: AttentionQuant | None
    heads: int
    kv_lora_rank: int
    rope: int
    kv_strides: tuple[int, int]
    kv_aligned: bool


@dataclass(frozen=True)
class Unsupported:
    """Why the Gluon kernels do not take a call; ``covered`` False for the recipe or
    another GPU (not logged), True for the platform or the tensors (logged once when
    auto falls back)."""

    reason: str
    covered: bool


Rule = Callable[[GluonFacts], "GluonRecipe | Unsupported"]
"""An op's preconditions of the Gluon kernels: ``gluon_taken``, or ``decode_shadow``'s."""


def gluon_taken(
    f: GluonFacts,
    *,
    recipe: Callable[[AttentionQuant | None], GluonRecipe | str] = gluon_recipe,
    stride_align: int = 16,
) -> GluonRecipe | Unsupported:
    """The recipe the Gluon kernels run ``f`` with, or why they cannot run it (the
    platform, the tensors, the recipe): preconditions, not preferences (those are
    ``dispatch.TABLE``'s). A pure function of ``f`` (testable without a GPU);
    ``recipe``: the recipe rule (``gluon_recipe``; ``decode_shadow``: the shadow's);
    ``stride_align``: the multiple of elements the tiles' page and row strides must be
    (16: ``decode``'s rule; the kernel needs 8 elements, 16-byte rows, which
    ``decode_shadow`` takes for its shadow sections)."""
    if f.device_type != "cuda":
        return Unsupported(f"tensors on {f.device_type}, not CUDA", False)
    if f.capability != (9, 0):
        return Unsupported(f"device capability {f.capability}, the Gluon kernel is sm90", False)
    if f.interpreting:
        return Unsupported("Triton's interpreter is on (Gluon has none)", True)
    if f.api_missing is not None:
        return Unsupported(f.api_missing, True)
    if f.dtype not in (torch.float16, torch.bfloat16):
        return Unsupported(f"dtype {f.dtype} (16-bit only)", True)
    if (f.kv_lora_rank, f.rope) != (512, 64):
        return Unsupported(f"kv_lora_rank {f.kv_lora_rank} + rope {f.rope} (512 + 64 only)", True)
    if any(s % stride_align for s in f.kv_strides) or not f.kv_aligned:
        return Unsupported(
            f"kv_cache page/row strides {f.kv_strides} must be multiples of {stride_align} "
            "elements and "
            "its data 16-byte aligned (the 16-byte cp.async tile copies)",
            True,
        )
    taken = recipe(f.quant)
    return Unsupported(taken, False) if isinstance(taken, str) else taken


def gluon_facts(
    q: torch.Tensor, kv_cache: torch.Tensor, quant: AttentionQuant | None, kv_lora_rank: int
) -> GluonFacts:
    """The facts of a checked ``decode`` call: ``q`` is q_nope ``[B, H, kv_lora_rank]``
    (``rope`` is the cache's width minus ``kv_lora_rank``)."""
    device = q.device
    capability = dev.capability(device) if device.type == "cuda" else None
    return GluonFacts(
        device_type=device.type,
        capability=capability,
        interpreting=dev.interpreting(),
        api_missing=dev.gluon_api_missing() if capability == (9, 0) else None,
        dtype=q.dtype,
        quant=quant,
        heads=q.shape[1],
        kv_lora_rank=kv_lora_rank,
        rope=kv_cache.shape[2] - kv_lora_rank,
        kv_strides=(kv_cache.stride(0), kv_cache.stride(1)),
        kv_aligned=kv_cache.data_ptr() % 16 == 0,
    )


class _ByName:
    """A kernel launched by keyword with only the arguments it declares (and
    ``num_warps``): ``decode.split_kernel_args`` builds those of both Triton split
    kernels, of which the Gluon kernel takes a subset."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.names = frozenset(kernel.arg_names) | {"num_warps"}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        launch = self.kernel[grid]

        def run(**kwargs: Any) -> Any:
            return launch(**{k: v for k, v in kwargs.items() if k in self.names})

        return run


by_name = by_identity(_ByName)
"""The ``_ByName`` launcher of a kernel, one per kernel object (a family is made per
call; a JIT function's hash would read its source)."""


class _GluonFamily(OnRead):
    """The decode core's split family of the Gluon kernel (``tuning.use("gluon")``):
    the on-read recipe rules (V̂ is K̂ for fp8 K and V of one scale), 64 heads a CTA,
    its tile configuration, and its own arguments (``k_inv_gs``, ``STAGES``,
    ``OVERLAP``, ``KV_FP8``)."""

    def __init__(self, config: GluonDecodeConfig) -> None:
        self.config = config
        self.kernel = by_name(kernels.gluon_decode_split_kernel)

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        cfg = self.config
        if self.v_own(recipe):  # two tiles a stage: SEPARATE_V_CONFIG (or the default)
            if cfg.on_read == 1 and cfg not in (VARIANTS[0], SEPARATE_V_CONFIG):
                raise ValueError(
                    f"config: V quantized into its own tiles runs the Gluon kernel as "
                    f"{SEPARATE_V_CONFIG.name} only (two tiles a stage), got {cfg.name}"
                )
            cfg = cfg if cfg.on_read > 1 else SEPARATE_V_CONFIG
        elif cfg.on_read > 1:
            raise ValueError(
                f"config: {cfg.name} is for V quantized into its own tiles (nvfp4 on read)"
            )
        return DecodeConfig(block_h=kernels.BLOCK_H, block_n=cfg.block_n,
                            num_warps=kernels.NUM_WARPS, num_stages=cfg.stages)  # fmt: skip

    def v_own(self, recipe: AttentionQuant | None) -> bool:
        """Whether the on-read recipe quantizes V into tiles of its own (``V_OWN``)."""
        taken = gluon_recipe(recipe)
        return isinstance(taken, GluonRecipe) and taken.v_own

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        ko, vo = ops[1], ops[2]
        own = not self.v_shares_k(ops) and vo.code != 0
        return {"k_inv_gs": 1.0 / ko.gs, "k_scales": (ko.gs, 1.0 / ko.gs, 1.0 / (6.0 * ko.gs)),
                "K_EXACT": not ko.pow2, "STAGES": cfg.num_stages,
                "OVERLAP": self.config.overlap and not own, "KV_FP8": self.v_shares_k(ops),
                "V_SEP": False, "V_TAIL": False,
                "V_OWN": own and self.config.v_own}  # fmt: skip


@functools.cache
def gluon_family(config: GluonDecodeConfig) -> _GluonFamily:
    """The split family ``decode`` runs the Gluon kernel with (one per configuration)."""
    return _GluonFamily(config)


# ---------------------------------------------------------------------- CPU compile


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
    ``recipe.mma_f16``, the tiles when ``recipe.shadow_f16``); ``num_splits``, ``page``,
    ``recipe``: what the launch would
    pass; integer strides and sizes are marked divisible by 16 as the JIT marks a
    multiple of 16 (a 576-wide row and a 64-row page are).
    """
    fn = kernels.gluon_decode_split_kernel
    q_dtype = "fp16" if recipe.mma_f16 else dtype
    tile_dtype = "fp16" if recipe.shadow_f16 else dtype
    div, i32, ptr = SIG_DIV, SIG_I32, sig_ptr
    cache: tuple[Any, ...] = (ptr(tile_dtype),)
    strides: tuple[Any, ...] = (div, div)
    if recipe.v_sep:  # (K tiles, V tiles, raw rows, K scales); a dynamic-K shadow's row
        # (2192 bytes: 1096 float16, 548 float32) is not a multiple of 16 elements
        sh = i32 if recipe.k_dyn else div
        cache = (ptr(tile_dtype), ptr("fp16" if recipe.v_f16 else dtype), ptr(dtype), ptr("fp32"))
        strides = (
            sh if recipe.shadow_f16 else div, sh if recipe.shadow_f16 else div,
            sh if recipe.v_f16 else div, sh if recipe.v_f16 else div, div, div, sh, sh,
        )  # fmt: skip
    split = split_signature(q_dtype, cache, strides, index_dtype, dtype)
    k_fmt = 1 if recipe.kv_fp8 or (recipe.shadow_f16 and not recipe.k_fmt) else recipe.k_fmt
    constexprs: dict[str, Any] = {
        "SHAPE": (512, 64, page, kernels.BLOCK_H, config.block_n, 2, SPLIT_ALIGN),
        "STAGES": config.stages, "OVERLAP": config.overlap, "Q_SCALED": recipe.q_scaled,
        "K_FMT": k_fmt, "KV_FP8": recipe.kv_fp8, "V_SEP": recipe.v_sep,
        "V_TAIL": recipe.v_tail, "V_EXACT": recipe.v_exact,
        "V_OWN": recipe.v_own and config.v_own,
        "K_EXACT": recipe.k_exact, "V_FMT": recipe.v_fmt, "K_DYN": recipe.k_dyn,
        "P_FMT": recipe.p_fmt, "MULTI_SPLIT": num_splits > 1,
    }  # fmt: skip
    scalars: dict[str, Any] = {"k_inv_gs": "fp32"}
    scalars |= dict.fromkeys(("k_scales", "v_scales", "p_scales"), ("fp32", "fp32", "fp32"))
    scalars["out_scale"] = "fp32"
    return compile_split_sm90(fn, split, scalars, constexprs, kernels.NUM_WARPS)


# A split kernel's signature for ``compile_split_sm90``: (type, marked divisible by 16) per
# element of ``split_program``'s tuple, nested as passed.
SIG_DIV = ("i32", True)
SIG_I32 = ("i32", False)


def sig_ptr(t: str) -> tuple[str, bool]:
    """A pointer to ``t`` (16-byte aligned)."""
    return (f"*{t}", True)


def split_signature(
    q_dtype: str, cache: tuple[Any, ...], strides: tuple[Any, ...], index_dtype: str, dtype: str
) -> tuple[Any, ...]:
    """``split_program``'s tuple as a signature: q (q̂) of ``q_dtype``, the ``cache``
    pointers and their ``strides``, the block table and lengths of ``index_dtype``, the
    output of ``dtype``."""
    div, i32, ptr = SIG_DIV, SIG_I32, sig_ptr
    return (
        (ptr(q_dtype), ptr(q_dtype), ptr("fp32")), cache, ptr(index_dtype),
        ptr(index_dtype), (ptr(dtype), ptr("fp32")), (ptr("fp32"), ptr("fp32")),
        (div, div, div, div), strides, (i32, i32), i32, (div, div, i32, i32),
        (i32, i32), ("fp32", False),
    )  # fmt: skip


def compile_split_sm90(
    fn: Any, split: Any, scalars: dict[str, Any], constexprs: dict[str, Any], num_warps: int
) -> CompiledVariant:
    """Compile a Gluon split kernel for sm_90a on any machine: its arguments are ``split``
    (the split tuple, leaves ``(type, divisible by 16)``), then ``scalars`` (name: type),
    ``num_splits`` and ``num_blocks`` (i32, not specialized), then ``constexprs``."""
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}

    def types(node: Any, path: tuple[int, ...]) -> Any:
        if isinstance(node[0], str):  # a leaf: (type, divisible)
            if node[1]:
                attrs[path] = [["tt.divisibility", 16]]
            return node[0]
        return tuple(types(child, (*path, k)) for k, child in enumerate(node))

    signature: dict[str, Any] = {"split": types(split, (0,)), **scalars}
    signature["num_splits"] = "i32"  # not specialized (do_not_specialize)
    signature["num_blocks"] = "i32"  # not specialized either
    signature |= dict.fromkeys(constexprs, "constexpr")
    assert list(signature) == list(fn.arg_names), fn.arg_names
    source = GluonASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
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
