"""Compile MLA_QUANT's kernels at engine start, not during inference.

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
Earlier still, when vLLM asks for the KV-cache specs (after the model is loaded, before
its memory profile and torch.compile), ``start_early`` compiles the same plans for
stand-in caches of the real geometry in a background thread, while vLLM compiles the
model (on by default; ``MLA_QUANT_WARMUP_EARLY=0`` turns it off);
the metadata builder and every later warm-up wait for it first (``join_early``) and
compile only what it left.
vLLM skips the registry when ``kernel_config.enable_jit_warmup`` is off (eager
mode). An in-place ``install`` (``mla_vllm.install``) comes after the registry
ran: it calls ``warm_layers`` on each worker, the same plans and calls for the
layers it published, with vLLM's JIT monitor paused (these compilations are not
inference); that runs in eager mode too.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry, VllmJitKernel

from mla_triton.precompile import (
    compile_only,
    compiled_variants,
    warmup_decode,
    warmup_prefill,
    warmup_update_cache,
)

__all__ = [
    "EARLY_ENV",
    "ENGINE_WARMUP",
    "ENV",
    "EarlyWarmup",
    "EngineWarmup",
    "Plan",
    "block_table_width",
    "join_early",
    "register",
    "standin_caches",
    "start_early",
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
        self._caches: Mapping[str, torch.Tensor] = {}

    def get_warmup_keys(self, vllm_config: Any) -> list[Plan]:
        """One plan per distinct variant set of the config's ``MLA_QUANT`` layers."""
        if not enabled():
            logger.info("MLA_QUANT warmup: off (%s=0)", ENV)
            return []
        return self.plan(vllm_config.compilation_config.static_forward_context, vllm_config)

    def plan(
        self,
        layers: Mapping[str, Any],
        vllm_config: Any,
        caches: Mapping[str, torch.Tensor] | None = None,
    ) -> list[Plan]:
        """One plan per distinct variant set of the ``MLA_QUANT`` layers among ``layers``.

        ``layers``: name to layer (others than ``MLAAttention`` with a quantized impl
        are left out); ``caches``: name to the KV cache to plan and compile for instead
        of the layer's bound ``kv_cache`` (the early warm-up's stand-ins); a failure is
        logged and gives no plans.
        """
        self._config = vllm_config
        self._caches = dict(caches or {})
        self._layers = {
            name: layer
            for name, layer in layers.items()
            if isinstance(layer, MLAAttention) and _quantized(layer.impl)
        }
        seen: dict[tuple[Any, ...], Plan] = {}
        try:
            for name, layer in self._layers.items():
                for kind, signature in _signatures(layer, self.cache(name)):
                    seen.setdefault((kind, *signature), Plan(kind, name))
        except Exception:  # as in compile_many: serving goes on, compiling on first use
            logger.exception("MLA_QUANT warmup failed; kernels will compile during inference")
            return []
        return list(seen.values())

    def compile(self, compile_key: Plan) -> None:
        self.compile_many([compile_key])

    def compile_many(self, compile_keys: Iterable[Plan]) -> None:
        """Compile every plan's variants in one thread pool; log the count and time
        (after the early warm-up, if one runs: ``join_early``)."""
        join_early(" (kernel_warmup)")
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
                layer = self._layers[plan.layer]
                _compile(plan, layer, self.cache(plan.layer), self._config)

    def cache(self, name: str) -> torch.Tensor | None:
        """The KV cache planned for layer ``name``: the stand-in given to ``plan``, else
        the layer's bound ``kv_cache`` (None or empty: none bound yet)."""
        found = self._caches.get(name)
        if found is None:
            found = getattr(self._layers.get(name), "kv_cache", None)
        return found if isinstance(found, torch.Tensor) and found.numel() else None


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
    join_early()
    warmup = EngineWarmup()
    plans = warmup.plan(layers, vllm_config)
    if not plans:
        return None
    with _jit_monitor_paused():
        return warmup.compile_plans(plans)


_BUILT: dict[int, weakref.ref[Any]] = {}  # id(VllmConfig) -> the config, warmed at a build
_STARTED: dict[int, weakref.ref[Any]] = {}  # id(VllmConfig) -> the config, warmed early


def _first_time(vllm_config: Any, seen_for: dict[int, weakref.ref[Any]]) -> bool:
    """True the first time for ``vllm_config`` (the object: one engine) in ``seen_for``,
    then False."""
    for key, old in list(seen_for.items()):
        if old() is None:
            del seen_for[key]  # that engine's config is gone: its id may be reused
    seen = seen_for.get(id(vllm_config))
    if seen is not None and seen() is vllm_config:
        return False
    seen_for[id(vllm_config)] = weakref.ref(vllm_config)
    return True


