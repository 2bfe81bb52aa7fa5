"""Triton kernels for quantized Multi-head Latent Attention (SPEC 6)."""

from mla_triton.decode import decode as decode
from mla_triton.decode import decode_workspace_size as decode_workspace_size
from mla_triton.prefill import prefill as prefill
from mla_triton.shadow import ShadowLayout as ShadowLayout
from mla_triton.shadow import allocate_shadow as allocate_shadow
from mla_triton.shadow import decode_shadow as decode_shadow
from mla_triton.shadow import shadow_decode_config as shadow_decode_config
from mla_triton.shadow import shadow_layout as shadow_layout
from mla_triton.shadow import update_cache as update_cache

__version__ = "0.1.0"
