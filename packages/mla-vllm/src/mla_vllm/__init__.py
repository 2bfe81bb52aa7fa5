"""Quantized MLA attention for vLLM 0.33.0: backend, prefill backend, installer, calibration.

Serve with ``vllm serve <model> --attention-backend MLA_QUANT --additional-config
'{"mla_quant": {"recipe": "nvfp4"}}'``; the ``vllm.general_plugins`` entry point
registers the backend in every vLLM process. The vLLM-facing modules are imported
lazily, so ``mla_vllm.config`` can validate a configuration without vLLM.
"""

from __future__ import annotations

from typing import Any

from mla_vllm.config import (
    LayerRecipe,
    MLAQuantConfig,
    MLAQuantConfigError,
    ObserveConfig,
    load_calibration,
    load_config,
)

__version__ = "0.1.0"

BACKEND_NAME = "MLA_QUANT"

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
    "calibrate": "mla_vllm.install",
    "get_stats": "mla_vllm.install",
    "install": "mla_vllm.install",
    "reset_stats": "mla_vllm.install",
    "uninstall": "mla_vllm.install",
    "register": "mla_vllm.plugin",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_vllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
