"""Quantized MLA attention for vLLM 0.33.0: backend, prefill backend, installer, calibration.

Serve with ``vllm serve <model> --attention-backend MLA_QUANT --additional-config
'{"mla_quant": {"recipe": "nvfp4"}}'``; the ``vllm.general_plugins`` entry point
registers the backend in every vLLM process. The vLLM-facing modules are imported
on first use of their names (``_LAZY``), so ``mla_vllm.config`` can validate a
configuration without vLLM.

Modules, each importing only those above it:

- ``checkpoint_amax`` (static amax from ModelOpt checkpoints and amax states);
- ``plugin`` (entry point, backend names), ``config`` (the ``mla_quant`` schema),
  ``gates`` (what cannot run quantized);
- ``state`` (per-layer recipe, statistics, amaxes);
- ``workspace`` (decode scratch), ``shadow`` (shadow bytes: layout and planning),
  ``targets`` (a model or a ``vllm.LLM``; its MLA layers);
- ``decode`` (the decode step, in named steps), ``prefill`` (the prefill backend);
- ``warmup`` (every kernel variant compiled in vLLM's kernel warm-up);
- ``backend`` (impl, metadata builder, attention backend);
- ``installer`` (``install`` in place, and ``uninstall``), ``stats`` (error statistics);
- ``calibration`` (static amaxes);
- the subpackage ``compare`` (the ``mla-compare`` command), above all of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from mla_vllm.config import (
    LayerRecipe,
    MLAQuantConfig,
    MLAQuantConfigError,
    ObserveConfig,
    load_calibration,
    load_config,
)
from mla_vllm.plugin import BACKEND_NAME, register

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "LayerRecipe",
    "MLAQuantConfig",
    "MLAQuantConfigError",
    "ObserveConfig",
    "__version__",
    "calibrate",
    "get_stats",
    "install",
    "load_calibration",
    "load_config",
    "register",
    "reset_stats",
    "uninstall",
]

_LAZY = {
    "calibrate": "mla_vllm.calibration",
    "get_stats": "mla_vllm.stats",
    "install": "mla_vllm.installer",
    "reset_stats": "mla_vllm.stats",
    "uninstall": "mla_vllm.installer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
