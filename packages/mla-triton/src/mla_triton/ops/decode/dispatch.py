"""Which decode implementation runs a call, and with which tiles.

``choose`` is a pure function of the call's facts (``gluon.GluonFacts``: device
capability, Triton release, dtype, recipe, head count, widths, cache strides) and of the
implementation forced by ``mla_triton.tuning.use`` (``"auto"`` otherwise). ``"auto"``
takes two steps:

1. Preconditions (``Route.rule``: ``gluon.gluon_taken``, for ``decode_shadow``
   ``shadow.gluon_shadow_taken``): an sm90 GPU, the Gluon release of Triton, no
   interpreter, 16-bit inputs, widths 512 + 64, aligned cache strides and a recipe the
   Gluon kernels implement. A call that fails one runs Triton split-K.
2. Preferences: ``TABLE``, data. The first row of the op whose ``recipes`` hold the
   call's recipe kind (``gluon.recipe_kind``) and whose ``min_heads`` its head count
   reaches names the implementation and its tiles; no row: Triton split-K.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch

from mla_formats import AttentionQuant
from mla_triton.common import device as dev
from mla_triton.common.splitk import Checked, DecodeConfig, SplitFamily
from mla_triton.ops.decode import gluon
from mla_triton.ops.decode import gluon_ws as ws
from mla_triton.ops.decode.gluon import GluonDecodeConfig, GluonRecipe, Rule, Unsupported
from mla_triton.ops.decode.triton import ON_READ

__all__ = [
    "DECODE",
    "KDYN_SECTION",
    "TABLE",
    "Route",
    "Row",
    "auto",
    "choose",
    "forced_taken",
    "lookup",
]


@dataclass(frozen=True)
class Row:
    """One preference of ``"auto"``, for calls that pass the preconditions.

    Attributes:
        op: ``"decode"`` (quantized on read) or ``"decode_shadow"``.
        recipes: the recipe kinds (``gluon.recipe_kind``: a ``GluonRecipe`` without its
            global scales) the row takes; None: every recipe the Gluon kernels take.
        min_heads: the fewest query heads the row takes.
        impl: ``"gluon_ws"`` (warp-specialized) or ``"gluon"`` (Gluon split).
        config: the tiles it runs with.
        why: what was measured (an H200, Triton 3.8; docs/design/decode.md).
    """

    op: str
    recipes: frozenset[GluonRecipe] | None
    min_heads: int
    impl: str
    config: GluonDecodeConfig | ws.WsConfig
    why: str


KDYN_SECTION = replace(ws.NVFP4_SHADOW, v_tail=False, k_dyn=True, q_fmt=1, v_fmt=1)
"""A V̂ section of fp8 q, each token's dynamic nvfp4 K scale, fp8 V̂ (no open block),
nvfp4 P: the Gluon split kernel reads it, the warp-specialized one does not."""

TABLE: tuple[Row, ...] = (
    Row("decode", frozenset({gluon.UNQUANTIZED}), 1, "gluon_ws", ws.DEFAULT_CONFIG,
        "b128 h16 L8192: 1.07x FlashMLA, Triton split-K 0.83x; b128 h128 L8192: 1.00x"),
    Row("decode", gluon.ON_READ_NVFP4_KINDS, 33, "gluon", gluon.ON_READ_BLOCKS_CONFIG,
        "h128: 1.30x / 1.37x SEPARATE_V_CONFIG at L8192 / L32768, the same bits"),
    Row("decode", None, 33, "gluon", gluon.VARIANTS[0],
        "h128: 1.5x Triton split-K; h16: 0.85x to 0.93x (48 of 64 wgmma rows padding)"),
    Row("decode_shadow", frozenset({ws.FP8_SHADOW}), 1, "gluon_ws", ws.DEFAULT_CONFIG,
        "b128 h16 L8192: 0.307 ms, Triton split-K 0.399 (any static scale)"),
    Row("decode_shadow", frozenset({ws.NVFP4_SHADOW}), 1, "gluon_ws", ws.NVFP4_CONFIG,
        "b128 h16 L8192: 0.546 ms, Triton split-K 0.866 (power-of-two scales)"),
    Row("decode_shadow", frozenset({ws.NVFP4_PACKED}), 1, "gluon_ws", ws.NVFP4_PACKED_CONFIG,
        "b128 h16 L8192: 2.30 ms, Triton split-K 2.79; the fp16 shadow's bits"),
    Row("decode_shadow", frozenset({KDYN_SECTION}), 33, "gluon", gluon.SEPARATE_V_CONFIG,
        "verified on an H200 at 16 and 128 heads; the split kernel's 32-head rule"),
)  # fmt: skip
"""``"auto"``'s preferences, first match wins. A shadow recipe in no row (an exact V
scale, K none with V quantized, q not quantized) is not verified on a GPU in the Gluon
kernels: Triton split-K unless forced."""


def lookup(
    op: str, kind: GluonRecipe, heads: int | None = None, impl: str | None = None
) -> Row | None:
    """The first row of ``TABLE`` for ``op`` taking the recipe ``kind`` (and ``heads``, and
    of ``impl``, where given), None for none."""
    for row in TABLE:
        if row.op != op or (row.recipes is not None and kind not in row.recipes):
            continue
        if (heads is None or heads >= row.min_heads) and (impl is None or row.impl == impl):
            return row
    return None


@dataclass(frozen=True)
class Route:
    """What ``choose`` needs of an op: its name in ``TABLE``, the Triton family, the Gluon
    split family of a config, the warp-specialized route and the preconditions."""

    op: str
    triton: SplitFamily
    gluon: Callable[[GluonDecodeConfig], SplitFamily]
    ws: ws.WsRoute
    rule: Rule
    rule_key: Hashable = None
    """``auto``'s key for ``rule`` (``decode_shadow``, whose rule is made per call: the
    shadow's layout, which determines it); None: the rule itself."""


