"""The ``MLA_QUANT`` attention backend: vLLM 0.33's TRITON_MLA with quantized attention.

- ``MLAQuantBackend(TritonMLABackend)``: refuses what the kernels cannot serve
  (quantized KV cache, sparse MLA, DCP) at backend selection.
- ``MLAQuantImpl(TritonMLAImpl)``: decode (``forward_mqa``) through
  ``mla_triton.decode`` with its workspace from vLLM's workspace manager; prefill
  (``forward_mha``) through vLLM's own path with ``MLAQuantPrefillBackend``.
- ``MLAQuantMetadataBuilder(TritonMLAMetadataBuilder)``: at construction (after
  the model is loaded, before serving) gates every layer of its group, resolves
  each layer's recipe from ``mla_quant`` and binds it, and reserves the decode
  workspace.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from mla_vllm.config import MLAQuantConfig, load_config
from mla_vllm.gates import check_layers
from mla_vllm.prefill import MLAQuantPrefillBackend
from mla_vllm.shadow import LayerShadow, layer_shadow, note_vllm_config, split_cache
from mla_vllm.state import LayerState, capturing, layer_errors

__all__ = [
    "BACKEND_NAME",
    "MLAQuantBackend",
    "MLAQuantImpl",
    "MLAQuantMetadataBuilder",
    "bind_layers",
    "config_from_vllm",
]

BACKEND_NAME = "MLA_QUANT"
_PRIVATE_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def config_from_vllm(vllm_config: VllmConfig | None) -> MLAQuantConfig:
    """The ``mla_quant`` entry of ``--additional-config`` (a dict or a JSON file path)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("mla_quant") if isinstance(extra, Mapping) else None
    return load_config(raw, where="additional_config.mla_quant")


