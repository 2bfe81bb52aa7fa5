"""Adds ``MLA_QUANT`` to the backends of vLLM 0.33.0's own MLA correctness tests.

vLLM's ``tests/v1/attention/_mla_backends.py`` runs every backend of its
``BACKENDS_TO_TEST`` on the same batch (mixed prefill/decode, chunked context,
block tables padded as for CUDA graphs) and compares each with one SDPA reference
at the same tolerances. This plugin changes no upstream file: before the upstream
test modules are collected it

- registers ``MLA_QUANT`` (our ``vllm.general_plugins`` entry point does the same)
  and ``MLA_QUANT_SHADOW``, a second name for the same backend class;
- appends both to ``BACKENDS_TO_TEST``, with their block size and spec-decode
  support derived as upstream derives them for its own backends;
- wraps ``run_attention_backend`` so that each of our names sees its ``mla_quant``
  configuration in ``additional_config`` (``VARIANTS``) and every other backend
  sees none;
- with ``MLA_BACKENDS`` (comma-separated enum names) keeps only those backends;
- with ``HF_HUB_OFFLINE=1`` and no cached config, answers the test's hub model
  ``deepseek-ai/DeepSeek-R1`` from a local config of the same attention shape;
- skips every upstream case on a machine without CUDA, saying so.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
SUITES = ("tests/v1/attention/mla/correctness",)
"""The upstream folders collected; the rest of vLLM's tests/ is ignored."""

VARIANTS: dict[str, dict[str, str]] = {
    "MLA_QUANT": {"recipe": "none", "kv_path": "on_read"},
    "MLA_QUANT_SHADOW": {"recipe": "none", "kv_path": "shadow"},
}
"""Backend enum name -> the ``additional_config["mla_quant"]`` it runs with."""

HUB_MODEL = "deepseek-ai/DeepSeek-R1"
HUB_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""The attention shape of ``HUB_MODEL`` (what the tests read from it), for offline runs."""

_HUB_REVISION = "0" * 40


def _present() -> bool:
    return all((UPSTREAM / suite).is_dir() for suite in SUITES)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect only ``SUITES`` (and the folders above them) of the upstream tree."""
    path = Path(collection_path).resolve()
    if path == UPSTREAM or UPSTREAM not in path.parents:
        return None
    rel = path.relative_to(UPSTREAM).as_posix()
    for suite in SUITES:
        if rel == suite or rel.startswith(suite + "/") or suite.startswith(rel + "/"):
            return None
    if path.is_file() and path.name == "conftest.py":
        return None
    return True


def _stub_hub_config() -> None:
    """Offline only: a cached ``config.json`` for ``HUB_MODEL`` where none is cached."""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("1", "true", "True", "YES", "yes"):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(HUB_MODEL, "config.json"), str):
        return
    repo = Path(constants.HF_HUB_CACHE) / ("models--" + HUB_MODEL.replace("/", "--"))
    snapshot = repo / "snapshots" / _HUB_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(HUB_CONFIG))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_HUB_REVISION)


def _block_size(backend: Any) -> int:
    """The kernel block size the upstream module gives its own backends."""
    sizes = backend.get_class().get_supported_kernel_block_sizes()
    if not sizes:
        return 16
    return sizes[0] if isinstance(sizes[0], int) else int(sizes[0].base)


def _with_mla_quant(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run_attention_backend`` with each backend's own ``additional_config``."""
    signature = inspect.signature(run)

    def run_attention_backend(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        backend = bound.arguments["backend"]
        vllm_config = bound.arguments["vllm_config"]
        saved = vllm_config.additional_config
        extra = dict(saved or {})
        extra.pop("mla_quant", None)
        if backend.name in VARIANTS:
            extra["mla_quant"] = dict(VARIANTS[backend.name])
        vllm_config.additional_config = extra
        try:
            return run(*args, **kwargs)
        finally:
            vllm_config.additional_config = saved

    return run_attention_backend


def _add_mla_quant() -> None:
    """Register our backend names and put them into the upstream module's lists."""
    sys.path.insert(0, str(UPSTREAM))
    _stub_hub_config()
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from mla_vllm.plugin import BACKEND_CLASS_PATH, register

    register()
    for name in VARIANTS:
        if name in AttentionBackendEnum.__members__:
            register_backend(AttentionBackendEnum[name], BACKEND_CLASS_PATH)
        else:
            register_backend(name, BACKEND_CLASS_PATH)

    import tests.v1.attention._mla_backends as upstream

    for name in VARIANTS:
        backend = AttentionBackendEnum[name]
        if backend in upstream.BACKENDS_TO_TEST:
            continue
        upstream.BACKENDS_TO_TEST.append(backend)
        upstream.BACKEND_BLOCK_SIZES[backend] = _block_size(backend)
        builder_cls, _ = upstream.try_get_attention_backend(backend)
        support = getattr(builder_cls, "query_len_support", QueryLenSupport.SINGLE_ONLY)
        if support != QueryLenSupport.SINGLE_ONLY:
            upstream.SPEC_DECODE_BACKENDS.append(backend)
    keep = os.environ.get("MLA_BACKENDS", "").strip()
    if keep:
        names = {name.strip() for name in keep.split(",") if name.strip()}
        upstream.BACKENDS_TO_TEST[:] = [b for b in upstream.BACKENDS_TO_TEST if b.name in names]
    upstream.run_attention_backend = _with_mla_quant(upstream.run_attention_backend)


def pytest_configure(config: pytest.Config) -> None:
    if _present():
        _add_mla_quant()


def pytest_report_header(config: pytest.Config) -> str:
    if not _present():
        return "MLA_QUANT: vLLM's tests/ not in tests-vllm-backends/upstream/ (README.md)"
    import tests.v1.attention._mla_backends as upstream

    names = ", ".join(b.name for b in upstream.BACKENDS_TO_TEST)
    return f"MLA backends under test (each case runs every one): {names}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="vLLM's MLA backend correctness tests need a CUDA GPU")
    for item in items:
        if UPSTREAM in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
