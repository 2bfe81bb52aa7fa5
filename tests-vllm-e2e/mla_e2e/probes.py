"""What ran where: functions ``LLM.apply_model`` runs on every worker, and registration.

They run inside the engine's worker processes (at TP > 1 spawned ones, which
unpickle them by reference: this package must be importable there, which
``run_e2e.py`` arranges through ``sys.path``).
"""

from __future__ import annotations

from typing import Any


def entry_point() -> str | None:
    """Where the ``mla_vllm.plugin:register`` entry point comes from, if installed."""
    from importlib.metadata import entry_points

    for e in entry_points(group="vllm.general_plugins"):
        if e.value == "mla_vllm.plugin:register":
            dist = getattr(e, "dist", None)
            return str(getattr(dist, "_path", None) or getattr(dist, "name", "?"))
    return None


def describe_layers(model: Any) -> dict[str, list[str]]:
    """Per MLA layer: its impl and prefill backend classes (which code really ran)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        m.layer_name: [type(m.impl).__name__, type(m.prefill_backend).__name__]
        for m in model.modules()
        if isinstance(m, MLAAttention)
    }


def describe_shadows(model: Any) -> dict[str, Any]:
    """Per MLA layer: its shadow KV storage and cache row width (None: on-read decode)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        m.layer_name: _shadow_info(m.impl, m)
        for m in model.modules()
        if isinstance(m, MLAAttention)
    }


def probe_worker(model: Any) -> dict[str, Any]:
    """What one worker process sees: pid, TP rank, registration, config, per-layer recipe."""
    import os as _os

    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        registered = AttentionBackendEnum["MLA_QUANT"].get_class().__name__
    except Exception as exc:  # not registered in this process
        registered = f"not registered ({type(exc).__name__}: {exc})"
    layers: dict[str, Any] = {}
    for m in model.modules():
        if not isinstance(m, MLAAttention):
            continue
        impl = m.impl
        config = getattr(impl, "_vllm_config", None)
        extra = getattr(config, "additional_config", None) or {}
        state = getattr(impl, "mla_layer", None)
        layers[m.layer_name] = {
            "impl": type(impl).__name__,
            "num_heads": int(getattr(impl, "num_heads", -1)),
            "mla_quant": extra.get("mla_quant") if isinstance(extra, dict) else None,
            "recipe": None if state is None else repr(state.recipe),
            # the shadow KV path: what the layer stores, and the cache row it got
            "shadow": _shadow_info(impl, m),
        }
    from importlib.metadata import entry_points

    found = [
        str(getattr(getattr(e, "dist", None), "_path", "?"))
        for e in entry_points(group="vllm.general_plugins")
        if e.value == "mla_vllm.plugin:register"
    ]
    return {
        "pid": _os.getpid(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "entry_point": found[0] if found else None,
        "registered": registered,
        "layers": layers,
    }


def _shadow_info(impl: Any, layer: Any) -> dict[str, Any] | None:
    """The layer's shadow (storage, bytes per token) and its cache row width; None: on-read."""
    shadow = getattr(impl, "mla_shadow", None)
    if shadow is None:
        return None
    cache = getattr(layer, "kv_cache", None)
    return {
        "storage": shadow.storage,
        "token_bytes": int(shadow.layout.token_bytes),
        "cache_row_bytes": None
        if cache is None or cache.dim() == 0 or cache.numel() == 0
        else int(cache.shape[-1] * cache.element_size()),
    }


def ensure_registered(tp: int = 1) -> str:
    """Register MLA_QUANT in this (engine) process; at ``tp > 1`` require the entry point.

    Installed packages have the ``vllm.general_plugins`` entry point, which vLLM
    runs itself in every process; with the packages only on PYTHONPATH there is no
    dist-info and so no entry point. At TP=1 the engine and its one worker run in
    this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: in-process engine core and
    executor), so registering here reaches it either way; ``register`` is
    re-entrant. At TP > 1 the workers are spawned processes: only the entry point
    reaches them.
    """
    from mla_vllm.plugin import register

    found = entry_point()
    if tp > 1 and found is None:
        raise RuntimeError(
            "no 'vllm.general_plugins' entry point for mla_vllm: TP workers could not "
            "register MLA_QUANT (install the wheels: docs/contributing.md)"
        )
    register()
    if found is None:
        return "registered directly"
    return f"entry point {found}; registered directly too"
