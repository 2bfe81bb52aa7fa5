"""The ``MLA_QUANT`` attention backend: vLLM 0.33's TRITON_MLA with quantized attention.

- ``MLAQuantBackend(TritonMLABackend)``: refuses what the kernels cannot serve
  (quantized KV cache, sparse MLA, DCP) at backend selection.
- ``MLAQuantImpl(TritonMLAImpl)``: decode (``forward_mqa``) through the steps of
  ``mla_vllm.decode`` (``mla_triton.decode`` or, on the shadow path,
  ``mla_triton.decode_shadow``; scratch from ``mla_vllm.workspace``); prefill
  (``forward_mha``) through vLLM's own path with ``MLAQuantPrefillBackend``; cache
  writes raw, plus the shadow on the shadow path (``mla_vllm.shadow``).
- ``MLAQuantMetadataBuilder(TritonMLAMetadataBuilder)``: at construction (after
  the model is loaded, before serving) gates every layer of its group, resolves
  each layer's recipe from ``mla_quant`` and binds it, and reserves the decode
  workspace.

The in-place installer (``mla_vllm.install``) turns vLLM's own TRITON_MLA impls
into ``MLAQuantImpl`` with ``quant_impl_from``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.v1.attention.backend import max_decode_query_len
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)

from mla_triton import update_cache
from mla_vllm.config import MLAQuantConfig, config_from_vllm
from mla_vllm.decode import forward_decode
from mla_vllm.gates import check_layers
from mla_vllm.plugin import BACKEND_NAME
from mla_vllm.prefill import MLAQuantPrefillBackend
from mla_vllm.shadow import LayerShadow, layer_shadow, shadow_spec, split_cache
from mla_vllm.state import LayerState, layer_errors
from mla_vllm.warmup import join_early, start_early, warm_before_capture
from mla_vllm.warmup import register as register_warmup
from mla_vllm.workspace import reserve_decode_workspace

__all__ = [
    "BACKEND_NAME",
    "MLAQuantBackend",
    "MLAQuantImpl",
    "MLAQuantMetadataBuilder",
    "bind_layers",
    "mla_layers",
    "quant_impl_from",
]

logger = init_logger("vllm.mla_vllm.backend")
_NOTED: list[VllmConfig] = []  # the VllmConfig of the last MLAQuantImpl built here


def _note_vllm_config(vllm_config: VllmConfig | None) -> None:
    """Remember the config of an ``MLAQuantImpl`` being built (for ``customize_spec``)."""
    if vllm_config is not None:
        _NOTED[:] = [vllm_config]


def _spec_config() -> VllmConfig | None:
    """The config ``customize_spec`` plans for: vLLM's current one, else the noted one.

    vLLM asks for the KV-cache specs after the worker built its model, not always
    under its config context; the impls of that model noted the config.
    """
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    return _NOTED[0] if _NOTED else None


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
    mla_warm_width: int | None
    """Block-table width the warmup compiled decode for (None: not warmed, or checked)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mla_init()
        config_from_vllm(self._vllm_config)  # validate mla_quant before weights load
        _note_vllm_config(self._vllm_config)  # MLAQuantBackend.customize_spec reads it
        register_warmup(self._vllm_config)  # compiled in vLLM's kernel_warmup (mla_vllm.warmup)

    def _mla_init(self) -> None:
        self.mla_layer = None
        self.mla_prefill = None
        self.mla_shadow = None
        self.mla_warm_width = None

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
            state.record_amax("decode", "k", kv_c_normed, k_pe)
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
        """``forward_mqa`` without the layer name on its errors (``mla_vllm.decode``)."""
        state = self._state(layer)
        if attn_metadata.decode is None:
            raise ValueError("attn_metadata.decode: forward_mqa needs decode metadata")
        query = q if isinstance(q, torch.Tensor) else (q[0], q[1])
        if self.mla_warm_width is not None:
            _check_warm_width(state.name, self.mla_warm_width, attn_metadata.decode.block_table)
            self.mla_warm_width = None
        cache, shadow_bytes = self._split(kv_c_and_k_pe_cache)
        shadow = None
        if shadow_bytes is not None and self.mla_shadow is not None:
            shadow = (self.mla_shadow, shadow_bytes)
        return forward_decode(
            state,
            query,
            cache,
            shadow,
            attn_metadata.decode,
            causal=bool(attn_metadata.causal),
            max_seq_len=int(attn_metadata.max_seq_len),
            softmax_scale=self.scale,
            kv_lora_rank=self.kv_lora_rank,
        )

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


def _check_warm_width(name: str, width: int, block_table: torch.Tensor) -> None:
    """Warn when the first decode's block table is not the width the warmup compiled for."""
    if int(block_table.shape[1]) != width or int(block_table.stride(0)) != width:
        logger.warning(
            "MLA_QUANT warmup compiled decode for block tables of %d pages per request; layer "
            "%r decodes with shape %s, strides %s: its kernels compile again on first use",
            width, name, tuple(block_table.shape), tuple(block_table.stride()),
        )  # fmt: skip


def mla_layers(context: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The ``MLAAttention`` layers of a static forward context, by name."""
    keys = list(context) if names is None else list(names)
    return {name: context[name] for name in keys if isinstance(context.get(name), MLAAttention)}


def bind_layers(
    layers: Mapping[str, Any], config: MLAQuantConfig, vllm_config: VllmConfig | None
) -> None:
    """Gate every layer, check the configuration against the layer names (patterns,
    calibration source), then bind each quantized impl's recipe."""
    check_layers(layers)
    config.check_layer_names(layers, where="additional_config.mla_quant")
    for name, layer in layers.items():
        impl = layer.impl
        if isinstance(impl, MLAQuantImpl):
            impl.bind(name, config, vllm_config)
            layer.prefill_backend = impl.mla_prefill


class MLAQuantMetadataBuilder(TritonMLAMetadataBuilder):
    """TRITON_MLA's builder; binds the group's layers and reserves decode scratch; its
    first ``build`` runs the engine warm-up for the caches then bound
    (``warmup.warm_before_capture``: before vLLM's CUDA-graph memory profile)."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        join_early(" (metadata builder)")  # it binds recipes and compiles: done before this
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
        self._mla_layers = layers
        self._mla_warm = True

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> Any:
        """TRITON_MLA's metadata; the first build warms the layers up first."""
        if self._mla_warm:
            self._mla_warm = False
            warm_before_capture(self._mla_layers, self.vllm_config)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


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
        """TRITON_MLA's spec; with ``kv_path: "shadow"`` each token also holds its shadow.

        ``customize_spec`` receives no config: it plans for ``_spec_config()`` and
        the ``MLA_QUANT`` layers of that config's forward context. vLLM asks for the
        specs once the model is loaded and the block size final, before its memory
        profile: the first call starts the engine's early warm-up there
        (``warmup.start_early``, once per engine).
        """
        spec = super().customize_spec(spec)
        vllm_config = _spec_config()
        if vllm_config is None:
            return spec
        context = vllm_config.compilation_config.static_forward_context
        config = config_from_vllm(vllm_config)
        # the first point where every layer name is known, before any kernel runs (vLLM's
        # memory profile follows): a calibration source for other names fails here
        config.check_layer_names(mla_layers(context), where="additional_config.mla_quant")
        layers = {
            name: layer
            for name, layer in mla_layers(context).items()
            if isinstance(layer.impl, MLAQuantImpl)
        }
        spec = shadow_spec(spec, config, layers)
        start_early(vllm_config, layers)
        return spec

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
