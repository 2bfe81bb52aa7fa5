"""ModelOpt amax as a calibration source: files the tests write, names, values, errors."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mla_vllm.checkpoint_amax import load_amax_source
from mla_vllm.config import MLAQuantConfig, MLAQuantConfigError, config_from_vllm

LAYER0 = "model.layers.0.self_attn.attn"
LAYER1 = "model.layers.1.self_attn.attn"


def _export(root: Path, scales: dict[str, float], algo: str | None = "FP8") -> Path:
    """A ModelOpt-style exported checkpoint: weights, KV scales, hf_quant_config.json."""
    root.mkdir(parents=True, exist_ok=True)
    tensors = {"model.layers.0.self_attn.kv_b_proj.weight": torch.ones(4, 4)}
    tensors |= {k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()}
    save_file(tensors, str(root / "model.safetensors"))
    if algo is not None:
        quant = {"producer": {"name": "modelopt"}, "quantization": {"kv_cache_quant_algo": algo}}
        (root / "hf_quant_config.json").write_text(json.dumps(quant))
    return root


def test_checkpoint_scales_map_to_prefill_k_and_v(tmp_path: Path) -> None:
    root = _export(
        tmp_path / "ckpt",
        {
            "model.layers.0.self_attn.k_proj.k_scale": 2.5,
            "model.layers.0.self_attn.v_proj.v_scale": 1.25,
            "model.layers.1.self_attn.k_proj.k_scale": 3.0,
        },
    )
    cal = load_amax_source({"from": "checkpoint"}, model_path=str(root))
    assert cal == {
        LAYER0: {"prefill": {"k": 2.5 * 448.0, "v": 1.25 * 448.0}},
        LAYER1: {"prefill": {"k": 3.0 * 448.0}},
    }


def test_checkpoint_feeds_the_recipe_through_vllm_config(tmp_path: Path) -> None:
    """``config_from_vllm`` passes the model path: the layer's prefill K amax is the scale's."""
    root = _export(tmp_path / "m", {"model.layers.0.self_attn.k_proj.k_scale": 1.5})
    vllm_config = SimpleNamespace(
        additional_config={"mla_quant": {"recipe": "fp8", "calibration": {"from": "checkpoint"}}},
        model_config=SimpleNamespace(model=str(root)),
    )
    recipe = config_from_vllm(vllm_config).recipe_for(LAYER0)
    assert recipe.prefill.k.amax == pytest.approx(1.5 * 448.0)
    assert recipe.decode.k.amax != pytest.approx(1.5 * 448.0)  # decode is not derived
    with pytest.raises(MLAQuantConfigError, match=r"'model\.layers\.1\.self_attn\.attn' \(closest"):
        config_from_vllm(vllm_config).recipe_for(LAYER1)  # no layer-1 scale: no silent default
    source = vllm_config.additional_config["mla_quant"]["calibration"]
    source["partial"] = True
    assert config_from_vllm(vllm_config).recipe_for(LAYER1).prefill.k.amax == 448.0  # default


def test_checkpoint_refuses_modelopt_fp8_floor_and_unknown_maxbound(tmp_path: Path) -> None:
    floor = _export(tmp_path / "a", {"model.layers.0.self_attn.k_proj.k_scale": 1.0})
    with pytest.raises(ValueError, match=r"the floor 1\.0.*modelopt"):
        load_amax_source({"from": "checkpoint", "path": str(floor)})
    nvfp4 = _export(tmp_path / "b", {"model.layers.0.self_attn.k_proj.k_scale": 0.01}, "NVFP4")
    with pytest.raises(ValueError, match=r"calibration\.maxbound: kv_cache_quant_algo 'NVFP4'"):
        load_amax_source({"from": "checkpoint", "path": str(nvfp4)})
    cal = load_amax_source({"from": "checkpoint", "path": str(nvfp4), "maxbound": 2688})
    assert cal[LAYER0]["prefill"]["k"] == pytest.approx(0.01 * 2688, rel=1e-6)
    bare = _export(tmp_path / "c", {"model.layers.0.self_attn.k_proj.k_scale": 0.5}, None)
    with pytest.raises(ValueError, match=r"calibration\.maxbound: .* names no kv_cache_quant_algo"):
        load_amax_source({"from": "checkpoint", "path": str(bare)})
    kv = _export(tmp_path / "d", {"model.layers.0.self_attn.kv_scale": 2.0})
    with pytest.raises(ValueError, match="deprecated kv_scale"):
        load_amax_source({"from": "checkpoint", "path": str(kv)})
    none = _export(tmp_path / "e", {})
    with pytest.raises(ValueError, match="no ModelOpt KV scale"):
        load_amax_source({"from": "checkpoint", "path": str(none)})
    with pytest.raises(ValueError, match=r"calibration\.path: no such file"):
        load_amax_source({"from": "checkpoint", "path": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=r"calibration\.path: the served model's path"):
        load_amax_source({"from": "checkpoint"})


def test_modelopt_state_vllm_plugin_and_hf_names(tmp_path: Path) -> None:
    """vLLM-plugin names give prefill Q and the decode row; HF names prefill Q, K, V.

    Two rank files merge by max; a per-channel amax counts by its largest entry.
    """
    rank0 = {
        f"{LAYER0}.q_bmm_quantizer._amax": torch.tensor(3.0),
        f"{LAYER0}.kv_c_bmm_quantizer._amax": torch.tensor([2.0]),
        f"{LAYER0}.k_pe_bmm_quantizer._amax": torch.tensor(5.0),
        "model.layers.0.mlp.down_proj.input_quantizer._amax": torch.tensor(99.0),
        "model.layers.1.self_attn.q_bmm_quantizer._amax": torch.tensor(1.0),
        "model.layers.1.self_attn.k_bmm_quantizer._amax": torch.tensor([0.5, 4.0]),
        "model.layers.1.self_attn.v_bmm_quantizer._amax": torch.tensor(0.75),
    }
    rank1 = {f"{LAYER0}.q_bmm_quantizer._amax": torch.tensor(3.5)}
    torch.save(rank0, tmp_path / "amax_dict_rank0-mp2.pt")
    save_file(rank1, str(tmp_path / "amax_dict_rank1-mp2.safetensors"))
    paths = [
        str(tmp_path / "amax_dict_rank0-mp2.pt"),
        str(tmp_path / "amax_dict_rank1-mp2.safetensors"),
    ]
    cal = load_amax_source({"from": "modelopt", "path": paths})
    assert cal == {
        LAYER0: {"prefill": {"q": 3.5}, "decode": {"k": 5.0, "v": 2.0}},
        LAYER1: {"prefill": {"q": 1.0, "k": 4.0, "v": 0.75}},
    }
    config = MLAQuantConfig.from_obj(
        {
            "recipe": "nvfp4",
            "q": {"format": "nvfp4", "amax": 7.0},
            "calibration": {"from": "modelopt", "path": paths},
        }
    )
    layer0 = config.recipe_for(LAYER0)
    assert (layer0.decode.k.amax, layer0.decode.v.amax) == (5.0, 2.0)
    assert layer0.prefill.q.amax == 7.0  # the recipe's own amax wins over the source


def test_modelopt_state_errors(tmp_path: Path) -> None:
    bad = tmp_path / "deepseek.pt"
    torch.save({"layers.0.attn.kv_bmm_quantizer._amax": torch.tensor(1.0)}, bad)
    with pytest.raises(ValueError, match="DeepSeek's own inference code"):
        load_amax_source({"from": "modelopt", "path": str(bad)})
    empty = tmp_path / "empty.pt"
    torch.save({"model.layers.0.mlp.input_quantizer._amax": torch.tensor(1.0)}, empty)
    with pytest.raises(ValueError, match="no attention quantizer amax"):
        load_amax_source({"from": "modelopt", "path": str(empty)})
    zero = tmp_path / "zero.pt"
    torch.save({f"{LAYER0}.kv_c_bmm_quantizer._amax": torch.tensor(0.0)}, zero)
    with pytest.raises(ValueError, match="positive finite"):
        load_amax_source({"from": "modelopt", "path": str(zero)})
    text = tmp_path / "notes.pt"
    text.write_text("not a torch file")
    with pytest.raises(ValueError, match=r"cannot read .* torch\.load"):
        load_amax_source({"from": "modelopt", "path": str(text)})
    with pytest.raises(MLAQuantConfigError, match=r"mla_quant\.calibration\.from: expected one of"):
        MLAQuantConfig.from_obj({"recipe": "fp8", "calibration": {"from": "hub"}})
    with pytest.raises(MLAQuantConfigError, match=r"mla_quant\.calibration: unknown key"):
        MLAQuantConfig.from_obj({"calibration": {"from": "modelopt", "paths": "x"}})
    with pytest.raises(MLAQuantConfigError, match=r"mla_quant\.calibration\.maxbound: only for"):
        MLAQuantConfig.from_obj(
            {"calibration": {"from": "modelopt", "path": str(zero), "maxbound": 1}}
        )


def _truncated(file: Path, keep: int) -> None:
    """Cut ``file`` to its first ``keep`` bytes (a copy interrupted, a download cut short)."""
    data = file.read_bytes()
    file.write_bytes(data[:keep])


@settings(max_examples=40, deadline=None)
@given(st.floats(0.0, 1.0, exclude_max=True), st.booleans())
def test_a_truncated_safetensors_source_names_the_key_and_the_file(
    fraction: float, named: bool
) -> None:
    """Every cut of a checkpoint's or an amax state's safetensors: a ValueError naming the
    configuration key (``...calibration.path``; ``...calibration`` when the served model's
    path is taken) and the file, never safetensors' own error."""
    with tempfile.TemporaryDirectory() as tmp:
        root = _export(Path(tmp) / "ckpt", {"model.layers.0.self_attn.k_proj.k_scale": 2.5})
        file = root / "model.safetensors"
        _truncated(file, int(fraction * file.stat().st_size))
        spec: dict[str, object] = {"from": "checkpoint"} | ({"path": str(root)} if named else {})
        vllm_config = SimpleNamespace(
            additional_config={"mla_quant": {"recipe": "fp8", "calibration": spec}},
            model_config=SimpleNamespace(model=str(root)),
        )
        key = r"additional_config\.mla_quant\.calibration" + (r"\.path" if named else "")
        with pytest.raises(
            MLAQuantConfigError,
            match=rf"^{key}: cannot read '{re.escape(str(file))}' as safetensors",
        ):
            config_from_vllm(vllm_config)
        state = Path(tmp) / "amax.safetensors"
        save_file({f"{LAYER0}.kv_c_bmm_quantizer._amax": torch.tensor([2.0, 3.0])}, str(state))
        _truncated(state, int(fraction * state.stat().st_size))
        rank0 = Path(tmp) / "rank0.pt"
        torch.save({f"{LAYER0}.q_bmm_quantizer._amax": torch.tensor(3.0)}, rank0)
        with pytest.raises(
            MLAQuantConfigError,
            match=rf"^mla_quant\.calibration\.path\[1\]: cannot read '{re.escape(str(state))}'",
        ):
            MLAQuantConfig.from_obj(
                {"calibration": {"from": "modelopt", "path": [str(rank0), str(state)]}}
            )


