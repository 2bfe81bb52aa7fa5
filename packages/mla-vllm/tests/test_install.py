"""In-place install on TRITON_MLA layers: quantizes, rolls back, uninstalls exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    SMALL,
    Model,
    build_model,
    expected_output,
    forward,
    layer_inputs,
    make_batch,
    make_builder,
    make_vllm_config,
    random_context,
)

import mla_vllm.installer as installer
from mla_vllm.backend import MLAQuantImpl
from mla_vllm.config import load_config
from mla_vllm.gates import MLAQuantGateError

pytestmark = pytest.mark.usefixtures("vllm_process", "cpu_cache_op")

NUM_LAYERS = 3


def _native(tmp_path: Path) -> tuple[Model, torch.nn.ModuleDict]:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    config = make_vllm_config(tmp_path, SMALL)
    model = build_model(config, SMALL, TritonMLABackend, num_layers=NUM_LAYERS)
    make_builder(model)
    module = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers.values())})
    return model, module


def _step(model: Model, seed: int = 5, *, check: bool = False) -> dict[str, torch.Tensor]:
    """A decode row over 21 cached tokens and a fresh prefill through every layer (the
    same inputs every call). ``check``: each layer's output must be its recipe's, as
    ``mla_reference`` computes it (every element of every request and head)."""
    batch = make_batch(model, [(21, 1), (0, 18)], seed=seed)
    latents = random_context(model, batch, seed)
    outs = {}
    for i, name in enumerate(model.layers):
        q, kv_c, k_pe = layer_inputs(SMALL, batch.num_tokens, seed + i)
        outs[name] = forward(model, batch, name, q, kv_c, k_pe)
        if check:
            want = expected_output(model, batch, name, q, kv_c, k_pe, latents[name])
            torch.testing.assert_close(outs[name].float(), want, atol=3e-3, rtol=3e-3)
    return outs


def _snapshot(model: Model) -> dict[str, tuple[Any, Any]]:
    return {n: (layer.impl, layer.prefill_backend) for n, layer in model.layers.items()}


def test_install_quantizes_and_uninstall_restores_exactly(tmp_path: Path) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)
    before = _step(model)
    names = installer.install(module, {"recipe": "nvfp4"})
    assert names == [list(model.layers)]
    assert all(isinstance(layer.impl, MLAQuantImpl) for layer in model.layers.values())
    nvfp4 = load_config({"recipe": "nvfp4"})
    for name, layer in model.layers.items():
        assert layer.impl.mla_layer.recipe == nvfp4.recipe_for(name)
    quantized = _step(model, check=True)  # the nvfp4 recipe's output, element by element
    for name in model.layers:
        assert not torch.equal(quantized[name], before[name])
    with pytest.raises(ValueError, match="already installed"):
        installer.install(module, {"recipe": "fp8"})
    assert installer.uninstall(module) == [list(model.layers)]
    assert _snapshot(model) == native
    after = _step(model)
    for name in model.layers:
        assert torch.equal(after[name], before[name])
    assert installer.uninstall(module) == [[]]


@pytest.mark.parametrize("fail_at", range(NUM_LAYERS))
def test_publish_failure_rolls_back_every_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)
    real = installer._publish_layer
    calls = []

    def publish(layer: Any, impl: Any, backend: Any) -> None:
        real(layer, impl, backend)  # the failure comes after this layer changed
        calls.append(layer.layer_name)
        if len(calls) == fail_at + 1:
            raise RuntimeError(f"injected failure at layer {fail_at}")

    monkeypatch.setattr(installer, "_publish_layer", publish)
    with pytest.raises(RuntimeError, match="injected failure"):
        installer.install(module, {"recipe": "nvfp4"})
    assert len(calls) == fail_at + 1
    assert _snapshot(model) == native
    assert installer.installed_layers(module) == [[]]
    assert not hasattr(module, "_mla_quant_native")


@pytest.mark.parametrize("fail_at", range(NUM_LAYERS))
def test_prepare_failure_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)
    real = MLAQuantImpl.bind
    seen = []

    def bind(self: MLAQuantImpl, *args: Any, **kwargs: Any) -> None:
        seen.append(args[0])
        if len(seen) == fail_at + 1:
            raise RuntimeError("injected bind failure")
        real(self, *args, **kwargs)

    monkeypatch.setattr(MLAQuantImpl, "bind", bind)
    with pytest.raises(RuntimeError, match="injected bind failure"):
        installer.install(module, {"recipe": "fp8"})
    assert _snapshot(model) == native


def test_bad_config_and_unknown_pattern_change_nothing(tmp_path: Path) -> None:
    model, module = _native(tmp_path)
    native = _snapshot(model)
    with pytest.raises(ValueError, match=r"mla_quant\.v\.amax: a dynamic amax"):
        installer.install(module, {"v": {"format": "fp8", "amax": "dynamic"}})
    with pytest.raises(ValueError, match=r"mla_quant\.layers\[0\]\.pattern: 'decoder\.\*'"):
        installer.install(module, {"layers": [{"pattern": "decoder.*", "recipe": "fp8"}]})
    assert _snapshot(model) == native


def test_per_layer_override(tmp_path: Path) -> None:
    model, module = _native(tmp_path)
    installer.install(
        module,
        {
            "recipe": "nvfp4",
            "layers": [
                {"pattern": "model.layers.1.*", "recipe": "none"},
                {"pattern": "*.2.*", "v": "fp8"},
            ],
        },
    )
    recipes = [layer.impl.mla_layer.recipe for layer in model.layers.values()]
    assert recipes[0].prefill.v.format.name == "nvfp4"
    assert recipes[1].is_identity
    assert recipes[2].decode.v.format.name == "fp8" and recipes[2].decode.q.format.name == "nvfp4"
    installer.uninstall(module)


def test_install_refuses_other_backends_listing_every_layer(tmp_path: Path) -> None:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    config = make_vllm_config(tmp_path, SMALL)
    model = build_model(config, SMALL, CPUMLABackend, num_layers=2)
    module = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers.values())})
    with pytest.raises(MLAQuantGateError) as info:
        installer.install(module, {"recipe": "fp8"})
    message = str(info.value)
    assert "2 of 2" in message and "CPU_MLA, not TRITON_MLA" in message
    for name in model.layers:
        assert name in message
