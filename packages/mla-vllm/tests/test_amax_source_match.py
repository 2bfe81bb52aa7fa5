"""A calibration source must match the model's MLA layers: no silent fallback.

The class: a source (a ``calibrate()`` file, an exported checkpoint's KV scales, a
ModelOpt amax state) whose layer names differ from the model's (another model, another
prefix, other layers) would leave layers at the default amax without a word. Every
such source is refused by ``check_layer_names`` (naming the source's key and the
layer) and by ``recipe_for`` (the layer that finds nothing), unless it says
``"partial": true``; a source that matches no layer at all is refused even then.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mla_vllm.compare.inputs import Recipe, check_layer_names
from mla_vllm.config import CALIBRATION_FORMAT, MLAQuantConfigError, load_config

PREFIXES = ("model.layers", "language_model.model.layers", "layers", "model.decoder.layers")
SETTINGS = settings(max_examples=60, deadline=None)


def _layer(prefix: str, i: int) -> str:
    return f"{prefix}.{i}.self_attn.attn"


def _calibrate_file(root: Path, layers: list[str]) -> dict[str, Any]:
    """A ``calibrate()`` file for ``layers``; the source object pointing at it."""
    amax = {"prefill": {"q": 9.0, "k": 7.0, "v": 3.0}, "decode": {"q": 40.0, "k": 2.5, "v": 2.0}}
    doc = {"format": CALIBRATION_FORMAT, "version": 1, "layers": dict.fromkeys(layers, amax)}
    path = root / "calibration.json"
    path.write_text(json.dumps(doc))
    return {"from": "calibrate", "path": str(path)}


def _checkpoint(root: Path, layers: list[str]) -> dict[str, Any]:
    """An FP8 ModelOpt export with a K and a V scale for each of ``layers``."""
    tensors = {}
    for layer in layers:
        module = layer.removesuffix(".attn")
        tensors[f"{module}.k_proj.k_scale"] = torch.tensor(2.0)
        tensors[f"{module}.v_proj.v_scale"] = torch.tensor(1.5)
    save_file(tensors, str(root / "model.safetensors"))
    quant = {"quantization": {"kv_cache_quant_algo": "FP8"}}
    (root / "hf_quant_config.json").write_text(json.dumps(quant))
    return {"from": "checkpoint", "path": str(root)}


def _modelopt(root: Path, layers: list[str]) -> dict[str, Any]:
    """A ModelOpt amax state of the vLLM plugin's quantizers for ``layers``."""
    state = {}
    for layer in layers:
        state[f"{layer}.q_bmm_quantizer._amax"] = torch.tensor(3.0)
        state[f"{layer}.kv_c_bmm_quantizer._amax"] = torch.tensor(2.0)
        state[f"{layer}.k_pe_bmm_quantizer._amax"] = torch.tensor(5.0)
    torch.save(state, root / "amax_dict_rank0.pt")
    return {"from": "modelopt", "path": str(root / "amax_dict_rank0.pt")}


def _source_keys(kind: str, layer: str) -> list[str]:
    """The keys a source of ``kind`` holds for ``layer``."""
    if kind == "calibrate":
        return [layer]
    if kind == "checkpoint":
        module = layer.removesuffix(".attn")
        return [f"{module}.k_proj.k_scale", f"{module}.v_proj.v_scale"]
    return [f"{layer}.{q}_bmm_quantizer._amax" for q in ("q", "kv_c", "k_pe")]


V_AMAX = {
    "calibrate": ("prefill", 3.0),
    "checkpoint": ("prefill", 672.0),
    "modelopt": ("decode", 2.0),
}
"""The path and V amax each source gives a layer it covers (448: fp8's default)."""


WRITERS: dict[str, Callable[[Path, list[str]], dict[str, Any]]] = {
    "calibrate": _calibrate_file,
    "checkpoint": _checkpoint,
    "modelopt": _modelopt,
}


@st.composite
def model_and_source(draw: st.DrawFn) -> tuple[list[str], list[str], bool]:
    """The model's MLA layers and a source's: same or other prefix, some or other layers."""
    model_prefix = draw(st.sampled_from(PREFIXES))
    count = draw(st.integers(1, 6))
    model = [_layer(model_prefix, i) for i in range(count)]
    source_prefix = draw(st.sampled_from((model_prefix, *PREFIXES)))
    indices = draw(st.sets(st.integers(0, 8), min_size=1, max_size=8))
    source = [_layer(source_prefix, i) for i in sorted(indices)]
    return model, source, draw(st.booleans())


