"""Seeing the launches of ``mla_triton``'s kernels: the warm-up compiles them without
running them (``precompile``), and a repeated call replays them (``common.replay``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_PACKAGE = "mla_triton"
LOCK = threading.Lock()
"""Held while launches are intercepted: one interception at a time in a process."""
Run = Callable[..., Any]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Action = Callable[[Run, Any, Args, Kwargs, Any], Any]


def ours(kernel: Any) -> bool:
    """Whether ``kernel`` is one of this package's ``@triton.jit``/``@gluon.jit`` kernels."""
    fn = getattr(kernel, "fn", None)
    return str(getattr(fn, "__module__", "")).startswith(_PACKAGE)


@contextmanager
def intercept(action: Action, *, busy: str | None = None) -> Iterator[bool]:
    """Replace every launch of an ``mla_triton`` kernel *from this thread* by ``action(...)``.

    ``action(run, kernel, args, kwargs, grid)`` gets the class's own ``run``.
    Patches ``run`` of Triton's ``JITFunction`` (Gluon's kernels included) and
    ``InterpretedFunction`` for the duration; other packages' kernels, and launches
    from other threads (a warm-up in a background thread while the engine serves or
    compiles in the main one), launch as usual. Interceptions do not nest: while one
    is active, ``busy`` None raises ``RuntimeError``, else the block runs without
    interception and the context yields False (True when intercepting).
    """
    if not LOCK.acquire(blocking=False):
        if busy is None:
            raise RuntimeError("mla_triton.warmup: compile_only/record_keys do not nest")
        yield False
        return
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    owner = threading.get_ident()

    def patched(cls: type) -> Callable[..., Any]:
        original = originals[cls]

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not ours(self) or threading.get_ident() != owner:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return action(original, self, args, kwargs, grid)

        return run

    try:
        for cls in originals:
            cls.run = patched(cls)
        yield True
    finally:
        for cls, original in originals.items():
            cls.run = original
        LOCK.release()
