"""NVFP4 and FP8 quantize-dequantize maths for quantized MLA attention.

The formats, their rounding primitives and the recipe types shared by
``mla_reference``, ``mla_triton`` and ``mla_vllm``. See docs/numerics.md
"Formats and scales".
"""

from mla_formats.formats import (
    FORMATS,
    FP8,
    NONE,
    NVFP4,
    AttentionQuant,
    Format,
    NMSparsity,
    OperandQuant,
    get_format,
)
from mla_formats.qdq import qdq, qdq_factored, resolve_amax
from mla_formats.rounding import E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, e2m1_round, e4m3_round

__version__ = "0.1.0"

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "FORMATS",
    "FP8",
    "NONE",
    "NVFP4",
    "AttentionQuant",
    "Format",
    "NMSparsity",
    "OperandQuant",
    "__version__",
    "e2m1_round",
    "e4m3_round",
    "get_format",
    "qdq",
    "qdq_factored",
    "resolve_amax",
]
