"""``mla_vllm.warmup``: vLLM's JIT warmup compiles what a served batch then launches.

Real vLLM layers, builder, metadata and forward pass (conftest). The compile keys
(``mla_triton.precompile.record_keys``, for sm_90, nothing launched) of a mixed batch
through ``MLAAttention.forward`` (decode rows, a prefill without context and one
with chunked context; the block table as wide as vLLM's persistent one) must be
among the keys of the engine's warmup plans.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    PAGE,
    SMALL,
    Model,
    build_model,
    forward,
    layer_inputs,
    make_batch,
    make_builder,
    make_vllm_config,
)
from test_shadow import _model as shadow_model

from mla_triton.precompile import record_keys

pytestmark = pytest.mark.usefixtures("vllm_process")

OBSERVE = {"enabled": True, "interval": 1}
CONFIGS: dict[str, Any] = {
    "none": {},
    "nvfp4-observed": {"recipe": "nvfp4", "observe": OBSERVE},
    "two-recipes": {"recipe": "nvfp4", "layers": [{"pattern": "*.layers.1.*", "v": "fp8"}]},
    "nvfp4-shadow": {"recipe": "nvfp4", "kv_path": "shadow"},
}
REQUESTS = [(37, 1), (5, 1), (0, 23), (70, 9)]  # two decodes, a prefill, one with context


def _quant_model(tmp_path: Path, mla_quant: object) -> Model:
    from mla_vllm.backend import MLAQuantBackend

    if isinstance(mla_quant, dict) and mla_quant.get("kv_path") == "shadow":
        return shadow_model(tmp_path, mla_quant, num_layers=2)
    config = make_vllm_config(tmp_path, SMALL, mla_quant=mla_quant)
    model = build_model(config, SMALL, MLAQuantBackend)
    make_builder(model)
    return model


def _table(model: Model, width: int) -> list[list[int]]:
    """Distinct pages per request (page 0 unused), padded to ``width`` like vLLM's buffer."""
    blocks = next(iter(model.caches.values())).shape[0]
    pages = random.Random(0).sample(range(1, blocks), blocks - 1)
    rows = []
    for c, q in REQUESTS:
        need = -(-(c + q) // PAGE)
        rows.append([pages.pop() for _ in range(need)] + [0] * (width - need))
    return rows


def test_one_registration_per_engine(tmp_path: Path) -> None:
    """Every impl registers; the registry keeps one entry for the engine's config."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant={"recipe": "nvfp4"})
    registry = JitWarmupRegistry(config)
    with registry.activate():
        build_model(config, SMALL, MLAQuantBackend, num_layers=3)
    assert len(registry) == 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_warmup_covers_a_served_batch(tmp_path: Path, name: str) -> None:
    from mla_vllm.warmup import ENGINE_WARMUP, block_table_width

    model = _quant_model(tmp_path, CONFIGS[name])
    plans = ENGINE_WARMUP.get_warmup_keys(model.config)
    kinds = sorted(p.kind for p in plans)
    expected = {"none": 1, "nvfp4-observed": 1, "two-recipes": 2, "nvfp4-shadow": 1}[name]
    assert kinds.count("decode") == expected, kinds
    assert kinds.count("update") == (1 if "shadow" in name else 0)
    with record_keys() as warmed:
        ENGINE_WARMUP.run_plans(plans)
    width = block_table_width(model.config, PAGE)
    assert width == 32  # 512 tokens / 16-token pages, already a multiple of 128 tokens
    batch = make_batch(model, REQUESTS, table=_table(model, width))
    with record_keys() as served:
        for i, layer in enumerate(model.layers):
            q, kv_c, k_pe = layer_inputs(SMALL, batch.num_tokens, 5 + i)
            forward(model, batch, layer, q, kv_c, k_pe)
    kernels = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
    assert {"prefill_fwd_kernel"} <= kernels and any("split" in k for k in kernels), kernels
    missing = served - warmed
    assert not missing, f"{len(missing)} of {len(served)} served keys not warmed: {sorted(missing)}"
    for layer in model.layers.values():
        assert layer.impl.mla_warm_width is None  # checked against the first decode, cleared


def test_warmup_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_vllm.warmup import ENGINE_WARMUP, ENV

    model = _quant_model(tmp_path, {"recipe": "nvfp4"})
    monkeypatch.setenv(ENV, "0")
    assert ENGINE_WARMUP.get_warmup_keys(model.config) == []
    monkeypatch.setenv(ENV, "1")
    assert ENGINE_WARMUP.get_warmup_keys(model.config)


def _probe(x):  # type: ignore[no-untyped-def]  # a kernel's source, never compiled
    pass


def test_failed_warmup_leaves_no_failed_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up that fails is logged and returns None, and the asynchronous compiles it
    left in an ``mla_triton`` kernel's cache unfinished or failed are forgotten (the next
    launch compiles them anew); finished ones and plain kernels stay."""
    import sys
    import types
    from concurrent.futures import Future
    from contextlib import contextmanager

    from triton.runtime._async_compile import FutureKernel
    from triton.runtime.jit import JITFunction

    import mla_vllm.warmup as warmup

    failed: Future[Any] = Future()
    failed.set_exception(RuntimeError("ptxas died"))
    finished: Future[Any] = Future()
    finished.set_result("binary")
    done = FutureKernel(lambda kernel: None, finished)
    done.result()
    cache: dict[str, Any] = {"plain": object(), "done": done, "pending": None, "failed": None}
    cache["pending"] = FutureKernel(lambda kernel: None, Future())
    cache["failed"] = FutureKernel(lambda kernel: None, failed)
    kernel = JITFunction(_probe)
    kernel.device_caches = {0: (cache, {}, None, None, None)}  # type: ignore[assignment]
    module = types.ModuleType("mla_triton._probe")
    module.kernel = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mla_triton._probe", module)

    @contextmanager
    def compile_only(threads: int | None = None) -> Any:
        yield

    def run_plans(plans: Any) -> None:
        raise RuntimeError("a warm-up call failed")

    monkeypatch.setattr(warmup, "compile_only", compile_only)
    engine = warmup.EngineWarmup()
    monkeypatch.setattr(engine, "run_plans", run_plans)
    assert engine.compile_plans([warmup.Plan("decode", "layer")]) is None
    assert sorted(cache) == ["done", "plain"]
