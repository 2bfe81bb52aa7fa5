"""Per-object memos for the recipes every call passes (the same frozen object, call after call).

``by_identity(fn)`` remembers ``fn(obj)`` under ``id(obj)`` and holds ``obj``, so that its
id cannot name another object while remembered: a lookup costs no hash of the recipe's
nested dataclasses (several microseconds for an ``AttentionQuant``). Only for immutable
arguments (the frozen ``mla_formats`` recipes, None) and pure functions of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["by_identity"]

K = TypeVar("K")
V = TypeVar("V")


class _ByIdentity(Generic[K, V]):
    def __init__(self, fn: Callable[[K], V], size: int) -> None:
        self.fn = fn
        self.size = size
        self.memo: dict[int, tuple[K, V]] = {}
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, key: K) -> V:
        hit = self.memo.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        value = self.fn(key)
        if len(self.memo) >= self.size:
            self.memo.clear()
        self.memo[id(key)] = (key, value)
        return value

    def cache_clear(self) -> None:
        self.memo.clear()


def by_identity(fn: Callable[[K], V], size: int = 64) -> _ByIdentity[K, V]:
    """``fn`` remembered per argument object (at most ``size`` of them; then forgotten
    all at once)."""
    return _ByIdentity(fn, size)
