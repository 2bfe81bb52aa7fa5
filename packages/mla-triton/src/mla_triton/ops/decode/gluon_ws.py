"""Decode, the warp-specialized Gluon implementation for sm90 (``gluon_ws_kernels``).

A producer warpgroup copies the cache tiles (``cp.async`` or TMA; for the packed nvfp4
shadow it decodes E2M1 codes and E4M3 block scales into float16 tiles) while two math
warpgroups compute ``S``, the softmax and ``P V`` (docs/design/decode.md). It runs through
the split-K core (``common.splitk.run_decode``): checks, split policy, workspace, q̂ and the
merge are shared, only the split kernel differs. It reads recipe none on read and the
shadows ``ws_shadow_kind`` takes (a float16 shadow with V̂ = K̂, an nvfp4 V̂ section, the
packed nvfp4 shadow); ``dispatch.TABLE`` says which calls run it. ``compile_ws`` compiles it for
sm_90a on any machine (Gluon has no interpreter).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_formats import AttentionQuant
from mla_triton.common.kernels import SPLIT_ALIGN
from mla_triton.common.splitk import DecodeConfig, Operands, scales
from mla_triton.ops.decode import gluon as gd
from mla_triton.ops.decode import gluon_ws_kernels as k
from mla_triton.ops.decode.gluon import GluonRecipe
from mla_triton.ops.decode.triton import OnRead

__all__ = [
    "DECODE_ROUTE",
    "DEFAULT_CONFIG",
    "FP8_SHADOW",
    "NVFP4_CONFIG",
    "NVFP4_PACKED",
    "NVFP4_PACKED_CONFIG",
    "NVFP4_SHADOW",
    "NVFP4_TMA_CONFIG",
    "VARIANTS",
    "WsConfig",
    "WsFamily",
    "WsRoute",
    "WsShadowFamily",
    "compile_ws",
    "tma_descriptor",
    "twin",
    "ws_config_family",
    "ws_family",
    "ws_shadow_config_family",
    "ws_shadow_default",
    "ws_shadow_dispatched",
    "ws_shadow_kind",
    "ws_shadow_route",
]


@dataclass(frozen=True)
class WsConfig:
    """Register split, loads and ring of the warp-specialized kernel (three warpgroups,
    65536 registers).

    Attributes:
        math_regs: registers a thread of the worker math warpgroup asks for
            (``setmaxnreg``; the default partition, math warpgroup 0, gets the rest of
            the 504 a thread of each of the three warpgroups has: 232 by default).
        producer_regs: registers a thread of the copy warpgroup asks for.
        chunked: ``S`` of a tile starts on each of its 64-feature chunks as that lands
            (nine barriers a slot), else (the default: measured faster on an H200,
            docs/design/decode.md) once the whole tile has landed.
        tma: tiles arrive by TMA (nine ``[block_n, 64]`` boxes a tile, expect-tx
            barriers; the tail tile's rows past the split zeroed in shared memory) where
            a page holds whole tiles (page a multiple of ``block_n``) and the cache's
            pages are back to back (``stride(0) == page * stride(1)``, 16-byte aligned);
            ``cp.async`` elsewhere (the default: always).
        block_n: tokens a tile, 64 (default) or 32.
        early_s: a math warpgroup issues ``S_t`` of its tile as soon as the tile has
            landed, before it waits for the other's ``P_{t-1}`` (so ``S_t`` runs under
            the other's softmax, ``P_{t-1} V_{t-1}`` under its own); the same outputs bit
            for bit. Else (the default) ``P_{t-1} V_{t-1}`` is issued first.
        stages: ring slots, 2 (default) or, with 32-token tiles, 4 (the same 144 KiB:
            three tiles can be landing while one is computed on, against one of two).
    """

    math_regs: int = 232
    producer_regs: int = 40
    chunked: bool = False
    tma: bool = False
    block_n: int = 64
    stages: int = 2
    early_s: bool = False

    def __post_init__(self) -> None:
        for name in ("math_regs", "producer_regs"):
            v = getattr(self, name)
            if not 24 <= v <= 256 or v % 8:
                raise ValueError(f"config.{name}: expected a multiple of 8 in [24, 256], got {v}")
        if self.block_n not in (32, 64):
            raise ValueError(f"config.block_n: expected 32 or 64, got {self.block_n}")
        if self.stages not in (2, 4) or self.stages * self.block_n > 128:
            raise ValueError(
                f"config.stages: expected 2 (or 4 with block_n 32: the ring is 144 KiB at "
                f"most), got {self.stages} with block_n {self.block_n}"
            )

    @property
    def name(self) -> str:
        """A short label: ``ws-r232-p40`` (``-tile`` when not chunked, ``-tma`` with TMA
        loads, ``-n32s4`` for tiles and slots other than 64 and 2, ``-es`` with
        ``early_s``)."""
        ring = "" if (self.block_n, self.stages) == (64, 2) else f"-n{self.block_n}s{self.stages}"
        loads = ("" if self.chunked else "-tile") + ("-tma" if self.tma else "")
        flags = "-es" if self.early_s else ""
        return f"ws-r{self.math_regs}-p{self.producer_regs}{loads}{ring}{flags}"


VARIANTS: tuple[WsConfig, ...] = (
    WsConfig(),
    WsConfig(chunked=True),
    WsConfig(math_regs=224, producer_regs=56, chunked=True),
    WsConfig(tma=True),
    WsConfig(tma=True, early_s=True),
    WsConfig(block_n=32, stages=4, tma=True, early_s=True),
)
"""The configurations the benchmark times; ``VARIANTS[0]`` (``ws-r232-p40-tile``, the
fastest of the first three on an H200 at b128 L8192 and b32 L32768, docs/design/decode.md) is the
default of ``compile_ws`` and the dispatch. ``[3:]``: the TMA loads, with S issued
early, and with the 4-slot ring of 32-token tiles (compiled for sm_90a, not yet timed;
``twin`` gives the configuration each must equal bit for bit)."""


def twin(config: WsConfig) -> WsConfig | None:
    """The configuration ``config``'s outputs equal bit for bit with one feature fewer
    (the same tiles in the same order): without ``early_s``, else without ``tma``; None
    for neither."""
    if config.early_s:
        return replace(config, early_s=False)
    return replace(config, tma=False) if config.tma else None


DEFAULT_CONFIG = VARIANTS[3]
"""The configuration the dispatch runs recipe none and a V̂ = K̂ shadow with
(``ws-r232-p40-tile-tma``: ``VARIANTS[0]``'s ring with K tiles by TMA where the page
holds whole tiles, else ``cp.async``; bit for bit ``VARIANTS[0]``'s outputs). On an H200
at b128 h128 L8192 / b32 h128 L32768 it ran 1.00x / 0.95x FlashMLA beside ``VARIANTS[0]``'s
0.93x / 0.89x."""


class WsFamily(OnRead):
    """The decode core's split family of the warp-specialized kernel: 64 heads and 64
    tokens a CTA, four warps a partition, its register split."""

    def __init__(self, config: WsConfig) -> None:
        self.config = config
        self.kernel = gd.by_name(k.gluon_decode_ws_kernel)

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        c = self.config
        return DecodeConfig(block_h=k.BLOCK_H, block_n=c.block_n, num_warps=k.NUM_WARPS,
                            num_stages=c.stages)  # fmt: skip

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        c = self.config
        desc = tma_descriptor(cache, c.block_n) if c.tma else None
        return {"MATH_REGS": c.math_regs, "PRODUCER_REGS": c.producer_regs, "CHUNKED": c.chunked,
                "STAGES": c.stages, "TMA": desc is not None, "kv_desc": desc,
                "EARLY_S": c.early_s, "p_hat_scales": None, "v_tail_scales": None,
                "V_SEP": False, "PACKED": False}  # fmt: skip


class WsShadowFamily(WsFamily):
    """``decode_shadow``'s split family of the warp-specialized kernel on a float16 shadow:
    ``tiles`` (the shadow's K̂ ``[num_blocks, page, 576]`` float16 view) is the cache the
    kernel reads (its TMA descriptor too), q̂ float16 (``decode_q_kernel``), P̂ fp8 or
    nvfp4 between the MMAs (``p_hat_scales``), K's static scale in the score scale and
    ``gs_p gs_v`` on the output (``decode.split_kernel_args``). V̂ = K̂'s first 512
    features, or with ``sections`` (nvfp4 V: ``ops.shadow._v_sections``' ``(K̂, V̂, raw rows,
    K scales)`` and their strides) the V̂ section in a ring of its own (``V_SEP``), the
    open 16-token V block quantized from the raw rows under ``v_tail_scales``; with
    ``config.tma`` the K̂ view's and the V̂ section's descriptors (``kv_desc``, a pair)
    where both views allow one, else ``cp.async``."""

    def __init__(
        self, config: WsConfig, tiles: torch.Tensor,
        sections: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self.tiles = tiles
        self.sections = sections
        # the packed nvfp4 shadow: its K tiles are the shadow's bytes (the producer decodes)
        self.packed = sections is not None and sections[0][0].dtype == torch.uint8

    def v_shares_k(self, ops: Operands) -> bool:
        return True  # P̂ and q̂ in float16 (PV_F16): V̂ is K̂'s first 512 features or float16

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: Operands) -> dict[str, Any]:
        po, vo = ops[3], ops[2]
        extra: dict[str, Any] = {"p_hat_scales": scales(po.gs) if po.code else None}
        if self.sections is not None:
            extra |= {"V_SEP": True, "v_tail_scales": scales(vo.gs)}
        args = super().extra_args(self.tiles, cfg, ops) | extra
        if self.packed:  # the producer decodes the packed bytes (config: no TMA)
            args |= {"PACKED": True, "TMA": False, "kv_desc": None}
        elif self.sections is not None and args["TMA"]:  # the V̂ section's descriptor too
            v_desc = tma_descriptor(self.sections[0][1], self.config.block_n)
            args["kv_desc"] = None if v_desc is None else (args["kv_desc"], v_desc)
            args["TMA"] = v_desc is not None
        return args

    def cache_args(self, cache: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        if self.sections is not None:
            return self.sections
        return (self.tiles,), (self.tiles.stride(0), self.tiles.stride(1))


def tma_descriptor(cache: torch.Tensor, block_n: int) -> Any:
    """The TMA descriptor of ``cache [num_blocks, page, 576]`` as its ``[num_blocks * page,
    576]`` rows in ``[block_n, 64]`` boxes (so no box reaches past the cache), or None where
    the kernel copies with ``cp.async`` instead: a page that does not hold whole tiles, pages
    not back to back, a base or row stride not 16-byte aligned, a dtype other than bfloat16
    and float16, no rows (a descriptor needs some) or more than int32 coordinates reach."""
    blocks, page, width = cache.shape
    if page % block_n or cache.dtype not in (torch.bfloat16, torch.float16) or blocks == 0:
        return None
    row = cache.stride(1)
    if cache.stride(2) != 1 or cache.stride(0) != page * row or (row * cache.element_size()) % 16:
        return None
    if cache.data_ptr() % 16 or blocks * page >= 2**31:
        return None
    block = [block_n, 64]
    return TensorDescriptor(
        cache, [blocks * page, width], [row, 1], block, _box_layout(block_n, cache.dtype)
    )


@functools.lru_cache(maxsize=16)
def _box_layout(block_n: int, dtype: torch.dtype) -> Any:
    """The shared layout of a ``[block_n, 64]`` TMA box (NVMMA, 128-byte swizzle for 64
    16-bit features; cached: built for every call's descriptor)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([block_n, 64], element)


@functools.cache
def ws_family(config: WsConfig) -> WsFamily:
    """The split family of ``config`` (one per configuration)."""
    return WsFamily(config)


FP8_SHADOW = GluonRecipe(q_scaled=True, p_fmt=1, shadow_f16=True, k_fmt=1, q_fmt=1, v_fmt=1)
"""fp8 Q/K/P/V through the float16 shadow (V̂ = K̂; global scales 1): the recipe
``compile_ws(recipe=...)`` compiles for the CPU test and the GPU script."""

NVFP4_SHADOW = GluonRecipe(q_scaled=True, p_fmt=2, shadow_f16=True, k_fmt=2, v_sep=True,
                           v_f16=True, v_tail=True, q_fmt=2, v_fmt=2)  # fmt: skip
"""nvfp4 Q/K/P/V through the float16 shadow (its V̂ section, the open V block quantized
in the kernel; power-of-two global scales, here 1): ``compile_ws(recipe=...)``'s."""

NVFP4_CONFIG = WsConfig(block_n=32, stages=2)
"""The ring a V̂ section runs with (``ws-r232-p40-tile-n32s2``): q̂ 73728 bytes and two
slots of a 32-token K̂ tile (36864) and V̂ tile (32768), 212992 bytes of 232448."""

NVFP4_TMA_CONFIG = replace(NVFP4_CONFIG, tma=True)
"""``NVFP4_CONFIG`` with TMA loads (``ws-r232-p40-tile-tma-n32s2``: K̂ and V̂ tiles by
their own descriptors, two expect-tx barriers a slot; pages multiples of 32, else
``cp.async``); compiled for sm_90a, not yet timed, not a default. ``twin``: ``NVFP4_CONFIG``."""

NVFP4_PACKED = replace(NVFP4_SHADOW, packed=True)
"""``NVFP4_SHADOW`` on the packed shadow (624 bytes a token: E2M1 codes and E4M3 block
scales, decoded by the producer into the same float16 tiles): ``compile_ws(recipe=...)``'s."""

NVFP4_PACKED_CONFIG = WsConfig(block_n=32, stages=2, math_regs=200, producer_regs=104)
"""The configuration the packed nvfp4 shadow runs with (``ws-r200-p104-tile-n32s2``:
``NVFP4_CONFIG``'s ring, registers moved from the math warpgroups to the decoding
producer). The producer keeps each tile's packed bytes in flight ahead of their decode
(``gluon_ws_kernels._producer_packed``: 16-row units, each one ``cp.async`` round trip
into a staging buffer two units ahead, the block-table entries a tile ahead). Its
reference: ``NVFP4_CONFIG`` on the ``fp16`` shadow of the same cache (the same tiles,
the same bits). docs/design/shadow.md, "The packed storage, and its bound"."""


def ws_shadow_kind(taken: GluonRecipe | str) -> GluonRecipe | str:
    """``taken`` (``shadow.gluon_shadow_recipe``'s answer) where this kernel reads it, else
    why not: a float16 shadow's K̂ with V̂ = K̂ (fp8 K and V of one static scale; P none
    or fp8) or with an nvfp4 V̂ section (a static power-of-two V scale, K̂ fp8 or nvfp4 of
    a static scale; P none, fp8 or nvfp4); q none or quantized (q̂ float16)."""
    if isinstance(taken, str):
        return taken
    if not taken.shadow_f16:
        return ("the warp-specialized Gluon kernel reads a float16 shadow's K̂ only (K none: "
                "raw tiles beside V̂)")  # fmt: skip
    if taken.v_sep and (not (taken.v_f16 and taken.v_tail) or taken.k_dyn or taken.v_exact):
        return ("the warp-specialized Gluon kernel reads a V̂ section for nvfp4 V under a "
                "static power-of-two scale with a static K scale only (fp8 V̂ sections, "
                "dynamic K and exact V scales: not built)")  # fmt: skip
    if not taken.v_sep and taken.p_fmt not in (0, 1):
        return ("the warp-specialized Gluon kernel quantizes P to fp8 only with V̂ = K̂ "
                "(nvfp4 P: with an nvfp4 V̂ section)")  # fmt: skip
    return taken


def ws_shadow_default(taken: GluonRecipe) -> WsConfig:
    """The configuration a shadow runs with: ``NVFP4_PACKED_CONFIG`` for the packed nvfp4
    shadow, ``NVFP4_CONFIG`` for another V̂ section, else ``DEFAULT_CONFIG`` (the rows of
    ``dispatch.TABLE`` name the same; a test checks)."""
    if taken.packed:
        return NVFP4_PACKED_CONFIG
    return NVFP4_CONFIG if taken.v_sep else DEFAULT_CONFIG


def ws_shadow_dispatched(taken: GluonRecipe | str) -> bool:
    """Whether this kernel reads the shadow of ``taken`` (``shadow.gluon_shadow_recipe``'s):
    ``ws_shadow_kind`` takes the recipe."""
    return not isinstance(ws_shadow_kind(taken), str)


Sections = tuple[tuple[torch.Tensor, ...], tuple[int, ...]]


def ws_shadow_family(
    config: WsConfig, tiles: torch.Tensor, sections: Sections | None = None
) -> WsShadowFamily:  # fmt: skip
    """The shadow split family of ``config`` reading ``tiles`` (and a V̂ section's
    ``sections``: uint8 K tiles are the packed nvfp4 shadow's bytes; a new one a call: it
    holds the tensors)."""
    return WsShadowFamily(config, tiles, sections)


def ws_shadow_config_family(
    config: WsConfig, facts: gd.GluonFacts, impl: str, taken: GluonRecipe | str,
    tiles: torch.Tensor, sections: Sections | None = None,
) -> WsShadowFamily:  # fmt: skip
    """``decode_shadow``'s split family for a forced ``tuning.GluonWsDecode`` (``facts`` of
    the K̂ tiles, ``taken``: ``ops.shadow.gluon_shadow_recipe``'s, ``sections``: a V̂
    section's pointers and strides). Raises ValueError before any launch: ``config`` for
    a V̂ section with another ring than ``NVFP4_CONFIG``'s
    (32-token tiles, two slots: shared memory) or TMA with ``chunked``; ``quant`` for a recipe
    ``ws_shadow_kind`` refuses, ``impl`` where the Gluon kernels cannot run (the platform,
    the widths, strides not multiples of 8 elements)."""
    if impl == "triton":
        raise ValueError("config: a WsConfig configures impl='gluon', not 'triton'")
    kind = ws_shadow_kind(taken)
    if isinstance(kind, str):
        raise ValueError(f"quant: {kind}")
    ring = (config.block_n, config.stages)
    if kind.v_sep and (ring != (32, 2) or (config.tma and config.chunked)):
        raise ValueError(
            f"config: a V̂ section runs the warp-specialized kernel with block_n=32, stages=2 "
            f"only (K̂ and V̂ rings: 212992 of 232448 bytes of shared memory), TMA with "
            f"whole-tile barriers only, got {config.name}"
        )
    if kind.packed and (config.tma or config.chunked):
        raise ValueError(
            f"config: a packed shadow is decoded by the producer into whole tiles (no TMA, "
            f"not chunked), got {config.name}"
        )
    if kind.v_sep and sections is None:
        raise ValueError("quant: a V̂ section's recipe, but the shadow has no V̂ section")
    why = gd.gluon_taken(facts, recipe=lambda _: kind, stride_align=8)
    if isinstance(why, gd.Unsupported):
        raise ValueError(f"impl: the warp-specialized Gluon decode does not take this call: "
                         f"{why.reason}")  # fmt: skip
    return ws_shadow_family(config, tiles, sections if kind.v_sep else None)


def _recipe_none(quant: AttentionQuant | None) -> gd.GluonRecipe | str:
    taken = gd.gluon_recipe(quant)
    if isinstance(taken, str):
        return taken
    if taken != gd.UNQUANTIZED:
        return "the warp-specialized Gluon kernel implements recipe none only"
    return taken


def ws_config_family(config: WsConfig, facts: gd.GluonFacts, impl: str) -> WsFamily:
    """``decode``'s split family for a forced ``tuning.GluonWsDecode`` (``facts``: the
    checked call's). Raises ValueError before any launch: ``quant`` for a quantized
    recipe, ``impl`` where the Gluon kernels cannot run (not an sm90 GPU, another Triton
    release, widths other than 512 + 64)."""
    if impl == "triton":
        raise ValueError("config: a WsConfig configures impl='gluon', not 'triton'")
    taken = _recipe_none(facts.quant)
    if isinstance(taken, str):
        raise ValueError(f"quant: {taken}")
    why = gd.gluon_taken(facts, recipe=_recipe_none)
    if isinstance(why, gd.Unsupported):
        raise ValueError(f"impl: the warp-specialized Gluon decode does not take this call: "
                         f"{why.reason}")  # fmt: skip
    return ws_family(config)


@dataclass(frozen=True)
class WsRoute:
    """How a decode op reaches this kernel through ``dispatch.choose``.

    Attributes:
        configured: the family for a given ``WsConfig`` (``config, facts, impl``), or a
            ValueError before any launch.
        family: the family of a config the dispatch picked (a row of ``dispatch.TABLE``).
        forced: the config of ``tuning.use("gluon_ws")`` for a recipe no row of the
            table runs through this kernel (None: the kernel does not read it).
    """

    configured: Callable[[WsConfig, gd.GluonFacts, str], WsFamily]
    family: Callable[[WsConfig], WsFamily]
    forced: Callable[[GluonRecipe], WsConfig | None]


def _reads_none(taken: GluonRecipe) -> WsConfig | None:
    del taken  # on read: recipe none only, a row of the table
    return None


DECODE_ROUTE = WsRoute(ws_config_family, ws_family, _reads_none)
"""``decode``'s route (recipe none on read)."""


def ws_shadow_route(
    taken: GluonRecipe | str, tiles: torch.Tensor, sections: Sections | None
) -> WsRoute:
    """``decode_shadow``'s route for one call (``taken``: ``shadow.gluon_shadow_recipe``'s,
    ``tiles`` the K̂ tiles, ``sections`` a V̂ section's pointers and strides or None):
    ``ws_shadow_config_family``, ``ws_shadow_family`` and, forced, ``ws_shadow_default``
    where ``ws_shadow_dispatched``."""

    def configured(config: WsConfig, facts: gd.GluonFacts, impl: str) -> WsFamily:
        return ws_shadow_config_family(config, facts, impl, taken, tiles, sections)

    def family(config: WsConfig) -> WsFamily:
        return ws_shadow_family(config, tiles, sections)

    def forced(recipe: GluonRecipe) -> WsConfig | None:
        return ws_shadow_default(recipe) if ws_shadow_dispatched(recipe) else None

    return WsRoute(configured, family, forced)


def compile_ws(
    config: WsConfig = VARIANTS[0], *, dtype: str = "bf16", num_splits: int = 1, page: int = 64,
    index_dtype: str = "i32", recipe: GluonRecipe = gd.UNQUANTIZED,
) -> gd.CompiledVariant:  # fmt: skip
    """Compile the warp-specialized kernel for sm_90a on any machine (no GPU needed).

    ``dtype``: ``"bf16"`` or ``"fp16"`` (q, cache and output); ``num_splits``, ``page``:
    what the launch would pass (``config.tma``: TMA loads where ``page`` holds whole
    tiles, as ``tma_descriptor`` decides for a contiguous cache); strides and sizes marked
    divisible by 16 as the JIT marks a multiple of 16 (``gluon.compile_variant``'s
    convention). ``recipe``: recipe none, or one ``ws_shadow_kind`` takes (``FP8_SHADOW``,
    ``NVFP4_SHADOW`` with ``NVFP4_CONFIG``): the shadow's float16 K̂ tiles and q̂
    (``dtype`` is the output's and the raw rows'), P̂ quantized, a V̂ section's pointers
    and strides; else a ValueError naming ``recipe``.
    """
    if recipe != gd.UNQUANTIZED and isinstance(why := ws_shadow_kind(recipe), str):
        raise ValueError(f"recipe: {why}")
    fn = k.gluon_decode_ws_kernel
    div, ptr = gd.SIG_DIV, gd.sig_ptr
    tile = "fp16" if recipe.shadow_f16 else dtype  # q (q̂) and the K tiles: one type

    cache: tuple[Any, ...] = (ptr(tile),)
    strides: tuple[Any, ...] = (div, div)
    if recipe.v_sep:  # (K̂, V̂, raw rows, K scales: the raw rows' pointer), 4 stride pairs
        section = "u8" if recipe.packed else "fp16"
        cache = (ptr("u8" if recipe.packed else tile), ptr(section), ptr(dtype), ptr(dtype))
        strides = (div,) * 8
    split = gd.split_signature(tile, cache, strides, index_dtype, dtype)
    tma = config.tma and page % config.block_n == 0 and not recipe.packed
    block = [config.block_n, 64]
    layout = _box_layout(config.block_n, torch.bfloat16 if tile == "bf16" else torch.float16)
    desc: Any = f"tensordesc<{tile}[{block[0]},{block[1]}],{layout!r}>"
    if recipe.v_sep:  # K̂ and the V̂ section (float16), the same boxes
        desc = (desc, f"tensordesc<fp16[{block[0]},{block[1]}],{layout!r}>")
    p_hat = ("fp32", "fp32", "fp32") if recipe.p_fmt else "constexpr"
    v_tail = ("fp32", "fp32", "fp32") if recipe.v_sep else "constexpr"
    scalars = {"out_scale": "fp32", "kv_desc": desc if tma else "constexpr", "p_hat_scales": p_hat,
               "v_tail_scales": v_tail}  # fmt: skip
    constexprs: dict[str, Any] = {} if tma else {"kv_desc": None}
    if not recipe.p_fmt:
        constexprs["p_hat_scales"] = None
    if not recipe.v_sep:
        constexprs["v_tail_scales"] = None
    constexprs |= {
        "SHAPE": (512, 64, page, k.BLOCK_H, config.block_n, 2, SPLIT_ALIGN),
        "MULTI_SPLIT": num_splits > 1, "PRODUCER_REGS": config.producer_regs,
        "MATH_REGS": config.math_regs, "CHUNKED": config.chunked, "STAGES": config.stages,
        "TMA": tma, "EARLY_S": config.early_s, "Q_SCALED": recipe.q_scaled,
        "K_FMT": recipe.k_fmt, "P_FMT": recipe.p_fmt, "V_SEP": recipe.v_sep,
        "PACKED": recipe.packed,
    }  # fmt: skip
    return gd.compile_split_sm90(fn, split, scalars, constexprs, k.NUM_WARPS)
