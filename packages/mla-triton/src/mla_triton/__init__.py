"""Triton kernels for quantized Multi-head Latent Attention (SPEC 6)."""

from mla_triton.decode import decode as decode
from mla_triton.decode import decode_workspace_size as decode_workspace_size
from mla_triton.prefill import prefill as prefill

__version__ = "0.1.0"
