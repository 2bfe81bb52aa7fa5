"""Triton kernels (``@triton.jit``) behind mla_triton's launch wrappers."""