def _check(kind: str, model: list[str], source: list[str], partial: bool) -> None:
    """The property for one source kind: refused exactly when the names do not match."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = WRITERS[kind](Path(tmp), source)
        if partial:
            spec["partial"] = True
        config = load_config({"recipe": "fp8", "calibration": spec})
        stray = [name for name in source if name not in model]
        missing = [name for name in model if name not in source]
        refused = not set(model) & set(source) or (not partial and bool(stray or missing))
        if not refused:
            config.check_layer_names(model)
            for name in model:  # a layer of the source takes its amax; others only if partial
                path, value = V_AMAX[kind]
                v = getattr(config.recipe_for(name), path).v.amax
                assert v == (value if name in source else 448.0)
            return
        with pytest.raises(MLAQuantConfigError, match=r"^mla_quant\.calibration: ") as info:
            config.check_layer_names(model)
        message = str(info.value)
        if stray:  # the source's side: its key and the layer it would give
            assert repr(stray[0]) in message
            assert any(repr(key) in message for key in _source_keys(kind, stray[0]))
        if missing:  # the model's side, and the same refusal when the layer is bound
            if set(model) & set(source):  # else the source's side says it all
                assert repr(missing[0]) in message
            if not partial:
                with pytest.raises(MLAQuantConfigError, match=repr(missing[0]).replace(".", r"\.")):
                    config.recipe_for(missing[0])


@SETTINGS
@given(model_and_source())
def test_a_calibrate_file_matches_the_layers_or_is_refused(
    case: tuple[list[str], list[str], bool],
) -> None:
    _check("calibrate", *case)


@settings(max_examples=25, deadline=None)
@given(model_and_source(), st.sampled_from(("checkpoint", "modelopt")))
def test_a_modelopt_source_matches_the_layers_or_is_refused(
    case: tuple[list[str], list[str], bool], kind: str
) -> None:
    _check(kind, *case)


def test_a_prefix_difference_names_both_sides_with_a_close_match(tmp_path: Path) -> None:
    """A ModelOpt export of the language model alone, served as a multimodal model."""
    model = [_layer("language_model.model.layers", i) for i in range(3)]
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    first = _checkpoint(tmp_path / "a", [_layer("model.layers", i) for i in range(3)])
    config = load_config({"recipe": "nvfp4", "calibration": first})
    with pytest.raises(MLAQuantConfigError) as info:
        config.check_layer_names(model, where="additional_config.mla_quant")
    message = str(info.value)
    assert message.startswith("additional_config.mla_quant.calibration: none of its 3 entries")
    assert (
        "'model.layers.0.self_attn.k_proj.k_scale' (+1 more) for layer "
        "'model.layers.0.self_attn.attn' (closest MLA layer "
        "'language_model.model.layers.0.self_attn.attn')"
    ) in message
    spec = _checkpoint(tmp_path / "b", [_layer("language_model.model.layers", i) for i in range(2)])
    with pytest.raises(MLAQuantConfigError) as info:
        load_config({"recipe": "nvfp4", "calibration": spec}).check_layer_names(model)
    assert str(info.value).endswith(
        "'language_model.model.layers.2.self_attn.attn' (closest source entry: "
        "'language_model.model.layers.1.self_attn.k_proj.k_scale' (+1 more) for layer "
        "'language_model.model.layers.1.self_attn.attn'); if the source is meant to cover "
        'only some layers, say so: "partial": true beside "from" in mla_quant.calibration'
    )
    with pytest.raises(MLAQuantConfigError, match=r"allows some layers unmatched, not all"):
        load_config(
            {"recipe": "nvfp4", "calibration": {**first, "partial": True}}
        ).check_layer_names(model)


def test_layers_that_read_no_static_amax_need_no_entry(tmp_path: Path) -> None:
    """A layer whose recipe is none (or whose amaxes are all explicit) reads nothing."""
    model = [_layer("model.layers", i) for i in range(3)]
    spec = _calibrate_file(tmp_path, model[1:])
    config = load_config(
        {
            "recipe": "fp8",
            "calibration": spec,
            "layers": [{"pattern": "model.layers.0.*", "recipe": "none"}],
        }
    )
    config.check_layer_names(model)
    assert config.recipe_for(model[0]).is_identity
    explicit = {"format": "fp8", "amax": 4.0}
    config = load_config(
        {"recipe": "fp8", "q": explicit, "k": explicit, "v": explicit, "calibration": spec}
    )
    config.check_layer_names(model)
    with pytest.raises(MLAQuantConfigError, match=r"'model\.layers\.0\.self_attn\.attn'"):
        load_config({"recipe": "fp8", "calibration": spec}).check_layer_names(model)


def test_an_empty_calibration_is_refused(tmp_path: Path) -> None:
    spec = _calibrate_file(tmp_path, [])
    with pytest.raises(MLAQuantConfigError, match=r"calibration: the source has no layer entries"):
        load_config({"recipe": "fp8", "calibration": spec}).check_layer_names(["a.attn"])


def test_the_source_keys_are_validated(tmp_path: Path) -> None:
    spec = _calibrate_file(tmp_path, ["a.attn"])
    bad: list[tuple[dict[str, Any], str]] = [
        ({**spec, "partial": "yes"}, r"^mla_quant\.calibration\.partial: expected true or false"),
        ({**spec, "maxbound": 448}, r"^mla_quant\.calibration\.maxbound: only for 'checkpoint'"),
        ({"from": "calibrate"}, r"^mla_quant\.calibration\.path: expected the path"),
        ({"from": "calibrate", "path": str(tmp_path / "x.json")}, r"calibration\.path: cannot"),
        ({**spec, "pattern": "*"}, r"^mla_quant\.calibration: unknown key\(s\) \['pattern'\]"),
        ({"from": "file"}, r"calibration\.from: expected one of \['calibrate', 'checkpoint'"),
    ]
    for source, message in bad:
        with pytest.raises(MLAQuantConfigError, match=message):
            load_config({"recipe": "fp8", "calibration": source})


def test_mla_compare_checks_the_source_before_any_engine(tmp_path: Path) -> None:
    """``mla-compare`` knows a DeepSeek model's layer names from its config.json."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps(config))
    spec = _calibrate_file(tmp_path, [_layer("layers", 0), _layer("layers", 1)])
    recipe = Recipe("cal", {"recipe": "fp8", "calibration": spec})
    with pytest.raises(MLAQuantConfigError, match=r"^--recipe cal: mla_quant\.calibration: none"):
        check_layer_names([recipe], str(model), str(model))
    good = _calibrate_file(tmp_path, [_layer("model.layers", 0), _layer("model.layers", 1)])
    check_layer_names([Recipe("cal", {"recipe": "fp8", "calibration": good})], str(model), None)


