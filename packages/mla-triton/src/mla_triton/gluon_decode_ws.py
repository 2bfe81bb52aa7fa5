"""The warp-specialized Gluon sm90 decode (``kernels.gluon_decode_ws``): launcher and CPU compile.

``mla_triton.decode(..., config=WsConfig(...))`` runs the kernel through the decode
core (``decode.run_decode``): the checks, split policy, workspace, ``split_kernel_args``
and the Triton merge kernel are ``decode``'s, only the split kernel differs, so its
outputs (one split: ``out`` and ``lse``; several: the workspace partials the merge
combines) follow the same contract. Recipe none only (bf16/fp16, widths 512 + 64, an
sm90 GPU with Triton 3.8: the conditions of ``gluon_decode.gluon_unsupported``;
``ws_config_family`` refuses the rest). ``decode`` without a config runs it, with
``VARIANTS[0]``, in place of ``gluon_decode``'s kernel where ``ws_dispatched`` holds:
recipe none while ``WS_AUTO`` is True (shipped False).

``compile_ws`` compiles the kernel for sm_90a on any machine (Gluon has no
interpreter): the CPU test and the GPU script's report use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton import gluon_decode as gd
from mla_triton.decode import DecodeConfig, _OnRead, _Operands

__all__ = [
    "VARIANTS",
    "WS_AUTO",
    "WsConfig",
    "WsFamily",
    "compile_ws",
    "ws_config_family",
    "ws_dispatched",
    "ws_family",
]


@dataclass(frozen=True)
class WsConfig:
    """Register split of the warp-specialized kernel (three warpgroups, 65536 registers).

    Attributes:
        math_regs: registers a thread of the worker math warpgroup asks for
            (``setmaxnreg``; the default partition, math warpgroup 0, gets the rest of
            the 504 a thread of each of the three warpgroups has: 232 by default).
        producer_regs: registers a thread of the copy warpgroup asks for.
        chunked: ``S`` of a tile starts on each of its 64-feature chunks as that lands
            (nine barriers a slot), else (the default: measured faster on an H200,
            docs/gluon.md) once the whole tile has landed.
    """

    math_regs: int = 232
    producer_regs: int = 40
    chunked: bool = False

    def __post_init__(self) -> None:
        for name in ("math_regs", "producer_regs"):
            v = getattr(self, name)
            if not 24 <= v <= 256 or v % 8:
                raise ValueError(f"config.{name}: expected a multiple of 8 in [24, 256], got {v}")

    @property
    def name(self) -> str:
        """A short label: ``ws-r232-p40`` (``-tile`` when not chunked)."""
        return f"ws-r{self.math_regs}-p{self.producer_regs}" + ("" if self.chunked else "-tile")


VARIANTS: tuple[WsConfig, ...] = (
    WsConfig(),
    WsConfig(chunked=True),
    WsConfig(math_regs=224, producer_regs=56, chunked=True),
)
"""The configurations the benchmark times; ``VARIANTS[0]`` (``ws-r232-p40-tile``, the
fastest of the three on an H200 at b128 L8192 and b32 L32768, docs/gluon.md) is the
default of ``compile_ws`` and the dispatch."""

WS_AUTO = False
"""Whether ``decode`` (``impl="auto"`` and ``"gluon"``, no ``GluonDecodeConfig``) runs
recipe none through this kernel (``ws_family(VARIANTS[0])``) instead of
``gluon_decode``'s; ``warmup_decode`` then compiles it, as it calls ``decode``. Flip
after ``tests/test_gluon_decode_ws.py`` passes on an H200 with ``MLA_REQUIRE_GPU=1``."""


def _kernel() -> Any:
    from mla_triton.kernels.gluon_decode_ws import gluon_decode_ws_kernel

    return gluon_decode_ws_kernel


class WsFamily(_OnRead):
    """The decode core's split family of the warp-specialized kernel: 64 heads and 64
    tokens a CTA, four warps a partition, its register split."""

    def __init__(self, config: WsConfig) -> None:
        self.config = config
        self.kernel = gd._ByName(_kernel())

    def default_config(self, num_heads: int, recipe: AttentionQuant) -> DecodeConfig:
        from mla_triton.kernels import gluon_decode_ws as k

        return DecodeConfig(block_h=k.BLOCK_H, block_n=k.BLOCK_N, num_warps=k.NUM_WARPS,
                            num_stages=k.STAGES)  # fmt: skip

    def extra_args(self, cache: torch.Tensor, cfg: DecodeConfig, ops: _Operands) -> dict[str, Any]:
        c = self.config
        return {"MATH_REGS": c.math_regs, "PRODUCER_REGS": c.producer_regs, "CHUNKED": c.chunked}


@functools.cache
def ws_family(config: WsConfig) -> WsFamily:
    """The split family of ``config`` (one per configuration)."""
    return WsFamily(config)


def ws_dispatched(facts: gd.GluonFacts) -> bool:
    """Whether ``decode``'s dispatch, having picked the Gluon kernel for a call (``facts``:
    ``gluon_decode.choose_impl`` said ``"gluon"``, no ``GluonDecodeConfig`` given), runs it
    through this kernel: ``WS_AUTO`` is on and the recipe is none."""
    return WS_AUTO and _recipe_none(facts.quant) == gd.UNQUANTIZED


def _recipe_none(quant: AttentionQuant | None) -> gd.GluonRecipe | str:
    taken = gd.gluon_recipe(quant)
    if isinstance(taken, str):
        return taken
    if taken != gd.UNQUANTIZED:
        return "the warp-specialized Gluon kernel implements recipe none only"
    return taken


def ws_config_family(config: WsConfig, facts: gd.GluonFacts, impl: str) -> WsFamily:
    """``decode``'s split family for ``config=WsConfig(...)`` (``facts``: the checked call's,
    ``impl``: ``check_impl``'s). Raises ValueError before any launch: ``config`` under
    ``impl="triton"``, ``quant`` for a quantized recipe, ``impl`` where the Gluon kernels
    cannot run (not an sm90 GPU, another Triton release, widths other than 512 + 64)."""
    if impl == "triton":
        raise ValueError("config: a WsConfig configures impl='gluon', not 'triton'")
    taken = _recipe_none(facts.quant)
    if isinstance(taken, str):
        raise ValueError(f"quant: {taken}")
    why = gd.gluon_unsupported(facts, forced=True, recipe=_recipe_none)
    if why is not None:
        raise ValueError(f"impl: the warp-specialized Gluon decode does not take this call: "
                         f"{why.reason}")  # fmt: skip
    return ws_family(config)


def compile_ws(
    config: WsConfig = VARIANTS[0], *, dtype: str = "bf16", num_splits: int = 1, page: int = 64,
    index_dtype: str = "i32",
) -> gd.CompiledVariant:  # fmt: skip
    """Compile the warp-specialized kernel for sm_90a on any machine (no GPU needed).

    ``dtype``: ``"bf16"`` or ``"fp16"`` (q, cache and output); ``num_splits``, ``page``:
    what the launch would pass; strides and sizes marked divisible by 16 as the JIT
    marks a multiple of 16 (``gluon_decode.compile_variant``'s convention).
    """
    from mla_triton.kernels import gluon_decode_ws as k
    from mla_triton.kernels.decode_kernel import SPLIT_ALIGN

    fn = _kernel()
    div, i32 = ("i32", True), ("i32", False)

    def ptr(t: str) -> tuple[str, bool]:
        return (f"*{t}", True)

    split = (
        (ptr(dtype), ptr(dtype), ptr("fp32")), (ptr(dtype),), ptr(index_dtype),
        ptr(index_dtype), (ptr(dtype), ptr("fp32")), (ptr("fp32"), ptr("fp32")),
        (div, div, div, div), (div, div), (i32, i32), i32, (div, div, i32, i32),
        (i32, i32), ("fp32", False),
    )  # fmt: skip
    constexprs: dict[str, Any] = {
        "SHAPE": (512, 64, page, k.BLOCK_H, k.BLOCK_N, 2, SPLIT_ALIGN),
        "MULTI_SPLIT": num_splits > 1, "PRODUCER_REGS": config.producer_regs,
        "MATH_REGS": config.math_regs, "CHUNKED": config.chunked,
    }  # fmt: skip
    return gd.compile_split_sm90(fn, split, {"out_scale": "fp32"}, constexprs, k.NUM_WARPS)
