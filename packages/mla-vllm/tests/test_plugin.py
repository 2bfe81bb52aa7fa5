"""Registration through vLLM's plugin loader, and the serve command's arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALL, make_vllm_config, model_dir

pytestmark = pytest.mark.usefixtures("vllm_process")


def test_entry_point_registers_and_is_reentrant() -> None:
    from importlib.metadata import entry_points

    from vllm.plugins import load_plugins_by_group
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_vllm.backend import MLAQuantBackend
    from mla_vllm.prefill import MLAQuantPrefillBackend

    names = [e.value for e in entry_points(group="vllm.general_plugins")]
    assert "mla_vllm.plugin:register" in names
    plugins = load_plugins_by_group("vllm.general_plugins")
    for _ in range(3):  # vLLM runs it in every process, possibly several times
        for func in plugins.values():
            func()
    assert AttentionBackendEnum["MLA_QUANT"].get_class() is MLAQuantBackend
    assert MLAPrefillBackendEnum["MLA_QUANT"].get_class() is MLAQuantPrefillBackend
    assert MLAQuantBackend.get_name() == "MLA_QUANT"


def test_attention_backend_argument(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mla_vllm.backend import MLAQuantBackend
    from mla_vllm.config import config_from_vllm

    path = model_dir(tmp_path / "m", SMALL)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    quant = {"recipe": "nvfp4", "layers": [{"pattern": "*.0.*", "v": "fp8"}]}
    args = parser.parse_args(
        [
            "--model",
            str(path),
            "--attention-backend",
            "MLA_QUANT",
            "--additional-config",
            json.dumps({"mla_quant": quant}),
        ]
    )
    engine_args = EngineArgs.from_cli_args(args)
    from vllm.config import AttentionConfig

    attention = AttentionConfig(backend=engine_args.attention_backend)
    assert attention.backend is not None
    assert attention.backend.get_class() is MLAQuantBackend
    config = make_vllm_config(tmp_path, SMALL, mla_quant=engine_args.additional_config["mla_quant"])
    recipe = config_from_vllm(config).recipe_for("model.layers.0.self_attn.attn")
    assert recipe.decode.v.format.name == "fp8" and recipe.decode.k.format.name == "nvfp4"


def test_bad_additional_config_fails_before_the_model(tmp_path: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant={"k": {"format": "nvfp4", "amax": 0}})
    with set_current_vllm_config(config):
        kv_b = ColumnParallelLinear(256, 16 * 128, bias=False)
        with pytest.raises(ValueError, match=r"^additional_config\.mla_quant\.k\.amax: "):
            MLAAttention(
                num_heads=16,
                scale=0.1,
                qk_nope_head_dim=64,
                qk_rope_head_dim=64,
                v_head_dim=64,
                q_lora_rank=None,
                kv_lora_rank=256,
                kv_b_proj=kv_b,
                prefix="l.attn",
                attn_backend=MLAQuantBackend,
            )


def test_backend_selection_refuses_what_it_cannot_serve() -> None:
    import torch
    from vllm.platforms.interface import DeviceCapability

    from mla_vllm.backend import MLAQuantBackend

    common: dict[str, object] = {
        "head_size": 576,
        "dtype": torch.bfloat16,
        "block_size": 64,
        "use_mla": True,
        "has_sink": False,
        "use_mm_prefix": False,
        "use_per_head_quant_scales": False,
        "device_capability": DeviceCapability(9, 0),
        "attn_type": "decoder",
    }
    assert (
        MLAQuantBackend.validate_configuration(kv_cache_dtype="auto", use_sparse=False, **common)
        == []
    )
    reasons = MLAQuantBackend.validate_configuration(
        kv_cache_dtype="fp8", use_sparse=True, use_dcp=True, **common
    )
    text = " ".join(reasons)
    assert "sparse" in text and "decode context parallelism" in text and "fp8" in text
