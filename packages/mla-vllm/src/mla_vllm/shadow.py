"""The write-once K/V shadow cache inside vLLM's own KV-cache blocks (``kv_path: "shadow"``).

``mla_triton.shadow`` quantizes each token's K̂ and V̂ once, at cache-write time,
into a uint8 shadow addressed by the same ``(block, slot)`` as the raw latent
cache. Here the shadow lives in the *same row* as the raw latent:

- ``MLAQuantBackend.customize_spec`` (vLLM's hook for backends that pack extra
  bytes per token, as the per-token-head fp8 MLA cache does for its scales)
  declares ``state_content_bytes = (kv_lora_rank + rope) * dtype_size + S`` for
  every MLA layer. vLLM sizes pages, counts blocks against
  ``gpu_memory_utilization`` and allocates from that, so the shadow is paid for in
  vLLM's own accounting, and a block id names raw + shadow: prefix-cache reuse,
  preemption and recompute, block copies and KV transfer carry the shadow with the
  raw rows, with no bookkeeping here.
- vLLM views each layer's bytes as ``[blocks, page, C / dtype_size]`` in the model
  dtype (``create_kv_cache_views``, then ``MLAAttention.bind_kv_cache``); the impl
  splits every row into the raw ``[blocks, page, kv_lora_rank + rope]`` view (row
  stride ``C / dtype_size``: ``mla_triton`` and vLLM's gathers read strides from
  the tensor) and a uint8 ``[blocks, page, S]`` view of the shadow bytes.
- ``S`` is one number for all layers (vLLM requires one spec, so one page size,
  per KV-cache group): the largest ``ShadowLayout.token_bytes`` over the layers'
  decode recipes. A layer whose own layout is smaller uses the first bytes of
  the region; a layer with neither K nor V quantized leaves it unused.

This module plans the bytes (``layer_shadow``, ``shadow_token_bytes``,
``shadow_spec``) and splits the rows (``split_cache``); ``mla_vllm.backend`` finds
the config and the layers that ``customize_spec`` plans for, and the impl checks
the width of the rows it gets against its own layout and raises if the bytes are
missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec

from mla_formats import AttentionQuant
from mla_triton import ShadowLayout, shadow_layout
from mla_vllm.config import MLAQuantConfig

__all__ = ["LayerShadow", "layer_shadow", "shadow_spec", "shadow_token_bytes", "split_cache"]


@dataclass(frozen=True)
class LayerShadow:
    """What one layer writes into (and decodes from) its shadow bytes."""

    quant: AttentionQuant
    """The layer's decode recipe (its k and v define the shadow)."""
    storage: str
    layout: ShadowLayout


def layer_shadow(
    config: MLAQuantConfig, quant: AttentionQuant, kv_lora_rank: int, rope_dim: int
) -> LayerShadow | None:
    """The shadow of a layer with decode recipe ``quant``; None: on-read, or nothing to store.

    A recipe with neither K nor V quantized stores nothing (0 bytes): such a layer
    decodes on read, which then does no K/V rounding either.
    """
    if config.kv_path != "shadow":
        return None
    layout = shadow_layout(
        quant, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, storage=config.shadow_storage
    )
    if layout.token_bytes == 0:
        return None
    return LayerShadow(quant, config.shadow_storage, layout)


def shadow_token_bytes(config: MLAQuantConfig, layers: Mapping[str, Any]) -> int:
    """Shadow bytes per token of every layer's row: the largest layout over ``layers``.

    ``layers`` maps vLLM layer names to ``MLAAttention`` layers (their dims are
    read); 0 with ``kv_path: "on_read"``.
    """
    if config.kv_path != "shadow":
        return 0
    nbytes = 0
    for name, layer in layers.items():
        layout = shadow_layout(
            config.recipe_for(name).decode,
            kv_lora_rank=int(layer.kv_lora_rank),
            rope_dim=int(layer.qk_rope_head_dim),
            storage=config.shadow_storage,
        )
        nbytes = max(nbytes, layout.token_bytes)
    return nbytes


def shadow_spec(spec: Any, config: MLAQuantConfig, layers: Mapping[str, Any]) -> Any:
    """``spec`` with the shadow bytes added to each token's state (MLA specs, shadow path).

    ``layers`` are the model's ``MLA_QUANT`` layers by name. Leaves every other spec
    alone: non-MLA specs, quantized KV caches (refused elsewhere), specs that
    already declare packed bytes, and the on-read path.
    """
    if (
        not isinstance(spec, MLAAttentionSpec)
        or spec.kv_quant_mode != KVQuantMode.NONE
        or spec.state_content_bytes is not None
        or config.kv_path != "shadow"
    ):
        return spec
    if not layers:
        raise RuntimeError(
            "mla_quant.kv_path 'shadow': no MLA_QUANT layer is registered in the model's "
            "forward context, so the shadow bytes per token are unknown (the KV cache spec "
            "is asked for before the model is built?)"
        )
    extra = shadow_token_bytes(config, layers)
    if extra == 0:
        return spec
    raw = spec.head_size * spec.dtype.itemsize
    return replace(spec, state_content_bytes=raw + extra)


def split_cache(
    kv_cache: torch.Tensor, raw_width: int, shadow: LayerShadow | None, layer_name: str = ""
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(raw [N, P, raw_width], shadow uint8 [N, P, token_bytes] or None)`` of a layer cache.

    ``kv_cache`` is the layer's ``[N, P, W]`` view in the model dtype (``W >=
    raw_width``); both results are views of it (the raw one is ``kv_cache`` itself
    when ``W == raw_width``). Raises when ``shadow`` is set and the rows hold fewer
    shadow bytes than its layout needs.
    """
    raw = kv_cache if kv_cache.shape[-1] == raw_width else kv_cache[..., :raw_width]
    if shadow is None:
        return raw, None
    have = (kv_cache.shape[-1] - raw_width) * kv_cache.element_size()
    need = shadow.layout.token_bytes
    if have < need:
        raise RuntimeError(
            f"mla_quant.kv_path 'shadow': the KV cache of layer {layer_name!r} has rows of "
            f"{kv_cache.shape[-1]} elements ({tuple(kv_cache.shape)}), which leaves {have} "
            f"bytes after the {raw_width}-element raw latent; its shadow needs {need} "
            f"({shadow.storage!r} storage). The cache was not allocated through "
            "MLAQuantBackend's KV cache spec (install in place, or a spec computed "
            "without the mla_quant config?)"
        )
    return raw, kv_cache[..., raw_width:].view(torch.uint8)[..., :need]
