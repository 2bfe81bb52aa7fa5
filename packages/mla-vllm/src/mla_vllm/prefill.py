"""``MLAQuantPrefillBackend``: vLLM's MLA prefill backend interface on ``mla_triton.prefill``.

vLLM keeps the up-projection (``kv_b_proj``), the gathering of cached context in
chunks and the LSE merge; this backend computes the two attentions it asks for:

- new tokens: causal over the new tokens, ``Q [T, H, Dqk]``, ``K [T, H, Dqk]``,
  ``V [T, H, Dv]``, varlen by ``query_start_loc``; optional N:M sparsity; LSE
  ``[H, T]`` (natural log) when context follows.
- context chunks: non-causal, queries against a chunk of cached tokens, LSE.

Each quantized layer owns an instance carrying its ``LayerState``; the impl puts
it into the batch's prefill metadata for the duration of its ``forward_mha``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend

from mla_vllm.plugin import PREFILL_BACKEND_NAME
from mla_vllm.state import LayerState, layer_errors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["PREFILL_BACKEND_NAME", "MLAQuantPrefillBackend"]


class MLAQuantPrefillBackend(MLAPrefillBackend):
    """Quantized MLA prefill through ``mla_triton.prefill`` (any dims, multiples of 16)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: VllmConfig,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )
        self.layer: LayerState | None = None

    @staticmethod
    def get_name() -> str:
        return PREFILL_BACKEND_NAME

    @classmethod
    def supports_mla_dimensions(cls, mla_dimensions: MLADimensions) -> bool:
        dims = (
            mla_dimensions.qk_nope_head_dim,
            mla_dimensions.qk_rope_head_dim,
            mla_dimensions.v_head_dim,
        )
        return all(d % 16 == 0 for d in dims) and sum(dims[:2]) <= 576 and dims[2] <= 512

    @classmethod
    def is_available(cls) -> bool:
        try:
            import mla_triton  # noqa: F401
        except ImportError:
            return False
        return True

    @classmethod
    def like(
        cls, dims: Any, vllm_config: VllmConfig, layer: LayerState | None
    ) -> MLAQuantPrefillBackend:
        """A backend with the attention dims of ``dims`` (an MLA impl or another backend)."""
        backend = cls(
            num_heads=dims.num_heads,
            scale=dims.scale,
            kv_lora_rank=dims.kv_lora_rank,
            qk_nope_head_dim=dims.qk_nope_head_dim,
            qk_rope_head_dim=dims.qk_rope_head_dim,
            v_head_dim=dims.v_head_dim,
            vllm_config=vllm_config,
        )
        backend.layer = layer
        return backend

    def clone(self) -> MLAQuantPrefillBackend:
        return self.like(self, self.vllm_config, self.layer)

    def supports_out(self) -> bool:
        return True

    def _metadata(self) -> Any:
        metadata = getattr(self, "_prefill_metadata", None)
        if metadata is None:
            raise RuntimeError(
                "MLAQuantPrefillBackend: prepare_metadata was not called before the prefill"
            )
        return metadata

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens: ``out [T, H, Dv]`` (, ``lse [H, T]``)."""
        from mla_triton import prefill

        if output_scale is not None:
            raise ValueError(
                "output_scale: MLAQuantPrefillBackend does not fuse output quantization"
            )
        metadata = self._metadata()
        cu = metadata.query_start_loc
        max_q = int(metadata.max_query_len)
        state = self.layer
        quant = None if state is None or state.recipe.prefill.is_identity else state.recipe.prefill
        sparsity = None if state is None else state.recipe.sparsity
        if state is not None:
            state.record_amax("prefill", "q", q)
            state.record_amax("prefill", "k", k)
            state.record_amax("prefill", "v", v)
        with layer_errors("" if state is None else state.name):
            result = prefill(
                q,
                k,
                v,
                cu,
                cu,
                softmax_scale=self.scale,
                causal=True,
                quant=quant,
                sparsity=sparsity,
                return_lse=return_softmax_lse,
                out=out,
                max_seqlen_q=max_q,
                max_seqlen_k=max_q,
            )
        observed = state is not None and (quant is not None or sparsity is not None)
        if observed and state is not None and state.should_observe("prefill"):
            reference = prefill(
                q,
                k,
                v,
                cu,
                cu,
                softmax_scale=self.scale,
                causal=True,
                max_seqlen_q=max_q,
                max_seqlen_k=max_q,
            )
            got = result[0] if isinstance(result, tuple) else result
            rows = state.observe.max_rows
            state.record_stats("prefill", got[:rows], reference[:rows])
        return result

    def run_prefill_context_chunk(
        self,
        chunk: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention to one chunk of cached context: ``(out, lse [H, T])``."""
        from mla_triton import prefill

        state = self.layer
        quant = None if state is None or state.recipe.prefill.is_identity else state.recipe.prefill
        with layer_errors("" if state is None else state.name):
            return prefill(
                q,
                k,
                v,
                chunk.query_start_loc,
                chunk.cu_seq_lens,
                softmax_scale=self.scale,
                causal=False,
                quant=quant,
                return_lse=True,
                out=out,
                max_seqlen_q=int(chunk.max_query_len),
                max_seqlen_k=int(chunk.max_seq_len),
            )
