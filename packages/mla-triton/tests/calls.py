"""The public calls with an implementation forced, as the tests pick them.

``decode``, ``decode_shadow`` and ``prefill`` take ``impl`` (``"auto"``, ``"triton"``,
``"gluon"``, ``"gluon_ws"``) and ``config`` (a ``mla_triton.tuning`` config) and run the
public function inside ``tuning.use``: what a benchmark or a tuner does.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import mla_triton
from mla_triton import tuning


def _forced(impl: str, config: object) -> Any:
    if config is not None:
        return tuning.use(config)  # type: ignore[arg-type]
    return nullcontext() if impl == "auto" else tuning.use(impl)


def decode(*args: Any, impl: str = "auto", config: object = None, **kwargs: Any) -> Any:
    with _forced(impl, config):
        return mla_triton.decode(*args, **kwargs)


def decode_shadow(*args: Any, impl: str = "auto", config: object = None, **kwargs: Any) -> Any:
    with _forced(impl, config):
        return mla_triton.decode_shadow(*args, **kwargs)


def prefill(*args: Any, impl: str = "auto", config: object = None, **kwargs: Any) -> Any:
    with _forced(impl, config):
        return mla_triton.prefill(*args, **kwargs)
