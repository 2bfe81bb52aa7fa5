"""Real vLLM 0.33 objects on CPU: a config, MLA layers, a metadata builder, batches.

The environment is fixed before vLLM or Triton is imported: vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``: the CUDA wheel's GPU platform cannot be detected
here), no visible GPU, and Triton's interpreter for the kernels. Inputs are
float16 (the interpreter computes bfloat16 wrongly).

Nothing of vLLM is stubbed: the layers are ``MLAAttention`` built by vLLM, the
metadata comes from the backend's own builder, and the forward pass goes
through ``MLAAttention.forward`` under vLLM's forward context.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest
import torch

import mla_reference

DTYPE = torch.float16
PAGE = 16


@dataclass(frozen=True)
class Dims:
    """A small DeepSeek-style attention: the decode head is 256 + 64 = 320."""

    heads: int = 16
    kv_lora_rank: int = 256
    rope: int = 64
    nope: int = 64
    v: int = 64

    @property
    def qk(self) -> int:
        return self.nope + self.rope


SMALL = Dims()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_dir(root: Path, dims: Dims, layers: int = 2) -> Path:
    """A local DeepSeek-V2 config (no hub): dense layers only."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.heads,
        "kv_lora_rank": dims.kv_lora_rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": dims.nope,
        "qk_rope_head_dim": dims.rope,
        "v_head_dim": dims.v,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "first_k_dense_replace": layers,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="session")
def vllm_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's single-rank distributed state (gloo), set up once per test process."""
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    from mla_vllm.plugin import register

    register()
    config = make_vllm_config(tmp_path_factory.mktemp("base"), SMALL)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        initialize_model_parallel(1, 1)


def make_vllm_config(
    root: Path,
    dims: Dims,
    *,
    mla_quant: object = None,
    kv_cache_dtype: str = "auto",
    max_model_len: int = 512,
) -> Any:
    """A real ``VllmConfig`` for the local model, with ``mla_quant`` in additional_config."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    path = model_dir(root / "model", dims)
    model = ModelConfig(
        model=str(path), skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
    )
    extra = {} if mla_quant is None else {"mla_quant": mla_quant}
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=PAGE, cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_model_len,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        additional_config=extra,
    )


@dataclass
class Model:
    """MLA layers built by vLLM for one config, with their weights and cache."""

    config: Any
    dims: Dims
    layers: dict[str, Any]
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    builder: Any = None


def build_model(
    config: Any,
    dims: Dims,
    backend: type,
    *,
    num_layers: int = 2,
    seed: int = 0,
    num_blocks: int = 48,
    **layer_kwargs: Any,
) -> Model:
    """``num_layers`` real ``MLAAttention`` layers on ``backend`` with seeded weights."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from mla_vllm.backend import MLAQuantBackend

    gen = torch.Generator().manual_seed(seed)
    layers: dict[str, Any] = {}
    old_default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with set_current_vllm_config(config):
            for i in range(num_layers):
                prefix = f"model.layers.{i}.self_attn"
                kv_b = ColumnParallelLinear(
                    dims.kv_lora_rank,
                    dims.heads * (dims.nope + dims.v),
                    bias=False,
                    prefix=f"{prefix}.kv_b_proj",
                )
                with torch.no_grad():
                    w = torch.randn(kv_b.weight.shape, generator=gen) / dims.kv_lora_rank**0.5
                    kv_b.weight.copy_(w.to(DTYPE))
                kv_b.quant_method.process_weights_after_loading(kv_b)
                prefill_cls = None if backend is MLAQuantBackend else CPUSDPAMLAPrefillBackend
                layer = MLAAttention(
                    num_heads=dims.heads,
                    scale=dims.qk**-0.5,
                    qk_nope_head_dim=dims.nope,
                    qk_rope_head_dim=dims.rope,
                    v_head_dim=dims.v,
                    q_lora_rank=None,
                    kv_lora_rank=dims.kv_lora_rank,
                    kv_b_proj=kv_b,
                    cache_config=config.cache_config,
                    prefix=f"{prefix}.attn",
                    attn_backend=backend,
                    prefill_backend_cls=prefill_cls,
                    **layer_kwargs,
                )
                layer.process_weights_after_loading(DTYPE)
                layers[layer.layer_name] = layer
    finally:
        torch.set_default_dtype(old_default)
    model = Model(config, dims, layers)
    for name, layer in layers.items():
        cache = torch.full(
            (num_blocks, PAGE, dims.kv_lora_rank + dims.rope), float("nan"), dtype=DTYPE
        )
        layer.bind_kv_cache(cache)
        model.caches[name] = cache
    return model


def make_builder(model: Model) -> Any:
    """The layers' own backend builder (binds ``mla_quant`` for MLA_QUANT layers)."""
    from vllm.config import set_current_vllm_config

    first = next(iter(model.layers.values()))
    spec = first.get_kv_cache_spec(model.config)
    builder_cls = first.attn_backend.get_builder_cls()
    with set_current_vllm_config(model.config):
        model.builder = builder_cls(spec, list(model.layers), model.config, torch.device("cpu"))
    return model.builder


