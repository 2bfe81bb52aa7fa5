"""Accuracy observation (off by default) and calibration of static amax."""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    SMALL,
    Model,
    build_model,
    forward,
    layer_inputs,
    make_batch,
    make_builder,
    make_vllm_config,
    random_context,
)

import mla_reference
import mla_vllm.decode as decode_step
from mla_formats import AttentionQuant
from mla_vllm.calibration import calibration_document, finish_calibration, start_calibration
from mla_vllm.config import LayerRecipe, load_config
from mla_vllm.state import LayerState
from mla_vllm.stats import get_stats, reset_stats

pytestmark = pytest.mark.usefixtures("vllm_process", "cpu_cache_op")

# four decode rows over cached context, then a fresh prefill of 17 tokens
REQUESTS = [(20, 1), (9, 1), (33, 1), (14, 1), (0, 17)]
MAX_ROWS = 3  # observation compares the first 3 rows (decode) or tokens (prefill) of a call


def _step(model: Model, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    batch = make_batch(model, REQUESTS, seed=seed)
    random_context(model, batch, seed)
    inputs = []
    for i, name in enumerate(model.layers):
        q, kv_c, k_pe = layer_inputs(SMALL, batch.num_tokens, seed + 10 * i)
        k_pe = k_pe * 2
        _CURRENT[0] = name
        forward(model, batch, name, q, kv_c, k_pe)
        inputs.append((q, kv_c, k_pe))
    return inputs


def _module(model: Model) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers.values())})


_CURRENT = [""]  # the layer whose forward runs: the spies tag their calls with it


@dataclass
class _Call:
    layer: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    return x


