"""Force an implementation and its tiles, for benchmarks and kernel tuning.

Every call of ``decode``, ``decode_shadow`` and ``prefill`` picks its implementation and
tile configuration from the device, the Triton release, the recipe and the shapes. Inside
``use(...)`` the calls of this thread (and of tasks started from it) take the one named
instead, or raise ``ValueError`` naming ``impl`` before any launch where it cannot run::

    from mla_triton import tuning

    with tuning.use("triton"):                                  # decode's Triton split-K
        out, lse = mla_triton.decode(...)
    with tuning.use(tuning.GluonWsDecode(block_n=32, stages=4)):  # an implementation and tiles
        out, lse = mla_triton.decode(...)

``IMPLS`` lists the implementations of each op (``"decode"`` covers ``decode`` and
``decode_shadow``). The config types are the tilings each implementation takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from mla_triton.common.choice import IMPLS, force
from mla_triton.common.splitk import DecodeConfig as TritonDecode
from mla_triton.common.splitk import decode_num_splits
from mla_triton.ops.decode.gluon import GluonDecodeConfig as GluonDecode
from mla_triton.ops.decode.gluon_ws import WsConfig as GluonWsDecode
from mla_triton.ops.prefill.gluon import GluonPrefillConfig as GluonPrefill
from mla_triton.ops.prefill.triton import PrefillConfig as TritonPrefill

__all__ = [
    "IMPLS",
    "GluonDecode",
    "GluonPrefill",
    "GluonWsDecode",
    "TritonDecode",
    "TritonPrefill",
    "decode_num_splits",
    "use",
]

_CONFIGS: dict[type, tuple[str, str]] = {
    TritonDecode: ("decode", "triton"),
    GluonDecode: ("decode", "gluon"),
    GluonWsDecode: ("decode", "gluon_ws"),
    TritonPrefill: ("prefill", "triton"),
    GluonPrefill: ("prefill", "gluon"),
}


@contextmanager
def use(
    *choices: str | TritonDecode | GluonDecode | GluonWsDecode | TritonPrefill | GluonPrefill,
) -> Iterator[None]:
    """Force implementations inside the block.

    Each choice is an implementation name (``"triton"``, ``"gluon"``, ``"gluon_ws"``:
    for every op that has it, with its default tiles) or a config object (that
    implementation of its op, with these tiles). Later choices override earlier ones.
    """
    with ExitStack() as stack:
        for choice in choices:
            if isinstance(choice, str):
                ops = [op for op, names in IMPLS.items() if choice in names]
                if not ops:
                    names = sorted({n for v in IMPLS.values() for n in v})
                    raise ValueError(f"impl: expected one of {', '.join(names)}, got {choice!r}")
                for op in ops:
                    stack.enter_context(force(op, choice))
            elif type(choice) in _CONFIGS:
                op, impl = _CONFIGS[type(choice)]
                stack.enter_context(force(op, impl, choice))
            else:
                raise ValueError(f"use: expected an implementation name or a tuning config, "
                                 f"got {type(choice).__name__}")  # fmt: skip
        yield
