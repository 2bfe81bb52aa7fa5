"""``mla_vllm.install`` compiles, after publishing, what the installed layers launch.

Real vLLM layers on TRITON_MLA (conftest). ``mla_vllm.warmup.compile_only`` is
replaced by ``record_keys`` (the compile keys for sm_90, nothing launched), so the
install's warm-up records what it would compile; the keys of a mixed batch served
after the install must be among them. Also: ``MLA_QUANT_WARMUP=0`` skips it, a
warm-up ``Exception`` is logged and leaves every layer installed, an interrupt
rolls every layer back, and vLLM's JIT monitor is paused during it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import PAGE, SMALL, Model, forward, layer_inputs, make_batch
from test_install import _native, _snapshot
from test_warmup import REQUESTS, _table

import mla_vllm.installer as installer
import mla_vllm.warmup as warmup
from mla_triton.precompile import record_keys
from mla_vllm.backend import MLAQuantImpl

pytestmark = pytest.mark.usefixtures("vllm_process", "cpu_cache_op")

TWO_RECIPES = {"recipe": "nvfp4", "layers": [{"pattern": "*.layers.1.*", "v": "fp8"}]}


class _Recorder:
    """Stands in for ``compile_only`` in ``mla_vllm.warmup``: records keys, counts entries."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str]] = set()
        self.entries = 0
        self.hooks: list[Any] = []  # Triton's post-compile hook seen inside

    @contextmanager
    def __call__(self, threads: int | None = None) -> Iterator[None]:
        from triton import knobs

        self.entries += 1
        self.hooks.append(knobs.runtime.jit_post_compile_hook)
        with record_keys() as keys:
            yield
        self.keys |= keys


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _serve(model: Model) -> set[tuple[str, str]]:
    """Compile keys of a mixed batch (two decodes, a prefill, one with context) through
    every layer, with a block table as wide as vLLM's (``block_table_width``)."""
    width = warmup.block_table_width(model.config, PAGE)
    batch = make_batch(model, REQUESTS, table=_table(model, width))
    with record_keys() as served:
        for i, name in enumerate(model.layers):
            q, kv_c, k_pe = layer_inputs(SMALL, batch.num_tokens, 5 + i)
            forward(model, batch, name, q, kv_c, k_pe)
    return served


def test_install_warms_what_the_installed_layers_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton import knobs
    from vllm.utils import jit_monitor

    model, module = _native(tmp_path)
    recorder = _Recorder()
    monkeypatch.setattr(warmup, "compile_only", recorder)
    compiled: list[tuple[str, str, int]] = []
    real_compile = warmup._compile

    def spy(plan: warmup.Plan, layer: Any, cache: Any, vllm_config: Any) -> None:
        assert isinstance(layer.impl, MLAQuantImpl)  # published before the warm-up
        assert vllm_config is model.config
        assert cache is None or cache is layer.kv_cache  # the layer's own cache
        compiled.append((plan.kind, plan.layer, layer.kv_cache.data_ptr()))
        real_compile(plan, layer, cache, vllm_config)

    monkeypatch.setattr(warmup, "_compile", spy)

    def monitor(**kwargs: Any) -> None:
        raise AssertionError("vLLM's JIT monitor saw a warm-up compilation")

    monkeypatch.setattr(jit_monitor, "_active", True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", monitor)
    installer.install(module, TWO_RECIPES)
    assert knobs.runtime.jit_post_compile_hook is monitor  # restored after the warm-up
    assert recorder.entries == 1 and recorder.hooks == [None]
    names = list(model.layers)
    # layers 0 and 2 share nvfp4, layer 1 has fp8 V: one plan per distinct recipe
    assert sorted(compiled) == sorted(
        (kind, names[i], model.caches[names[i]].data_ptr())
        for kind in ("decode", "prefill")
        for i in (0, 1)
    )
    served = _serve(model)
    assert {k.rsplit(".", 1)[1] for k, _ in served} >= {"prefill_fwd_kernel"}
    assert any("split" in k for k, _ in served)
    missing = served - recorder.keys
    assert not missing, f"{len(missing)} of {len(served)} served keys not warmed: {missing}"
    installer.uninstall(module)
    assert recorder.entries == 1  # uninstall compiles nothing


def test_install_warmup_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, module = _native(tmp_path)
    recorder = _Recorder()
    monkeypatch.setattr(warmup, "compile_only", recorder)
    monkeypatch.setenv(warmup.ENV, "0")
    assert installer.install(module, {"recipe": "nvfp4"}) == [list(model.layers)]
    assert recorder.entries == 0
    assert all(isinstance(layer.impl, MLAQuantImpl) for layer in model.layers.values())
    installer.uninstall(module)
    monkeypatch.setenv(warmup.ENV, "1")
    installer.install(module, {"recipe": "nvfp4"})
    assert recorder.entries == 1


def test_warmup_error_is_logged_and_the_install_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("injected warm-up failure")

    monkeypatch.setattr(warmup, "warmup_decode", broken)
    errors = _Errors()
    warmup.logger.addHandler(errors)
    try:
        assert installer.install(module, {"recipe": "nvfp4"}) == [list(model.layers)]
    finally:
        warmup.logger.removeHandler(errors)
    assert errors.messages == ["MLA_QUANT warmup failed; kernels will compile during inference"]
    assert installer.installed_layers(module) == [sorted(model.layers)]
    assert all(isinstance(layer.impl, MLAQuantImpl) for layer in model.layers.values())
    installer.uninstall(module)
    assert _snapshot(model) == native


def test_interrupted_warmup_rolls_back_every_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)

    def interrupted(*args: Any, **kwargs: Any) -> int:
        assert all(isinstance(layer.impl, MLAQuantImpl) for layer in model.layers.values())
        raise KeyboardInterrupt

    monkeypatch.setattr(warmup, "warmup_prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        installer.install(module, {"recipe": "fp8"})
    assert _snapshot(model) == native
    assert installer.installed_layers(module) == [[]]
    assert not hasattr(module, "_mla_quant_native")