def _may_warm(vllm_config: Any) -> bool:
    """The warm-up's switches: ``MLA_QUANT_WARMUP`` on, a compiler (not Triton's
    interpreter), vLLM's JIT warm-up on (off in eager mode), no CUDA-graph capture under
    way and vLLM's JIT monitor off (a compilation now would be inference)."""
    from vllm.utils import jit_monitor

    kernel_config = getattr(vllm_config, "kernel_config", None)
    if not enabled() or not _compiles() or not getattr(kernel_config, "enable_jit_warmup", True):
        return False
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return not capturing and not jit_monitor.is_active()


# ---------------------------------------------------------------------------- early


EARLY_ENV = "MLA_QUANT_WARMUP_EARLY"


def early_enabled() -> bool:
    """False when ``MLA_QUANT_WARMUP_EARLY`` is ``0`` (or empty, ``false``/``off``/``no``);
    on by default (docs/vllm.md "Warm-up and CUDA graphs")."""
    return os.environ.get(EARLY_ENV, "1").strip().lower() not in ("", "0", "false", "off", "no")


@dataclass
class EarlyWarmup:
    """One engine's warm-up compiling in a background thread (``start_early``)."""

    plans: int
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.perf_counter)
    added: int | None = None
    """Kernel variants it added (None: not finished, or failed: logged)."""
    seconds: float | None = None


_RUNNING: list[EarlyWarmup] = []  # started, not yet joined


def start_early(vllm_config: Any, layers: Mapping[str, Any] | None = None) -> EarlyWarmup | None:
    """Start compiling the engine warm-up's plans in a background thread; once per engine.

    For ``MLAQuantBackend.customize_spec``: vLLM asks each layer's KV-cache spec after
    the model is built and loaded and the block size is final, before its memory
    profile (which runs torch.compile). The plans are made for stand-in caches of the
    spec's geometry (``standin_caches``: the page, row width and dtype vLLM allocates;
    the kernels do not key the block count), in the main thread, and compiled in a
    daemon thread (its own ``compile_only`` pool) while vLLM goes on. Every later
    warm-up (``warm_before_capture`` at the first metadata build, ``kernel_warmup``,
    ``warm_layers``) and the metadata builder's construction (before any CUDA-graph
    capture) first wait for it (``join_early``), then compile what is still missing.
    ``layers``: default the config's forward context. Returns None when off
    (``MLA_QUANT_WARMUP_EARLY=0``, or any switch of ``_may_warm``), already started
    for ``vllm_config``, no ``MLA_QUANT`` layer or block size yet, or nothing to plan.
    """
    if vllm_config is None or not early_enabled() or not _may_warm(vllm_config):
        return None
    if layers is None:
        layers = vllm_config.compilation_config.static_forward_context
    quantized = {
        name: layer
        for name, layer in layers.items()
        if isinstance(layer, MLAAttention) and _quantized(layer.impl)
    }
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if not quantized or not isinstance(block_size, int) or block_size < 1:
        return None
    if not _first_time(vllm_config, _STARTED):
        return None
    try:
        caches = standin_caches(quantized, vllm_config)
    except Exception:  # the first metadata build then warms up as without this
        logger.exception("MLA_QUANT early warmup failed; the first metadata build warms up")
        return None
    warmup = EngineWarmup()
    plans = warmup.plan(quantized, vllm_config, caches)
    if not plans:
        return None
    device = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()  # the worker's: a new thread starts on device 0
        from triton.runtime.driver import driver

        driver.active.get_current_device()  # Triton's driver made here, not raced with the thread
    run = EarlyWarmup(len(plans))
    run.thread = threading.Thread(
        target=_early_body, args=(run, warmup, plans, device), name="mla-quant-early-warmup",
        daemon=True,
    )  # fmt: skip
    _RUNNING.append(run)
    run.thread.start()
    return run


def _early_body(
    run: EarlyWarmup, warmup: EngineWarmup, plans: list[Plan], device: int | None
) -> None:
    """The early warm-up's thread: compile ``plans``, drop the stand-in caches."""
    try:
        if device is not None:
            torch.cuda.set_device(device)
        run.added = warmup.compile_plans(plans, where=" (early, in the background)")
    except Exception:  # compile_plans logs its own failures; this is anything around it
        logger.exception("MLA_QUANT early warmup failed; the first metadata build warms up")
    finally:
        warmup._caches = {}
        run.seconds = time.perf_counter() - run.started


def join_early(where: str = "") -> float:
    """Wait for every early warm-up of this process (``start_early``); returns the seconds
    waited, and logs them from 0.05 s on (``where``: who waited). Called in the thread
    that started them, before any other warm-up."""
    start = time.perf_counter()
    joined = False
    while _RUNNING:
        run = _RUNNING.pop(0)
        if run.thread is not None and run.thread is not threading.current_thread():
            run.thread.join()
            joined = True
    waited = time.perf_counter() - start
    if joined and waited >= 0.05:
        logger.info("MLA_QUANT warmup: waited %.1f s for the early warm-up%s", waited, where)
    return waited


