"""Configurations the quantized backend refuses, checked for every layer at once.

``check_layers`` looks at every MLA layer before anything is changed and raises
one ``MLAQuantGateError`` that lists each offending layer with its reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

__all__ = ["MLAQuantGateError", "check_layers", "layer_problems"]

_FP8_CACHE_PREFIXES = ("fp8", "nvfp4")


class MLAQuantGateError(ValueError):
    """A model the quantized MLA backend cannot run; lists every offending layer."""


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def layer_problems(layer: Any, *, in_place: bool = False) -> list[str]:
    """Why ``layer`` (a vLLM ``MLAAttention``) cannot run quantized; empty if it can.

    ``in_place`` adds the installer's condition: the layer must run vLLM's
    TRITON_MLA backend with its native impl.
    """
    problems: list[str] = []
    impl = getattr(layer, "impl", None)
    cache_dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
    if cache_dtype.startswith(_FP8_CACHE_PREFIXES):
        problems.append(
            f"quantized KV cache (kv_cache_dtype={cache_dtype}): the latent cache must stay "
            "in the model dtype (drop --kv-cache-dtype)"
        )
    if (
        getattr(layer, "use_sparse", False)
        or getattr(layer, "indexer", None) is not None
        or getattr(impl, "is_sparse", False)
    ):
        problems.append("sparse-indexer MLA (DeepSeek-V3.2 style top-k attention)")
    num_heads = getattr(layer, "num_heads", None)
    q_pad = getattr(layer, "q_pad_num_heads", None)
    if q_pad is None:
        q_pad = getattr(impl, "q_pad_num_heads", None)
    if q_pad is not None and q_pad != num_heads:
        problems.append(f"query head padding (q_pad_num_heads={q_pad}, num_heads={num_heads})")
    dcp = int(getattr(impl, "dcp_world_size", 1) or 1)
    if dcp > 1:
        problems.append(f"decode context parallelism {dcp} > 1")
    dims = {
        "kv_lora_rank": getattr(layer, "kv_lora_rank", 0),
        "qk_nope_head_dim": getattr(layer, "qk_nope_head_dim", 0),
        "qk_rope_head_dim": getattr(layer, "qk_rope_head_dim", 0),
        "v_head_dim": getattr(layer, "v_head_dim", 0),
    }
    bad = [f"{k}={v}" for k, v in dims.items() if not isinstance(v, int) or v <= 0 or v % 16]
    if bad:
        problems.append(f"dims not positive multiples of 16: {', '.join(bad)}")
    else:
        pow2 = [
            f"{k}={dims[k]}"
            for k in ("kv_lora_rank", "qk_rope_head_dim")
            if not _is_power_of_two(dims[k])
        ]
        if pow2:
            problems.append(f"decode needs powers of two: {', '.join(pow2)}")
    if in_place:
        backend = getattr(layer, "attn_backend", None)
        name = backend.get_name() if backend is not None else None
        if name != "TRITON_MLA":
            problems.append(
                f"attention backend {name}, not TRITON_MLA (serve with "
                "--attention-backend TRITON_MLA, or MLA_QUANT directly)"
            )
        elif type(impl) is not TritonMLAImpl:
            problems.append(
                f"impl {type(impl).__name__} is not vLLM's TritonMLAImpl "
                "(already installed? call uninstall first)"
            )
    return problems


def check_layers(layers: Mapping[str, Any], *, in_place: bool = False) -> None:
    """Raise ``MLAQuantGateError`` listing every layer with a problem (none: no-op)."""
    report = {name: layer_problems(layer, in_place=in_place) for name, layer in layers.items()}
    bad = {name: problems for name, problems in report.items() if problems}
    if not bad:
        return
    lines = [f"  {name}: {'; '.join(problems)}" for name, problems in bad.items()]
    raise MLAQuantGateError(
        f"quantized MLA cannot run {len(bad)} of {len(layers)} MLA layer(s):\n" + "\n".join(lines)
    )
