"""MLA_QUANT through real vLLM layers, builder and forward pass, against mla_reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    DTYPE,
    PAGE,
    SMALL,
    Dims,
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

pytestmark = pytest.mark.usefixtures("vllm_process")

NVFP4 = {"recipe": "nvfp4"}


def _quant_model(tmp_path: Path, mla_quant: object, dims: Dims = SMALL, **kw: Any) -> Model:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, dims, mla_quant=mla_quant)
    model = build_model(config, dims, MLAQuantBackend, **kw)
    make_builder(model)
    return model


def _run(model: Model, requests: list[tuple[int, int]], seed: int = 3) -> None:
    """One mixed step through both layers, each compared with the reference."""
    dims = model.dims
    batch = make_batch(model, requests, seed=seed)
    latents = random_context(model, batch, seed)
    for i, name in enumerate(model.layers):
        q, kv_c, k_pe = layer_inputs(dims, batch.num_tokens, seed + 10 * i)
        got = forward(model, batch, name, q, kv_c, k_pe)
        want = expected_output(model, batch, name, q, kv_c, k_pe, latents[name])
        torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)
        # the new latent rows went into the raw cache
        r, (c, _) = len(requests) - 1, requests[-1]
        t = int(batch.query_start_loc[r])
        row = model.caches[name][int(batch.block_table[r, c // PAGE]), c % PAGE]
        assert torch.equal(row, torch.cat([kv_c[t], k_pe[t, 0]]))


def test_decode_and_prefill_nvfp4(tmp_path: Path) -> None:
    model = _quant_model(tmp_path, NVFP4)
    assert all(
        layer.impl.mla_layer.recipe.decode.q.format.name == "nvfp4"
        for layer in model.layers.values()
    )
    # two decodes, then a prefill without context
    _run(model, [(37, 1), (5, 1), (0, 21)])


def test_chunked_context_prefill_fp8_with_sparsity(tmp_path: Path) -> None:
    config = {"recipe": "fp8", "sparsity": {"n": 2, "m": 4, "dense_recent_tokens": 4}}
    model = _quant_model(tmp_path, config)
    # context lengths are multiples of 16, so the new tokens' blocks and N:M groups
    # sit at the same absolute positions as in one pass over the whole sequence
    _run(model, [(3, 1), (32, 9), (16, 20)])


def test_unquantized_matches_reference(tmp_path: Path) -> None:
    model = _quant_model(tmp_path, None)
    assert all(layer.impl.mla_layer.recipe.is_identity for layer in model.layers.values())
    _run(model, [(20, 1), (16, 7)])


def test_multi_token_decode_rows(tmp_path: Path) -> None:
    """Uniform 3-token decode blocks (speculative decoding): one causal row per token."""
    model = _quant_model(tmp_path, {"recipe": "nvfp4", "k": "fp8"}, num_layers=1)
    model.builder.reorder_batch_threshold = 3  # what a speculative config sets
    _run(model, [(40, 3), (9, 3), (16, 12)])


def test_deepseek_dims(tmp_path: Path) -> None:
    """DeepSeek-V3's attention dims: kv_lora_rank 512, rope 64, nope 128, v 128."""
    dims = Dims(kv_lora_rank=512, nope=128, v=128)
    model = _quant_model(tmp_path, NVFP4, dims, num_layers=1)
    _run(model, [(33, 1), (16, 17)])


def test_decode_workspace_comes_from_vllm_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reserved up front by the builder; after the manager locks, decode with several
    splits takes its scratch from it without growing it."""
    import vllm.v1.worker.workspace as workspace

    from mla_vllm.backend import MLAQuantBackend
    from mla_vllm.workspace import decode_workspace_bytes

    monkeypatch.setattr(workspace, "_manager", None)
    workspace.init_workspace_manager(torch.device("cpu"))
    config = make_vllm_config(tmp_path, SMALL, mla_quant=NVFP4, max_model_len=1024)
    model = build_model(config, SMALL, MLAQuantBackend, num_layers=1, num_blocks=64)
    make_builder(model)
    manager = workspace.current_workspace_manager()
    reserved = manager._workspace_size_bytes(manager._current_workspaces[0])
    rows = config.scheduler_config.max_num_seqs
    need = decode_workspace_bytes(rows, SMALL.heads, 1024, SMALL.kv_lora_rank, torch.device("cpu"))
    assert reserved >= need > 0
    manager.lock()
    _run(model, [(700, 1), (5, 1)])  # 701 tokens: two splits, merged through the workspace
    assert manager._workspace_size_bytes(manager._current_workspaces[0]) == reserved


def test_kernel_errors_name_the_layer(tmp_path: Path) -> None:
    """vLLM reports a tensor-parallel worker's error by its message: it must name the layer."""
    model = _quant_model(tmp_path, NVFP4, num_layers=1)
    name, layer = next(iter(model.layers.items()))
    impl = layer.impl
    q = torch.zeros(2, SMALL.heads, SMALL.kv_lora_rank + SMALL.rope, dtype=DTYPE)

    class NoDecode:
        decode = None

    with pytest.raises(ValueError, match=rf"^layer '{name}': attn_metadata\.decode"):
        impl.forward_mqa(q, model.caches[name], NoDecode(), layer)
    prefill = impl.mla_prefill
    prefill.layer = impl.mla_layer
    chunk = type(
        "Chunk",
        (),
        {
            "query_start_loc": torch.tensor([0, 2], dtype=torch.int32),
            "cu_seq_lens": torch.tensor([0, 3], dtype=torch.int32),
            "max_query_len": 2,
            "max_seq_len": 3,
        },
    )()
    k = torch.zeros(3, SMALL.heads, SMALL.qk, dtype=DTYPE)
    v = torch.zeros(3, SMALL.heads, SMALL.v + 1, dtype=DTYPE)  # not a multiple of 16
    with pytest.raises(ValueError, match=rf"^layer '{name}': "):
        prefill.run_prefill_context_chunk(
            chunk, torch.zeros(2, SMALL.heads, SMALL.qk, dtype=DTYPE), k, v
        )