@pytest.mark.usefixtures("vllm_process")
def test_the_engine_refuses_it_when_it_asks_for_the_kv_cache_specs(tmp_path: Path) -> None:
    """vLLM asks for each layer's KV-cache spec once the model is built, before its memory
    profile runs the first forward: MLA_QUANT checks the layer names there."""
    from conftest import SMALL, build_model, make_vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import customize_attention_spec

    from mla_vllm.backend import MLAQuantBackend

    layers = [_layer("model.layers", i) for i in range(2)]
    for name, source in (("other", [_layer("layers", i) for i in range(2)]), ("same", layers)):
        (tmp_path / name).mkdir()
        spec = _calibrate_file(tmp_path / name, source)
        config = make_vllm_config(
            tmp_path / name, SMALL, mla_quant={"recipe": "fp8", "calibration": spec}
        )
        model = build_model(config, SMALL, MLAQuantBackend)
        assert list(model.layers) == layers
        layer = model.layers[layers[0]]
        with set_current_vllm_config(config):
            if name == "same":
                customize_attention_spec(layer.get_attn_backend(), layer.get_kv_cache_spec(config))
                continue
            with pytest.raises(
                MLAQuantConfigError,
                match=r"^additional_config\.mla_quant\.calibration: none of its 2 entries .*"
                r"'layers\.0\.self_attn\.attn' \(closest MLA layer "
                r"'model\.layers\.0\.self_attn\.attn'\)",
            ):
                customize_attention_spec(layer.get_attn_backend(), layer.get_kv_cache_spec(config))
