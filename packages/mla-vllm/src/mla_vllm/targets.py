"""What the public functions act on: a model in this process, or a ``vllm.LLM``.

``on_models(target, func)`` runs ``func`` on the model of each worker (through
``LLM.apply_model``, which with vLLM's default multiprocessing engine needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send the function); ``model_layers``
and ``layer_states`` find a model's MLA layers and the quantized ones' states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import MLAAttention

from mla_vllm.state import LayerState

__all__ = ["is_llm", "layer_states", "model_layers", "on_models"]


def is_llm(target: object) -> bool:
    """True for a ``vllm.LLM`` (anything with ``apply_model`` that is not a module)."""
    return hasattr(target, "apply_model") and not isinstance(target, torch.nn.Module)


def on_models(target: Any, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
    """``func`` of each worker's model (one entry for a module), in rank order."""
    if isinstance(target, torch.nn.Module):
        return [func(target)]
    if is_llm(target):
        return list(target.apply_model(func))
    raise ValueError(
        f"target: expected a torch.nn.Module or a vllm.LLM, got {type(target).__name__}"
    )


def model_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The ``MLAAttention`` layers of ``model`` by layer name; ``ValueError`` if none."""
    layers = {m.layer_name: m for m in model.modules() if isinstance(m, MLAAttention)}
    if not layers:
        raise ValueError("model: has no vLLM MLAAttention layer")
    return layers


def layer_states(model: torch.nn.Module) -> dict[str, LayerState]:
    """The state of every layer carrying a quantized impl (in place or via the backend)."""
    out: dict[str, LayerState] = {}
    for module in model.modules():
        if isinstance(module, MLAAttention):
            state = getattr(module.impl, "mla_layer", None)
            if isinstance(state, LayerState):
                out[module.layer_name] = state
    return out
