"""Install quantized attention into a model already loaded on TRITON_MLA, and back.

``install(target, config)`` validates every layer (gates, configuration, layer
patterns), builds every quantized impl, then publishes them layer by layer; if
anything fails midway, every layer gets its native impl and prefill backend back
and the error is raised. ``uninstall`` restores the native objects themselves.

``target`` is a ``torch.nn.Module`` (the model inside a worker) or a
``vllm.LLM``; for an ``LLM`` the work runs in each worker through
``LLM.apply_model``, which (with vLLM's default multiprocessing engine) needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send the function.

Decode graphs captured before ``install`` keep replaying the native kernel, so an
engine with full CUDA graphs is refused: use ``enforce_eager=True`` or piecewise
graphs, or serve with ``--attention-backend MLA_QUANT`` from the start.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mla_vllm.config import (
    CALIBRATION_FORMAT,
    MLAQuantConfig,
    MLAQuantConfigError,
    load_config,
)
from mla_vllm.gates import MLAQuantGateError, check_layers
from mla_vllm.state import LayerState

__all__ = [
    "calibrate",
    "finish_calibration",
    "get_stats",
    "install",
    "installed_layers",
    "reset_stats",
    "start_calibration",
    "uninstall",
]

_INSTALLED_ATTR = "_mla_quant_native"


@dataclass
class _Native:
    impl: Any
    prefill_backend: Any


def _is_llm(target: object) -> bool:
    return hasattr(target, "apply_model") and not isinstance(target, torch.nn.Module)


def _on_models(target: Any, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
    if isinstance(target, torch.nn.Module):
        return [func(target)]
    if _is_llm(target):
        return list(target.apply_model(func))
    raise ValueError(
        f"target: expected a torch.nn.Module or a vllm.LLM, got {type(target).__name__}"
    )


def _layers(model: torch.nn.Module) -> dict[str, Any]:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = {m.layer_name: m for m in model.modules() if isinstance(m, MLAAttention)}
    if not layers:
        raise ValueError("model: has no vLLM MLAAttention layer")
    return layers


def _cudagraph_problem(layers: dict[str, Any]) -> str | None:
    impl = next(iter(layers.values())).impl
    config = getattr(impl, "_vllm_config", None)
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None and mode.has_full_cudagraphs():
        return (
            f"cudagraph_mode {mode.name} captures the native decode kernel; install in place "
            "needs enforce_eager=True or cudagraph_mode PIECEWISE (or serve with "
            "--attention-backend MLA_QUANT)"
        )
    return None


def _publish_layer(layer: Any, impl: Any, prefill_backend: Any) -> None:
    """Point one layer at its new impl and prefill backend (a seam for tests)."""
    layer.impl = impl
    layer.prefill_backend = prefill_backend


def _restore(layers: dict[str, Any], natives: dict[str, _Native]) -> None:
    for name, native in natives.items():
        layer = layers[name]
        layer.impl = native.impl
        layer.prefill_backend = native.prefill_backend


def _install_model(model: torch.nn.Module, config: object) -> list[str]:
    from mla_vllm.backend import quant_impl_from

    if getattr(model, _INSTALLED_ATTR, None):
        raise ValueError("model: quantized MLA is already installed; call uninstall first")
    cfg = load_config(config)
    if cfg.kv_path == "shadow":
        raise MLAQuantConfigError(
            "mla_quant.kv_path: 'shadow' needs shadow bytes in every KV cache row, which "
            "only MLA_QUANT's KV cache spec allocates; install in place keeps TRITON_MLA's "
            "raw cache: use kv_path 'on_read', or serve with --attention-backend MLA_QUANT"
        )
    layers = _layers(model)
    cfg.check_patterns(layers)
    check_layers(layers, in_place=True)
    problem = _cudagraph_problem(layers)
    if problem is not None:
        raise MLAQuantGateError(problem)
    prepared = {}
    for name, layer in layers.items():  # nothing published yet: a failure changes nothing
        impl = quant_impl_from(layer.impl)
        impl.bind(name, cfg, getattr(layer.impl, "_vllm_config", None))
        prepared[name] = impl
    natives: dict[str, _Native] = {}
    try:
        for name, layer in layers.items():
            natives[name] = _Native(layer.impl, layer.prefill_backend)
            impl = prepared[name]
            _publish_layer(layer, impl, impl.mla_prefill)
    except BaseException:
        _restore(layers, natives)
        raise
    setattr(model, _INSTALLED_ATTR, natives)
    return list(layers)


def _uninstall_model(model: torch.nn.Module) -> list[str]:
    natives: dict[str, _Native] | None = getattr(model, _INSTALLED_ATTR, None)
    if not natives:
        return []
    _restore(_layers(model), natives)
    delattr(model, _INSTALLED_ATTR)
    return list(natives)


def install(target: Any, config: object = None) -> list[list[str]]:
    """Quantize the MLA attention of ``target`` in place; returns the layer names per worker.

    ``config`` is an ``mla_quant`` object, a JSON file path or an ``MLAQuantConfig``;
    it is validated here before anything is sent to a worker.
    """
    cfg = load_config(config)
    raw = cfg if isinstance(target, torch.nn.Module) else _portable(config)
    return _on_models(target, functools.partial(_install_model, config=raw))


def _portable(config: object) -> object:
    """A picklable form of ``config`` for the workers (they validate it again)."""
    if isinstance(config, MLAQuantConfig):
        return config
    if isinstance(config, Path):
        return str(config)
    return config


def uninstall(target: Any) -> list[list[str]]:
    """Give every layer its native impl and prefill backend back; returns the names."""
    return _on_models(target, _uninstall_model)


def installed_layers(target: Any) -> list[list[str]]:
    """The layers carrying a quantized impl, per worker (in place or via the backend)."""
    return _on_models(target, lambda m: sorted(_states(m)))


def _states(model: torch.nn.Module) -> dict[str, LayerState]:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    out: dict[str, LayerState] = {}
    for module in model.modules():
        if isinstance(module, MLAAttention):
            state = getattr(module.impl, "mla_layer", None)
            if isinstance(state, LayerState):
                out[module.layer_name] = state
    return out


def _collect_stats(model: torch.nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    return {name: state.snapshot() for name, state in _states(model).items()}


def get_stats(target: Any) -> dict[str, dict[str, dict[str, float]]]:
    """Per layer and path (``prefill``/``decode``): calls observed and error statistics.

    Keys: ``calls``, ``rel_l2_mean``, ``rel_l2_max``, ``cosine_mean``, ``cosine_min``,
    ``max_abs_mean``, ``max_abs_max`` (quantized vs unquantized attention output,
    before ``W_UV`` / ``o_proj``). Workers' results are merged (tensor parallel
    ranks hold different heads of the same layer: their names repeat with ``@rank``).
    """
    merged: dict[str, dict[str, dict[str, float]]] = {}
    for rank, stats in enumerate(_on_models(target, _collect_stats)):
        for name, value in stats.items():
            merged[name if rank == 0 else f"{name}@{rank}"] = value
    return merged


def reset_stats(target: Any) -> None:
    """Forget the statistics gathered so far."""
    _on_models(target, _reset_model)


def _reset_model(model: torch.nn.Module) -> None:
    for state in _states(model).values():
        state.reset()


# ---------------------------------------------------------------------- calibration

_CALIB_ATTR = "_mla_quant_calibration_installed"


def start_calibration(model: torch.nn.Module) -> list[str]:
    """Record amax of q, k, v on every MLA layer from now on (installs if needed)."""
    states = _states(model)
    if not states:
        _install_model(model, {})
        setattr(model, _CALIB_ATTR, True)
        states = _states(model)
    for state in states.values():
        state.amax.clear()
        state.calibrating = True
    return sorted(states)


def finish_calibration(model: torch.nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """Stop recording; ``{layer: {"prefill"|"decode": {"q"|"k"|"v": amax}}}``."""
    states = _states(model)
    result = {name: state.amax_snapshot() for name, state in states.items()}
    for state in states.values():
        state.calibrating = False
        state.amax.clear()
    if getattr(model, _CALIB_ATTR, False):
        _uninstall_model(model)
        delattr(model, _CALIB_ATTR)
    return result


def calibration_document(
    per_worker: Sequence[dict[str, dict[str, dict[str, float]]]],
) -> dict[str, Any]:
    """Merge workers' amaxes (max over ranks) into a calibration JSON document."""
    layers: dict[str, dict[str, dict[str, float]]] = {}
    for amaxes in per_worker:
        for name, paths in amaxes.items():
            for path, roles in paths.items():
                slot = layers.setdefault(name, {}).setdefault(path, {})
                for role, value in roles.items():
                    slot[role] = max(value, slot.get(role, 0.0))
    return {"format": CALIBRATION_FORMAT, "version": 1, "layers": layers}


def calibrate(
    llm: Any,
    prompts: Sequence[Sequence[int]] | Sequence[Any],
    *,
    output: str | Path | None = None,
    max_tokens: int = 8,
) -> dict[str, Any]:
    """Static amax per layer for q, k and v over ``prompts`` (token-id lists or prompts).

    Runs ``llm.generate`` with greedy sampling and ``max_tokens`` new tokens, so both
    prefill and decode operands are seen; records ``max |x|`` over every token. Run
    the engine with ``enforce_eager=True`` (decode replayed from a captured CUDA
    graph is not observed). Writes the JSON to ``output`` when given and returns it.
    """
    from vllm import SamplingParams

    if not _is_llm(llm):
        raise ValueError(f"llm: expected a vllm.LLM, got {type(llm).__name__}")
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    inputs = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
    llm.apply_model(start_calibration)
    try:
        llm.generate(inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    finally:
        amaxes = llm.apply_model(finish_calibration)
    document = calibration_document(amaxes)
    if output is not None:
        Path(output).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return document
