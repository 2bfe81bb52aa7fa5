"""The implementation a call is forced to take (``mla_triton.tuning.use``), per thread.

Dispatch reads ``forced(op)``: ``("auto", None)`` unless a ``tuning.use`` block of this
context names an implementation (and optionally its tile configuration) for that op.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

__all__ = ["IMPLS", "force", "forced"]

IMPLS: dict[str, tuple[str, ...]] = {
    "decode": ("triton", "gluon", "gluon_ws"),
    "prefill": ("triton", "gluon"),
}
"""The implementations of each op (``decode`` covers ``decode`` and ``decode_shadow``)."""

_NONE: Mapping[str, tuple[str, object]] = MappingProxyType({})
_FORCED: ContextVar[Mapping[str, tuple[str, object]]] = ContextVar(
    "mla_triton_forced", default=_NONE
)


def forced(op: str) -> tuple[str, object]:
    """``(implementation, config or None)`` forced for ``op`` here, else ``("auto", None)``."""
    return _FORCED.get().get(op, ("auto", None))


@contextmanager
def force(op: str, impl: str, config: object = None) -> Iterator[None]:
    """Force ``op`` to ``impl`` (one of ``IMPLS[op]``) with ``config`` inside the block."""
    if impl not in IMPLS[op]:
        raise ValueError(f"impl: expected one of {', '.join(IMPLS[op])} for {op}, got {impl!r}")
    token = _FORCED.set({**_FORCED.get(), op: (impl, config)})
    try:
        yield
    finally:
        _FORCED.reset(token)
