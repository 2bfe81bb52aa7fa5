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
    fill_context,
    forward,
    make_batch,
    make_builder,
    make_vllm_config,
)

import mla_reference

pytestmark = pytest.mark.usefixtures("vllm_process")

NVFP4 = {"recipe": "nvfp4"}


def _inputs(dims: Dims, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, dims.heads, dims.qk, generator=gen).to(DTYPE)
    kv_c = (torch.randn(tokens, dims.kv_lora_rank, generator=gen) * 0.5).to(DTYPE)
    k_pe = torch.randn(tokens, 1, dims.rope, generator=gen).to(DTYPE)
    return q, kv_c, k_pe


def _quant_model(tmp_path: Path, mla_quant: object, dims: Dims = SMALL, **kw: Any) -> Model:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, dims, mla_quant=mla_quant)
    model = build_model(config, dims, MLAQuantBackend, **kw)
    make_builder(model)
    return model


def _up_project(layer: Any, latent: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[S, H, qk]`` and V ``[S, H, v]`` of latent rows ``[S, L + rope]``."""
    kv = (latent[:, : dims.kv_lora_rank].float() @ layer.kv_b_proj.weight.float().T).to(DTYPE)
    kv = kv.view(-1, dims.heads, dims.nope + dims.v)
    k_pe = latent[:, None, dims.kv_lora_rank :].expand(-1, dims.heads, -1)
    k = torch.cat([kv[..., : dims.nope], k_pe], dim=-1)
    return k, kv[..., dims.nope :]


def _expected(
    model: Model,
    batch: Any,
    name: str,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latents: torch.Tensor,
) -> torch.Tensor:
    """The layer output from mla_reference: decode rows absorbed, prefill rows split
    into the context part (non-causal) and the new tokens (causal), merged by LSE."""
    dims = model.dims
    layer = model.layers[name]
    recipe = layer.impl.mla_layer.recipe
    scale = layer.impl.scale
    out = torch.empty(q.shape[0], dims.heads, dims.v, dtype=torch.float32)
    for r, (c, n) in enumerate(batch.requests):
        t0 = int(batch.query_start_loc[r])
        rows = slice(t0, t0 + n)
        new = torch.cat([kv_c[rows], k_pe[rows, 0]], dim=-1)
        full = torch.cat([latents[r, :c], new])  # [c + n, 576]
        if n <= model.builder.reorder_batch_threshold:  # decode rows: absorbed, causal
            ql = torch.einsum(
                "bhp,hpl->bhl", q[rows, :, : dims.nope].float(), layer.W_UK_T.float()
            ).to(DTYPE)
            cache = full[None]  # one page run holding the whole sequence
            o, _ = mla_reference.decode(
                (ql, q[rows, :, dims.nope :].contiguous()),
                cache,
                torch.zeros(n, 1, dtype=torch.int32),
                torch.arange(c + 1, c + n + 1),
                softmax_scale=scale,
                kv_lora_rank=dims.kv_lora_rank,
                quant=None if recipe.decode.is_identity else recipe.decode,
            )
            out[rows] = torch.einsum("bhl,hlv->bhv", o.float(), layer.W_UV.float())
            continue
        k, v = _up_project(layer, full, dims)
        quant = None if recipe.prefill.is_identity else recipe.prefill
        cu_n = torch.tensor([0, n])
        o_new, lse_new = mla_reference.prefill(
            q[rows],
            k[c:],
            v[c:],
            cu_n,
            cu_n,
            softmax_scale=scale,
            causal=True,
            quant=quant,
            sparsity=recipe.sparsity,
            return_lse=True,
        )
        if c == 0:
            out[rows] = o_new.float()
            continue
        o_ctx, lse_ctx = mla_reference.prefill(
            q[rows],
            k[:c],
            v[:c],
            cu_n,
            torch.tensor([0, c]),
            softmax_scale=scale,
            causal=False,
            quant=quant,
            return_lse=True,
        )
        m = torch.maximum(lse_new, lse_ctx).float()
        w_new = torch.exp(lse_new.float() - m).T[..., None]
        w_ctx = torch.exp(lse_ctx.float() - m).T[..., None]
        out[rows] = (o_new.float() * w_new + o_ctx.float() * w_ctx) / (w_new + w_ctx)
    return out.reshape(q.shape[0], -1)


def _run(model: Model, requests: list[tuple[int, int]], seed: int = 3) -> None:
    """One mixed step through both layers, each compared with the reference."""
    dims = model.dims
    batch = make_batch(model, requests, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    latents = {
        name: (
            torch.randn(
                len(requests),
                max(c for c, _ in requests) + 1,
                dims.kv_lora_rank + dims.rope,
                generator=gen,
            )
            * 0.5
        ).to(DTYPE)
        for name in model.layers
    }
    fill_context(model, batch, latents)
    for i, name in enumerate(model.layers):
        q, kv_c, k_pe = _inputs(dims, batch.num_tokens, seed + 10 * i)
        got = forward(model, batch, name, q, kv_c, k_pe)
        want = _expected(model, batch, name, q, kv_c, k_pe, latents[name])
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

    from mla_vllm.backend import MLAQuantBackend, decode_workspace_bytes

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
