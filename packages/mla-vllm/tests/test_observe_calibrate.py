"""Accuracy observation (off by default) and calibration of static amax."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SMALL, Model, build_model, forward, make_batch, make_builder, make_vllm_config

import mla_vllm.install as installer
from mla_vllm.config import load_config

pytestmark = pytest.mark.usefixtures("vllm_process", "cpu_cache_op")

REQUESTS = [(0, 1), (0, 1), (0, 17)]


def _step(model: Model, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    batch = make_batch(model, REQUESTS, seed=seed)
    inputs = []
    for i, name in enumerate(model.layers):
        gen = torch.Generator().manual_seed(seed + i)
        t = batch.num_tokens
        q = torch.randn(t, SMALL.heads, SMALL.qk, generator=gen).half()
        kv_c = (torch.randn(t, SMALL.kv_lora_rank, generator=gen) * 0.5).half()
        k_pe = (torch.randn(t, 1, SMALL.rope, generator=gen) * 2).half()
        forward(model, batch, name, q, kv_c, k_pe)
        inputs.append((q, kv_c, k_pe))
    return inputs


def _module(model: Model) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers.values())})


def test_statistics_per_layer_and_path(tmp_path: Path) -> None:
    from mla_vllm.backend import MLAQuantBackend

    quant = {
        "recipe": "nvfp4",
        "observe": {"enabled": True, "interval": 2},
        "layers": [{"pattern": "model.layers.1.*", "recipe": "fp8"}],
    }
    config = make_vllm_config(tmp_path, SMALL, mla_quant=quant)
    model = build_model(config, SMALL, MLAQuantBackend)
    make_builder(model)
    module = _module(model)
    for seed in range(3):  # calls 0 and 2 are observed
        _step(model, seed)
    stats = installer.get_stats(module)
    assert sorted(stats) == sorted(model.layers)
    errors = {}
    for name, paths in stats.items():
        assert sorted(paths) == ["decode", "prefill"]
        for path, s in paths.items():
            assert s["calls"] == 2.0
            assert 0.0 < s["rel_l2_mean"] <= s["rel_l2_max"] < 0.3
            assert 0.95 < s["cosine_min"] <= s["cosine_mean"] <= 1.0
            assert 0.0 < s["max_abs_mean"] <= s["max_abs_max"]
            errors[name, path] = s["rel_l2_mean"]
    # fp8 (layer 1) is more accurate than nvfp4 (layer 0)
    for path in ("decode", "prefill"):
        assert (
            errors["model.layers.1.self_attn.attn", path]
            < errors["model.layers.0.self_attn.attn", path]
        )
    installer.reset_stats(module)
    assert installer.get_stats(module) == {name: {} for name in model.layers}


def test_observation_is_off_by_default(tmp_path: Path) -> None:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant={"recipe": "fp8"})
    model = build_model(config, SMALL, MLAQuantBackend)
    make_builder(model)
    _step(model)
    assert installer.get_stats(_module(model)) == {name: {} for name in model.layers}


def test_calibration_records_amax_and_round_trips(tmp_path: Path) -> None:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

    config = make_vllm_config(tmp_path, SMALL)
    model = build_model(config, SMALL, TritonMLABackend)
    make_builder(model)
    module = _module(model)
    assert installer.start_calibration(module) == sorted(model.layers)
    inputs = _step(model)
    amaxes = installer.finish_calibration(module)
    assert all(type(layer.impl) is TritonMLAImpl for layer in model.layers.values())
    decode_rows = sum(1 for _, n in REQUESTS if n == 1)
    for (q, kv_c, k_pe), name in zip(inputs, model.layers, strict=True):
        got = amaxes[name]
        assert sorted(got) == ["decode", "prefill"]
        assert sorted(got["prefill"]) == ["k", "q", "v"]
        assert sorted(got["decode"]) == ["k", "q", "v"]
        assert got["prefill"]["q"] == float(q[decode_rows:].abs().max())
        assert got["decode"]["v"] == float(kv_c.abs().max())
        assert got["decode"]["k"] == float(torch.maximum(kv_c.abs().max(), k_pe.abs().max()))
    document = installer.calibration_document([amaxes])
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(document))
    recipe = load_config({"recipe": "nvfp4", "calibration": str(path)}).recipe_for(
        "model.layers.0.self_attn.attn"
    )
    assert recipe.prefill.q.static_amax() == pytest.approx(
        amaxes["model.layers.0.self_attn.attn"]["prefill"]["q"]
    )
    assert recipe.decode.v.static_amax() == pytest.approx(
        amaxes["model.layers.0.self_attn.attn"]["decode"]["v"]
    )
    assert recipe.prefill.p.static_amax() == 1.0