@dataclass
class Batch:
    """One scheduler step: requests as (context tokens already cached, new tokens)."""

    requests: Sequence[tuple[int, int]]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def slots_of(table: Sequence[Sequence[int]], requests: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The cache slots of each request's new tokens, ``[num_new_tokens]`` int64."""
    slots = [
        int(table[r][pos // PAGE]) * PAGE + pos % PAGE
        for r, (c, q) in enumerate(requests)
        for pos in range(c, c + q)
    ]
    return torch.tensor(slots, dtype=torch.int64)


def common_metadata(
    requests: Sequence[tuple[int, int]],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    max_seq_len: int | None = None,
) -> Any:
    """vLLM's ``CommonAttentionMetadata`` of ``requests`` (context, new tokens): block table
    ``[R, W]``, slots of the new tokens; ``max_seq_len`` defaults to the longest request."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in requests]), 0)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=len(requests),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q for _, q in requests),
        max_seq_len=int(seq_lens.max()) if max_seq_len is None else max_seq_len,
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        is_prefilling=torch.tensor([q > 1 for _, q in requests]),
    )


def make_batch(
    model: Model,
    requests: Sequence[tuple[int, int]],
    seed: int = 1,
    table: Sequence[Sequence[int]] | None = None,
) -> Batch:
    """Block tables (given, or over shuffled pages with page 0 unused), slots of the new
    tokens, metadata."""
    if table is None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = next(iter(model.caches.values())).shape[0]
        pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        table = [[pages.pop() for _ in range(-(-(c + q) // PAGE))] for c, q in requests]
    width = max(len(row) for row in table)
    padded = [[*row] + [0] * (width - len(row)) for row in table]
    block_table = torch.tensor(padded, dtype=torch.int32)
    slot_mapping = slots_of(table, requests)
    common = common_metadata(requests, block_table, slot_mapping)
    batch = Batch(requests, block_table, common.seq_lens, common.query_start_loc, slot_mapping)
    batch.metadata = model.builder.build(0, common)
    return batch


def fill_context(model: Model, batch: Batch, latents: dict[str, torch.Tensor]) -> None:
    """Write each request's context rows (``latents[name] [R, L, 576]``) into the cache."""
    for name, cache in model.caches.items():
        for r, (c, _) in enumerate(batch.requests):
            for pos in range(c):
                cache[int(batch.block_table[r, pos // PAGE]), pos % PAGE] = latents[name][r, pos]


def random_context(model: Model, batch: Batch, seed: int) -> dict[str, torch.Tensor]:
    """Seeded latent rows ``[R, max context + 1, L + rope]`` per layer, written as context."""
    dims = model.dims
    gen = torch.Generator().manual_seed(seed)
    longest = max(c for c, _ in batch.requests) + 1
    latents = {
        name: (
            torch.randn(len(batch.requests), longest, dims.kv_lora_rank + dims.rope, generator=gen)
            * 0.5
        ).to(DTYPE)
        for name in model.layers
    }
    fill_context(model, batch, latents)
    return latents


def layer_inputs(
    dims: Dims, tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [T, H, qk]``, ``kv_c [T, L]``, ``k_pe [T, 1, rope]`` of ``tokens`` new tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, dims.heads, dims.qk, generator=gen).to(DTYPE)
    kv_c = (torch.randn(tokens, dims.kv_lora_rank, generator=gen) * 0.5).to(DTYPE)
    k_pe = torch.randn(tokens, 1, dims.rope, generator=gen).to(DTYPE)
    return q, kv_c, k_pe


def up_project(layer: Any, latent: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[S, H, qk]`` and V ``[S, H, v]`` of latent rows ``[S, L + rope]``."""
    kv = (latent[:, : dims.kv_lora_rank].float() @ layer.kv_b_proj.weight.float().T).to(DTYPE)
    kv = kv.view(-1, dims.heads, dims.nope + dims.v)
    k_pe = latent[:, None, dims.kv_lora_rank :].expand(-1, dims.heads, -1)
    k = torch.cat([kv[..., : dims.nope], k_pe], dim=-1)
    return k, kv[..., dims.nope :]


def expected_output(
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
        k, v = up_project(layer, full, dims)
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


def forward(
    model: Model, batch: Batch, name: str, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
) -> torch.Tensor:
    """``MLAAttention.forward`` of layer ``name`` under vLLM's forward context."""
    from vllm.forward_context import set_forward_context

    layer = model.layers[name]
    metadata = dict.fromkeys(model.layers, batch.metadata)
    slots = dict.fromkeys(model.layers, batch.slot_mapping)
    with set_forward_context(metadata, model.config, slot_mapping=slots):
        out: torch.Tensor = layer.forward(
            q, kv_c, k_pe, output_shape=torch.Size((q.shape[0], model.dims.heads * model.dims.v))
        )
    return out


def _concat_and_cache_mla_cpu(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    skip_scale: bool = False,
) -> None:
    """What vLLM's CUDA ``concat_and_cache_mla`` does for an unquantized cache."""
    assert kv_cache_dtype == "auto"
    slots = slot_mapping.flatten()
    keep = slots >= 0
    slots = slots[keep].long()
    rank = kv_c.shape[-1]
    kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1], :rank] = kv_c[keep]
    kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1], rank:] = k_pe[keep]


@pytest.fixture
def cpu_cache_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA wheel has no CPU build of ``concat_and_cache_mla``, which the native
    TRITON_MLA impl calls to write its cache; this puts an equivalent in its place
    (MLA_QUANT's own impl writes CPU caches itself)."""
    import vllm._custom_ops as ops

    monkeypatch.setattr(ops, "concat_and_cache_mla", _concat_and_cache_mla_cpu)
