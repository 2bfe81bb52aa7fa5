"""Which decode implementation runs a call, and with which tiles.

``choose`` is a pure function of the call's facts (``gluon.GluonFacts``: device
capability, Triton release, dtype, recipe, head count, widths, cache strides) and of the
implementation forced by ``mla_triton.tuning.use`` (``"auto"`` otherwise). The rules:

| facts | implementation |
|---|---|
| not an sm90 GPU, Triton other than the Gluon release, widths other than 512 + 64 | Triton split-K
|
| recipe none | warp-specialized Gluon (``gluon_ws``), any head count |
| a recipe the Gluon split kernel implements, more than 32 heads | Gluon split (``gluon``) |
| anything else | Triton split-K |

``decode_shadow`` passes its own families and rule (``mla_triton.ops.shadow``), with the
same shape: the warp-specialized kernel for the shadows it reads, at any head count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton.common.splitk import Checked, DecodeConfig, SplitFamily
from mla_triton.ops.decode import gluon
from mla_triton.ops.decode import gluon_ws as ws
from mla_triton.ops.decode.triton import ON_READ

__all__ = ["Families", "choose"]

Families = tuple[SplitFamily, Callable[[gluon.GluonDecodeConfig], SplitFamily], ws.WsRoute]
"""The Triton family, the Gluon split family of a config and the warp-specialized route."""

DECODE_FAMILIES: Families = (ON_READ, gluon.gluon_family, ws.DECODE_ROUTE)


def choose(
    c: Checked,
    kv_cache: torch.Tensor,
    quant: AttentionQuant | None,
    kv_lora_rank: int,
    forced: tuple[str, object],
    families: Families = DECODE_FAMILIES,
    rule: Callable[..., Any] = ws.decode_unsupported,
    on_read: bool = True,
) -> tuple[SplitFamily, DecodeConfig | None]:
    """The split family and the Triton tile config (None: the family's default) of a call.

    ``forced``: ``(implementation, config)`` from ``tuning.use`` (``"auto"``: the table of
    this module's docstring); a forced implementation that cannot run the call is a
    ValueError naming ``impl`` (or ``config``/``quant``) before any launch. ``kv_cache``:
    the tiles the Gluon kernels read (the facts' strides); ``on_read``: ``decode``'s
    recipe is quantized on read (``decode_shadow``'s is in its shadow).
    """
    impl, config = forced
    triton_family, make, route = families
    if impl == "triton":
        if config is not None and not isinstance(config, DecodeConfig):
            raise ValueError(f"config: impl 'triton' takes a tuning.TritonDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        return triton_family, config
    facts = gluon.gluon_facts(c.q_nope, kv_cache, quant, kv_lora_rank)
    if impl == "gluon_ws":
        if config is not None and not isinstance(config, ws.WsConfig):
            raise ValueError(f"config: impl 'gluon_ws' takes a tuning.GluonWsDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        if config is not None:
            return route.configured(config, facts, "gluon"), None
        gluon.choose_impl("gluon", facts, rule)  # the platform's refusals, naming impl
        family = route.default(facts)
        if family is None:
            raise ValueError("impl: the warp-specialized Gluon decode does not take this recipe")
        return family, None
    if impl == "gluon":
        if config is not None and not isinstance(config, gluon.GluonDecodeConfig):
            raise ValueError(f"config: impl 'gluon' takes a tuning.GluonDecode, got "
                             f"{type(config).__name__}")  # fmt: skip
        gluon.choose_impl("gluon", facts, rule)
        default = gluon.gluon_decode_config(c.heads, quant if on_read else None)
        return make(config if isinstance(config, gluon.GluonDecodeConfig) else default), None
    if gluon.choose_impl("auto", facts, rule) == "triton":
        return triton_family, None
    default = gluon.gluon_decode_config(c.heads, quant if on_read else None)
    return route.default(facts) or make(default), None
