"""Eager oracles for quantized Multi-head Latent Attention (MLA) prefill and decode.

Written from the project's definitions (docs/numerics.md "Operands and axes" to
"Interface"),
never from a kernel's schedule: every kernel in ``mla_triton`` is judged against
``prefill`` and ``decode`` here. Both accept a ``debug`` dict that receives the
quantized operands they used, so tests can check operands exactly.
"""

from mla_reference.decode import decode, gather_latent
from mla_reference.prefill import nm_keep, prefill

__version__ = "0.1.0"

__all__ = ["__version__", "decode", "gather_latent", "nm_keep", "prefill"]
