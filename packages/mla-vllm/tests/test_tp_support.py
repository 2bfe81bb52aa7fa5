"""Tensor parallelism: quantizing H heads equals quantizing each rank's H/TP heads.

vLLM's tensor parallelism gives each rank a contiguous slice of the query heads
(``kv_b_proj`` is column-parallel: rows by heads) and the whole latent cache. SPEC
2 requires that no scale depends on how heads are split. Here one MLA_QUANT layer
with 16 heads and two layers with 8 heads each (the two ranks of TP=2: their
``kv_b_proj`` rows are the full layer's, sliced by heads) run the same step
(decodes, a prefill with context, a prefill without) through vLLM's real
``MLAAttention.forward``: the two halves' outputs, side by side, must equal the
full layer's output bit for bit, for quant none, fp8 and nvfp4.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import (
    DTYPE,
    SMALL,
    Model,
    build_model,
    fill_context,
    forward,
    make_batch,
    make_builder,
    make_vllm_config,
)

pytestmark = pytest.mark.usefixtures("vllm_process")

TP = 2
# Two decodes, a prefill over a cached context, a prefill without context.
REQUESTS = [(37, 1), (5, 1), (16, 9), (0, 13)]


def _model(root: Path, mla_quant: object, heads: int, kv_b: torch.Tensor) -> Model:
    """One MLA_QUANT layer with ``heads`` heads and the given ``kv_b_proj`` weight."""
    from mla_vllm.backend import MLAQuantBackend

    dims = replace(SMALL, heads=heads)
    config = make_vllm_config(root, dims, mla_quant=mla_quant)
    model = build_model(config, dims, MLAQuantBackend, num_layers=1)
    layer = next(iter(model.layers.values()))
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(kv_b)
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        layer.process_weights_after_loading(DTYPE)  # W_UK_T / W_UV from the new kv_b_proj
    finally:
        torch.set_default_dtype(old)
    make_builder(model)
    return model


@pytest.mark.parametrize(
    "mla_quant", [None, {"recipe": "fp8"}, {"recipe": "nvfp4"}], ids=["none", "fp8", "nvfp4"]
)
def test_head_split_is_exact(tmp_path: Path, mla_quant: object) -> None:
    dims = SMALL
    gen = torch.Generator().manual_seed(7)
    rows = dims.nope + dims.v  # kv_b_proj rows per head
    kv_b = (torch.randn(dims.heads * rows, dims.kv_lora_rank, generator=gen) * 0.06).to(DTYPE)
    full = _model(tmp_path / "full", mla_quant, dims.heads, kv_b)
    local = dims.heads // TP
    ranks = [
        _model(
            tmp_path / f"rank{r}", mla_quant, local, kv_b[r * local * rows : (r + 1) * local * rows]
        )
        for r in range(TP)
    ]
    latent = (
        torch.randn(
            len(REQUESTS),
            max(c for c, _ in REQUESTS) + 1,
            dims.kv_lora_rank + dims.rope,
            generator=gen,
        )
        * 0.5
    ).to(DTYPE)
    tokens = sum(n for _, n in REQUESTS)
    q = torch.randn(tokens, dims.heads, dims.qk, generator=gen).to(DTYPE)
    kv_c = (torch.randn(tokens, dims.kv_lora_rank, generator=gen) * 0.5).to(DTYPE)
    k_pe = torch.randn(tokens, 1, dims.rope, generator=gen).to(DTYPE)
    outputs: list[torch.Tensor] = []
    for r, model in enumerate([full, *ranks], start=-1):  # r = -1: the full layer
        batch = make_batch(model, REQUESTS, seed=3)  # same pages, slots and metadata
        assert batch.num_tokens == tokens
        name = next(iter(model.layers))
        fill_context(model, batch, {name: latent})
        heads = model.dims.heads
        q_local = q if r < 0 else q[:, r * heads : (r + 1) * heads].contiguous()
        outputs.append(forward(model, batch, name, q_local, kv_c, k_pe))
        state = model.layers[name].impl.mla_layer
        want = "none" if not isinstance(mla_quant, dict) else mla_quant["recipe"]
        assert state.recipe.decode.q.format.name == want
    whole = outputs[0].view(tokens, dims.heads, dims.v)
    split = torch.cat([o.view(tokens, local, dims.v) for o in outputs[1:]], dim=1)
    assert torch.isfinite(whole).all()
    assert torch.equal(split, whole), (
        f"max |Δ| {(split.float() - whole.float()).abs().max().item():.3e} between the "
        f"{TP} ranks' heads and the full layer's"
    )