def standin_caches(layers: Mapping[str, Any], vllm_config: Any) -> dict[str, torch.Tensor]:
    """A KV cache per ``MLA_QUANT`` layer of the geometry vLLM will allocate for it.

    The layer's spec as the worker makes it (``get_kv_cache_spec``, then the backend's
    ``customize_spec``: the shadow bytes), viewed as ``MLAAttention.bind_kv_cache``
    binds it: ``[blocks, page, row]`` in the spec's dtype, rows contiguous (vLLM's
    LBNHC layout), on the device of the layer's weights; ``blocks`` as the minimal
    cache of vLLM's CUDA-graph memory profile (``min(max_num_seqs, largest capture
    size)``). Layers with the same shape share one tensor (1.2 MB at DeepSeek-V3's
    576-wide bf16 rows, pages of 16, 64 blocks).
    """
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    from vllm.v1.worker.utils import customize_attention_spec

    seqs = int(vllm_config.scheduler_config.max_num_seqs)
    largest = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None)
    blocks = max(1, min(seqs, int(largest)) if largest else seqs)
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    caches: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        if not (isinstance(layer, MLAAttention) and _quantized(layer.impl)):
            continue
        spec: Any = layer.get_kv_cache_spec(vllm_config)
        spec = customize_attention_spec(layer.get_attn_backend(), spec)
        shape = tuple(int(x) for x in compute_layer_kv_cache_shape_bytes(spec, blocks))
        device = _device(layer)
        key = (shape, spec.dtype, device)
        if key not in made:
            flat = torch.zeros(math.prod(shape), dtype=torch.int8, device=device)
            made[key] = flat.view(shape).view(spec.dtype).squeeze(1)
        caches[name] = made[key]
    return caches


def _device(layer: Any) -> torch.device:
    """The device of ``layer``'s weights (the worker's); the current CUDA device if none."""
    for param in layer.parameters():
        device: torch.device = param.device
        return device
    return torch.device("cuda", torch.cuda.current_device())


def warm_before_capture(layers: Mapping[str, Any], vllm_config: Any) -> int | None:
    """The engine warm-up's plans, now, for the caches bound to ``layers``; once per engine.

    For the first metadata build (``MLAQuantMetadataBuilder.build``). vLLM 0.33's V2
    model runner captures CUDA graphs on a minimal KV cache to measure their memory
    (``profile_cudagraph_memory``) before ``kernel_warmup`` runs; its first batch
    would compile every decode variant it reaches there, one after another. Warmed
    here in the pool instead, that pass and ``kernel_warmup`` (on the real cache)
    then find them compiled: the split kernels do not specialize the cache's block
    count. It first waits for the early warm-up (``start_early``), whose variants are
    then found compiled: what it compiles is what that one did not. Returns the
    variants added; None when off (``MLA_QUANT_WARMUP=0``, or
    vLLM's JIT warm-up off: eager), done before for ``vllm_config``, no KV cache bound
    yet, during a CUDA-graph capture, with vLLM's JIT monitor on (this would be
    inference), under Triton's interpreter (nothing compiles there), nothing to plan,
    or failed (logged; ``kernel_warmup`` then runs as before).
    """
    join_early(" (first metadata build)")
    if not _may_warm(vllm_config):
        return None
    bound = any(
        isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and layer.kv_cache.numel()
        for layer in layers.values()
    )  # before the caches are bound there is no decode to plan: wait for them
    if not bound or not _first_time(vllm_config, _BUILT):
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


def _signatures(layer: Any, cache: torch.Tensor | None) -> list[tuple[str, tuple[Any, ...]]]:
    """``(kind, what keys its kernels)`` of one ``MLA_QUANT`` layer with KV cache ``cache``."""
    impl = layer.impl
    state = impl._state(layer)
    recipe = state.recipe
    observe = bool(state.observe.enabled)
    dims = (impl.num_heads, impl.qk_nope_head_dim + impl.qk_rope_head_dim, impl.v_head_dim)
    dtype = cache.dtype if cache is not None else torch.get_default_dtype()
    out: list[tuple[str, tuple[Any, ...]]] = [
        ("prefill", (recipe.prefill, recipe.sparsity, dims, observe, str(dtype)))
    ]
    if cache is not None:
        raw, shadow = impl._split(cache)
        layout = None if impl.mla_shadow is None else impl.mla_shadow.layout
        geometry = (*_geometry(raw), None if shadow is None else _geometry(shadow))
        out.append(("decode", (recipe.decode, layout, observe, impl.num_heads, *geometry)))
        if shadow is not None:
            out.append(("update", (layout, *geometry)))
    return out


def _compile(plan: Plan, layer: Any, cache: torch.Tensor | None, vllm_config: Any) -> None:
    """Run ``mla_triton.warmup`` for one plan of ``layer`` with KV cache ``cache`` (inside
    ``compile_only``)."""
    impl = layer.impl
    state = impl._state(layer)
    recipe = state.recipe
    observe = bool(state.observe.enabled)
    if plan.kind == "prefill":
        if cache is not None:
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
    assert cache is not None  # decode and update plans exist only for a bound cache
    raw, shadow = impl._split(cache)
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
