"""``kv_path: "shadow"``: the write-once K/V shadow inside vLLM's own KV-cache blocks.

The caches here are allocated the way a vLLM worker allocates them: the layers'
specs through the backend's ``customize_spec``, groups and block counts from
vLLM's planner, one backing buffer viewed per layer by ``allocate_kv_cache`` and
bound with ``MLAAttention.bind_kv_cache``. Tokens are written through the impl's
``do_kv_cache_update`` (the call vLLM makes before attention), never by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    DTYPE,
    PAGE,
    SMALL,
    Batch,
    Model,
    build_model,
    forward,
    make_batch,
    make_builder,
    make_vllm_config,
    slots_of,
)

from mla_vllm.config import MLAQuantConfigError, load_config

pytestmark = pytest.mark.usefixtures("vllm_process")

RAW = SMALL.kv_lora_rank + SMALL.rope  # 320 elements, 640 bytes per token in float16
NVFP4_SHADOW = {"recipe": "nvfp4", "kv_path": "shadow"}
NUM_BLOCKS = 40  # max_model_len 512 needs 32 blocks of 16 per request, plus the null block


# ------------------------------------------------------------------ helpers


def _specs(model: Model) -> dict[str, Any]:
    """Each layer's KV cache spec as a vLLM worker makes it (``get_kv_cache_spec``)."""
    from vllm.v1.worker.utils import customize_attention_spec

    return {
        name: customize_attention_spec(
            layer.get_attn_backend(), layer.get_kv_cache_spec(model.config)
        )
        for name, layer in model.layers.items()
    }


def _allocate(model: Model, num_blocks: int = NUM_BLOCKS) -> Any:
    """vLLM's planner and allocator on CPU; binds the views to the layers. Returns the config."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache

    from mla_vllm.backend import MLAQuantBackend

    with set_current_vllm_config(model.config):  # this model's, whatever was built last
        specs = _specs(model)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([MLAQuantBackend])]
    layout = resolve_kv_cache_layout(model.config, [layouts], specs.values())  # engine core
    page = next(iter(specs.values())).page_size_bytes
    groups = get_global_kv_cache_groups(model.config, [specs])
    (kv_config,) = get_kv_cache_configs(
        model.config, [specs], [num_blocks * page * len(specs)], groups
    )
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    for name, layer in model.layers.items():
        layer.bind_kv_cache(caches[name])
        cache = layer.kv_cache
        cache[..., :RAW] = float("nan")  # raw slots never written must never be read
        cache[..., RAW:].view(torch.uint8).fill_(0xFF)
        model.caches[name] = cache
    return kv_config


def _model(tmp_path: Path, mla_quant: object, num_layers: int = 1) -> Model:
    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant=mla_quant)
    model = build_model(config, SMALL, MLAQuantBackend, num_layers=num_layers, num_blocks=1)
    make_builder(model)
    _allocate(model)
    return model


def _metadata(model: Model, table: list[list[int]], requests: list[tuple[int, int]]) -> Any:
    """The builder's metadata for requests (context, new tokens) on explicit block tables."""
    return make_batch(model, requests, table=table).metadata


