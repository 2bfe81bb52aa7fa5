"""Every gate, on real layers, reported for every offending layer in one error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SMALL, Dims, build_model, make_builder, make_vllm_config

import mla_vllm.installer as installer
from mla_vllm.gates import MLAQuantGateError, check_layers, layer_problems

pytestmark = pytest.mark.usefixtures("vllm_process")


def _triton(
    tmp_path: Path, dims: Dims = SMALL, *, kv_cache_dtype: str = "auto", prefix: str = "", **kw: Any
) -> dict[str, Any]:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    config = make_vllm_config(tmp_path, dims, kv_cache_dtype=kv_cache_dtype)
    return build_model(config, dims, TritonMLABackend, **kw).layers


def test_clean_layers_pass(tmp_path: Path) -> None:
    layers = _triton(tmp_path)
    check_layers(layers, in_place=True)
    assert all(layer_problems(layer) == [] for layer in layers.values())


def test_every_gate_listed_in_one_error(tmp_path: Path) -> None:
    fp8 = _triton(tmp_path / "a", kv_cache_dtype="fp8")
    sparse = _triton(tmp_path / "b", indexer=object())
    padded = _triton(tmp_path / "c", q_pad_num_heads=32)
    dcp = _triton(tmp_path / "d")
    for layer in dcp.values():  # DCP needs several ranks; the gate reads the impl's size
        layer.impl.dcp_world_size = 2
    odd = _triton(tmp_path / "e", Dims(nope=40, v=24))
    groups = {
        "quantized KV cache": fp8,
        "sparse-indexer": sparse,
        "head padding": padded,
        "decode context parallelism 2": dcp,
        "not positive multiples of 16": odd,
    }
    layers: dict[str, Any] = {}
    for label, group in groups.items():
        for name, layer in group.items():
            layers[f"{label}/{name}"] = layer
    with pytest.raises(MLAQuantGateError) as info:
        check_layers(layers)
    message = str(info.value)
    assert f"{len(layers)} of {len(layers)} MLA layer(s)" in message
    for key in layers:
        label = key.split("/")[0]
        line = next(x for x in message.splitlines() if x.strip().startswith(key + ":"))
        assert label in line, line
    assert "qk_nope_head_dim=40" in message and "v_head_dim=24" in message


def test_install_checks_all_layers_before_changing_any(tmp_path: Path) -> None:
    layers = _triton(tmp_path, kv_cache_dtype="fp8", num_layers=3)
    module = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(layers.values())})
    impls = [layer.impl for layer in layers.values()]
    with pytest.raises(MLAQuantGateError, match=r"3 of 3 MLA layer\(s\)"):
        installer.install(module, {"recipe": "nvfp4"})
    assert [layer.impl for layer in layers.values()] == impls


def test_backend_builder_gates_every_layer(tmp_path: Path) -> None:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant={"recipe": "fp8"})
    model = build_model(config, SMALL, MLAQuantBackend, num_layers=2, q_pad_num_heads=32)
    with pytest.raises(MLAQuantGateError) as info:
        make_builder(model)
    for name in model.layers:
        assert f"{name}: query head padding (q_pad_num_heads=32, num_heads=16)" in str(info.value)


def test_backend_builder_names_unmatched_pattern(tmp_path: Path) -> None:
    from mla_vllm.backend import MLAQuantBackend

    quant = {"layers": [{"pattern": "model.layers.7.*", "recipe": "fp8"}]}
    config = make_vllm_config(tmp_path, SMALL, mla_quant=quant)
    model = build_model(config, SMALL, MLAQuantBackend, num_layers=2)
    with pytest.raises(ValueError, match=r"additional_config\.mla_quant\.layers\[0\]\.pattern"):
        make_builder(model)
