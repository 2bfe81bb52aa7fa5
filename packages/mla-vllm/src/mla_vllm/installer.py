"""Install quantized attention into a model already loaded on TRITON_MLA, and back.

``install(target, config)`` validates every layer (gates, configuration, layer
patterns), builds every quantized impl, publishes them layer by layer, then
compiles the kernels they will launch (``mla_vllm.warmup.warm_layers``: the engine
warm-up's plans for these layers and their KV caches; ``MLA_QUANT_WARMUP=0`` skips
it). If publishing fails midway, or the warm-up is interrupted
(``KeyboardInterrupt``), every layer gets its native impl and prefill backend back
and the error is raised. A warm-up that fails with an ``Exception`` is logged and
the install stands: every layer is published and serves, its kernels compiling on
first use as without warm-up (and each worker of a tensor-parallel engine keeps
the same impls). ``uninstall`` restores the native objects themselves.

``target`` is a ``torch.nn.Module`` (the model inside a worker) or a
``vllm.LLM``; for an ``LLM`` the work runs in each worker through
``LLM.apply_model`` (``mla_vllm.targets``), which (with vLLM's default
multiprocessing engine) needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send the
function. Statistics are in ``mla_vllm.stats``, calibration in
``mla_vllm.calibration``.

Decode graphs captured before ``install`` keep replaying the native kernel, so an
engine with full CUDA graphs is refused: use ``enforce_eager=True`` or piecewise
graphs, or serve with ``--attention-backend MLA_QUANT`` from the start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mla_vllm.backend import quant_impl_from
from mla_vllm.config import MLAQuantConfig, MLAQuantConfigError, load_config
from mla_vllm.gates import MLAQuantGateError, check_layers
from mla_vllm.targets import layer_states, model_layers, on_models
from mla_vllm.warmup import warm_layers

__all__ = [
    "install",
    "install_model",
    "installed_layers",
    "uninstall",
    "uninstall_model",
]

_INSTALLED_ATTR = "_mla_quant_native"


@dataclass
class _Native:
    impl: Any
    prefill_backend: Any


def _engine_config(layers: dict[str, Any]) -> Any:
    """The engine's ``VllmConfig`` the layers' impls were built under (or None)."""
    return getattr(next(iter(layers.values())).impl, "_vllm_config", None)


def _cudagraph_problem(layers: dict[str, Any]) -> str | None:
    config = _engine_config(layers)
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


def _warm(layers: dict[str, Any]) -> None:
    """Compile the published layers' kernels now (a seam for tests); failures are logged."""
    config = _engine_config(layers)
    if config is not None:
        warm_layers(layers, config)


def _restore(layers: dict[str, Any], natives: dict[str, _Native]) -> None:
    for name, native in natives.items():
        layer = layers[name]
        layer.impl = native.impl
        layer.prefill_backend = native.prefill_backend


def install_model(model: torch.nn.Module, config: object) -> list[str]:
    """``install`` on one model in this process; returns its layer names."""
    if getattr(model, _INSTALLED_ATTR, None):
        raise ValueError("model: quantized MLA is already installed; call uninstall first")
    cfg = load_config(config)
    if cfg.kv_path == "shadow":
        raise MLAQuantConfigError(
            "mla_quant.kv_path: 'shadow' needs shadow bytes in every KV cache row, which "
            "only MLA_QUANT's KV cache spec allocates; install in place keeps TRITON_MLA's "
            "raw cache: use kv_path 'on_read', or serve with --attention-backend MLA_QUANT"
        )
    layers = model_layers(model)
    cfg.check_layer_names(layers)
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
        _warm(layers)  # an Exception is logged inside: only an interrupt rolls back
    except BaseException:
        _restore(layers, natives)
        raise
    setattr(model, _INSTALLED_ATTR, natives)
    return list(layers)


def uninstall_model(model: torch.nn.Module) -> list[str]:
    """``uninstall`` on one model in this process; returns the names restored."""
    natives: dict[str, _Native] | None = getattr(model, _INSTALLED_ATTR, None)
    if not natives:
        return []
    _restore(model_layers(model), natives)
    delattr(model, _INSTALLED_ATTR)
    return list(natives)


def install(target: Any, config: object = None) -> list[list[str]]:
    """Quantize the MLA attention of ``target`` in place; returns the layer names per worker.

    ``config`` is an ``mla_quant`` object, a JSON file path or an ``MLAQuantConfig``;
    it is validated here before anything is sent to a worker.
    """
    cfg = load_config(config)
    raw = cfg if isinstance(target, torch.nn.Module) else _portable(config)
    return on_models(target, functools.partial(install_model, config=raw))


def _portable(config: object) -> object:
    """A picklable form of ``config`` for the workers (they validate it again)."""
    if isinstance(config, MLAQuantConfig):
        return config
    if isinstance(config, Path):
        return str(config)
    return config


def uninstall(target: Any) -> list[list[str]]:
    """Give every layer its native impl and prefill backend back; returns the names."""
    return on_models(target, uninstall_model)


def installed_layers(target: Any) -> list[list[str]]:
    """The layers carrying a quantized impl, per worker (in place or via the backend)."""
    return on_models(target, lambda m: sorted(layer_states(m)))