DECODE = Route("decode", ON_READ, gluon.gluon_family, ws.DECODE_ROUTE, gluon.gluon_taken)
"""``decode``'s route (quantized on read)."""

_logged: set[str] = set()
_DECISIONS: dict[tuple[str, gluon.GluonFacts, object], tuple[GluonRecipe | Unsupported, Row | None]]
_DECISIONS = {}
_DECISIONS_SIZE = 256


def auto(
    op: str, facts: gluon.GluonFacts, rule: gluon.Rule, rule_key: Hashable = None
) -> Row | None:
    """``"auto"``'s row of ``TABLE`` for ``facts`` that pass ``rule`` (``op``'s
    preconditions), None for Triton split-K. On an sm90 GPU a platform or tensor reason
    is logged once.

    The decision is a pure function of ``op``, ``facts`` and the rule, so it is remembered
    under ``(op, facts, rule)``, or ``(op, facts, rule_key)`` where the caller gives a key
    that determines the rule (at most ``_DECISIONS_SIZE`` entries): a call with the same facts
    as an earlier one skips the rule and the table. Logging is not remembered: each call
    checks its reason."""
    key = (op, facts, rule if rule_key is None else rule_key)
    hit = _DECISIONS.get(key)
    if hit is None:
        taken = rule(facts)
        row = None
        if not isinstance(taken, Unsupported):
            row = lookup(op, gluon.recipe_kind(taken), facts.heads)
        if len(_DECISIONS) >= _DECISIONS_SIZE:
            _DECISIONS.clear()
        _DECISIONS[key] = hit = (taken, row)
    taken, row = hit
    if isinstance(taken, Unsupported):
        if taken.covered and taken.reason not in _logged:
            _logged.add(taken.reason)
            dev.log.warning("mla_triton.decode: the Triton kernel on this sm90 GPU: %s",
                            taken.reason)  # fmt: skip
        return None
    return row


def forced_taken(facts: gluon.GluonFacts, rule: gluon.Rule) -> GluonRecipe:
    """The recipe a forced Gluon kernel runs ``facts`` with, else a ValueError naming
    ``impl`` with ``rule``'s reason."""
    taken = rule(facts)
    if isinstance(taken, Unsupported):
        raise ValueError(f"impl: the Gluon decode does not take this call: {taken.reason}")
    return taken


def choose(
    c: Checked,
    kv_cache: torch.Tensor,
    quant: AttentionQuant | None,
    kv_lora_rank: int,
    forced: tuple[str, object],
    route: Route = DECODE,
) -> tuple[SplitFamily, DecodeConfig | None]:
    """The split family and the Triton tile config (None: the family's default) of a call.

    ``forced``: ``(implementation, config)`` from ``tuning.use`` (``"auto"``: the
    preconditions, then ``TABLE``); a forced implementation that cannot run the call is a
    ValueError naming ``impl`` (or ``config``/``quant``) before any launch; forced without
    a config, it takes the tiles of the table's first row of it for the recipe. On an sm90
    GPU, ``"auto"`` logs once each platform or tensor reason it falls back for.
    ``kv_cache``: the tiles the Gluon kernels read (the facts' strides).
    """
    impl, config = forced
    if impl == "triton":
        if config is not None and not isinstance(config, DecodeConfig):
            raise ValueError(f"config: impl 'triton' takes a tuning.TritonDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        return route.triton, config
    facts = gluon.gluon_facts(c.q_nope, kv_cache, quant, kv_lora_rank)
    if impl == "gluon_ws":
        if config is not None and not isinstance(config, ws.WsConfig):
            raise ValueError(f"config: impl 'gluon_ws' takes a tuning.GluonWsDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        if config is not None:
            return route.ws.configured(config, facts, "gluon"), None
        taken = forced_taken(facts, route.rule)
        row = lookup(route.op, gluon.recipe_kind(taken), impl="gluon_ws")
        tiles = row.config if row is not None else route.ws.forced(taken)
        if not isinstance(tiles, ws.WsConfig):
            raise ValueError("impl: the warp-specialized Gluon decode does not take this recipe")
        return route.ws.family(tiles), None
    if impl == "gluon":
        if config is not None and not isinstance(config, GluonDecodeConfig):
            raise ValueError(f"config: impl 'gluon' takes a tuning.GluonDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        taken = forced_taken(facts, route.rule)
        if config is None:
            row = lookup(route.op, gluon.recipe_kind(taken), impl="gluon")
            config = row.config if row is not None else gluon.VARIANTS[0]
        assert isinstance(config, GluonDecodeConfig)
        return route.gluon(config), None
    row = auto(route.op, facts, route.rule, route.rule_key)
    if row is None:
        return route.triton, None
    if isinstance(row.config, ws.WsConfig):
        return route.ws.family(row.config), None
    return route.gluon(row.config), None
