"""Triton and Gluon kernels for quantized Multi-head Latent Attention.

NVFP4 or FP8 attention with Q, K, P and V each quantize-dequantized along its own
contraction axis (docs/numerics.md), for DeepSeek-V2/V3/R1-style MLA:

- ``decode``: absorbed-MLA decode over a paged latent cache, K and V quantized on read;
- ``decode_shadow``: the same reading K̂ and V̂ from a quantized shadow of the cache,
  written by ``update_cache`` (``allocate_shadow``, ``shadow_layout``);
- ``prefill``: varlen causal (or not) attention with N:M score sparsity;
- ``decode_workspace_size``: the workspace a CUDA-graph-captured decode needs;
- ``warmup``: compile every variant serving launches, before serving.

Implementations and tile configurations are chosen per call; ``mla_triton.tuning``
forces them for benchmarks and tuning.
"""

from mla_triton.common.splitk import decode_workspace_size
from mla_triton.ops.decode import decode
from mla_triton.ops.prefill import prefill
from mla_triton.ops.shadow import (
    ShadowLayout,
    allocate_shadow,
    decode_shadow,
    shadow_layout,
    update_cache,
)
from mla_triton.precompile import warmup

__all__ = [
    "ShadowLayout",
    "allocate_shadow",
    "decode",
    "decode_shadow",
    "decode_workspace_size",
    "prefill",
    "shadow_layout",
    "update_cache",
    "warmup",
]

__version__ = "0.1.0"
