"""The ``vllm.general_plugins`` entry point: registers ``MLA_QUANT`` (re-entrant).

vLLM runs it in every process (front end, engine core, each worker), possibly
more than once; registering again only re-points the same names at the same
classes. The backends are registered by class path, so registering imports
none of this package's vLLM-facing modules; vLLM imports them when it selects
the backend. This module also owns the backends' names.
"""

from __future__ import annotations

__all__ = [
    "BACKEND_CLASS_PATH",
    "BACKEND_NAME",
    "PREFILL_BACKEND_NAME",
    "PREFILL_CLASS_PATH",
    "register",
]

BACKEND_NAME = "MLA_QUANT"
PREFILL_BACKEND_NAME = "MLA_QUANT"
BACKEND_CLASS_PATH = "mla_vllm.backend.MLAQuantBackend"
PREFILL_CLASS_PATH = "mla_vllm.prefill.MLAQuantPrefillBackend"


def register() -> None:
    """Register the attention backend and the prefill backend under ``MLA_QUANT``."""
    # vLLM's registries are imported here, not at module level, so that this module
    # (and the BACKEND_NAME that ``mla_vllm`` exports) can be imported without vLLM.
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum[BACKEND_NAME], BACKEND_CLASS_PATH)
    else:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    if PREFILL_BACKEND_NAME in MLAPrefillBackendEnum.__members__:
        register_mla_prefill_backend(
            MLAPrefillBackendEnum[PREFILL_BACKEND_NAME], PREFILL_CLASS_PATH
        )
    else:
        register_mla_prefill_backend(PREFILL_BACKEND_NAME, PREFILL_CLASS_PATH)