def _device_for_splits(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def decode_workspace_bytes(
    max_rows: int, num_heads: int, max_seq_len: int, kv_lora_rank: int, device: torch.device
) -> int:
    """Bytes ``mla_triton.decode`` needs for up to ``max_rows`` decode rows."""
    from mla_triton.decode import decode_workspace_size

    return decode_workspace_size(
        max(1, max_rows),
        num_heads,
        max(1, max_seq_len),
        kv_lora_rank=kv_lora_rank,
        device=_device_for_splits(device),
    )


def _workspace(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``nbytes`` of scratch: vLLM's shared workspace, else a private buffer."""
    if nbytes <= 0:
        return None
    if is_workspace_manager_initialized():
        manager = current_workspace_manager()
        try:
            (shared,) = manager.get_simultaneous(((nbytes,), torch.uint8))
        except AssertionError:
            pass  # locked and too small (in-place install after warm-up): private buffer
        else:
            if shared.device == device:
                return shared
    buffer = _PRIVATE_WORKSPACE.get(device)
    if buffer is None or buffer.numel() < nbytes:
        if capturing():
            raise RuntimeError(
                f"mla_vllm: decode workspace of {nbytes} bytes was not reserved before CUDA "
                "graph capture"
            )
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _PRIVATE_WORKSPACE[device] = buffer
    return buffer[:nbytes]


def reserve_decode_workspace(
    vllm_config: VllmConfig, max_rows: int, num_heads: int, kv_lora_rank: int
) -> None:
    """Grow vLLM's shared workspace to the decode worst case (max_model_len) now."""
    if not is_workspace_manager_initialized():
        return
    manager = current_workspace_manager()
    device = (
        manager._device
        if isinstance(getattr(manager, "_device", None), torch.device)
        else torch.device("cpu")
    )
    nbytes = decode_workspace_bytes(
        max_rows, num_heads, vllm_config.model_config.max_model_len, kv_lora_rank, device
    )
    if nbytes > 0:
        manager.get_simultaneous(((nbytes,), torch.uint8))


class MLAQuantImpl(TritonMLAImpl):
    """TRITON_MLA's impl with decode and prefill through the quantized kernels.

    Shapes (DeepSeek-V3: N local heads, B decode rows, T prefill tokens): decode q
    ``[B, N, 512 + 64]`` (or the pair), latent cache ``[blocks, page, 576]``, output
    ``[B, N, 512]`` and natural-log LSE ``[B, N]`` float32. The latent cache is
    written raw (never quantized). With ``kv_path: "shadow"`` each cache row also
    holds the token's quantized K̂/V̂ after the raw latent (``mla_vllm.shadow``).
    """

    mla_layer: LayerState | None
    mla_prefill: MLAQuantPrefillBackend | None
    mla_shadow: LayerShadow | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mla_init()
        config_from_vllm(self._vllm_config)  # validate mla_quant before weights load
        note_vllm_config(self._vllm_config)  # MLAQuantBackend.customize_spec reads it

    def _mla_init(self) -> None:
        self.mla_layer = None
        self.mla_prefill = None
        self.mla_shadow = None

    def bind(self, name: str, config: MLAQuantConfig, vllm_config: VllmConfig | None) -> None:
        """Attach the recipe of layer ``name`` and this layer's prefill backend."""
        self.mla_layer = LayerState(name, config.recipe_for(name), config.observe)
        self.mla_prefill = MLAQuantPrefillBackend.like(
            self,
            vllm_config if vllm_config is not None else self._vllm_config,
            self.mla_layer,
        )
        self.mla_shadow = layer_shadow(
            config, self.mla_layer.recipe.decode, self.kv_lora_rank, self.qk_rope_head_dim
        )

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The raw latent view of a cache row and, on the shadow path, its shadow bytes."""
        name = self.mla_layer.name if self.mla_layer is not None else ""
        return split_cache(
            kv_cache, self.kv_lora_rank + self.qk_rope_head_dim, self.mla_shadow, name
        )

    def _state(self, layer: Any = None) -> LayerState:
        if self.mla_layer is None:
            name = str(getattr(layer, "layer_name", "")) if layer is not None else ""
            self.bind(name, config_from_vllm(self._vllm_config), self._vllm_config)
        assert self.mla_layer is not None
        return self.mla_layer

    # ------------------------------------------------------------------ cache

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write the new latent rows raw; on CUDA through vLLM's kernel.

        ``kv_c_normed [T, 512]``, ``k_pe [T, 1, 64]``, ``slot_mapping [T]`` (negative:
        skip). While calibrating, records the decode K (576) and V (512) amax.
        """
        state = self.mla_layer
        if state is not None and state.calibrating:
            state.record_amax(
                "decode",
                "k",
                torch.cat([kv_c_normed.abs().amax().reshape(1), k_pe.abs().amax().reshape(1)]),
            )
            state.record_amax("decode", "v", kv_c_normed)
        if kv_cache.numel() == 0:
            return
        if (
            self.mla_layer is None
            and kv_cache.shape[-1] != self.kv_lora_rank + self.qk_rope_head_dim
        ):
            self._state()  # rows with shadow bytes: bind the recipe that says what they hold
        kv_cache, shadow = self._split(kv_cache)
        if shadow is not None:
            from mla_triton.shadow import update_cache

            assert self.mla_shadow is not None
            with layer_errors(self._state().name):
                update_cache(
                    kv_c_normed,
                    k_pe.reshape(k_pe.shape[0], -1),
                    kv_cache,
                    slot_mapping.flatten(),
                    shadow,
                    quant=self.mla_shadow.quant,
                    storage=self.mla_shadow.storage,
                )
            return
        if kv_cache.device.type == "cuda":
            super().do_kv_cache_update(
                kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale
            )
            return
        slots = slot_mapping.flatten()
        rows = slots.shape[0]
        keep = slots[:rows] >= 0
        slots = slots[keep].long()
        page = kv_cache.shape[1]
        blocks, offsets = slots // page, slots % page
        rank = kv_c_normed.shape[-1]
        kv_cache[blocks, offsets, :rank] = kv_c_normed[:rows][keep].to(kv_cache.dtype)
        kv_cache[blocks, offsets, rank:] = k_pe[:rows].reshape(rows, -1)[keep].to(kv_cache.dtype)

    # ------------------------------------------------------------------ workspace

    def reserve_workspace(self) -> None:
        from vllm.v1.attention.backend import max_decode_query_len

        config = self._vllm_config
        reserve_decode_workspace(
            config,
            config.scheduler_config.max_num_seqs * max_decode_query_len(config),
            self.num_heads,
            self.kv_lora_rank,
        )

    # ------------------------------------------------------------------ decode

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed decode: ``(out [B, N, kv_lora_rank], lse [B, N] float32)``."""
        with layer_errors(self._state(layer).name):
            return self._forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    def _forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_mqa`` without the layer name on its errors."""
        from mla_triton.decode import decode, decode_num_splits, decode_workspace_size

        state = self._state(layer)
        decode_md = attn_metadata.decode
        if decode_md is None:
            raise ValueError("attn_metadata.decode: forward_mqa needs decode metadata")
        query = q if isinstance(q, torch.Tensor) else (q[0], q[1])
        first = query if isinstance(query, torch.Tensor) else query[0]
        rows, heads = first.shape[0], first.shape[1]
        block_table = decode_md.block_table
        seq_lens = decode_md.seq_lens
        num_reqs = seq_lens.shape[0]
        query_len, rest = divmod(rows, num_reqs) if num_reqs else (1, 0)
        if rest:
            raise ValueError(f"q: {rows} decode rows do not split evenly over {num_reqs} requests")
        if query_len > 1:  # multi-token decode: one row per query token
            block_table = block_table.repeat_interleave(query_len, dim=0)
            if attn_metadata.causal:
                shift = torch.arange(1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
                seq_lens = (seq_lens.unsqueeze(1) + shift).flatten().clamp(min=0)
            else:
                seq_lens = seq_lens.repeat_interleave(query_len)
        kv_c_and_k_pe_cache, shadow = self._split(kv_c_and_k_pe_cache)
        page = kv_c_and_k_pe_cache.shape[1]
        capacity = block_table.shape[1] * page
        max_seq_len = max(1, min(int(attn_metadata.max_seq_len), capacity))
        splits = decode_num_splits(
            rows, heads, max_seq_len, device=_device_for_splits(first.device)
        )
        nbytes = decode_workspace_size(
            rows, heads, max_seq_len, kv_lora_rank=self.kv_lora_rank, num_splits=splits
        )
        workspace = _workspace(nbytes, first.device)
        recipe = state.recipe.decode
        quant = None if recipe.is_identity else recipe
        if state.calibrating:
            if isinstance(query, torch.Tensor):
                state.record_amax("decode", "q", query)
            else:
                state.record_amax(
                    "decode",
                    "q",
                    torch.cat([query[0].abs().amax().reshape(1), query[1].abs().amax().reshape(1)]),
                )
        if shadow is not None and self.mla_shadow is not None:
            from mla_triton.shadow import decode_shadow

            out, lse = decode_shadow(
                query,
                kv_c_and_k_pe_cache,
                shadow,
                block_table,
                seq_lens,
                softmax_scale=self.scale,
                quant=self.mla_shadow.quant,
                storage=self.mla_shadow.storage,
                kv_lora_rank=self.kv_lora_rank,
                num_splits=splits,
                workspace=workspace,
                max_seq_len=max_seq_len,
                check_values=False,
            )
        else:
            out, lse = decode(
                query,
                kv_c_and_k_pe_cache,
                block_table,
                seq_lens,
                softmax_scale=self.scale,
                kv_lora_rank=self.kv_lora_rank,
                quant=quant,
                num_splits=splits,
                workspace=workspace,
                max_seq_len=max_seq_len,
                check_values=False,
            )
        if quant is not None and state.should_observe("decode"):
            n = min(rows, state.observe.max_rows)
            sub = query[:n] if isinstance(query, torch.Tensor) else (query[0][:n], query[1][:n])
            reference, _ = decode(
                sub,
                kv_c_and_k_pe_cache,
                block_table[:n],
                seq_lens[:n],
                softmax_scale=self.scale,
                kv_lora_rank=self.kv_lora_rank,
                num_splits=splits,
                max_seq_len=max_seq_len,
                check_values=False,
            )
            state.record_stats("decode", out[:n], reference)
        return out, lse

    # ------------------------------------------------------------------ prefill

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """vLLM's prefill (up-projection, chunked context, merge) on this layer's backend."""
        self._state()  # binds the recipe on first use
        prefill_md = attn_metadata.prefill
        if prefill_md is None:
            raise ValueError("attn_metadata.prefill: forward_mha needs prefill metadata")
        backend = self.mla_prefill
        assert backend is not None
        backend.prepare_metadata(prefill_md)
        kv_c_and_k_pe_cache, _ = self._split(kv_c_and_k_pe_cache)
        if (
            prefill_md.chunked_context is not None
            and kv_c_and_k_pe_cache.device.type == "cpu"
            and not kv_c_and_k_pe_cache.is_contiguous()
        ):
            # vLLM's CPU context gather flattens the cache with .view(); its CUDA
            # gathers read the row stride, so only CPU needs the raw rows compacted.
            kv_c_and_k_pe_cache = kv_c_and_k_pe_cache.contiguous()
        native = prefill_md.prefill_backend
        prefill_md.prefill_backend = backend
        try:
            super().forward_mha(
                q,
                kv_c_normed,
                k_pe,
                kv_c_and_k_pe_cache,
                attn_metadata,
                k_scale,
                output,
                output_scale,
            )
        finally:
            prefill_md.prefill_backend = native


def mla_layers(context: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The ``MLAAttention`` layers of a static forward context, by name."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    keys = list(context) if names is None else list(names)
    return {name: context[name] for name in keys if isinstance(context.get(name), MLAAttention)}


def bind_layers(
    layers: Mapping[str, Any], config: MLAQuantConfig, vllm_config: VllmConfig | None
) -> None:
    """Gate every layer, check the patterns, then bind each quantized impl's recipe."""
    check_layers(layers)
    config.check_patterns(layers, where="additional_config.mla_quant")
    for name, layer in layers.items():
        impl = layer.impl
        if isinstance(impl, MLAQuantImpl):
            impl.bind(name, config, vllm_config)
            layer.prefill_backend = impl.mla_prefill


class MLAQuantMetadataBuilder(TritonMLAMetadataBuilder):
    """TRITON_MLA's builder; binds the group's layers and reserves decode scratch."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        context = vllm_config.compilation_config.static_forward_context
        layers = mla_layers(context, layer_names)
        bind_layers(layers, config_from_vllm(vllm_config), vllm_config)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[no-untyped-call]
        if layers:
            first = next(iter(layers.values()))
            if isinstance(first.prefill_backend, MLAQuantPrefillBackend):
                self._prefill_backend = first.prefill_backend.clone()
        reserve_decode_workspace(
            vllm_config,
            vllm_config.scheduler_config.max_num_seqs * self.reorder_batch_threshold,
            self.num_heads * self.dcp_world_size,
            self.mla_dims.kv_lora_rank,
        )


class MLAQuantBackend(TritonMLABackend):
    """``--attention-backend MLA_QUANT``: TRITON_MLA with NVFP4/FP8 Q, K, P, V attention."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MLAQuantImpl]:
        return MLAQuantImpl

    @staticmethod
    def get_builder_cls() -> type[MLAQuantMetadataBuilder]:
        return MLAQuantMetadataBuilder

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """TRITON_MLA's spec; with ``kv_path: "shadow"`` each token also holds its shadow."""
        from mla_vllm.shadow import customize_spec

        return customize_spec(super().customize_spec(spec))

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        reasons: list[str] = list(super().validate_configuration(*args, **kwargs))
        if kwargs.get("use_sparse"):
            reasons.append("sparse-indexer MLA is not supported by MLA_QUANT")
        if kwargs.get("use_dcp"):
            reasons.append("decode context parallelism > 1 is not supported by MLA_QUANT")
        cache = kwargs.get("kv_cache_dtype")
        if cache is not None and str(cache).startswith(("fp8", "nvfp4")):
            reasons.append(f"kv_cache_dtype {cache}: MLA_QUANT keeps the latent cache raw")
        return reasons


def quant_impl_from(native: TritonMLAImpl) -> MLAQuantImpl:
    """A quantized impl sharing the state of ``native`` (which is left untouched)."""
    impl = copy.copy(native)
    impl.__class__ = MLAQuantImpl
    assert isinstance(impl, MLAQuantImpl)
    impl._mla_init()
    return impl


def current_config() -> VllmConfig | None:
    """vLLM's current config, if one is set."""
    return get_current_vllm_config_or_none()
