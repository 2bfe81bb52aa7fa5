"""Compile MLA_QUANT's kernels at engine start, not during inference (issue 15).

vLLM 0.33's GPU model runner holds a JIT-warmup registry while it builds the model;
every ``MLAQuantImpl`` registers ``ENGINE_WARMUP`` there with the engine's
``VllmConfig`` (one registration per engine: the same kernel object and config).
vLLM's ``kernel_warmup`` runs the registry after the KV cache is allocated and
before CUDA graphs are captured and its JIT monitor is switched on; it calls
``EngineWarmup.get_warmup_keys`` (one ``Plan`` per distinct decode, prefill and
cache-write variant set among the model's ``MLA_QUANT`` layers: recipe, path,
cache geometry) and then ``compile_many``, which runs ``mla_triton.warmup`` for
every plan inside one ``compile_only`` (a thread pool; nothing is launched).

What a plan compiles (``mla_triton.warmup``): decode for every split count the
policy can pick for up to ``max_num_seqs`` x the decode query length rows and up
to ``max_model_len`` tokens (on read, or from the shadow), prefill for new tokens
(with and without LSE) and context chunks, the shadow's cache write, and, with
``observe`` on, the unquantized reference calls. ``MLA_QUANT_WARMUP=0`` turns it
off; ``MLA_QUANT_WARMUP_THREADS`` sets the pool size (default: CPUs, at most 16).
The same plans run once per engine earlier, at the first metadata build
(``warm_before_capture``, from ``MLAQuantMetadataBuilder.build``): vLLM's CUDA-graph
memory profile, which runs before ``kernel_warmup`` on a minimal KV cache, then finds
its variants compiled (the log line ends in ``(first metadata build)``), and
``kernel_warmup`` on the real cache finds them too (the kernels do not specialize the
cache's block count).
vLLM skips the registry when ``kernel_config.enable_jit_warmup`` is off (eager
mode). An in-place ``install`` (``mla_vllm.install``) comes after the registry
ran: it calls ``warm_layers`` on each worker, the same plans and calls for the
layers it published, with vLLM's JIT monitor paused (these compilations are not
inference); that runs in eager mode too.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry, VllmJitKernel

from mla_triton.warmup import (
    compile_only,
    compiled_variants,
    warmup_decode,
    warmup_prefill,
    warmup_update_cache,
)

__all__ = [
    "ENGINE_WARMUP",
    "ENV",
    "EngineWarmup",
    "Plan",
    "block_table_width",
    "register",
    "warm_before_capture",
    "warm_layers",
]

ENV = "MLA_QUANT_WARMUP"
THREADS_ENV = "MLA_QUANT_WARMUP_THREADS"
logger = init_logger("vllm.mla_vllm.warmup")  # under vLLM's logger: its handlers print it


def enabled() -> bool:
    """False when ``MLA_QUANT_WARMUP`` is ``0`` (or ``false``/``off``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass(frozen=True)
class Plan:
    """One variant set to compile: ``kind`` (decode, prefill, update) of layer ``layer``."""

    kind: str
    layer: str


def block_table_width(vllm_config: Any, page: int) -> int:
    """Pages per request of vLLM's block table (its row stride keys the decode kernel).

    ``cdiv(max_model_len, page)`` rounded as vLLM's ``get_block_table_width`` does
    (to 128 tokens), for the KV cache's page size ``page``.
    """
    from vllm.v1.worker.block_table import get_block_table_width

    max_len = int(vllm_config.model_config.max_model_len)
    return int(get_block_table_width(-(-max_len // page), page))


def _max_rows(vllm_config: Any) -> int:
    from vllm.v1.attention.backend import max_decode_query_len

    return int(vllm_config.scheduler_config.max_num_seqs) * int(max_decode_query_len(vllm_config))


class EngineWarmup(VllmJitKernel[Plan]):
    """vLLM's JIT-warmup entry for every ``MLA_QUANT`` layer of an engine."""

    def __init__(self) -> None:
        super().__init__()
        self._layers: dict[str, Any] = {}
        self._config: Any = None

    def get_warmup_keys(self, vllm_config: Any) -> list[Plan]:
        """One plan per distinct variant set of the config's ``MLA_QUANT`` layers."""
        if not enabled():
            logger.info("MLA_QUANT warmup: off (%s=0)", ENV)
            return []
        return self.plan(vllm_config.compilation_config.static_forward_context, vllm_config)

    def plan(self, layers: Mapping[str, Any], vllm_config: Any) -> list[Plan]:
        """One plan per distinct variant set of the ``MLA_QUANT`` layers among ``layers``.

        ``layers``: name to layer (others than ``MLAAttention`` with a quantized impl
        are left out); a failure is logged and gives no plans.
        """
        self._config = vllm_config
        self._layers = {
            name: layer
            for name, layer in layers.items()
            if isinstance(layer, MLAAttention) and _quantized(layer.impl)
        }
        seen: dict[tuple[Any, ...], Plan] = {}
        try:
            for name, layer in self._layers.items():
                for kind, signature in _signatures(layer):
                    seen.setdefault((kind, *signature), Plan(kind, name))
        except Exception:  # as in compile_many: serving goes on, compiling on first use
            logger.exception("MLA_QUANT warmup failed; kernels will compile during inference")
            return []
        return list(seen.values())

    def compile(self, compile_key: Plan) -> None:
        self.compile_many([compile_key])

    def compile_many(self, compile_keys: Iterable[Plan]) -> None:
        """Compile every plan's variants in one thread pool; log the count and time."""
        self.compile_plans(compile_keys)

    def compile_plans(self, compile_keys: Iterable[Plan], where: str = "") -> int | None:
        """``compile_many``, returning the kernel variants added (None: failed, logged);
        ``where`` ends the log line (which warm-up this was)."""
        plans = list(compile_keys)
        if not plans:
            return 0
        before = sum(compiled_variants().values())
        start = time.perf_counter()
        threads = os.environ.get(THREADS_ENV)
        try:
            with compile_only(int(threads) if threads else None):
                self.run_plans(plans)
        except Exception:  # serving still works: the kernels then compile on first use
            _drop_failed_compiles()
            logger.exception("MLA_QUANT warmup failed; kernels will compile during inference")
            return None
        seconds = time.perf_counter() - start
        after = sum(compiled_variants().values())
        message = "MLA_QUANT warmup: %d plans (%s) over %d layers: %d kernel variants in %.1f s%s"
        kinds = ", ".join(sorted({p.kind for p in plans}))
        layers = len(self._layers)
        logger.info(message, len(plans), kinds, layers, after - before, seconds, where)
        return after - before

    def run_plans(self, plans: Iterable[Plan]) -> None:
        """The warmup calls of ``plans`` (as returned by the last ``get_warmup_keys``).

        Launches for real unless inside ``mla_triton.warmup.compile_only`` (or
        ``record_keys``, which computes the keys).
        """
        with torch.inference_mode():
            for plan in plans:
                _compile(plan, self._layers[plan.layer], self._config)


ENGINE_WARMUP = EngineWarmup()


def register(vllm_config: Any) -> None:
    """Register the engine's warmup with the registry vLLM holds now (no-op if none)."""
    if vllm_config is not None:
        JitWarmupRegistry.register(ENGINE_WARMUP, vllm_config)


def warm_layers(layers: Mapping[str, Any], vllm_config: Any) -> int | None:
    """Compile now what the ``MLA_QUANT`` layers among ``layers`` will launch.

    For ``mla_vllm.install`` (after vLLM's own warm-up): the engine warm-up's plans
    and calls for these layers, their KV caches and ``vllm_config``'s limits
    (``max_num_seqs``, ``max_model_len``), with vLLM's JIT monitor paused. Returns
    the kernel variants added; None when off (``MLA_QUANT_WARMUP=0``) or failed
    (logged; the kernels then compile on first use, as without warm-up).
    """
    if not enabled():
        logger.info("MLA_QUANT warmup after install: off (%s=0)", ENV)
        return None
    warmup = EngineWarmup()
    plans = warmup.plan(layers, vllm_config)
    if not plans:
        return None
    with _jit_monitor_paused():
        return warmup.compile_plans(plans)


_EARLY: dict[int, weakref.ref[Any]] = {}  # id(VllmConfig) -> the config, warmed early


def _first_time(vllm_config: Any) -> bool:
    """True the first time for ``vllm_config`` (the object: one engine), then False."""
    for key, old in list(_EARLY.items()):
        if old() is None:
            del _EARLY[key]  # that engine's config is gone: its id may be reused
    seen = _EARLY.get(id(vllm_config))
    if seen is not None and seen() is vllm_config:
        return False
    _EARLY[id(vllm_config)] = weakref.ref(vllm_config)
    return True


def warm_before_capture(layers: Mapping[str, Any], vllm_config: Any) -> int | None:
    """The engine warm-up's plans, now, for the caches bound to ``layers``; once per engine.

    For the first metadata build (``MLAQuantMetadataBuilder.build``). vLLM 0.33's V2
    model runner captures CUDA graphs on a minimal KV cache to measure their memory
    (``profile_cudagraph_memory``) before ``kernel_warmup`` runs; its first batch
    would compile every decode variant it reaches there, one after another. Warmed
    here in the pool instead, that pass and ``kernel_warmup`` (on the real cache)
    then find them compiled: the split kernels do not specialize the cache's block
    count. Returns the variants added; None when off (``MLA_QUANT_WARMUP=0``, or
    vLLM's JIT warm-up off: eager), done before for ``vllm_config``, no KV cache bound
    yet, during a CUDA-graph capture, with vLLM's JIT monitor on (this would be
    inference), under Triton's interpreter (nothing compiles there), nothing to plan,
    or failed (logged; ``kernel_warmup`` then runs as before).
    """
    from vllm.utils import jit_monitor

    kernel_config = getattr(vllm_config, "kernel_config", None)
    if not enabled() or not _compiles() or not getattr(kernel_config, "enable_jit_warmup", True):
        return None
    bound = any(
        isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and layer.kv_cache.numel()
        for layer in layers.values()
    )  # before the caches are bound there is no decode to plan: wait for them
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not bound or capturing or jit_monitor.is_active() or not _first_time(vllm_config):
        return None
    warmup = EngineWarmup()
    plans = warmup.plan(layers, vllm_config)
    if not plans:
        return None
    added = warmup.compile_plans(plans, where=" (first metadata build)")
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # the warm-up's small inputs and workspaces go back to the device before vLLM's
        # profile measures what its CUDA graphs take
        torch.cuda.empty_cache()
    return added


def _compiles() -> bool:
    """False under Triton's interpreter (``TRITON_INTERPRET=1``): kernels compile nothing."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() in ("", "0")


def _drop_failed_compiles() -> None:
    """Forget every ``mla_triton`` kernel variant whose asynchronous compile failed or
    never finished (``triton.AsyncCompileMode`` puts a future in the kernel cache at
    once): the next launch then compiles it again instead of raising the old error."""
    import sys

    from triton.runtime.jit import JITFunction

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("mla_triton") and m]
    for module in modules:
        for value in list(vars(module).values()):
            if not isinstance(value, JITFunction):
                continue
            for entry in list(getattr(value, "device_caches", {}).values()):
                cache = entry[0]
                for key, kernel in list(cache.items()):
                    future = getattr(kernel, "future", None)
                    if future is None or getattr(kernel, "kernel", None) is not None:
                        continue  # compiled, or not a future
                    if not future.done() or future.cancelled() or future.exception() is not None:
                        del cache[key]


@contextmanager
def _jit_monitor_paused() -> Iterator[None]:
    """Triton's post-compile hook unset inside while vLLM's JIT monitor is active.

    The monitor (``vllm.utils.jit_monitor``, switched on after an engine's warm-up)
    reports every Triton compilation as one during inference, and raises in its
    ``error`` mode; a warm-up asked for is not one.
    """
    from triton import knobs
    from vllm.utils import jit_monitor

    if not jit_monitor.is_active():
        yield
        return
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = None
    try:
        yield
    finally:
        knobs.runtime.jit_post_compile_hook = hook


def _quantized(impl: Any) -> bool:
    """An ``MLAQuantImpl`` (recognised by its methods: backend imports this module)."""
    return all(hasattr(impl, name) for name in ("mla_shadow", "mla_warm_width", "_split", "_state"))


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.data_ptr() % 16)


def _signatures(layer: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """``(kind, what keys its kernels)`` of one bound ``MLA_QUANT`` layer."""
    impl = layer.impl
    state = impl._state(layer)
    recipe = state.recipe
    observe = bool(state.observe.enabled)
    dims = (impl.num_heads, impl.qk_nope_head_dim + impl.qk_rope_head_dim, impl.v_head_dim)
    out: list[tuple[str, tuple[Any, ...]]] = [
        ("prefill", (recipe.prefill, recipe.sparsity, dims, observe, str(_dtype(layer))))
    ]
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, torch.Tensor) and cache.numel():
        raw, shadow = impl._split(cache)
        layout = None if impl.mla_shadow is None else impl.mla_shadow.layout
        geometry = (*_geometry(raw), None if shadow is None else _geometry(shadow))
        out.append(("decode", (recipe.decode, layout, observe, impl.num_heads, *geometry)))
        if shadow is not None:
            out.append(("update", (layout, *geometry)))
    return out


def _dtype(layer: Any) -> torch.dtype:
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, torch.Tensor) and cache.numel():
        return cache.dtype
    return torch.get_default_dtype()


def _compile(plan: Plan, layer: Any, vllm_config: Any) -> None:
    """Run ``mla_triton.warmup`` for one plan (inside ``compile_only``)."""
    impl = layer.impl
    state = impl._state(layer)
    recipe = state.recipe
    observe = bool(state.observe.enabled)
    if plan.kind == "prefill":
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, torch.Tensor) and cache.numel():
            device = cache.device
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        dims: dict[str, Any] = {
            "num_heads": impl.num_heads,
            "head_dim_qk": impl.qk_nope_head_dim + impl.qk_rope_head_dim,
            "head_dim_v": impl.v_head_dim,
            "dtype": vllm_config.model_config.dtype,
            "device": device,
            "softmax_scale": impl.scale,
        }
        quant = None if recipe.prefill.is_identity else recipe.prefill
        warmup_prefill(quant=quant, sparsity=recipe.sparsity, **dims)
        if observe and (quant is not None or recipe.sparsity is not None):
            warmup_prefill(context=False, **dims)  # the observed call's unquantized reference
        return
    raw, shadow = impl._split(layer.kv_cache)
    decode_quant = None if recipe.decode.is_identity else recipe.decode
    if plan.kind == "update":
        assert impl.mla_shadow is not None and shadow is not None
        warmup_update_cache(
            raw, shadow, quant=impl.mla_shadow.quant, storage=impl.mla_shadow.storage,
            kv_lora_rank=impl.kv_lora_rank,
        )  # fmt: skip
        return
    width = block_table_width(vllm_config, int(raw.shape[1]))
    impl.mla_warm_width = width
    common: dict[str, Any] = {
        "num_heads": impl.num_heads,
        "pages_per_row": width,
        "max_rows": _max_rows(vllm_config),
        "max_seq_len": int(vllm_config.model_config.max_model_len),
        "softmax_scale": impl.scale,
        "kv_lora_rank": impl.kv_lora_rank,
    }
    if shadow is not None and impl.mla_shadow is not None:
        warmup_decode(raw, quant=impl.mla_shadow.quant, shadow=shadow,
                      storage=impl.mla_shadow.storage, **common)  # fmt: skip
    else:
        warmup_decode(raw, quant=decode_quant, **common)
    if observe and decode_quant is not None:
        warmup_decode(raw, quant=None, **common)  # observe_error's reference
