"""Scratch memory of ``mla_triton.decode``: from vLLM's workspace manager, else private.

The builder reserves the decode worst case (``max_model_len``) in vLLM's shared
workspace before CUDA-graph capture; each decode step then takes its split-KV
scratch from it without growing it. Without a manager (tests, or an in-place
install after the manager locked) a private buffer per device is used, grown
only outside graph capture.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from mla_triton import decode_workspace_size
from mla_triton.tuning import decode_num_splits
from mla_vllm.state import capturing

__all__ = ["decode_scratch", "decode_workspace_bytes", "reserve_decode_workspace"]

_PRIVATE_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _splits_device(device: torch.device) -> torch.device | None:
    """The device whose SM count sizes the splits (None on CPU: the default count)."""
    return device if device.type == "cuda" else None


def decode_workspace_bytes(
    max_rows: int, num_heads: int, max_seq_len: int, kv_lora_rank: int, device: torch.device
) -> int:
    """Bytes ``mla_triton.decode`` needs for up to ``max_rows`` decode rows."""
    return decode_workspace_size(
        max(1, max_rows),
        num_heads,
        max(1, max_seq_len),
        kv_lora_rank=kv_lora_rank,
        device=_splits_device(device),
    )


def decode_scratch(
    rows: int, heads: int, max_seq_len: int, kv_lora_rank: int, device: torch.device
) -> tuple[int, torch.Tensor | None]:
    """``(num_splits, workspace)`` of one decode launch of ``rows`` rows of ``heads`` heads.

    ``max_seq_len`` bounds every row's sequence length; the workspace is a uint8
    view of ``decode_workspace_size`` bytes (None when one split needs none).
    """
    splits = decode_num_splits(rows, heads, max_seq_len, device=_splits_device(device))
    nbytes = decode_workspace_size(
        rows, heads, max_seq_len, kv_lora_rank=kv_lora_rank, num_splits=splits
    )
    return splits, _workspace(nbytes, device)


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