def _spy(calls: list[_Call], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, recording a copy of its arguments (the cache changes later)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(_Call(_CURRENT[0], _clone(args), {k: _clone(v) for k, v in kwargs.items()}))
        return real(*args, **kwargs)

    return call


def _observed(calls: list[_Call]) -> list[tuple[_Call, _Call]]:
    """``(quantized call, its unquantized reference call)`` of each observed call."""
    pairs = []
    for before, call in itertools.pairwise(calls):
        if call.kwargs.get("quant") is None and before.kwargs.get("quant") is not None:
            assert call.layer == before.layer
            pairs.append((before, call))
    return pairs


def _oracle_error(kind: str, quantized: _Call, reference: _Call) -> torch.Tensor:
    """``[rel_l2, cosine, max_abs]`` of the recipe on the reference call's rows, by
    ``mla_reference``: the quantized and the unquantized attention of the same rows."""
    kw = {k: v for k, v in reference.kwargs.items() if k in ("softmax_scale", "kv_lora_rank")}
    if kind == "decode":
        outs = [
            mla_reference.decode(*reference.args, **kw, quant=quant)[0]
            for quant in (quantized.kwargs["quant"], None)
        ]
    else:
        kw["causal"] = reference.kwargs["causal"]
        outs = [
            mla_reference.prefill(
                *reference.args, **kw, quant=quant, sparsity=quantized.kwargs.get("sparsity")
            )
            for quant in (quantized.kwargs["quant"], None)
        ]
    rows = min(MAX_ROWS, outs[0].shape[0])
    a, b = (o[:rows].double().flatten() for o in outs)
    cosine = (a @ b) / (a.norm() * b.norm())
    return torch.stack([(a - b).norm() / b.norm(), cosine, (a - b).abs().max()])


def test_statistics_are_the_recipes_error_on_the_observed_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every observed call is recorded with the error ``mla_reference`` gives for the
    layer's recipe on the same rows (the first ``max_rows``): a swapped reference, other
    rows, another recipe or an unobserved call changes the numbers."""
    from mla_vllm.backend import MLAQuantBackend

    quant = {
        "recipe": "nvfp4",
        "observe": {"enabled": True, "interval": 2, "max_rows": MAX_ROWS},
        "layers": [{"pattern": "model.layers.1.*", "recipe": "fp8"}],
    }
    calls: dict[str, list[_Call]] = {"decode": [], "prefill": []}
    monkeypatch.setattr(decode_step, "decode", _spy(calls["decode"], decode_step.decode))
    kernels = importlib.import_module("mla_triton")  # mla_vllm.prefill imports it at call time
    monkeypatch.setattr(kernels, "prefill", _spy(calls["prefill"], kernels.prefill))
    config = make_vllm_config(tmp_path, SMALL, mla_quant=quant)
    model = build_model(config, SMALL, MLAQuantBackend)
    make_builder(model)
    module = _module(model)
    for seed in range(3):  # calls 0 and 2 are observed
        _step(model, seed)
    stats = get_stats(module)
    assert sorted(stats) == sorted(model.layers)
    errors = {}
    for path, path_calls in calls.items():
        observed = _observed(path_calls)
        assert len(observed) == 2 * len(model.layers)
        for name in model.layers:
            want = torch.stack([_oracle_error(path, q, r) for q, r in observed if q.layer == name])
            got = stats[name][path]
            assert got["calls"] == 2.0
            # kernel and oracle differ by float32 summation order (and rare rounding
            # ties): measured here within 0.1 % (rel_l2) and 0.3 % (1 - cosine);
            # another recipe, other rows or an unquantized reference miss by far more
            rel, cos = want[:, 0], want[:, 1]
            assert got["rel_l2_mean"] == pytest.approx(float(rel.mean()), rel=0.01)
            assert got["rel_l2_max"] == pytest.approx(float(rel.max()), rel=0.01)
            assert 1 - got["cosine_min"] == pytest.approx(float(1 - cos.min()), rel=0.02)
            assert got["max_abs_max"] == pytest.approx(float(want[:, 2].max()), rel=0.01)
            errors[name, path] = got["rel_l2_mean"]
    # fp8 (layer 1) is more accurate than nvfp4 (layer 0)
    for path in ("decode", "prefill"):
        assert (
            errors["model.layers.1.self_attn.attn", path]
            < errors["model.layers.0.self_attn.attn", path]
        )
    reset_stats(module)
    assert get_stats(module) == {name: {} for name in model.layers}


def test_empty_calls_are_counted_and_left_out_of_the_figures() -> None:
    """An engine's dummy or warm-up batch (all-zero unquantized output) would read as
    cosine 0 and drag every mean; it is counted apart and changes no figure."""
    fp8 = AttentionQuant.uniform("fp8")
    recipe = LayerRecipe(prefill=fp8, decode=fp8, sparsity=None)

    gen = torch.Generator().manual_seed(3)
    want = torch.randn(4, 8, 16, generator=gen)
    got = want + 0.01 * torch.randn(4, 8, 16, generator=gen)
    zeros = torch.zeros_like(want)
    alone, mixed = LayerState("a", recipe), LayerState("b", recipe)
    alone.record_stats("decode", got, want)
    for quantized, reference in ((zeros, zeros), (got, want), (got[:2] * 0 + 1e30, zeros[:2])):
        mixed.record_stats("decode", quantized, reference)
    a, m = alone.snapshot()["decode"], mixed.snapshot()["decode"]
    assert (a["calls"], a["empty_calls"]) == (1.0, 0.0)
    assert (m["calls"], m["empty_calls"]) == (1.0, 2.0)
    assert {k: v for k, v in m.items() if "calls" not in k} == pytest.approx(
        {k: v for k, v in a.items() if "calls" not in k}
    )
    assert 0.99 < m["cosine_min"] <= 1.0
    only_empty = LayerState("c", recipe)
    only_empty.record_stats("decode", zeros, zeros)
    assert only_empty.snapshot() == {}


def test_observation_is_off_by_default(tmp_path: Path) -> None:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant={"recipe": "fp8"})
    model = build_model(config, SMALL, MLAQuantBackend)
    make_builder(model)
    _step(model)
    assert get_stats(_module(model)) == {name: {} for name in model.layers}


def test_calibration_records_amax_and_round_trips(tmp_path: Path) -> None:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

    config = make_vllm_config(tmp_path, SMALL)
    model = build_model(config, SMALL, TritonMLABackend)
    make_builder(model)
    module = _module(model)
    assert start_calibration(module) == sorted(model.layers)
    inputs = _step(model)
    amaxes = finish_calibration(module)
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
    document = calibration_document([amaxes])
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
