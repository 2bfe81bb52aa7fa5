"""Adds ``MLA_QUANT`` to the backends of vLLM 0.33.0's own MLA correctness tests.

At vLLM's v0.33.0 tag the MLA backend correctness tests live in
``tests/v1/attention/test_mla_backends.py``: ``test_backend_correctness`` and
``test_chunked_context_backend_correctness`` run every backend of the module's
``BACKENDS_TO_TEST`` on the same batch (mixed prefill/decode, speculative-decode
query lengths, chunked context, block tables padded as for CUDA graphs) and compare
each with one SDPA reference at the same tolerances. This plugin changes no upstream
file. It

- puts ``upstream/`` (vLLM's ``tests`` package) first on ``sys.path`` and
  ``upstream/site/`` (vLLM test requirements that vLLM itself does not install:
  ``tblib``, ``anthropic``) last;
- registers ``MLA_QUANT`` (our ``vllm.general_plugins`` entry point does the same)
  and ``MLA_QUANT_SHADOW``, a second name for the same backend class;
- collects only ``test_mla_backends.py`` of the upstream tree and, of it, only the
  correctness tests (``CASES``);
- in the collected module, appends both names to ``BACKENDS_TO_TEST`` with their
  block size and spec-decode support derived as upstream derives them for its own
  backends, and wraps ``run_attention_backend`` so that each of our names sees its
  ``mla_quant`` configuration in ``additional_config`` (``VARIANTS``) and every
  other backend sees none;
- with ``MLA_BACKENDS`` (comma-separated enum names) keeps only those backends;
- with ``HF_HUB_OFFLINE=1`` and no cached config, answers the tests' hub model
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
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
SITE = UPSTREAM / "site"
"""vLLM test requirements that a vLLM install lacks (``pip install --target``); last on
``sys.path``, so that the install's own packages win."""
SUITE = "tests/v1/attention/test_mla_backends.py"
"""The upstream file collected; the rest of vLLM's tests/ is ignored."""
CASES = ("test_backend_correctness", "test_chunked_context_backend_correctness")
"""The tests of ``SUITE`` kept; its other tests (routing, metadata, ROCm) are deselected."""

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
_PATCHED = "_mla_quant_plugin_applied"
_backends_key = pytest.StashKey[list[str]]()


def _present() -> bool:
    return (UPSTREAM / SUITE).is_file()


def _in_upstream(path: Path) -> bool:
    return UPSTREAM in path.resolve().parents


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect only ``SUITE`` (and the folders above it) of the upstream tree."""
    path = Path(collection_path).resolve()
    if path == UPSTREAM or not _in_upstream(path):
        return None
    rel = path.relative_to(UPSTREAM).as_posix()
    if rel == SUITE or SUITE.startswith(rel + "/"):
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


def _register() -> None:
    """Register ``MLA_QUANT`` (and its prefill backend) and ``MLA_QUANT_SHADOW``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from mla_vllm.plugin import BACKEND_CLASS_PATH, register

    register()
    for name in VARIANTS:
        if name in AttentionBackendEnum.__members__:
            register_backend(AttentionBackendEnum[name], BACKEND_CLASS_PATH)
        else:
            register_backend(name, BACKEND_CLASS_PATH)


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


def _add_mla_quant(module: ModuleType) -> None:
    """Put our backend names into the upstream module's lists (once per module)."""
    if getattr(module, _PATCHED, False):
        return
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in VARIANTS:
        backend = AttentionBackendEnum[name]
        if backend in module.BACKENDS_TO_TEST:
            continue
        module.BACKENDS_TO_TEST.append(backend)
        module.BACKEND_BLOCK_SIZES[backend] = _block_size(backend)
        builder_cls, _ = module.try_get_attention_backend(backend)
        support = getattr(builder_cls, "query_len_support", QueryLenSupport.SINGLE_ONLY)
        if support != QueryLenSupport.SINGLE_ONLY:
            module.SPEC_DECODE_BACKENDS.append(backend)
    keep = os.environ.get("MLA_BACKENDS", "").strip()
    if keep:
        names = {name.strip() for name in keep.split(",") if name.strip()}
        module.BACKENDS_TO_TEST[:] = [b for b in module.BACKENDS_TO_TEST if b.name in names]
    module.run_attention_backend = _with_mla_quant(module.run_attention_backend)
    setattr(module, _PATCHED, True)


def pytest_configure(config: pytest.Config) -> None:
    if not _present():
        return
    if UPSTREAM.is_dir() and str(UPSTREAM) not in sys.path:
        sys.path.insert(0, str(UPSTREAM))
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.append(str(SITE))  # last: only what the vLLM install lacks comes from here
    _stub_hub_config()
    _register()


def pytest_report_header(config: pytest.Config) -> str | None:
    if _present():
        return None
    return "MLA_QUANT: vLLM's tests/ not in tests-vllm-backends/upstream/ (README.md)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep ``CASES`` of the upstream module, add our backends to it, skip without CUDA."""
    import torch

    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    modules: dict[int, ModuleType] = {}
    for item in items:
        if not _in_upstream(Path(str(item.path))):
            kept.append(item)
        elif isinstance(item, pytest.Function) and item.originalname in CASES:
            kept.append(item)
            modules[id(item.module)] = item.module
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    for module in modules.values():
        _add_mla_quant(module)
    config.stash[_backends_key] = sorted(
        {b.name for m in modules.values() for b in m.BACKENDS_TO_TEST},
        key=lambda name: (name in VARIANTS, name),
    )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="vLLM's MLA backend correctness tests need a CUDA GPU")
    for item in items:
        if _in_upstream(Path(str(item.path))):
            # In front: without CUDA upstream collects no prefill backend, and the
            # skip of its empty parameter set would otherwise give the reason.
            item.add_marker(skip, append=False)


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    names = config.stash.get(_backends_key, None)
    if names is None:
        return None
    return f"MLA backends under test (each case runs every one): {', '.join(names) or 'none'}"