def _latents(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv_c = (torch.randn(tokens, SMALL.kv_lora_rank, generator=gen) * 0.5).to(DTYPE)
    k_pe = torch.randn(tokens, 1, SMALL.rope, generator=gen).to(DTYPE)
    return kv_c, k_pe


def _write(
    model: Model, table: list[list[int]], requests: list[tuple[int, int]], seed: int
) -> None:
    """Write each request's tokens ``c .. c + n`` through every layer's ``do_kv_cache_update``."""
    slots = slots_of(table, requests)
    for i, (name, layer) in enumerate(model.layers.items()):
        kv_c, k_pe = _latents(slots.shape[0], seed + i)
        scale = torch.ones((), dtype=torch.float32)
        layer.impl.do_kv_cache_update(kv_c, k_pe, model.caches[name], slots, "auto", scale)


def _decode_q(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(rows, SMALL.heads, SMALL.kv_lora_rank, generator=gen).to(DTYPE)
    q_pe = torch.randn(rows, SMALL.heads, SMALL.rope, generator=gen).to(DTYPE)
    return q_nope, q_pe


def _impl_decode(
    model: Model, name: str, table: list[list[int]], seq_lens: list[int], seed: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_mqa`` of the real impl for one decode row per request, and the on-read
    ``mla_triton.decode`` of the same rows on the same raw cache (the layer's recipe)."""
    from mla_triton import decode

    layer = model.layers[name]
    impl = layer.impl
    requests = [(n - 1, 1) for n in seq_lens]
    metadata = _metadata(model, table, requests)
    assert metadata.num_decodes == len(requests)
    q = _decode_q(len(requests), seed)
    got, _ = impl.forward_mqa(q, layer.kv_cache, metadata, layer)
    raw = layer.kv_cache[..., :RAW]
    want, _ = decode(
        q,
        raw,
        metadata.decode.block_table,
        metadata.decode.seq_lens,
        softmax_scale=impl.scale,
        kv_lora_rank=SMALL.kv_lora_rank,
        quant=impl.mla_layer.recipe.decode,
    )
    return got, want


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bitwise-equal operands; float32 summation order differs between the tile configs
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------------ configuration


def test_config_switch_and_errors() -> None:
    assert load_config(None).kv_path == "on_read"
    config = load_config(NVFP4_SHADOW)
    assert (config.kv_path, config.shadow_storage) == ("shadow", "fp16")
    assert load_config({**NVFP4_SHADOW, "shadow_storage": "fp16"}).shadow_storage == "fp16"
    dynamic_k = load_config({**NVFP4_SHADOW, "k": {"format": "nvfp4", "amax": "dynamic"}})
    assert dynamic_k.recipe_for("x").decode.k.is_dynamic
    bad = [
        ({"kv_path": "cached"}, r"mla_quant\.kv_path: expected one of \['on_read', 'shadow'\]"),
        ({"shadow_storage": "fp16"}, r"mla_quant\.shadow_storage: only used with kv_path"),
        ({"kv_path": "shadow", "shadow_storage": "fp4"}, r"mla_quant\.shadow_storage: expected"),
        (
            {"kv_path": "shadow", "layers": [{"pattern": "*", "kv_path": "on_read"}]},
            r"mla_quant\.layers\[0\]\.kv_path: the KV path is global",
        ),
        (
            {"kv_path": "shadow", "layers": [{"pattern": "*", "shadow_storage": "fp16"}]},
            r"mla_quant\.layers\[0\]\.shadow_storage: the KV path is global",
        ),
        (
            {"kv_path": "shadow", "v": {"format": "nvfp4", "amax": "dynamic"}},
            r"mla_quant\.v\.amax: a dynamic amax is only defined for q and k",
        ),
    ]
    for obj, message in bad:
        with pytest.raises(MLAQuantConfigError, match=message):
            load_config(obj)


def test_install_in_place_refuses_shadow() -> None:
    from mla_vllm.installer import install_model

    with pytest.raises(MLAQuantConfigError, match=r"mla_quant\.kv_path: 'shadow' needs"):
        install_model(torch.nn.Module(), NVFP4_SHADOW)


# ------------------------------------------------------------------ accounting and views


def test_spec_page_size_and_row_split(tmp_path: Path) -> None:
    """The spec declares raw + shadow bytes per token (the largest layout of the layers);
    vLLM's planner counts blocks with it; the impl splits each row into views."""
    from vllm.config import set_current_vllm_config

    from mla_triton import shadow_layout
    from mla_vllm.backend import MLAQuantBackend

    config = {
        **NVFP4_SHADOW,
        "layers": [{"pattern": "*.layers.1.*", "k": {"format": "fp8", "amax": "dynamic"}}],
    }
    model = _model(tmp_path / "shadow", config, num_layers=2)
    names = list(model.layers)
    layouts = {
        name: shadow_layout(
            layer.impl.mla_layer.recipe.decode,
            kv_lora_rank=SMALL.kv_lora_rank,
            rope_dim=SMALL.rope,
            storage="fp16",  # the default shadow_storage
        )
        for name, layer in model.layers.items()
    }
    extra = max(lay.token_bytes for lay in layouts.values())
    assert layouts[names[0]].token_bytes != layouts[names[1]].token_bytes
    # outside vLLM's config context the spec comes from the config the impls noted
    specs = _specs(model)
    with set_current_vllm_config(model.config):
        assert _specs(model) == specs
    for spec in specs.values():
        assert spec.state_content_bytes == 2 * RAW + extra
        assert spec.page_size_bytes == PAGE * (2 * RAW + extra)
    raw_config = make_vllm_config(tmp_path / "raw", SMALL, mla_quant={"recipe": "nvfp4"})
    on_read = build_model(raw_config, SMALL, MLAQuantBackend, num_layers=1, num_blocks=1)
    (raw_spec,) = _specs(on_read).values()
    assert raw_spec.state_content_bytes is None and raw_spec.page_size_bytes == PAGE * 2 * RAW

    kv_config = _allocate(model, num_blocks=NUM_BLOCKS)
    assert kv_config.num_blocks == NUM_BLOCKS  # memory / (layers * raw-and-shadow page)
    for name, layer in model.layers.items():
        cache = layer.kv_cache
        assert cache.dtype == DTYPE and tuple(cache.shape) == (NUM_BLOCKS, PAGE, RAW + extra // 2)
        raw, shadow = layer.impl._split(cache)
        assert tuple(raw.shape) == (NUM_BLOCKS, PAGE, RAW) and raw.stride() == cache.stride()
        assert shadow is not None and shadow.dtype == torch.uint8
        assert tuple(shadow.shape) == (NUM_BLOCKS, PAGE, layouts[name].token_bytes)
        assert shadow.stride()[:2] == (2 * cache.stride(0), 2 * cache.stride(1))
        assert shadow.data_ptr() == raw.data_ptr() + 2 * RAW  # same row, after the latent
    # a block id names raw + shadow: writing block 3 changes nothing outside block 3
    first = model.layers[names[0]]
    before = first.kv_cache.clone()
    _write(model, [[3]], [(0, PAGE)], seed=1)
    after = first.kv_cache
    changed = (before.view(torch.uint8) != after.view(torch.uint8)).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [3]
    _, shadow = first.impl._split(after)
    assert shadow is not None and bool((shadow[3] != 0xFF).any())


def test_cache_without_shadow_bytes_is_refused(tmp_path: Path) -> None:
    model = _model(tmp_path, NVFP4_SHADOW)
    layer = next(iter(model.layers.values()))
    narrow = torch.zeros(4, PAGE, RAW, dtype=DTYPE)
    kv_c, k_pe = _latents(1, 0)
    with pytest.raises(RuntimeError, match=r"kv_path 'shadow': the KV cache of layer"):
        layer.impl.do_kv_cache_update(kv_c, k_pe, narrow, torch.tensor([5]), "auto", torch.ones(()))


# ------------------------------------------------------------------ decode


def test_layer_forward_shadow_equals_on_read(tmp_path: Path) -> None:
    """Two models with the same weights, one per KV path, fed the same tokens through
    ``MLAAttention.forward``: a request grows one token at a time across a 16-token
    V block (15 -> 18 tokens) beside another one; the outputs agree."""
    recipe = {"recipe": "nvfp4", "k": {"format": "nvfp4", "amax": "dynamic"}}
    models = {
        path: _model(tmp_path / path, {**recipe, "kv_path": path}) for path in ("on_read", "shadow")
    }
    layers = {path: next(iter(model.layers.values())) for path, model in models.items()}
    assert layers["on_read"].impl.mla_shadow is None
    assert layers["shadow"].impl.mla_shadow is not None
    table = [[7, 2], [4, 9, 11]]
    context = [(0, 14), (0, 35)]
    for model in models.values():
        _write(model, table, context, seed=20)
    lengths = [14, 35]
    for step in range(3):  # seq lens 15, 16, 17 and 36, 37, 38
        requests = [(n, 1) for n in lengths]
        outs = {}
        for path, model in models.items():
            name = next(iter(model.layers))
            batch = Batch(
                requests, torch.empty(0), torch.empty(0), torch.empty(0), slots_of(table, requests)
            )
            batch.metadata = _metadata(model, table, requests)
            gen = torch.Generator().manual_seed(100 + step)
            q = torch.randn(2, SMALL.heads, SMALL.qk, generator=gen).to(DTYPE)
            kv_c, k_pe = _latents(2, 200 + step)
            outs[path] = forward(model, batch, name, q, kv_c, k_pe)
        _close(outs["shadow"], outs["on_read"])
        lengths = [n + 1 for n in lengths]
    shadow = layers["shadow"]
    _, view = shadow.impl._split(shadow.kv_cache)
    assert view is not None and bool((view[2] != 0xFF).any())  # the shadow was written


def test_prefix_cache_reuse_reads_the_shared_shadow(tmp_path: Path) -> None:
    """Request A writes a 40-token prompt; request B hits A's first two blocks (prefix
    caching hands B the same block ids): B's prefill reads them as context (vLLM's
    chunked-context gather on the raw view of the wide rows) and writes only its own
    17 tokens. Both then decode through the shadow as on read; corrupting a shared
    block's shadow changes what B reads."""
    models = {
        path: _model(tmp_path / path, {"recipe": "nvfp4", "kv_path": path})
        for path in ("on_read", "shadow")
    }
    table_a = [[5, 6, 12]]
    for model in models.values():
        _write(model, table_a, [(0, 40)], seed=30)
    model = models["shadow"]
    name, layer = next(iter(model.layers.items()))
    _, shadow = layer.impl._split(layer.kv_cache)
    assert shadow is not None
    shared = shadow[[5, 6]].clone()
    table_b = [[5, 6, 8, 3]]
    requests = [(32, 17)]  # a prefix hit of 32 tokens, 17 new ones
    outs = {}
    for path, each in models.items():
        batch = Batch(
            requests, torch.empty(0), torch.empty(0), torch.empty(0), slots_of(table_b, requests)
        )
        batch.metadata = _metadata(each, table_b, requests)
        assert batch.metadata.prefill.chunked_context is not None
        gen = torch.Generator().manual_seed(31)
        q = torch.randn(17, SMALL.heads, SMALL.qk, generator=gen).to(DTYPE)
        kv_c, k_pe = _latents(17, 32)
        outs[path] = forward(each, batch, next(iter(each.layers)), q, kv_c, k_pe)
    assert torch.equal(outs["shadow"], outs["on_read"])  # prefill reads the raw rows only
    assert torch.equal(shadow[[5, 6]], shared)  # the reused blocks are untouched
    table = [table_a[0], table_b[0]]
    got, want = _impl_decode(model, name, table, [40, 49])
    _close(got, want)
    shadow[6, 3, :8] ^= 0x11  # a K̂ code of a shared token: B (and A) must see it
    bad, _ = _impl_decode(model, name, table, [40, 49])
    assert not torch.allclose(bad[1].float(), got[1].float(), atol=2e-3, rtol=2e-3)


def test_preempted_request_resumes_with_rewritten_shadow(tmp_path: Path) -> None:
    """Request A (37 tokens) is preempted: its blocks go to request C, which overwrites
    them (and leaves a half-written block); A resumes on other block ids, recomputed
    through ``do_kv_cache_update``, and decodes exactly as before preemption."""
    config = {"recipe": "nvfp4", "v": "fp8", "kv_path": "shadow", "shadow_storage": "fp16"}
    model = _model(tmp_path, config)
    name = next(iter(model.layers))
    table_a = [[3, 10, 14]]
    _write(model, table_a, [(0, 37)], seed=40)
    before, want = _impl_decode(model, name, table_a, [37])
    _close(before, want)
    table_c = [[14, 3, 10]]  # A's blocks, reallocated in another order
    _write(model, table_c, [(0, 41)], seed=41)  # C overwrites them; block 10 half full
    table_a2 = [[10, 17, 3]]  # A resumes: a recycled block, a fresh one, another recycled
    _write(model, table_a2, [(0, 37)], seed=40)  # the same tokens, recomputed
    after, want = _impl_decode(model, name, table_a2, [37])
    _close(after, want)
    assert torch.equal(after, before)