@settings(max_examples=40, deadline=None)
@given(st.floats(2.0**-20, 1.0, width=32))
def test_fp8_scales_at_or_below_the_floor_are_refused_with_the_reason(scale: float) -> None:
    """ModelOpt's FP8 export writes max(amax / 448, 1): a scale of 1.0 or less holds no
    amax. The message says what the floor is, why it loses the amax, and what to use."""
    key = "model.layers.0.self_attn.k_proj.k_scale"
    with tempfile.TemporaryDirectory() as tmp:
        root = _export(Path(tmp), {key: scale})
        stored = float(torch.tensor(scale, dtype=torch.float32))
        with pytest.raises(MLAQuantConfigError) as info:
            MLAQuantConfig.from_obj({"calibration": {"from": "checkpoint", "path": str(root)}})
    message = str(info.value)
    assert message.startswith(f"mla_quant.calibration: 1 FP8 KV scale(s) of 1.0 or less ('{key}'")
    assert f"= {stored:g}" in message
    for part in ("max(amax / 448, 1.0)", "every amax up to 448", "the calibrated amax is lost"):
        assert part in message  # what the floor is and why it holds no amax
    for part in ('{"from": "modelopt"', "mla_vllm.calibrate()", '"amax"'):
        assert part in message  # what to use instead


@settings(max_examples=30, deadline=None)
@given(st.floats(1.0, 2.0**100, exclude_min=True, width=32))
def test_fp8_scales_above_the_floor_give_scale_times_448(scale: float) -> None:
    key = "model.layers.0.self_attn.v_proj.v_scale"
    with tempfile.TemporaryDirectory() as tmp:
        cal = load_amax_source(
            {"from": "checkpoint", "path": str(_export(Path(tmp), {key: scale}))}
        )
    stored = float(torch.tensor(scale, dtype=torch.float32))
    assert cal[LAYER0]["prefill"]["v"] == pytest.approx(stored * 448.0, rel=1e-6)
