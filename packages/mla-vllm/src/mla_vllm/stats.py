"""Accuracy statistics of the quantized layers (``"observe": {"enabled": true}``).

Each quantized layer's ``LayerState`` accumulates, on sampled calls, the error of
its attention output against the unquantized one; these functions read and
clear them on every worker.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_vllm.targets import layer_states, on_models

__all__ = ["get_stats", "reset_stats"]


def _collect_stats(model: torch.nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    return {name: state.snapshot() for name, state in layer_states(model).items()}


def get_stats(target: Any) -> dict[str, dict[str, dict[str, float]]]:
    """Per layer and path (``prefill``/``decode``): calls observed and error statistics.

    Keys: ``calls``, ``rel_l2_mean``, ``rel_l2_max``, ``cosine_mean``, ``cosine_min``,
    ``max_abs_mean``, ``max_abs_max`` (quantized vs unquantized attention output,
    before ``W_UV`` / ``o_proj``), over the observed calls whose unquantized output is
    not all zeros; ``empty_calls`` counts the others (an engine's dummy and warm-up
    batches), which the figures leave out. Calls replayed from a CUDA graph are not
    observed: with CUDA graphs on, ``decode`` covers the eager steps only. Workers'
    results are merged (tensor parallel ranks hold different heads of the same layer:
    their names repeat with ``@rank``).
    """
    merged: dict[str, dict[str, dict[str, float]]] = {}
    for rank, stats in enumerate(on_models(target, _collect_stats)):
        for name, value in stats.items():
            merged[name if rank == 0 else f"{name}@{rank}"] = value
    return merged


def _reset_model(model: torch.nn.Module) -> None:
    for state in layer_states(model).values():
        state.reset()


def reset_stats(target: Any) -> None:
    """Forget the statistics gathered so far."""
    on_models(target, _reset_model)
